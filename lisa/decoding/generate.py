"""Vanilla autoregressive decoding of a LlamaGen-style target, in gpt-fast's shape: prefill, then one-token steps.

CFG runs the conditional and unconditional rows in one batch (conditional first) sharing one KV cache; guidance is
applied to the logits before temperature / top-k / top-p (lisa.decoding.sampling). Reproducible through an explicit
torch.Generator. The speculative loop (drafting, verification) builds on the same `prefill` / `decode_one_token`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from lisa.models.gpt import Transformer
from lisa.decoding import verify
from lisa.decoding.sampling import SamplingConfig, cfg_logits, logits_to_probs, sample, sample_from
from lisa.decoding.tree import chain, dynamic_tree, static_choices, static_tree


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


def force_tokens(dist: Tensor, pos: Tensor, forced: Optional[Tensor], log: bool = False, free_vocab: int = 0) -> Tensor:
    """The grammar hook: `forced` (T,) holds a token id at each image position that must be emitted as is (e.g.
    Lumina-mGPT's end-of-line after every row), -1 elsewhere. At sequence positions `pos` (B, S) that are forced,
    the distribution dist (B, S, V) becomes that token: one-hot probabilities, or (log=True) log-probabilities 0
    there and -1e4 elsewhere (finite, so draft-tree ranking stays strict). Forced tokens are thus never sampled:
    drafters draft them with certainty and every verifier accepts them, or emits them as the correction.
    free_vocab > 0 (lm targets): at the free positions ids >= free_vocab (the grammar tokens) get probability 0
    (log: -1e4), so a drafter never proposes one where a code belongs (a relaxed verifier could accept it)."""
    if forced is None:
        return dist
    T = forced.shape[0]
    f = torch.where(pos < T, forced[pos.clamp(0, T - 1)], -1)  # (B, S)
    on = f >= 0
    if free_vocab:
        grammar_id = torch.arange(dist.shape[-1], device=dist.device) >= free_vocab
        dist = dist.masked_fill(~on[..., None] & grammar_id, -1e4 if log else 0.0)
    if not bool(on.any()):
        return dist
    hot = torch.nn.functional.one_hot(f.clamp(min=0), dist.shape[-1]).bool()
    value = torch.where(hot, 0.0, -1e4).to(dist.dtype) if log else hot.to(dist.dtype)
    return torch.where(on[..., None], value, dist)


def prefill(model: Transformer, prefix: Tensor, sampling: SamplingConfig, generator: Optional[torch.Generator],
            key_mask: Optional[Tensor] = None) -> Tensor:
    """Run the condition prefix (B', C, D) through the model and sample the first image token (B,)."""
    input_pos = torch.arange(prefix.shape[1], device=prefix.device)  # (C,)
    logits = model(prefix, input_pos, mask=step_mask(model, input_pos, key_mask)).logits[:, -1]  # (B', V)
    return sample(guided(logits, sampling), sampling, generator)[0]


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, sampling: SamplingConfig,
                     generator: Optional[torch.Generator], key_mask: Optional[Tensor] = None) -> Tensor:
    """token (B,) at slot input_pos (1,) -> next token (B,)."""
    x = model.embed_tokens(torch.cat([token, token]) if sampling.use_cfg else token)[:, None]  # (B', 1, D)
    logits = model(x, input_pos, mask=step_mask(model, input_pos, key_mask)).logits[:, -1]  # (B', V)
    return sample(guided(logits, sampling), sampling, generator)[0]


@torch.no_grad()
def generate(model: Transformer, cond: Tensor, sampling: SamplingConfig, generator: Optional[torch.Generator] = None,
             num_tokens: Optional[int] = None, cond_mask: Optional[Tensor] = None,
             step_fn: Optional[Callable] = None, forced: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """Sample image tokens (B, T) for `cond` (class ids (B,) or caption features (B, C, Dc)).

    cond_mask: (B, C) bool for t2i caption padding (True = real token). step_fn: a compiled
    decode_one_token, if wanted. forced: (T,) grammar tokens (see force_tokens), -1 = sampled.
    Returns (tokens, {"forwards": target forward passes}).
    """
    cond, cond_mask = model.split_cond(cond, cond_mask)  # a packed condition carries its mask
    forced = forced if forced is not None else getattr(model, "grammar", None)  # lm: the image grammar
    cfg = model.config
    T = num_tokens or cfg.block_size
    if sampling.use_cfg and not cfg.has_null_cond:
        raise ValueError("cfg_scale != 1 needs a null class: this c2i model was built with class_dropout_prob=0")
    B, C = cond.shape[0], cfg.cls_token_num
    model.setup_caches((2 if sampling.use_cfg else 1) * B, C + T)
    key_mask = prefix_key_mask(model, cond_mask, sampling.use_cfg, cond)
    step = step_fn or decode_one_token

    tokens = torch.empty(B, T, dtype=torch.long, device=cond.device)
    tokens[:, 0] = prefill(model, prefix_embeddings(model, cond, sampling.use_cfg), sampling, generator, key_mask)
    fixed = forced.tolist() if forced is not None else [-1] * T
    if fixed[0] >= 0:
        tokens[:, 0] = fixed[0]
    for t in range(1, T):
        input_pos = torch.tensor([C + t - 1], device=cond.device)  # slot of the token being fed
        tokens[:, t] = step(model, tokens[:, t - 1], input_pos, sampling, generator, key_mask)
        if fixed[t] >= 0:
            tokens[:, t] = fixed[t]
    return tokens, {"forwards": T}


# ---------------------------------------------------------------------------------------------------------------
# Speculative decoding: draft a tree with the drafter, verify it with one target forward, keep what passes.


@dataclass(frozen=True)
class SpecConfig:
    verifier: str = "exact"  # a name in lisa.decoding.verify.VERIFIERS
    tree: str = "dynamic"  # "dynamic" (EAGLE-2/3) | "static" (fixed shape: lisa.decoding.tree.static_choices) | "chain"
    depth: int = 4  # draft levels
    top_k: int = 4  # children per expanded node, nodes expanded per level (dynamic)
    total_tokens: int = 16  # draft nodes kept after reranking (dynamic)

    def __post_init__(self):
        if self.tree not in ("dynamic", "static", "chain"):
            raise ValueError(f"SpecConfig.tree must be 'dynamic', 'static' or 'chain', got {self.tree!r}")
        if min(self.depth, self.top_k, self.total_tokens) < 1:
            raise ValueError(f"SpecConfig: depth, top_k and total_tokens must be >= 1, got {self}")

    @property
    def nodes(self) -> int:
        if self.tree == "static":
            return len(static_choices(self.depth, self.top_k, self.total_tokens))
        return self.depth if self.tree == "chain" else self.total_tokens


def _dup(x: Tensor, use_cfg: bool) -> Tensor:
    return torch.cat([x, x]) if use_cfg else x


@torch.no_grad()
def speculative_generate(target: Transformer, drafter, cond: Tensor, sampling: SamplingConfig, spec: SpecConfig,
                         generator: Optional[torch.Generator] = None, num_tokens: Optional[int] = None,
                         cond_mask: Optional[Tensor] = None, geometry=None, options: Optional[dict] = None,
                         trace: Optional[list] = None, forced: Optional[Tensor] = None,
                         measure: bool = False) -> tuple[Tensor, dict]:
    """Speculative sampling of image tokens (B, T) with an EAGLE-3 drafter; each row accepts its own length.

    Layout. Target cache: condition prefix at slots 0..C-1, image token j at slot C + j once accepted; a round
    writes its root (the last emitted token, not yet fed) at its own slot and the tree right after it, per row,
    then moves the accepted nodes down to their sequence slots (the rest is overwritten later). Drafter cache:
    pair j = (target hidden that predicted token j, token j) at slot j; tree pairs go after the committed ones.
    RoPE positions are sequence positions (a node at depth d sits d after the root). CFG: cond rows then uncond
    rows in both models, guidance on both models' logits. Returns (tokens, {"forwards", "rounds", "tau",
    "accept_lengths"}): tau = tokens emitted per target forward after the prefill, bonus token included.
    trace: a list that receives, per round, the draft tree's node scores and depths, the accepted path and its
    length, and which rows were live (what lisa.decoding.costmodel learns acceptance from). forced: (T,) grammar tokens,
    -1 = free (force_tokens): both models' distributions are one-hot there, so they are never drafted freely
    nor sampled, and the emitted sequence has them exactly in place. measure: stats["tv"] (B, T) gets the total
    variation between the law each token was emitted from and the target's distribution there (lisa.decoding.verify.walk;
    0 at the prefill token).
    """
    cond, cond_mask = target.split_cond(cond, cond_mask)  # a packed condition carries its mask
    forced = forced if forced is not None else getattr(target, "grammar", None)  # lm: the image grammar
    cfg = target.config
    T = num_tokens or cfg.block_size
    if sampling.use_cfg and not cfg.has_null_cond:
        raise ValueError("cfg_scale != 1 needs a null class: this c2i model was built with class_dropout_prob=0")
    verifier = verify.get_verifier(spec.verifier)
    fv = target.config.free_vocab  # lm targets: grammar ids are never drafted at code positions
    use_cfg, dev = sampling.use_cfg, cond.device
    B, C, N = cond.shape[0], cfg.cls_token_num, spec.nodes
    GB = (2 if use_cfg else 1) * B
    taps = tuple(drafter.config.taps)
    max_pos = target.rope.shape[0] - 1
    target.setup_caches(GB, C + T + N + 2)
    t_junk = target.cache_length - 1  # padding writes land here
    scratch = {"dynamic": spec.depth * spec.top_k, "static": N, "chain": spec.depth}[spec.tree]  # drafted pairs
    drafter.setup_caches(GB, T + scratch + spec.top_k + 2)
    d_junk = drafter.cache_length - 1
    key_mask = prefix_key_mask(target, cond_mask, use_cfg, cond)
    ar = torch.arange(B, device=dev)
    Lt, Ld = target.cache_length, drafter.cache_length

    def probs_of(logits):  # (GB, ..., V) -> guided logits and the sampling distribution (B, ..., V)
        g = guided(logits, sampling)
        return g, logits_to_probs(g, sampling.temperature, sampling.top_k, sampling.top_p)

    def draw(p):
        return p.argmax(-1) if sampling.greedy else sample_from(p, generator)

    # prefill: the target reads the prefix and gives token 0; the drafter commits pair 0
    prefix = prefix_embeddings(target, cond, use_cfg)
    pos = torch.arange(C, device=dev)
    out = target(prefix, pos, mask=step_mask(target, pos, key_mask), taps=taps)
    _, p0 = probs_of(out.logits[:, -1])
    p0 = force_tokens(p0[:, None], torch.zeros(B, 1, dtype=torch.long, device=dev), forced)[:, 0]
    tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
    tokens[:, 0] = draw(p0)
    n = torch.ones(B, dtype=torch.long, device=dev)  # tokens emitted per row
    fused = drafter.fuse([h[:, -1:] for h in out.hidden])  # (GB, 1, H)
    d = drafter(_dup(tokens[:, :1], use_cfg), fused, input_pos=torch.zeros(GB, 1, dtype=torch.long, device=dev),
                mask=(torch.arange(Ld, device=dev) == 0).expand(GB, 1, Ld),
                rope_pos=torch.full((GB, 1), C, device=dev))
    root_logits, root_hidden = d.logits[:, 0], d.hidden[:, :1]  # (GB, V), (GB, 1, H)

    forwards, accepted, rounds = 1, [], 0
    tv = torch.zeros(B, T, device=dev) if measure else None
    while bool((n < T).any()):
        rounds += 1
        live = n < T
        base = (C + n - 1).clamp(max=Lt - N - 2)  # the root's slot (finished rows idle at the end)
        # ---- draft
        root_logp = guided(root_logits, sampling).log_softmax(-1)  # (B, V): scores use the raw guided drafter
        root_logp = force_tokens(root_logp[:, None], n[:, None], forced, log=True, free_vocab=fv)[:, 0]
        if spec.tree == "chain":
            tree = _draft_chain(drafter, root_logp, root_hidden, n, spec.depth, C, use_cfg, sampling, max_pos,
                                forced, fv)
        else:
            tree = _draft_tree(drafter, root_logp, root_hidden, n, spec, C, use_cfg, sampling, max_pos, forced, fv)
        # ---- verify: one target forward over root + tree, per-row slots and tree mask
        out = tree_forward(target, tokens[ar, n - 1], tree, base, key_mask, use_cfg, taps)
        forwards += 1
        g_logits, p = probs_of(out.logits)  # (B, S, V)
        p = force_tokens(p, n[:, None] + torch.cat([torch.zeros_like(tree.depth[:, :1]), tree.depth], 1), forced)
        verdict = verifier(verify.VerifyContext(p, tree, logits=g_logits, geometry=geometry, options=options,
                                                measure=measure), generator)
        m = verdict.n_accepted  # (B,)
        if tv is not None:
            _record_tv(tv, verdict.tv, n, m, live)
        M = int(m.max())
        if trace is not None:
            trace.append({"scores": tree.scores, "depth": tree.depth, "path": verdict.path, "m": m, "live": live})
        # ---- commit: move accepted nodes to their sequence slots in the target cache
        path = verdict.path[:, :M] if M else verdict.path[:, :0]
        valid = torch.arange(M, device=dev)[None] < m[:, None]  # (B, M)
        src = torch.where(valid, base[:, None] + 1 + path.clamp(min=0), torch.full_like(path, t_junk))
        dst = torch.where(valid, base[:, None] + 1 + torch.arange(M, device=dev), torch.full_like(path, t_junk))
        if M:
            for layer in target.layers:
                layer.attention.kv_cache.move(_dup(src, use_cfg), _dup(dst, use_cfg))
        new = torch.cat([tree.tokens.gather(1, path.clamp(min=0)), verdict.next_token[:, None]], 1)  # (B, M+1)
        new = torch.where(torch.cat([valid, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1), new,
                          torch.zeros_like(new))
        # the (M+1)-th new token of a row with m < M sits at column m: shift next_token there
        new.scatter_(1, m[:, None], verdict.next_token[:, None])
        for i in range(M + 1):
            write = live & (i <= m) & (n + i < T)
            tokens[ar[write], (n + i)[write]] = new[write, i]
        accepted.append(torch.where(live, torch.minimum(m + 1, T - n), torch.zeros_like(m)))  # what was kept
        # ---- drafter: commit pairs n .. n + m (target hidden of root / accepted node, the token after it)
        rows_h = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), 1 + path.clamp(min=0)], 1)  # (B, M+1)
        feats = drafter.fuse([h.gather(1, _dup(rows_h, use_cfg)[..., None].expand(-1, -1, h.shape[-1]))
                              for h in out.hidden])  # (GB, M+1, H)
        ok = torch.arange(M + 1, device=dev)[None] <= m[:, None]  # (B, M+1)
        dslots = torch.where(ok, (n[:, None] + torch.arange(M + 1, device=dev)).clamp(max=d_junk - 1),
                             torch.full_like(rows_h, d_junk))
        dmask = torch.arange(Ld, device=dev)[None, None, :] <= dslots[:, :, None]  # causal over own slots
        dmask &= ok[:, :, None] | (torch.arange(Ld, device=dev)[None, None, :] == d_junk)  # padding: junk only
        drope = (C + n[:, None] + torch.arange(M + 1, device=dev)).clamp(max=max_pos)
        d = drafter(_dup(new, use_cfg), feats, input_pos=_dup(dslots, use_cfg), mask=_dup(dmask, use_cfg),
                    rope_pos=_dup(drope, use_cfg))
        last = _dup(m, use_cfg)
        root_logits = d.logits[torch.arange(GB, device=dev), last]
        root_hidden = d.hidden[torch.arange(GB, device=dev), last][:, None]
        n = torch.where(live, (n + m + 1).clamp(max=T), n)
    acc = torch.stack(accepted) if accepted else torch.zeros(0, B, dtype=torch.long)
    live_rounds = acc > 0
    return tokens, {"forwards": forwards, "rounds": rounds,
                    "tau": float(acc[live_rounds].float().mean()) if live_rounds.any() else 0.0,
                    "accept_lengths": acc.T.tolist(), **({"tv": tv} if tv is not None else {})}


def _record_tv(tv: Tensor, round_tv: Tensor, n: Tensor, m: Tensor, live: Tensor) -> None:
    """tv (B, T): the round's per-visited-node TV (B, D + 1) at the positions n .. n + m it emitted."""
    B, T = tv.shape
    for level in range(round_tv.shape[1]):
        write = live & (level <= m) & (n + level < T)
        if write.any():
            tv[write, (n + level)[write]] = round_tv[write, level]


def tree_forward(target: Transformer, root: Tensor, tree, base: Tensor, key_mask: Optional[Tensor], use_cfg: bool,
                 taps=()):
    """One target forward over [root, tree nodes] per row: the root at slot base (B,), node i at base + 1 + i;
    each query sees the committed slots < base (and the caption key mask), the root, and its ancestors."""
    B, N = tree.tokens.shape
    dev = root.device
    Lt = target.cache_length
    slots = base[:, None] + torch.arange(N + 1, device=dev)  # (B, S)
    mask = (torch.arange(Lt, device=dev)[None, None, :] < base[:, None, None]).expand(B, N + 1, Lt).clone()
    mask[torch.arange(B, device=dev), :, base] = True  # everyone sees the root
    tree_cols = torch.zeros(B, N + 1, Lt, dtype=torch.bool, device=dev)
    tree_cols.scatter_(2, slots[:, None, 1:].expand(B, N, N), tree.ancestor_mask())  # node i sees its ancestors
    mask[:, 1:] |= tree_cols[:, :N]
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), tree.depth], 1)
    rope = (base[:, None] + depth).clamp(max=target.rope.shape[0] - 1)
    x = target.embed_tokens(_dup(torch.cat([root[:, None], tree.tokens], 1), use_cfg))
    mask = _dup(mask, use_cfg)
    if key_mask is not None:  # per row: the unconditional rows of an lm target mask their whole prompt
        mask &= key_mask[:, None, :]
    return target(x, _dup(slots, use_cfg), mask=mask, rope_pos=_dup(rope, use_cfg), taps=taps)


def _draft_tree(drafter, root_logp, root_hidden, n, spec: SpecConfig, C, use_cfg, sampling, max_pos, forced=None,
                free_vocab=0):
    """EAGLE-2/3 dynamic tree (or a static one): expansions are drafter pairs written after the committed ones
    (slots n, n + 1, ... in expansion order) that see the committed pairs and their own ancestors' pairs."""
    B = root_logp.shape[0]
    dev = root_logp.device
    Ld = drafter.cache_length
    GB = root_hidden.shape[0]
    state = {"used": 0, "slot_of": torch.zeros(B, 0, dtype=torch.long, device=dev),
             "hid_of": torch.zeros(GB, 0, root_hidden.shape[-1], device=dev, dtype=root_hidden.dtype)}

    def expand(tree, pick):
        M, k = tree.size, pick.shape[1]
        slot_of = torch.cat([state["slot_of"], torch.full((B, M - state["slot_of"].shape[1]), -1, dtype=torch.long,
                                                          device=dev)], 1)
        hid_of = torch.cat([state["hid_of"], torch.zeros(GB, M - state["hid_of"].shape[1], root_hidden.shape[-1],
                                                         device=dev, dtype=root_hidden.dtype)], 1)
        slots = n[:, None] + state["used"] + torch.arange(k, device=dev)  # (B, k)
        slot_of.scatter_(1, pick, slots)
        anc = tree.ancestor_mask().gather(1, pick[..., None].expand(-1, -1, M))  # (B, k, M) incl. self
        cols = torch.where(anc & (slot_of[:, None, :] >= 0), slot_of[:, None, :].expand(-1, k, -1),
                           torch.full_like(slot_of[:, None, :].expand(-1, k, -1), Ld - 1))
        mask = torch.arange(Ld, device=dev)[None, None, :] < n[:, None, None]
        mask = mask.expand(B, k, Ld).clone()
        mask.scatter_(2, cols, anc)
        mask[:, :, Ld - 1] = False  # the junk slot is never attended
        parent = tree.parents.gather(1, pick)  # (B, k)
        in_hid = torch.where(_dup(parent, use_cfg)[..., None] < 0, root_hidden.expand(-1, k, -1),
                             hid_of.gather(1, _dup(parent.clamp(min=0), use_cfg)[..., None]
                                           .expand(-1, -1, hid_of.shape[-1])))
        depth = tree.depth.gather(1, pick)
        rope = (C + n[:, None] - 1 + depth).clamp(max=max_pos)
        out = drafter(_dup(tree.tokens.gather(1, pick), use_cfg), in_hid, input_pos=_dup(slots, use_cfg),
                      mask=_dup(mask, use_cfg), rope_pos=_dup(rope, use_cfg))
        hid_of.scatter_(1, _dup(pick, use_cfg)[..., None].expand(-1, -1, hid_of.shape[-1]), out.hidden)
        state.update(used=state["used"] + k, slot_of=slot_of, hid_of=hid_of)
        return force_tokens(guided(out.logits, sampling).log_softmax(-1), n[:, None] + depth, forced, log=True,
                            free_vocab=free_vocab)

    if spec.tree == "static":
        return static_tree(root_logp, expand, static_choices(spec.depth, spec.top_k, spec.total_tokens))
    return dynamic_tree(root_logp, expand, spec.depth, spec.top_k, spec.total_tokens)


def _draft_chain(drafter, root_logp, root_hidden, n, depth, C, use_cfg, sampling, max_pos, forced=None,
                 free_vocab=0):
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
        rope = (C + n[:, None] + i).clamp(max=max_pos)
        out = drafter(_dup(tok[:, None], use_cfg), hid, input_pos=_dup(slot, use_cfg), mask=_dup(mask, use_cfg),
                      rope_pos=_dup(rope, use_cfg))
        hid = out.hidden
        logp = force_tokens(guided(out.logits[:, 0], sampling).log_softmax(-1)[:, None], (n + i + 1)[:, None], forced,
                            log=True, free_vocab=free_vocab)[:, 0]
        qs.append(logp.exp())
    qs += [torch.zeros_like(qs[0])] * (depth + 1 - len(qs))
    return chain(torch.stack(toks, 1), torch.stack(scores, 1), torch.stack(qs, 1))


@torch.no_grad()
def jacobi_generate(target: Transformer, cond: Tensor, sampling: SamplingConfig, verifier: str = "sjd",
                    window: int = 16, generator: Optional[torch.Generator] = None, num_tokens: Optional[int] = None,
                    cond_mask: Optional[Tensor] = None, geometry=None, options: Optional[dict] = None,
                    forced: Optional[Tensor] = None, measure: bool = False):
    """Drafter-free speculative decoding (SJD; GSD with verifier="gsd"): a window of `window` draft tokens (new
    positions start uniformly random) is refined by the target itself. Each iteration feeds [last token, drafts]
    in one forward; drafts are verified against the distributions they were drawn from; the drafts after the
    first rejection are re-drawn from this iteration's distributions (Jacobi), and the window is refilled.
    forced: (T,) grammar tokens, -1 = free (force_tokens). measure: stats["tv"] as in speculative_generate.
    Returns (tokens (B, T), {"forwards", "rounds", "tau", "accept_lengths"})."""
    cond, cond_mask = target.split_cond(cond, cond_mask)  # a packed condition carries its mask
    forced = forced if forced is not None else getattr(target, "grammar", None)  # lm: the image grammar
    cfg = target.config
    T = num_tokens or cfg.block_size
    use_cfg, dev = sampling.use_cfg, cond.device
    B, C, V, L = cond.shape[0], cfg.cls_token_num, cfg.vocab_size, window
    fn = verify.get_verifier(verifier)
    target.setup_caches((2 if use_cfg else 1) * B, C + T + L + 2)
    key_mask = prefix_key_mask(target, cond_mask, use_cfg, cond)
    ar = torch.arange(B, device=dev)

    def probs_of(logits):
        g = guided(logits, sampling)
        return g, logits_to_probs(g, sampling.temperature, sampling.top_k, sampling.top_p)

    tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
    tokens[:, 0] = prefill(target, prefix_embeddings(target, cond, use_cfg), sampling, generator, key_mask)
    if forced is not None and int(forced[0]) >= 0:
        tokens[:, 0] = forced[0]
    n = torch.ones(B, dtype=torch.long, device=dev)
    q = torch.full((B, L, V), 1.0 / V, device=dev)  # what each draft was drawn from
    drafts = sample_from(q, generator)
    forwards, accepted, rounds = 1, [], 0
    tv = torch.zeros(B, T, device=dev) if measure else None
    while bool((n < T).any()):
        rounds += 1
        live = n < T
        base = (C + n - 1).clamp(max=target.cache_length - L - 2)
        tree = chain(drafts, q=torch.cat([q, q[:, -1:]], 1))
        out = tree_forward(target, tokens[ar, n - 1], tree, base, key_mask, use_cfg)
        forwards += 1
        g_logits, p = probs_of(out.logits)  # (B, L + 1, V): row i = distribution of draft i's position
        p = force_tokens(p, n[:, None] + torch.arange(L + 1, device=dev), forced)
        v = fn(verify.VerifyContext(p, tree, logits=g_logits, sampled_siblings=True, geometry=geometry,
                                    options=options, measure=measure), generator)
        m = v.n_accepted
        if tv is not None:
            _record_tv(tv, v.tv, n, m, live)
        for i in range(L + 1):  # accepted drafts are already at their sequence slots (a chain): just record them
            write = live & (i <= m) & (n + i < T)
            tok = torch.where(i < m, drafts[:, min(i, L - 1)], v.next_token)
            tokens[ar[write], (n + i)[write]] = tok[write]
        accepted.append(torch.where(live, torch.minimum(m + 1, T - n), torch.zeros_like(m)))
        # Jacobi update: positions after the emitted ones keep being refined from this iteration's distributions
        shift = m + 1  # drafts consumed (accepted + the rejected / bonus position)
        idx = (shift[:, None] + torch.arange(L, device=dev)).clamp(max=L)  # rows of p for the new window
        fresh = (shift[:, None] + torch.arange(L, device=dev)) > L  # beyond this iteration's rows: uniform
        q = torch.where(fresh[..., None], torch.full_like(q, 1.0 / V), p.gather(1, idx[..., None].expand(-1, -1, V)))
        drafts = sample_from(q, generator)
        n = torch.where(live, (n + m + 1).clamp(max=T), n)
    acc = torch.stack(accepted)
    return tokens, {"forwards": forwards, "rounds": rounds, "tau": float(acc[acc > 0].float().mean()),
                    "accept_lengths": acc.T.tolist(), **({"tv": tv} if tv is not None else {})}


def decoder(target: Transformer, method: str = "vanilla", drafter=None, spec: Optional[SpecConfig] = None,
            window: int = 16, geometry=None, options: Optional[dict] = None, measure: bool = False) -> Callable:
    """The Python API behind `lisa sample --method`: a function (cond, sampling, generator, cond_mask=None,
    forced=None) -> (tokens (B, T), stats) decoding with `method`: "vanilla", or a verifier name (greedy / exact / lantern / ...
    with an EAGLE-3 `drafter` and a `spec` tree; sjd / gsd run drafter-free over a `window`). Relaxed verifiers
    read `geometry` (lisa.decoding.verify.Geometry) and their knobs from `options`. stats holds "forwards" and, for the
    speculative methods, "tau" and the per-round "accept_lengths" (and with measure, "tv": see
    speculative_generate)."""
    if method == "vanilla":
        return lambda c, s, g, cond_mask=None, forced=None: generate(target, c, s, g, cond_mask=cond_mask,
                                                                      forced=forced)
    if method not in verify.VERIFIERS:
        raise ValueError(f"decoding method {method!r}: not 'vanilla' nor a verifier {sorted(verify.VERIFIERS)}")
    if method in ("sjd", "gsd"):
        return lambda c, s, g, cond_mask=None, forced=None: jacobi_generate(
            target, c, s, method, window, g, cond_mask=cond_mask, geometry=geometry, options=options, forced=forced,
            measure=measure)
    if drafter is None:
        raise ValueError(f"decoding method {method!r} verifies a drafter's trees: give a drafter "
                         "(`lisa train-drafter`)")
    spec = spec or SpecConfig(method)
    if spec.verifier != method:
        spec = SpecConfig(method, spec.tree, spec.depth, spec.top_k, spec.total_tokens)
    return lambda c, s, g, cond_mask=None, forced=None: speculative_generate(
        target, drafter, c, s, spec, g, cond_mask=cond_mask, geometry=geometry, options=options, forced=forced,
        measure=measure)
