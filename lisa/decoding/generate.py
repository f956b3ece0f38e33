"""Decoding of a LlamaGen-style target, in gpt-fast's shape: vanilla (prefill, then one-token steps), speculative
with an EAGLE-3 drafter (draft a tree, verify it in one target forward, keep what passes) and drafter-free Jacobi
(SJD / GSD).

CFG runs the conditional and unconditional rows in one batch (conditional first) sharing one KV cache; guidance is
applied to the logits before temperature / top-k / top-p (lisa.decoding.sampling). Reproducible through an explicit
torch.Generator. The loops run under torch.inference_mode (no autograd bookkeeping: ~10% of a step on a CPU at the
built-in shapes; their outputs are inference tensors, clone them before an in-place edit outside it). Every loop
starts with the same preamble (`start`: caches, key mask, grammar) and `prefill`; the
speculative loops commit through `Emitted` and return `DecodeStats`. `compile=True` runs the target's and the
drafter's forwards under torch.compile (`compiled`: static shapes, one graph per shape, compiled on first use and
shared by every loop of the same model); the loop's pure bookkeeping steps
(distributions, a draft level, the walk's sibling step, the commit) are fused too (lisa.decoding.fused); the random
draws, the walk's control flow and the cache moves stay eager.

Where it lives: the parts every loop shares in lisa.decoding.loop, the drafting of a round's tree in
lisa.decoding.draft, the verifiers in lisa.decoding.verify, and the one path from a params.yaml method to a decoder
in lisa.decoding.methods; here the three loops (`generate`, `speculative_generate`, `jacobi_generate`) and the
speculative tree's config (`SpecConfig`).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from pydantic.dataclasses import dataclass
from torch import Tensor

from lisa.config import STRICT, DraftTree
from lisa.decoding import jacobi, verify
from lisa.decoding.draft import commit_accepted, commit_pairs, draft
from lisa.decoding.fused import fused
from lisa.decoding.loop import (Clock, DecodeStats, Emitted, _no_tick, compiled, draw, emitted_tokens, move_accepted,
                                prefill, start, step_mask, target_dists, target_probs, tree_forward)
from lisa.decoding.loop import guided, pooled_tau, prefix_embeddings  # noqa: F401  (importable from here too)
from lisa.decoding.sampling import SamplingConfig
from lisa.decoding.tree import branching_choices, static_choices
from lisa.models.gpt import Transformer


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, sampling: SamplingConfig,
                     generator: Optional[torch.Generator], key_mask: Optional[Tensor] = None,
                     fuse: bool = False) -> Tensor:
    """token (B,) at slot input_pos (1,) -> next token (B,). fuse: the guidance and sampling filters under
    torch.compile (lisa.decoding.fused; the draw itself stays outside)."""
    x = model.embed_tokens(torch.cat([token, token]) if sampling.use_cfg else token)[:, None]  # (B', 1, D)
    logits = model(x, input_pos, mask=step_mask(model, input_pos, key_mask)).logits[:, -1]  # (B', V)
    return draw(fused(next_token_probs, fuse)(logits, sampling), sampling, generator)


def next_token_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """A step's logits (B', V) -> the distribution (B, V) vanilla sampling draws from."""
    return target_probs(logits, sampling)[1]


@torch.inference_mode()
def generate(model: Transformer, cond: Tensor, sampling: SamplingConfig, generator: Optional[torch.Generator] = None,
             num_tokens: Optional[int] = None, cond_mask: Optional[Tensor] = None,
             step_fn: Optional[Callable] = None, forced: Optional[Tensor] = None,
             compile: bool = False) -> tuple[Tensor, DecodeStats]:
    """Sample image tokens (B, T) for `cond` (class ids (B,) or caption features (B, C, Dc)).

    cond_mask: (B, C) bool for t2i caption padding (True = real token). step_fn: a replacement for
    decode_one_token, if wanted. forced: (T,) grammar tokens (lisa.decoding.grammar), -1 = sampled; default: the
    model's own grammar. compile: the model's forward under torch.compile (`compiled`). Returns (tokens,
    {"forwards": target forward passes}).
    """
    model = compiled(model) if compile else model
    b = start(model, cond, sampling, num_tokens, cond_mask, forced)
    step = step_fn or functools.partial(decode_one_token, fuse=compile)
    fixed = b.grammar.host(b.T)  # host sync, once per call: the loop then overrides forced tokens without one
    tokens = torch.empty(b.B, b.T, dtype=torch.long, device=b.cond.device)
    tokens[:, 0] = prefill(model, b, sampling, generator)[0]
    for t in range(1, b.T):
        input_pos = torch.tensor([b.C + t - 1], device=b.cond.device)  # slot of the token being fed
        tokens[:, t] = step(model, tokens[:, t - 1], input_pos, sampling, generator, b.key_mask)
        if fixed[t] >= 0:
            tokens[:, t] = fixed[t]
    return tokens, DecodeStats(forwards=b.T)


# ---------------------------------------------------------------------------------------------------------------
# Speculative decoding: draft a tree with the drafter, verify it with one target forward, keep what passes.


@dataclass(config=STRICT)
class _Verifier:
    verifier: str = "exact"  # a name in lisa.decoding.verify.VERIFIERS that verifies a drafter's trees


@dataclass(config=STRICT)
class SpecConfig(DraftTree, _Verifier):
    """A drafter's tree as the loop reads it: the verifier, then the params' draft tree (lisa.config.DraftTree: its
    fields, defaults and types), resolved (no "auto") and checked for what the loop can draft."""

    def __post_init__(self):
        if self.tree == "auto":
            raise ValueError("SpecConfig.tree must be 'dynamic', 'static' or 'chain': tree 'auto' is resolved by the "
                             "cost model before decoding (lisa.decoding.methods.auto_tree)")
        if self.draft == "sample" and self.tree == "dynamic" and not self.branching:
            raise ValueError("sampled drafts need a shape fixed before drawing (a value-dependent rerank would bias "
                             "the draws): tree 'chain', 'static' (a node budget) or a `branching` list, not 'dynamic'")
        if self.branching and self.draft != "sample":
            raise ValueError("`branching` shapes sampled trees (draft: sample); top-k trees use depth / top_k_draft / "
                             "total_tokens")
        if verify.is_jacobi(self.verifier):
            raise ValueError(f"{self.verifier} runs drafter-free on Jacobi windows (jacobi_generate), not on a "
                             f"drafter's trees")

    def choices(self) -> Optional[list[tuple[int, ...]]]:
        """A sampled tree's shape as sibling-index paths (lisa.decoding.tree.sampled_tree); None for top-k trees."""
        if self.draft != "sample":
            return None
        if self.branching:
            return branching_choices(self.branching)
        if self.tree == "chain":
            return branching_choices((1,) * self.depth)
        return static_choices(self.depth, self.top_k_draft, self.total_tokens)

    @property
    def nodes(self) -> int:
        """Draft nodes verified per round."""
        if self.draft == "sample":
            return len(self.choices())
        if self.tree == "static":
            return len(static_choices(self.depth, self.top_k_draft, self.total_tokens))
        return self.depth if self.tree == "chain" else self.total_tokens

    @property
    def max_depth(self) -> int:
        """The deepest node a round's tree can hold (the longest accepted path)."""
        return max(len(c) for c in self.choices()) if self.draft == "sample" else self.depth

    @property
    def drafted_pairs(self) -> int:
        """Drafter pairs one round writes after the committed ones."""
        if self.draft == "sample":
            return self.nodes
        return {"dynamic": self.depth * self.top_k_draft, "static": self.nodes, "chain": self.depth}[self.tree]

    def describe(self) -> str:
        """The tree in a few words (reports)."""
        if self.draft == "sample":
            shape = (f"branching {list(self.branching)}" if self.branching else
                     f"chain, depth {self.depth}" if self.tree == "chain" else
                     f"static, depth {self.depth}, {self.nodes} nodes")
            return f"sampled ({self.siblings}) {shape}"
        if self.tree == "chain":
            return f"chain, depth {self.depth}"
        return f"{self.tree}, depth {self.depth}, top-{self.top_k_draft}, {self.nodes} nodes"


@torch.inference_mode()
def speculative_generate(target: Transformer, drafter, cond: Tensor, sampling: SamplingConfig, spec: SpecConfig,
                         generator: Optional[torch.Generator] = None, num_tokens: Optional[int] = None,
                         cond_mask: Optional[Tensor] = None, geometry=None, options=None,
                         trace: Optional[list] = None, forced: Optional[Tensor] = None,
                         measure: bool = False, clock: Optional[Clock] = None,
                         compile: bool = False, verifier_fn: Optional[Callable] = None) -> tuple[Tensor, DecodeStats]:
    """Speculative sampling of image tokens (B, T) with an EAGLE-3 drafter; each row accepts its own length.

    Layout. Target cache: condition prefix at slots 0..C-1, image token j at slot C + j once accepted; a round
    writes its root (the last emitted token, not yet fed) at its own slot and the tree right after it, per row,
    then moves the accepted nodes down to their sequence slots (the rest is overwritten later). Drafter cache:
    pair j = (target hidden that predicted token j, token j) at slot j; tree pairs go after the committed ones.
    RoPE positions are sequence positions (a node at depth d sits d after the root). CFG: cond rows then uncond
    rows in both models, guidance on both models' logits. options: the verifier's (a dict or its typed options,
    lisa.decoding.verify.verifier_options). Returns (tokens, DecodeStats). trace: a list that receives, per round,
    the draft tree's node scores and depths, the accepted path and its length, and which rows were live (what
    lisa.decoding.costmodel learns acceptance from). forced: (T,) grammar tokens, -1 = free (lisa.decoding.grammar;
    default: the target's own). measure: stats["tv"] (lisa.decoding.verify.walk). clock: a Clock that receives
    the time of each part of every round (the benchmark's breakdown; None in timed runs). compile: both models'
    forwards under torch.compile (`compiled`); the commit of the accepted pairs then always feeds the drafter the
    longest possible path (padding lands in its junk slot), so that its forward keeps one shape. verifier_fn: a
    function (VerifyContext, generator) -> Verdict in place of the registry's spec.verifier (lisa.bench.replay).
    """
    if compile:
        target, drafter = compiled(target), compiled(drafter)
    b = start(target, cond, sampling, num_tokens, cond_mask, forced, extra_slots=spec.nodes + 2)
    verifier, options = verify.get_verifier(spec.verifier), verify.verifier_options(spec.verifier, options)
    verifier = verifier_fn or verifier
    taps = tuple(drafter.config.taps)
    drafter.setup_caches(b.GB, b.T + spec.drafted_pairs + spec.top_k_draft + 2)
    first, out = prefill(target, b, sampling, generator, taps)
    em = Emitted.first(first, b.T, measure)
    zero = torch.zeros(b.B, dtype=torch.long, device=first.device)
    root = commit_pairs(drafter, b, drafter.fuse([h[:, -1:] for h in out.hidden]), first[:, None], zero, zero)
    dists, commit = fused(target_dists, compile), fused(commit_accepted, compile)
    tick = clock.tick if clock is not None else _no_tick
    tick("prefill")
    while em.unfinished():
        live, n = em.live(), em.n
        base = (b.C + n - 1).clamp(max=target.cache_length - spec.nodes - 2)  # root slot; finished rows idle at the end
        tick("rest")
        tree = draft(drafter, b, root, n, spec, sampling, generator, compile)
        tick("draft")
        out = tree_forward(target, em.last(), tree, base, b.key_mask, b.use_cfg, taps)  # root + tree, tree mask
        em.forwards += 1
        tick("target")
        at = n[:, None] + torch.cat([torch.zeros_like(tree.depth[:, :1]), tree.depth], 1)  # (B, N + 1) positions
        g_logits, p = dists(out.logits, sampling, b.grammar, at)  # (B, N + 1, V)
        verdict = verifier(verify.VerifyContext(p, tree, logits=g_logits, geometry=geometry, options=options,
                                                measure=measure, fuse=compile), generator)
        m = verdict.n_accepted  # (B,)
        M = int(m.max())  # host sync, once per round: the longest acceptance sizes the moves and the drafter commit
        tick("verify")
        if trace is not None:
            trace.append({"scores": tree.scores, "depth": tree.depth, "path": verdict.path, "m": m, "live": live})
        move_accepted(target, verdict.path[:, :M], m, base, b.use_cfg)
        tick("move")
        path = verdict.path[:, :M]  # (B, M) accepted node indices, -1 past m
        if compile:  # one commit width: the longest path the tree holds
            path = torch.nn.functional.pad(path, (0, spec.max_depth - M), value=-1)
        new, root = commit(drafter, b, out.hidden, tree.tokens, path, m, verdict.next_token, n)  # new: (B, M + 1)
        tick("commit")
        em.commit(new, m, live, verdict.tv)
    tick("rest")
    return em.result()

@torch.inference_mode()
def jacobi_generate(target: Transformer, cond: Tensor, sampling: SamplingConfig, verifier: str = "sjd",
                    window: int = 16, generator: Optional[torch.Generator] = None, num_tokens: Optional[int] = None,
                    cond_mask: Optional[Tensor] = None, geometry=None, options=None,
                    forced: Optional[Tensor] = None, measure: bool = False,
                    clock: Optional[Clock] = None, compile: bool = False) -> tuple[Tensor, DecodeStats]:
    """Drafter-free speculative decoding over a window of `window` draft tokens refined by the target itself (new
    positions start uniformly random): SJD, GSD, SCD (maximal / Gumbel coupling) and SJD-PAC (a proactive tree).
    Each iteration feeds [last token, window] in one forward; drafts are verified against the distributions they
    were drawn from; the positions after the accepted ones are re-drafted from this iteration's distributions, as
    the method says (lisa.decoding.jacobi), and the window is refilled. options, forced, measure: as in
    speculative_generate. clock, compile: as in speculative_generate. Returns (tokens (B, T), DecodeStats)."""
    target = compiled(target) if compile else target
    b = start(target, cond, sampling, num_tokens, cond_mask, forced, extra_slots=window + 2)
    fn, options = verify.get_verifier(verifier), verify.verifier_options(verifier, options)
    paths, coupling = jacobi.window_policy(verifier, options, window)
    L, V = window, target.config.vocab_size
    first, _ = prefill(target, b, sampling, generator)
    layout = jacobi.Layout.of(paths, L, first.device)
    em = Emitted.first(first, b.T, measure)
    Q = torch.full((b.B, L + 1, V), 1.0 / V, device=first.device)  # (B, L + 1, V) each position's cached law
    old = torch.full((b.B, L + 1), -1, dtype=torch.long, device=first.device)  # no untested drafts yet
    q_old = Q
    noise = jacobi.gumbel(Q.shape, generator, Q.device) if coupling == "gumbel" else None
    dists, next_state = fused(target_dists, compile), fused(jacobi.next_state, compile)
    tick = clock.tick if clock is not None else _no_tick
    tick("prefill")
    while em.unfinished():
        live, n = em.live(), em.n
        base = (b.C + n - 1).clamp(max=target.cache_length - L - 2)
        tick("rest")
        tree = jacobi.draft_window(layout, Q, old, q_old, coupling, noise, generator)
        tick("draft")
        out = tree_forward(target, em.last(), tree, base, b.key_mask, b.use_cfg)
        em.forwards += 1
        tick("target")
        at = torch.cat([torch.zeros_like(tree.depth[:, :1]), tree.depth], 1)  # (B, L + 1) offset of each row's children
        g_logits, p = dists(out.logits, sampling, b.grammar, n[:, None] + at)  # (B, L + 1, V): row i + 1 after node i
        rows_noise = noise.gather(1, at[..., None].expand(-1, -1, V)) if noise is not None else None
        v = fn(verify.VerifyContext(p, tree, logits=g_logits, geometry=geometry, options=options, measure=measure,
                                    noise=rows_noise, fuse=compile), generator)
        m = v.n_accepted  # (B,)
        tick("verify")
        if layout.is_chain:  # accepted drafts are already at their sequence slots
            drafted = tree.tokens
        else:
            M = int(m.max())  # host sync, once per iteration: the longest acceptance sizes the cache moves
            move_accepted(target, v.path[:, :M], m, base, b.use_cfg)
            drafted = tree.tokens.gather(1, v.path[:, :M].clamp(min=0))
        tick("move")
        em.commit(emitted_tokens(drafted, m, v.next_token), m, live, v.tv)
        Q, old, q_old = next_state(layout, tree, p, v.path, m)
        if noise is not None:
            noise = jacobi.shift_noise(noise, m + 1, generator)
        tick("commit")
    tick("rest")
    return em.result()
