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
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, TypedDict

import torch
from torch import Tensor

from lisa.models.gpt import GPTOutput, Transformer
from lisa.decoding import jacobi, verify
from lisa.decoding.fused import fused
from lisa.decoding.grammar import Grammar
from lisa.decoding.sampling import SamplingConfig, cfg_logits, filtered, logits_to_probs, sample, sample_from
from lisa.decoding.tree import (Shape, branching_choices, chain, dynamic_tree, sampled_tree, static_choices,
                                static_tree, tree_shape)


def compiled(model: Optional[torch.nn.Module]) -> Optional[torch.nn.Module]:
    """`model` with its forward under torch.compile (inductor, dynamic=False: one graph per input shape, as gpt-fast
    compiles its decode step), made once per model and reused by every decoder of it. Everything but the forward
    call (caches, embeddings, config) is the model's own: torch's OptimizedModule delegates attribute access. The
    decode loops call each forward with a handful of shapes (prefill, one step or one tree / window, the drafter's
    level widths and one commit width), so the recompile limit is raised to hold them all."""
    if model is None:
        return None
    if "_lisa_compiled" not in model.__dict__:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # kept outside the module's registry (object.__setattr__): not a submodule, not in the state dict
        object.__setattr__(model, "_lisa_compiled", torch.compile(model, dynamic=False))
    return model.__dict__["_lisa_compiled"]


def prefix_embeddings(model: Transformer, cond: Tensor, use_cfg: bool) -> Tensor:
    """Condition prefix (B', C, D), B' = 2B with CFG: conditional rows first, then their unconditional twins."""
    if not use_cfg:
        return model.embed_cond(cond)
    B = cond.shape[0]
    drop = torch.cat([torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool)]).to(cond.device)
    return model.embed_cond(torch.cat([cond, cond]), drop)


def prefix_key_mask(model: Transformer, cond_mask: Optional[Tensor], use_cfg: bool,
                    cond: Optional[Tensor] = None) -> Optional[Tensor]:
    """(B', L) bool over cache slots: False at padded caption positions (LlamaGen's emb_masks), True elsewhere.
    lm targets (Lumina-mGPT): the unconditional CFG rows mask their whole prompt, so that they start at the
    start-of-image token as in Lumina-mGPT's own guidance."""
    lm_uncond = model.config.model_type == "lm" and use_cfg
    if cond_mask is None and not lm_uncond:
        return None
    if cond_mask is None:
        cond_mask = torch.ones(cond.shape[0], model.config.cls_token_num, dtype=torch.bool, device=cond.device)
    uncond = torch.zeros_like(cond_mask.bool()) if lm_uncond else cond_mask
    cond_mask = torch.cat([cond_mask, uncond]) if use_cfg else cond_mask
    keep = torch.ones(cond_mask.shape[0], model.cache_length, dtype=torch.bool, device=cond_mask.device)
    keep[:, : cond_mask.shape[1]] = cond_mask.bool()
    return keep


def step_mask(model: Transformer, input_pos: Tensor, key_mask: Optional[Tensor]) -> Optional[Tensor]:
    """Causal mask for the slots `input_pos` (S,), restricted by key_mask (B', L); a token always sees itself."""
    if key_mask is None:
        return None
    mask = model.causal[input_pos][None] & key_mask[:, None, :]  # (B', S, L)
    return mask | torch.nn.functional.one_hot(input_pos, model.cache_length).bool()[None]


def guided(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    return cfg_logits(logits, sampling.cfg_scale) if sampling.use_cfg else logits


def target_probs(logits: Tensor, sampling: SamplingConfig) -> tuple[Tensor, Tensor]:
    """Target logits (B', ..., V) -> (guided logits, the distribution p vanilla sampling draws from), (B, ..., V)."""
    g = guided(logits, sampling)
    return g, logits_to_probs(g, sampling.temperature, sampling.top_k, sampling.top_p)


def target_dists(logits: Tensor, sampling: SamplingConfig, grammar: Grammar, pos: Tensor) -> tuple[Tensor, Tensor]:
    """A tree or window forward's logits (B', S, V) -> (guided logits, p with the grammar applied at the sequence
    positions pos (B, S)), each (B, S, V): what verification reads."""
    g, p = target_probs(logits, sampling)
    return g, grammar.probs(p, pos)


def draw(p: Tensor, sampling: SamplingConfig, generator: Optional[torch.Generator]) -> Tensor:
    """One token per row of p (..., V): the argmax when sampling is greedy, else a draw (no host sync)."""
    return p.argmax(-1) if sampling.greedy else sample_from(p, generator)


class DecodeStats(TypedDict, total=False):
    """What every decode loop returns beside the tokens."""
    forwards: int  # target forward passes, the prefill included
    rounds: int  # draft-verify rounds (speculative loops)
    tau: float  # tokens emitted per target forward after the prefill, bonus token included
    accept_lengths: list[list[int]]  # (B, rounds): tokens each row kept per round, 0 once it was finished
    tv: Tensor  # (B, T) TV between each token's law and the target's p there (measure=True; 0 at the prefill token)


def pooled_tau(stats: Iterable[DecodeStats]) -> float:
    """tau over several decodes: their rows' live rounds pooled (the mean accept length, bonus token included), as
    the benchmarks report it; DecodeStats.tau is one decode's."""
    lengths = [a for s in stats for row in s["accept_lengths"] for a in row if a > 0]
    return sum(lengths) / len(lengths)


class Clock:
    """Wall time of each part of a decode loop's rounds (lisa.bench.speed's per-round breakdown): the loop calls
    `tick(part)` after each part, which charges the time since the previous tick to it (CUDA-synchronised). A loop
    given no clock ticks a no-op: the timed passes pay nothing for the breakdown."""

    PARTS = ("prefill", "draft", "target", "verify", "move", "commit", "rest")

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device(device or "cpu")
        self.seconds = {part: 0.0 for part in self.PARTS}
        self.rounds = 0
        self._t = time.perf_counter()

    def tick(self, part: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[part] += now - self._t
        self._t = now
        self.rounds += part == "rest"


def _no_tick(part: str) -> None:
    return None


@dataclass
class Batch:
    """What a decode call resolves once, before its loop: the condition (B, ...), the key mask over cache slots
    (GB, L) (None: all visible), CFG (GB = 2B rows per forward: conditional rows first), the grammar, and the sizes:
    T image tokens after a prefix of C slots; max_pos, the target's last RoPE position."""
    cond: Tensor
    key_mask: Optional[Tensor]
    grammar: Grammar
    use_cfg: bool
    T: int
    C: int
    max_pos: int

    @property
    def B(self) -> int:
        return self.cond.shape[0]

    @property
    def GB(self) -> int:
        return (2 if self.use_cfg else 1) * self.B

    def dup(self, x: Tensor) -> Tensor:
        """(B, ...) -> (GB, ...): the unconditional rows repeat the conditional ones."""
        return _dup(x, self.use_cfg)


def start(model: Transformer, cond: Tensor, sampling: SamplingConfig, num_tokens: Optional[int],
          cond_mask: Optional[Tensor], forced: Optional[Tensor], extra_slots: int = 0) -> Batch:
    """The preamble every loop shares: unpack a packed condition (it carries its mask), check CFG, resolve the
    grammar, size the KV cache (GB rows, C + T + extra_slots slots) and mask the padded prefix."""
    cond, cond_mask = model.split_cond(cond, cond_mask)
    cfg = model.config
    if sampling.use_cfg and not cfg.has_null_cond:
        raise ValueError("cfg_scale != 1 needs a null class: this c2i model was built with class_dropout_prob=0")
    b = Batch(cond, None, Grammar.of(model, forced), sampling.use_cfg, num_tokens or cfg.block_size,
              cfg.cls_token_num, model.rope.shape[0] - 1)
    model.setup_caches(b.GB, b.C + b.T + extra_slots)
    b.key_mask = prefix_key_mask(model, cond_mask, b.use_cfg, cond)
    return b


def prefill(model: Transformer, b: Batch, sampling: SamplingConfig, generator: Optional[torch.Generator],
            taps=()) -> tuple[Tensor, GPTOutput]:
    """Run the condition prefix through the model: the first image token (B,) (the grammar's where forced) and
    the forward's output (its hidden taps feed a drafter)."""
    prefix = prefix_embeddings(model, b.cond, b.use_cfg)  # (GB, C, D)
    pos = torch.arange(b.C, device=prefix.device)  # (C,)
    out = model(prefix, pos, mask=step_mask(model, pos, b.key_mask), taps=taps)
    _, p0 = target_probs(out.logits[:, -1], sampling)  # (B, V)
    p0 = b.grammar.probs(p0[:, None], torch.zeros(b.B, 1, dtype=torch.long, device=p0.device))[:, 0]
    return draw(p0, sampling, generator), out


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


@dataclass(frozen=True)
class SpecConfig:
    verifier: str = "exact"  # a name in lisa.decoding.verify.VERIFIERS
    tree: str = "dynamic"  # "dynamic" (EAGLE-2/3) | "static" (fixed shape: lisa.decoding.tree.static_choices) | "chain"
    depth: int = 4  # draft levels
    top_k_draft: int = 4  # children per expanded node, nodes expanded per level (dynamic)
    total_tokens: int = 16  # draft nodes kept after reranking (dynamic)
    draft: str = "topk"  # "topk": siblings are the drafter's top-k | "sample": drawn from its q (lisa.decoding.tree)
    siblings: str = "wor"  # sampled siblings: "wor" (without replacement) | "iid"
    branching: tuple[int, ...] = ()  # sampled trees: children per node at each level, e.g. (3, 2, 1, 1)

    def __post_init__(self):
        if self.tree not in ("dynamic", "static", "chain"):
            raise ValueError(f"SpecConfig.tree must be 'dynamic', 'static' or 'chain', got {self.tree!r}")
        if min(self.depth, self.top_k_draft, self.total_tokens) < 1:
            raise ValueError(f"SpecConfig: depth, top_k_draft and total_tokens must be >= 1, got {self}")
        if self.draft not in ("topk", "sample") or self.siblings not in ("iid", "wor"):
            raise ValueError(f"SpecConfig: draft must be 'topk' or 'sample' and siblings 'iid' or 'wor', got "
                             f"{self.draft!r}, {self.siblings!r}")
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


def _dup(x: Tensor, use_cfg: bool) -> Tensor:
    return torch.cat([x, x]) if use_cfg else x


@dataclass
class Emitted:
    """The image tokens of a batch as a speculative loop's rounds commit them (each row accepts its own length),
    and the statistics of those rounds."""
    tokens: Tensor  # (B, T + 1) long; column T is a junk slot that takes the writes past a row's end
    n: Tensor  # (B,) tokens emitted per row
    tv: Optional[Tensor]  # (B, T + 1) measured TV of each emitted token (measure=True), 0 at the prefill token
    accepted: list = field(default_factory=list)  # per round: (B,) tokens each row kept, 0 once finished
    forwards: int = 1  # target forwards: the prefill

    @classmethod
    def first(cls, token: Tensor, T: int, measure: bool) -> "Emitted":
        """Start from the prefill's token (B,)."""
        B, dev = token.shape[0], token.device
        tokens = torch.zeros(B, T + 1, dtype=torch.long, device=dev)
        tokens[:, 0] = token
        tv = torch.zeros(B, T + 1, device=dev) if measure else None
        return cls(tokens, torch.ones(B, dtype=torch.long, device=dev), tv)

    @property
    def T(self) -> int:
        return self.tokens.shape[1] - 1

    def live(self) -> Tensor:
        return self.n < self.T  # (B,)

    def unfinished(self) -> bool:
        return bool(self.live().any())  # host sync, once per round: the loop's exit test

    def last(self) -> Tensor:
        """(B,) each row's last emitted token (the next round's root)."""
        return self.tokens.gather(1, (self.n - 1)[:, None]).squeeze(1)

    def commit(self, new: Tensor, m: Tensor, live: Tensor, tv: Optional[Tensor] = None) -> None:
        """Emit new[:, :m + 1] (new: (B, K)) at positions n .. n + m of the live rows, as far as T, with the TV
        measured at them (tv: (B, >= m + 1)); record what each row kept and advance n."""
        self.tokens.scatter_(1, self._slots(m, live, new.shape[1]), new)
        if self.tv is not None:
            self.tv.scatter_(1, self._slots(m, live, tv.shape[1]), tv)
        self.accepted.append(torch.where(live, torch.minimum(m + 1, self.T - self.n), torch.zeros_like(m)))
        self.n = torch.where(live, (self.n + m + 1).clamp(max=self.T), self.n)

    def _slots(self, m: Tensor, live: Tensor, K: int) -> Tensor:
        """(B, K) the position of each row's i-th new token, or the junk column T where it is not written."""
        i = torch.arange(K, device=m.device)[None]  # (1, K)
        pos = self.n[:, None] + i  # (B, K)
        return torch.where(live[:, None] & (i <= m[:, None]) & (pos < self.T), pos, self.T)

    def result(self) -> tuple[Tensor, DecodeStats]:
        """(tokens (B, T), stats); the host syncs here happen once per call."""
        acc = torch.stack(self.accepted) if self.accepted else torch.zeros(0, self.n.shape[0], dtype=torch.long)
        kept = acc[acc > 0]  # (rounds, B) -> the lengths of the rounds rows were live in
        stats = DecodeStats(forwards=self.forwards, rounds=len(self.accepted),
                            tau=float(kept.float().mean()) if kept.numel() else 0.0, accept_lengths=acc.T.tolist())
        if self.tv is not None:
            stats["tv"] = self.tv[:, : self.T].contiguous()
        return self.tokens[:, : self.T].contiguous(), stats


def emitted_tokens(drafted: Tensor, m: Tensor, next_token: Tensor) -> Tensor:
    """(B, K + 1): the drafted tokens (B, K) of a round, the first m (B,) of them accepted, then the correction /
    bonus token next_token (B,) at column m (columns past m are never emitted)."""
    return torch.cat([drafted, next_token[:, None]], 1).scatter(1, m[:, None], next_token[:, None])


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


def move_accepted(target: Transformer, path: Tensor, m: Tensor, base: Tensor, use_cfg: bool) -> None:
    """Move the target's cache entries of the accepted nodes (path (B, M), the first m (B,) valid) from their tree
    slots to their sequence slots right after the root at base (B,); padding moves the junk slot onto itself."""
    M = path.shape[1]
    if not M:
        return
    junk = target.cache_length - 1
    valid = torch.arange(M, device=path.device)[None] < m[:, None]  # (B, M)
    src = torch.where(valid, base[:, None] + 1 + path.clamp(min=0), junk)  # (B, M)
    dst = torch.where(valid, base[:, None] + 1 + torch.arange(M, device=path.device), junk)  # (B, M)
    src, dst = _dup(src, use_cfg), _dup(dst, use_cfg)
    k0 = target.layers[0].attention.kv_cache.k  # (GB', H_kv, L, hd), the same shape in every layer
    GB, (_, H, _, hd) = src.shape[0], k0.shape
    src_i, dst_i = (t[:, None, :, None].expand(GB, H, M, hd) for t in (src, dst))  # (GB, H_kv, M, hd)
    for layer in target.layers:  # KVCache.move, with the index expanded once for every layer
        cache = layer.attention.kv_cache
        for buf in (cache.k, cache.v):
            buf[:GB].scatter_(2, dst_i, buf[:GB].gather(2, src_i))


def commit_accepted(drafter, b: Batch, taps: tuple[Tensor, ...], tokens: Tensor, path: Tensor, m: Tensor,
                    next_token: Tensor, n: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """A round's emitted tokens and the drafter's commit of them: path (B, M) the accepted nodes of the tree's
    tokens (B, N) (the first m (B,) valid), next_token (B,) the correction / bonus; taps: the tree forward's
    hidden states (GB, N + 1, H) each, row 0 the root. Returns (the tokens new (B, M + 1), the next round's
    drafter root from `commit_pairs`)."""
    new = emitted_tokens(tokens.gather(1, path.clamp(min=0)), m, next_token)  # (B, M + 1)
    rows = b.dup(torch.cat([torch.zeros_like(m)[:, None], 1 + path.clamp(min=0)], 1))  # (GB, M + 1) of the taps
    feats = drafter.fuse([h.gather(1, rows[..., None].expand(-1, -1, h.shape[-1])) for h in taps])
    return new, commit_pairs(drafter, b, feats, new, m, n)


def commit_pairs(drafter, b: Batch, feats: Tensor, new: Tensor, m: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """Write drafter pairs n .. n + m (n, m: (B,)) of each row: feats (GB, K, H) the target hidden that predicted
    each token of new (B, K); columns past m are padding that lands in the junk slot. Returns the next round's
    drafter root: logits (GB, V) and hidden (GB, 1, H) after each row's last pair."""
    K, Ld = new.shape[1], drafter.cache_length
    junk = Ld - 1
    i = torch.arange(K, device=new.device)[None]  # (1, K)
    ok = i <= m[:, None]  # (B, K)
    slots = torch.where(ok, (n[:, None] + i).clamp(max=junk - 1), junk)  # (B, K)
    cols = torch.arange(Ld, device=new.device)[None, None, :]  # (1, 1, Ld)
    mask = (cols <= slots[:, :, None]) & (ok[:, :, None] | (cols == junk))  # (B, K, Ld) causal; padding: junk only
    rope = (b.C + n[:, None] + i).clamp(max=b.max_pos)  # (B, K)
    d = drafter(b.dup(new), feats, input_pos=b.dup(slots), mask=b.dup(mask), rope_pos=b.dup(rope))
    rows, last = torch.arange(b.GB, device=new.device), b.dup(m)
    return d.logits[rows, last], d.hidden[rows, last][:, None]


def tree_forward(target: Transformer, root: Tensor, tree, base: Tensor, key_mask: Optional[Tensor], use_cfg: bool,
                 taps=()):
    """One target forward over [root, tree nodes] per row: the root at slot base (B,), node i at base + 1 + i;
    each query sees the committed slots < base (and the caption key mask), the root, and its ancestors."""
    B, N = tree.tokens.shape
    dev = root.device
    Lt = target.cache_length
    slots = base[:, None] + torch.arange(N + 1, device=dev)  # (B, S)
    mask = (torch.arange(Lt, device=dev)[None, None, :] < base[:, None, None]).expand(B, N + 1, Lt).clone()
    window, depth = (_window(tree.shape) if tree.shape is not None else
                     _window_of(tree.ancestor_mask(), tree.depth))  # (B|1, N + 1, N + 1) over slots base .. base + N
    mask.scatter_(2, slots[:, None, :].expand(B, N + 1, N + 1), window.expand(B, N + 1, N + 1))
    rope = (base[:, None] + depth).clamp(max=target.rope.shape[0] - 1)
    x = target.embed_tokens(_dup(torch.cat([root[:, None], tree.tokens], 1), use_cfg))
    mask = _dup(mask, use_cfg)
    if key_mask is not None:  # per row: the unconditional rows of an lm target mask their whole prompt
        mask &= key_mask[:, None, :]
    return target(x, _dup(slots, use_cfg), mask=mask, rope_pos=_dup(rope, use_cfg), taps=taps)


def _window_of(ancestors: Tensor, depth: Tensor) -> tuple[Tensor, Tensor]:
    """A tree forward's attention window over [root, nodes] from the nodes' ancestor mask (B, N, N) and depths
    (B, N): everyone sees the root, a node its ancestors and itself; and the depths with the root's 0 first."""
    B, N = depth.shape
    window = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=depth.device)
    window[:, :, 0] = True
    window[:, 1:, 1:] = ancestors
    return window, torch.cat([torch.zeros_like(depth[:, :1]), depth], 1)


@functools.lru_cache(maxsize=64)
def _window(shape: Shape) -> tuple[Tensor, Tensor]:
    """`_window_of` a fixed shape, built once: (1, N + 1, N + 1), (1, N + 1)."""
    return _window_of(shape.ancestors[None], shape.depth[None])


def draft(drafter, b: Batch, root: tuple[Tensor, Tensor], n: Tensor, spec: SpecConfig, sampling: SamplingConfig,
          generator: Optional[torch.Generator] = None, fuse: bool = False):
    """One round's draft tree (lisa.decoding.tree.Tree) from the drafter's root (logits (GB, V), hidden
    (GB, 1, H)) for rows that have emitted n (B,) tokens. Top-k trees rank the raw guided drafter; sampled ones
    draw from the drafter's guided logits processed like the target's (temperature, top-k, top-p), the q that
    verification divides by, with the round's generator. fuse: the distributions under torch.compile (fused)."""
    logits, hidden = root
    dist = _draft_dist(sampling, b.grammar, spec.draft, fuse)
    logp = dist(logits[:, None], n[:, None])[:, 0]
    if spec.draft == "sample":
        return _draft_tree(drafter, b, logp, hidden, n, spec, sampling, generator, fuse)
    if spec.tree == "chain":
        return _draft_chain(drafter, b, logp, hidden, n, spec.depth, sampling)
    return _draft_tree(drafter, b, logp, hidden, n, spec, sampling, fuse=fuse)


def _draft_dist(sampling: SamplingConfig, grammar: Grammar, policy: str,
                fuse: bool = False) -> Callable[[Tensor, Tensor], Tensor]:
    """(drafter logits (GB, S, V), positions (B, S)) -> the drafter's log-distribution (B, S, V) with the grammar
    applied: `_ranked_logq` (topk) or `_sampled_logq` (sample), fused under torch.compile when `fuse`."""
    fn = fused(_sampled_logq if policy == "sample" else _ranked_logq, fuse)
    return lambda logits, pos: fn(logits, pos, sampling, grammar)


def _ranked_logq(logits: Tensor, pos: Tensor, sampling: SamplingConfig, grammar: Grammar) -> Tensor:
    """The raw guided drafter (what top-k trees rank)."""
    return grammar.log_probs(guided(logits, sampling).log_softmax(-1), pos)


def _sampled_logq(logits: Tensor, pos: Tensor, sampling: SamplingConfig, grammar: Grammar) -> Tensor:
    """The guided logits processed like the target's (temperature, top-k, top-p), the q that sampled drafts are
    drawn from and verification divides by; where that filter leaves only ids the grammar bars, the full guided
    drafter instead (any q is exact, if it is the one drawn from)."""
    g = guided(logits, sampling)
    logq = grammar.log_probs(logits_to_probs(g, sampling.temperature, sampling.top_k, sampling.top_p).log(), pos)
    if grammar.forced is None and not filtered(sampling, logits.shape[-1]):  # every id keeps mass: never empty
        return logq.log_softmax(-1)
    empty = torch.isinf(logq.amax(-1, keepdim=True))
    return torch.where(empty, grammar.log_probs(g.log_softmax(-1), pos), logq).log_softmax(-1)


def _draft_tree(drafter, b: Batch, root_logp, root_hidden, n, spec: SpecConfig, sampling,
                generator: Optional[torch.Generator] = None, fuse: bool = False):
    """EAGLE-2/3 dynamic tree, a static one, or a sampled one: expansions are drafter pairs written after the
    committed ones (slots n, n + 1, ... in expansion order) that see the committed pairs and their own ancestors'
    pairs, one drafter forward per level. A tree whose shape is fixed before drafting (sampled, static) takes the
    shape's expansion plan (`_fixed_expander`); a dynamic one builds each node's mask row as it goes
    (`_expansion`; fused under torch.compile when `fuse`)."""
    if spec.draft == "sample" or spec.tree == "static":
        choices = spec.choices() if spec.draft == "sample" else static_choices(spec.depth, spec.top_k_draft,
                                                                                spec.total_tokens)
        expand = _fixed_expander(drafter, b, tree_shape(choices, root_logp.device), root_hidden, n, sampling,
                                 spec.draft, fuse)
        if spec.draft == "sample":
            return sampled_tree(root_logp, expand, choices, spec.siblings, generator)
        return static_tree(root_logp, expand, choices)
    expand = _node_expander(drafter, b, root_hidden, n, sampling, spec.draft, fuse)
    return dynamic_tree(root_logp, expand, spec.depth, spec.top_k_draft, spec.total_tokens)


def _node_expander(drafter, b: Batch, root_hidden: Tensor, n: Tensor, sampling: SamplingConfig, policy: str,
                   fuse: bool = False) -> Callable[[object, Tensor], Tensor]:
    """`expand(tree, pick)` for a tree of any shape (the dynamic one's depends on the drafts): `_expansion` per
    level, each expanded node's mask row and output hidden state kept for its children."""
    step = fused(_expansion, fuse)
    B, dev = n.shape[0], n.device
    Ld, H = drafter.cache_length, root_hidden.shape[-1]
    committed = torch.arange(Ld, device=dev)[None, :] < n[:, None]  # (B, Ld) the pairs every node sees
    # per expanded node: its drafter mask row (the committed pairs, its ancestors' pairs and its own; never the junk
    # slot Ld - 1) and its output hidden state; a child's row is its parent's plus its own slot
    state = {"used": 0, "rows": torch.zeros(B, 0, Ld, dtype=torch.bool, device=dev),
             "hid": torch.zeros(root_hidden.shape[0], 0, H, device=dev, dtype=root_hidden.dtype)}

    def expand(tree, pick):
        logq, state["rows"], state["hid"] = step(drafter, tree.tokens, tree.parents, tree.depth, pick, state["rows"],
                                                 state["hid"], committed, root_hidden, n, state["used"], b.C,
                                                 b.max_pos, b.use_cfg, sampling, b.grammar, policy)
        state["used"] += pick.shape[1]
        return logq

    return expand


@dataclass(frozen=True, eq=False)
class _Step:
    """One drafter forward of a fixed-shape tree's drafting: the level's nodes that have children (`nodes`, the
    `pick` sampled_tree / static_tree pass), their pairs at offsets `slots` after the committed ones, the offsets
    each one's drafter query sees besides the committed pairs (`seen` (k, depth): its ancestors' pairs and its own),
    and where its input hidden state comes from (`src`: its parent's position in the previous step's pick; None:
    the root's children, which read the round's root hidden state)."""
    nodes: Tensor  # (k,)
    slots: Tensor  # (k,)
    seen: Tensor  # (k, depth)
    src: Optional[Tensor]  # (k,)
    depth: int  # of the picked nodes


@functools.lru_cache(maxsize=64)
def _expansion_plan(shape: Shape) -> tuple[_Step, ...]:
    """The drafter forwards of a fixed shape, built once per shape (a Shape is itself built once per paths and
    device): the same masks, inputs and slots as `_expansion` builds node by node, as static indices."""
    parents, dev = shape.parents.tolist(), shape.parents.device
    steps, placed, used = [], {}, 0  # placed: node -> (its position in its step's pick, its pair's offset)
    for lv in shape.levels[1:]:
        pick = lv.parents.tolist()
        seen = []
        for j, x in enumerate(pick):
            up, y = [], parents[x]
            while y >= 0:  # every ancestor has children, so an earlier step drafted its pair
                up.append(placed[y][1])
                y = parents[y]
            seen.append(up[::-1] + [used + j])
        src = [placed[parents[x]][0] if parents[x] >= 0 else -1 for x in pick]
        steps.append(_Step(lv.parents, torch.arange(used, used + len(pick), device=dev),
                           torch.tensor(seen, device=dev), torch.tensor(src, device=dev) if src[0] >= 0 else None,
                           len(seen[0])))
        placed |= {x: (j, used + j) for j, x in enumerate(pick)}
        used += len(pick)
    return tuple(steps)


def _fixed_expander(drafter, b: Batch, shape: Shape, root_hidden: Tensor, n: Tensor, sampling: SamplingConfig,
                    policy: str, fuse: bool = False) -> Callable[[object, Tensor], Tensor]:
    """`expand(tree, pick)` for a tree of fixed `shape` (sampled_tree / static_tree call it level by level with
    the level's parents as pick): one drafter forward over the picked nodes (`_expansion_plan`), whose queries see
    the committed pairs (slots < n (B,)) and their ancestors' pairs; the root's children read root_hidden
    (GB, 1, H), deeper nodes their parent's output hidden state. Returns their log-distributions (B, k, V) under
    the draft policy. The same drafter inputs as `_expansion`, without building a mask row per node."""
    plan, hidden = _expansion_plan(shape), []
    B, Ld = n.shape[0], drafter.cache_length
    committed = torch.arange(Ld, device=n.device)[None, None, :] < n[:, None, None]  # (B, 1, Ld)
    dist = _draft_dist(sampling, b.grammar, policy, fuse)

    def expand(tree, pick):
        st = plan[len(hidden)]
        k = st.slots.shape[0]
        mask = committed.expand(B, k, Ld).clone()
        mask.scatter_(2, n[:, None, None] + st.seen, True)  # (B, k, Ld)
        mask[:, :, Ld - 1] = False  # the junk slot is never attended
        in_hid = root_hidden.expand(-1, k, -1) if st.src is None else hidden[-1][:, st.src]  # (GB, k, H)
        at = (n[:, None] + st.depth).expand(B, k)  # (B, k) the sequence position each picked node predicts
        out = drafter(b.dup(tree.tokens[:, st.nodes]), in_hid, input_pos=b.dup(n[:, None] + st.slots),
                      mask=b.dup(mask), rope_pos=b.dup((b.C - 1 + at).clamp(max=b.max_pos)))
        hidden.append(out.hidden)
        return dist(out.logits, at)

    return expand


def _expansion(drafter, tokens: Tensor, parents: Tensor, depth: Tensor, pick: Tensor, rows: Tensor, hid: Tensor,
               committed: Tensor, root_hidden: Tensor, n: Tensor, used: int, C: int, max_pos: int, use_cfg: bool,
               sampling: SamplingConfig, grammar: Grammar, policy: str) -> tuple[Tensor, Tensor, Tensor]:
    """One draft level: the drafter's forward over the picked nodes pick (B, k) of the tree built so far (tokens,
    parents, depth (B, M)), their pairs at drafter slots n + used + 0 .. k - 1. rows (B, M', Ld): each expanded
    node's mask row (the committed pairs (B, Ld), its ancestors' pairs and its own; never the junk slot Ld - 1);
    hid (GB, M', H): each expanded node's output hidden state; a child's row is its parent's plus its own slot, a
    child of the root reads root_hidden (GB, 1, H). Returns (the picked nodes' log-distributions (B, k, V) under
    the draft policy (`_ranked_logq` / `_sampled_logq`), rows, hid), both grown to M nodes."""
    B, M = tokens.shape
    k, Ld, H = pick.shape[1], committed.shape[1], root_hidden.shape[-1]
    if rows.shape[1] < M:
        rows = torch.cat([rows, rows.new_zeros(B, M - rows.shape[1], Ld)], 1)
        hid = torch.cat([hid, hid.new_zeros(hid.shape[0], M - hid.shape[1], H)], 1)
    slots = n[:, None] + used + torch.arange(k, device=n.device)  # (B, k)
    parent = parents.gather(1, pick)  # (B, k)
    at_root = (parent < 0)[..., None]  # (B, k, 1)
    mask = torch.where(at_root, committed[:, None], rows.gather(1, parent.clamp(min=0)[..., None].expand(-1, -1, Ld)))
    mask = mask.scatter(2, slots[..., None], True)  # (B, k, Ld)
    mask[:, :, Ld - 1] = False  # the junk slot is never attended
    rows = rows.scatter(1, pick[..., None].expand(-1, -1, Ld), mask)
    in_hid = torch.where(_dup(at_root, use_cfg), root_hidden.expand(-1, k, -1),
                         hid.gather(1, _dup(parent.clamp(min=0), use_cfg)[..., None].expand(-1, -1, H)))
    d = depth.gather(1, pick)  # (B, k)
    rope = (C + n[:, None] - 1 + d).clamp(max=max_pos)
    out = drafter(_dup(tokens.gather(1, pick), use_cfg), in_hid, input_pos=_dup(slots, use_cfg),
                  mask=_dup(mask, use_cfg), rope_pos=_dup(rope, use_cfg))
    hid = hid.scatter(1, _dup(pick, use_cfg)[..., None].expand(-1, -1, H), out.hidden)
    logq = (_sampled_logq if policy == "sample" else _ranked_logq)(out.logits, n[:, None] + d, sampling, grammar)
    return logq, rows, hid


def _draft_chain(drafter, b: Batch, root_logp, root_hidden, n, depth, sampling):
    """A chain: the drafter's argmax, `depth` times (pairs at slots n, n+1, ...)."""
    B, dev = root_logp.shape[0], root_logp.device
    Ld = drafter.cache_length
    toks, scores, qs = [], [], [root_logp.exp()]
    logp, hid = root_logp, root_hidden
    total = torch.zeros(B, device=dev)
    for i in range(depth):
        tok = logp.argmax(-1)
        total = total + logp.gather(1, tok[:, None]).squeeze(1)
        toks.append(tok)
        scores.append(total)
        if i == depth - 1:
            break
        slot = (n + i)[:, None]
        mask = torch.arange(Ld, device=dev)[None, None, :] <= slot[:, :, None]
        rope = (b.C + n[:, None] + i).clamp(max=b.max_pos)
        out = drafter(b.dup(tok[:, None]), hid, input_pos=b.dup(slot), mask=b.dup(mask), rope_pos=b.dup(rope))
        hid = out.hidden
        logp = b.grammar.log_probs(guided(out.logits[:, 0], sampling).log_softmax(-1)[:, None],
                                   (n + i + 1)[:, None])[:, 0]
        qs.append(logp.exp())
    qs += [torch.zeros_like(qs[0])] * (depth + 1 - len(qs))
    return chain(torch.stack(toks, 1), torch.stack(scores, 1), torch.stack(qs, 1))


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
