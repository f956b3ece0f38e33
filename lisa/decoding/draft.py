"""Drafting with an EAGLE-3 drafter (lisa.decoding.generate.speculative_generate): one round's draft tree from the
drafter's root, a chain, a dynamic tree (EAGLE-2/3) or a tree of fixed shape (static, sampled), one drafter forward
per level, and the drafter's commit of the accepted pairs after the target's verification."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from lisa.decoding.fused import fused
from lisa.decoding.grammar import Grammar
from lisa.decoding.loop import Batch, _dup, emitted_tokens, guided
from lisa.decoding.sampling import SamplingConfig, filtered, logits_to_probs
from lisa.decoding.tree import Shape, chain, dynamic_tree, sampled_tree, static_choices, static_tree, tree_shape


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
