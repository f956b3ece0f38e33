"""What every verifier of lisa.decoding.verify shares (its docstring gives the theory): the context and verdict, the
batched walk with a per-draft acceptance rule (`walk`: deterministic siblings, gsd's sampled chains), recursive
rejection over sampled siblings (`walk_sampled`), a Jacobi chain in one go (`walk_chain`), the relaxed target's mass
transport along codebook edges (`transport`, `neighbour_edges`), and the typing of a verifier's knobs
(`typed_options`). p = target, q = draft."""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from lisa.decoding.fused import fused
from lisa.decoding.sampling import sample_inverse
from lisa.decoding.tree import Shape, Tree


@dataclass
class VerifyContext:
    p: Tensor  # (B, N + 1, V) target probabilities at the root (row 0) and each node (row i + 1)
    tree: Tree
    logits: Optional[Tensor] = None  # (B, N + 1, V) raw guided target logits (uncertainty measures)
    geometry: Any = None  # codebook / neighbour table / calibration, for relaxed verifiers
    options: Any = None  # the verifier's typed options (verifier_options), a dict of them, or None = defaults
    measure: bool = False  # also compute the law of each emitted token and its TV distance to p (Verdict.tv)
    noise: Optional[Tensor] = None  # (B, N + 1, V) scd-gumbel: the Gumbel noise of the position each row's children
    #                                 sit at (row 0: the root's children), shared with the drafting
    fuse: bool = False  # the walk's pure steps under torch.compile (the loop's compile=True; lisa.decoding.fused)


@dataclass
class Verdict:
    path: Tensor  # (B, D) accepted node indices, root side first, padded -1
    n_accepted: Tensor  # (B,) accepted draft tokens
    next_token: Tensor  # (B,) the token emitted after them (correction or bonus)
    tv: Optional[Tensor] = None  # (B, D + 1) TV(law of the token emitted at each visited node, p there); NaN beyond


def children_table(tree: Tree) -> Tensor:
    """(B, N + 1, C) child node indices of the root (row 0) and every node (row i + 1), in node order, pad -1."""
    return tree.children()


AcceptFn = Callable[[Tensor, Tensor, Tensor, Tensor, "VerifyContext"], tuple[Tensor, Tensor]]
EmitFn = Callable[[Tensor, Tensor, "VerifyContext"], Tensor]
MarginalFn = Callable[[Tensor, Tensor, Tensor, "VerifyContext"], tuple[Tensor, Tensor]]


def walk(ctx: VerifyContext, generator: torch.Generator, accept_fn: AcceptFn, emit_fn: Optional[EmitFn] = None,
         marginal_fn: Optional[MarginalFn] = None) -> Verdict:
    """The walk with a per-draft acceptance rule, vectorised over the batch: deterministic siblings (top-k trees),
    and gsd's sampled chains.

    accept_fn(r, tok, q_parent, row, ctx) -> (acceptance probability of child tok (B,), the residual after its
    rejection (B, V)); a child is accepted when a fresh uniform u < that probability. emit_fn(r, row, ctx) -> the
    distribution (B, V) the correction / bonus token is drawn from when no child is accepted (default: r
    normalised). With ctx.measure, the walk also computes, at every node it stands on, the law of the token
    emitted next (over the verifier's randomness, drafts fixed): sum_j [prod_{i<j} (1 - a_i)] a_j delta(x_j)
    + prod_j (1 - a_j) emit(r_final), and its total-variation distance to the target's p at that node
    (Verdict.tv). On a sampled chain (gsd) the law is also over the draft: `marginal_fn(r, q, row, ctx) ->
    (acceptance probability of every token (B, V), the residual after a rejection (B, V))` gives q * a + (1 -
    sum q * a) * emit(residual). Sampled trees under a fixed-target rule take `walk_sampled`."""
    p, tree = ctx.p, ctx.tree
    B = p.shape[0]
    kids = children_table(tree)
    depth = int(tree.depth.max()) if tree.size else 0
    dev = p.device
    ar = torch.arange(B, device=dev)
    row = torch.zeros(B, dtype=torch.long, device=dev)  # the current node's row in p (0 = root)
    r = p[:, 0].clone()
    path = torch.full((B, max(depth, 1)), -1, dtype=torch.long, device=dev)
    n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    emit = emit_fn or (lambda r, row, ctx: _normalise(r))
    tv = torch.full((B, depth + 1), float("nan"), device=dev) if ctx.measure else None
    for level in range(depth + 1):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        law = torch.zeros_like(r) if ctx.measure else None
        stay = torch.ones(B, device=dev)
        r_node = r
        for s in range(kids.shape[-1]):
            child = kids[ar, row, s]  # (B,)
            exists = (child >= 0) & ~done
            if not exists.any():
                continue
            active = exists & ~moved
            tok = tree.tokens[ar, child.clamp(min=0)]
            q_parent = tree.q[ar, row] if tree.q is not None else None
            u = torch.rand(B, generator=generator, device=dev)
            prob, r_rejected = accept_fn(r, tok, q_parent, row, ctx)
            acc = (u < prob) & active
            if law is not None:  # the hypothetical chain: every child tried after all earlier ones were rejected
                w = torch.where(exists, stay * prob, 0.0)
                law.scatter_add_(1, tok[:, None], w[:, None])
                stay = torch.where(exists, stay * (1 - prob), stay)
            r = torch.where(exists[:, None], r_rejected, r)  # rows that accepted leave r behind: unused
            path[acc, level] = child[acc]  # a child of a node at depth `level` has depth level + 1 <= depth
            moved |= acc
        if law is not None and tree.sampled:  # one child drawn from q (walk's callers check)
            a_all, res = marginal_fn(r_node, tree.q[ar, row], row, ctx)
            qa = tree.q[ar, row] * a_all
            law_q = qa + (1 - qa.sum(-1, keepdim=True)).clamp(min=0) * emit(res, row, ctx)
            law = torch.where((kids[ar, row, 0] >= 0)[:, None], law_q, emit(r_node, row, ctx))
        elif law is not None:
            law = law + stay[:, None] * emit(r, row, ctx)
        if law is not None:
            tv[:, level] = torch.where(~done, 0.5 * (law - p[ar, row]).abs().sum(-1), tv[:, level])
        n_acc += moved.long()
        done |= ~moved
        if done.all():
            break
        row = torch.where(moved, path[:, level] + 1, row)
        r = torch.where(moved[:, None], p[ar, row], r)
    if tv is not None:  # only the nodes the walk stood on: levels 0 .. n_accepted
        tv = torch.where(torch.arange(depth + 1, device=dev)[None] <= n_acc[:, None], tv, float("nan"))
    return Verdict(path, n_acc, sample_residual(emit(r, row, ctx), generator), tv)


RelaxFn = Callable[[Tensor, Tensor, Tensor, "VerifyContext"], Tensor]


def walk_sampled(ctx: VerifyContext, generator: torch.Generator, relax_fn: Optional[RelaxFn] = None,
                 emit_fn: Optional[EmitFn] = None) -> Verdict:
    """The walk over siblings drawn from the drafter's q (tree.sampled "iid" or "wor"), vectorised over the batch.

    relax_fn(p, q, rows, ctx) -> p~ (B, S, V): the target each of the nodes at rows (B, S) (p, q (B, S, V) there)
    draws its token from (default: p, `exact`); it may depend on the node's p and q, never on the drawn children.
    The children are tried in draw order by recursive rejection sampling of p~ (module docstring); a child whose
    remaining q_i is empty (a draw without replacement past q's support) is skipped. emit_fn(r, row, ctx): the
    distribution the correction / bonus token comes from (default r normalised; greedy: its argmax). With
    ctx.measure, the law of the token emitted at each node the walk stands on, over the drafts and the verifier's
    randomness, and its TV to p (Verdict.tv): for i.i.d. siblings computed by the recursion law_i = q a_i + (1 -
    sum q a_i) law_{i+1} (the residuals do not depend on the drawn tokens there), for siblings drawn without
    replacement p~ itself (the recursive rejection theorem). A fan of chains (the root's children each heading a
    chain: branching [k, 1, 1, ...], `fan_chains`) takes `walk_fan` where `_use_fan` says so:
    the same verdicts, without a p~ per level or a host sync per sibling."""
    p, tree = ctx.p, ctx.tree
    if tree.q is None:
        raise ValueError("verifying sampled drafts needs the distributions they were drawn from (tree.q)")
    relax_rows = relax_fn or (lambda p, q, rows, ctx: p)
    emit = emit_fn or (lambda r, row, ctx: _normalise(r))
    chains = fan_chains(tree.shape) if _use_fan(ctx, relax_fn) else None
    if chains is not None:
        return walk_fan(ctx, generator, chains, relax_rows, emit)
    B, V = p.shape[0], p.shape[-1]
    kids = children_table(tree)
    depth = len(tree.shape.levels) if tree.shape is not None else int(tree.depth.max()) if tree.size else 0
    dev = p.device
    ar = torch.arange(B, device=dev)

    def relax(p_node, q, row, ctx):  # one node per row
        return relax_rows(p_node[:, None], q[:, None], row[:, None], ctx)[:, 0]

    row = torch.zeros(B, dtype=torch.long, device=dev)
    r = relax(p[:, 0], tree.q[:, 0], row, ctx)
    path = torch.full((B, max(depth, 1)), -1, dtype=torch.long, device=dev)
    n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    tv = torch.full((B, depth + 1), float("nan"), device=dev) if ctx.measure else None
    widths = tree.shape.widths if tree.shape is not None else (kids.shape[-1],) * (depth + 1)
    try_sibling, drop = fused(_try_sibling, ctx.fuse), fused(_drop_token, ctx.fuse)
    for level in range(depth + 1):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        r_node, q_node = r, tree.q[ar, row]
        qi = q_node
        krow = kids[ar, row]  # (B, C) the children of each row's node
        toks = tree.tokens.gather(1, krow.clamp(min=0))  # (B, C)
        for s in range(widths[level]):  # past the level's widest node no row has a child
            child = krow[:, s]  # (B,)
            exists = (child >= 0) & ~done & (qi.sum(-1) > 1e-12)
            if not exists.any():  # a host sync per sibling on a GPU; a draw is made only for a tried sibling
                continue
            tok = toks[:, s, None]  # (B, 1)
            u = torch.rand(B, generator=generator, device=dev)
            active = exists & ~moved
            if not active.any():  # every row with this sibling accepted an earlier one (B = 1: after any acceptance)
                if tree.sampled == "wor":  # r is not read again; q loses the token as in _try_sibling
                    qi = drop(qi, tok, exists)
                continue
            acc, r, qi = try_sibling(r, qi, tok, u, active, exists, tree.sampled == "wor")
            path[:, level] = torch.where(acc, child, path[:, level])
            moved |= acc
        if tv is not None:
            law = _sampled_law(r_node, q_node, kids[ar, row], tree.sampled, emit, row, ctx)
            tv[:, level] = torch.where(~done, 0.5 * (law - p[ar, row]).abs().sum(-1), tv[:, level])
        n_acc += moved.long()
        done |= ~moved
        if done.all():
            break
        row = torch.where(moved, path[:, level] + 1, row)
        r = torch.where(moved[:, None], relax(p[ar, row], tree.q[ar, row], row, ctx), r)
    if tv is not None:
        tv = torch.where(torch.arange(depth + 1, device=dev)[None] <= n_acc[:, None], tv, float("nan"))
    return Verdict(path, n_acc, sample_residual(emit(r, row, ctx), generator), tv)


def _use_fan(ctx: VerifyContext, relax_fn: Optional[RelaxFn]) -> bool:
    """Whether walk_sampled hands a fan of chains to walk_fan: not when measuring (the law is computed level by
    level), and on the CPU only for a relaxed target, where making p~ once for the root and once for the accepted
    chain beats once per level; exact on the CPU pays nothing for its per-sibling syncs, and the level-by-level walk
    stops at the first rejection, where walk_fan works every level (measured: fashion-c2i, exact-sampled 0.47 ms
    per round level by level against 0.53; lisa-sampled 2.20 against 1.48)."""
    return ctx.tree.shape is not None and not ctx.measure and (relax_fn is not None or ctx.p.device.type != "cpu")


@functools.lru_cache(maxsize=256)
def fan_chains(shape: Shape) -> Optional[Tensor]:
    """(k, D) node indices of a fan of chains: the root's k children (column 0, in draw order), each heading a
    chain down to depth D (branching [k, 1, ..., 1]); None for any other shape. Built once per Shape."""
    index = {p: i for i, p in enumerate(shape.paths)}
    k, D = sum(len(p) == 1 for p in shape.paths), max(len(p) for p in shape.paths)
    chains = [[index.get((c,) + (0,) * d) for d in range(D)] for c in range(k)]
    if len(shape.paths) != k * D or any(i is None for ch in chains for i in ch):
        return None
    return torch.tensor(chains, device=shape.parents.device)


def walk_fan(ctx: VerifyContext, generator: torch.Generator, chains: Tensor, relax: RelaxFn, emit: EmitFn) -> Verdict:
    """`walk_sampled` on a fan of chains (chains (k, D): `fan_chains`), without its per-level loop and its host
    syncs: recursive rejection among the root's k siblings (`_fan_root`), then the accepted sibling's chain, every
    level at once (`_fan_chain`), p~ made for two sets of nodes only (the root; the accepted chain). The same rule,
    residuals and arithmetic as the level-by-level walk; the uniforms are drawn up front, one (B,) block per
    (level, sibling) in the order that walk draws them, and on a CPU generator the generator is then rewound to
    where that walk leaves it (it draws a block where any row tries the sibling): so on the CPU the same verdict,
    bit for bit, from the same generator state, and everywhere the same law."""
    p, tree = ctx.p, ctx.tree
    B, V = p.shape[0], p.shape[-1]
    k, D = chains.shape
    rewind = p.device.type == "cpu"
    gen = generator if generator is not None else torch.default_generator
    state = gen.get_state() if rewind else None
    u = torch.rand(k + D - 1, B, generator=generator, device=p.device)  # at most this many blocks are drawn
    root = torch.zeros(B, 1, dtype=torch.long, device=p.device)
    r_root = relax(p[:, :1], tree.q[:, :1], root, ctx)[:, 0]
    c, r, blocks = fused(_fan_root, ctx.fuse)(r_root, tree.q[:, 0], tree.tokens[:, chains[:, 0]], u,
                                              tree.sampled == "wor")
    nodes = chains[c.clamp(min=0)]  # (B, D) the accepted sibling's chain (any chain where none was accepted)
    rows = nodes + 1  # their rows in p and q
    pt = relax(_at_rows(p, rows), _at_rows(tree.q, rows), rows, ctx)  # (B, D, V) p~ down the chain
    u_chain = u.index_select(0, (blocks + torch.arange(D - 1, device=p.device)).clamp(max=k + D - 2)).T
    m, r_chain, drew = fused(_fan_chain, ctx.fuse)(pt, _at_rows(tree.q, rows[:, :-1]),
                                                   tree.tokens.gather(1, nodes[:, 1:]), u_chain)
    hit = c >= 0
    if rewind:  # leave the generator where the level-by-level walk does: one sync
        used = int(blocks + torch.where(hit, drew, 0).max())
        gen.set_state(state)
        if used:
            torch.rand(used, B, generator=generator)
    m = torch.where(hit, m + 1, 0)
    r = torch.where(hit[:, None], r_chain, r)
    row = torch.where(hit, rows.gather(1, (m - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    path = torch.where(torch.arange(D, device=p.device)[None] < m[:, None], nodes, -1)
    return Verdict(path, m, sample_residual(emit(r, row, ctx), generator))


def _fan_root(r: Tensor, q: Tensor, tokens: Tensor, u: Tensor, wor: bool) -> tuple[Tensor, Tensor, Tensor]:
    """walk_fan's root: the k siblings tokens (B, k), drawn from q (B, V), tried in draw order against the root's
    p~ r (B, V) (`_try_sibling`), sibling s with the next unused block of u (blocks, B) (a block is used where any
    row has the sibling). Returns (the accepted sibling (B,), -1 for none; the residual after every sibling was
    rejected (B, V); the blocks used (a 0-d tensor))."""
    B, k = tokens.shape
    c = torch.full((B,), -1, dtype=torch.long, device=r.device)
    used = torch.zeros((), dtype=torch.long, device=r.device)
    for s in range(k):
        exists = q.sum(-1) > 1e-12
        acc, r, q = _try_sibling(r, q, tokens[:, s:s + 1], u.index_select(0, used[None])[0], exists & (c < 0),
                                 exists, wor)
        c = torch.where(acc, s, c)
        used = used + exists.any().long()
    return c, r, used


def _fan_chain(pt: Tensor, q: Tensor, tokens: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """walk_fan's chain, every level at once: pt (B, D, V) p~ at the chain's nodes (depth 1 .. D), q (B, D - 1, V)
    the law each one's child was drawn from, tokens (B, D - 1) those children, u (B, D - 1) their uniforms.
    `_try_sibling`'s arithmetic per level. Returns (accepted children (B,); what the emitted token is drawn from
    (B, V): the residual at the first rejection, p~ itself where the node's q is empty or after the leaf; the
    levels each row drew a uniform at (B,))."""
    Dc, V = tokens.shape[1], pt.shape[-1]
    if Dc == 0:  # a fan of leaves: the bonus from p~ at the accepted sibling
        m = torch.zeros(pt.shape[0], dtype=torch.long, device=pt.device)
        return m, pt[:, 0], m
    r, rn = pt[:, :Dc], _normalise(pt[:, :Dc])
    tok = tokens[..., None]
    prob = ratio(rn.gather(2, tok).squeeze(2), q.gather(2, tok).squeeze(2))  # (B, Dc)
    exists = q.sum(-1) > 1e-12
    stop = ~((u < prob) & exists)  # the walk stops here, if it gets here
    m = torch.where(stop.any(1), stop.long().argmax(1), Dc)  # (B,) accepted children
    rest = _normalise((rn - q).clamp(min=0))
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, rn)  # r == q: nothing is ever rejected
    out = torch.cat([torch.where(exists[..., None], rest, r), pt[:, Dc:]], 1)  # (B, Dc + 1, V)
    emit = out.gather(1, m[:, None, None].expand(-1, 1, V)).squeeze(1)
    drew = m + (exists.gather(1, m.clamp(max=Dc - 1)[:, None]).squeeze(1) & (m < Dc)).long()
    return m, emit, drew


def _at_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x (B, N, V) at rows (B, S) -> (B, S, V)."""
    return x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))


def walk_chain(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """`walk_sampled`'s exact rule on a Jacobi window that is a chain (node i at depth i + 1, drawn from tree.q[:, i]),
    every level at once: node i is accepted iff u_i < min(1, p_i(x_i) / q_i(x_i)) with one uniform per level drawn
    up front (B, D); the walk stops at the first rejection and emits from norm(max(p - q, 0)) there (p where that
    is empty, p = q), or from p after the last node. The same law as walking level by level (the uniforms of levels
    the walk never reaches are simply unused), in ~20 tensor ops per round instead of ~35 per level, with one
    inverse-CDF draw for the emitted token. measure: the law of each emitted token, q a + (1 - sum q a) residual
    (walk_sampled's i.i.d. recursion with one child), against p."""
    p, tree = ctx.p, ctx.tree
    B, D = tree.tokens.shape
    u = torch.rand(B, D, generator=generator, device=p.device)
    m, emit, law = fused(_chain_verdict, ctx.fuse)(p, tree.q, tree.tokens, u, ctx.measure)
    levels = torch.arange(D, device=p.device)[None]  # (1, D)
    path = torch.where(levels < m[:, None], levels, -1)
    tv = None
    if law is not None:  # only the nodes the walk stood on: levels 0 .. m
        tv = 0.5 * (law - p).abs().sum(-1)  # (B, D + 1)
        tv = torch.where(torch.arange(D + 1, device=p.device)[None] <= m[:, None], tv, float("nan"))
    return Verdict(path, m, sample_inverse(emit, generator), tv)


def _chain_verdict(p: Tensor, q: Tensor, tokens: Tensor, u: Tensor,
                   measure: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """walk_chain's pure part: p (B, D + 1, V), q (B, >= D, V) the law of each node, tokens (B, D), u (B, D) ->
    (accepted m (B,), the distribution the next token is drawn from (B, V), the law of the token emitted at each
    level (B, D + 1, V) when measure, else None)."""
    B, D = tokens.shape
    r, q = _normalise(p), q[:, :D]  # (B, D + 1, V), (B, D, V)
    tok = tokens[..., None]  # (B, D, 1)
    prob = torch.where(q.sum(-1) > 1e-12, ratio(r[:, :D].gather(2, tok).squeeze(2), q.gather(2, tok).squeeze(2)), 0.0)
    rejected = u >= prob  # (B, D)
    m = torch.where(rejected.any(1), rejected.long().argmax(1), D)  # (B,) the first rejection, D if none
    rest = _normalise((r[:, :D] - q).clamp(min=0))  # (B, D, V) the residual after each level's rejection
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, r[:, :D])  # r == q: nothing is ever rejected
    at = m[:, None, None].expand(B, 1, r.shape[-1])
    emit = torch.cat([rest, r[:, D:]], 1).gather(1, at).squeeze(1)  # (B, V): the residual at m, or p after the chain
    law = None
    if measure:
        qa = q * ratio(r[:, :D], q)
        law = torch.cat([qa + (1 - qa.sum(-1, keepdim=True)).clamp(min=0) * rest, r[:, D:]], 1)
    return m, emit, law


def _try_sibling(r: Tensor, qi: Tensor, tok: Tensor, u: Tensor, active: Tensor, exists: Tensor,
                 wor: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One sibling of walk_sampled's recursive rejection: the draft tok (B, 1) drawn from qi (B, V) (q with the
    earlier siblings removed, wor) is accepted where u (B,) < r(tok) / qi(tok) on the active rows (its node's turn,
    no sibling accepted yet); where it exists and is rejected, r becomes norm(max(r - qi, 0)) (r itself where that
    is empty: r == qi) and, without replacement, tok leaves qi. Returns (accepted (B,), r, qi)."""
    rn = _normalise(r)
    prob = ratio(rn.gather(1, tok).squeeze(1), qi.gather(1, tok).squeeze(1))
    rest = _normalise((rn - qi).clamp(min=0))
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, rn)  # r == q: nothing is ever rejected
    acc = (u < prob) & active
    r = torch.where((exists & ~acc)[:, None], rest, r)  # rows that accepted leave r behind: unused
    if wor:
        qi = _drop_token(qi, tok, exists)
    return acc, r, qi


def _drop_token(qi: Tensor, tok: Tensor, exists: Tensor) -> Tensor:
    """A draw without replacement: where the sibling exists (B,), its token tok (B, 1) leaves qi (B, V)."""
    return torch.where(exists[:, None], _normalise(qi.scatter(1, tok, 0.0)), qi)


def _sampled_law(p_tilde: Tensor, q: Tensor, kids: Tensor, scheme: str, emit: EmitFn, row: Tensor,
                 ctx: VerifyContext) -> Tensor:
    """(B, V) law of the token emitted at a node with children kids (B, C) drawn from q (walk_sampled)."""
    n = (kids >= 0).sum(-1)  # (B,) children of each row's node
    if scheme == "wor":
        return torch.where((n > 0)[:, None], _normalise(p_tilde), emit(p_tilde, row, ctx))
    C = kids.shape[-1]
    rs = [_normalise(p_tilde)]  # r_1 .. r_{C+1}: the residual after each rejection (q the same for every draw)
    for _ in range(C):
        rest = _normalise((rs[-1] - q).clamp(min=0))
        rs.append(torch.where(rest.sum(-1, keepdim=True) > 0, rest, rs[-1]))
    law = emit(rs[C], row, ctx)
    for i in range(C, 0, -1):  # law_i = q a_i + (1 - sum q a_i) law_{i+1}, from law_{n+1} = emit(r_{n+1})
        law = torch.where((n == i)[:, None], emit(rs[i], row, ctx), law)
        qa = q * ratio(rs[i - 1], q)
        law = torch.where((i <= n)[:, None], qa + (1 - qa.sum(-1, keepdim=True)).clamp(min=0) * law, law)
    return torch.where((n > 0)[:, None], law, emit(p_tilde, row, ctx))


def transport(r: Tensor, q: Tensor, edges: tuple[Tensor, Tensor], want: Tensor,
              budget: Optional[float] = None) -> Tensor:
    """r (B, V) with some of its mass moved toward q along codebook edges; the relaxed target of a verifier on
    sampled drafts. Every token v inside r's support with a deficit d(v) = q(v) - r(v) > 0 asks for up to
    min(want(v), d(v)) from the excess e(u) = r(u) - q(u) > 0 of its nearest codes, split in proportion to their
    excess; a code asked for more than its excess gives pro rata; budget caps the total moved mass (scaling every
    flow). Mass only moves from where r exceeds q to nearby codes where q exceeds r, so each unit moved raises the
    acceptance of a sampled draft, sum_x min(r~, q), by exactly one unit, and the TV of r~ to r is the total moved.

    edges: (A, A^T) of `neighbour_edges(table)`, A[v, u] = how often u is among v's nearest codes. v asks each
    neighbour u for the share f(v) = min(want, avail) / avail of its excess (avail(v) = (A e)(v)), so a code's
    requests total e(u) (A^T f)(u), its give ratio is g(u) = min(1, e(u) / that), and the flows are three sparse
    products over the edges, never a (B, V, k) tensor."""
    A, At = edges
    if A._nnz() == 0:
        return r
    if A.dtype != r.dtype:
        A, At = A.to(r.dtype), At.to(r.dtype)
    excess = (r - q).clamp(min=0)  # (B, V)
    want = torch.minimum(want, torch.where(r > 0, (q - r).clamp(min=0), torch.zeros_like(r)))
    avail = (A @ excess.T).T  # (B, V) the excess of each code's neighbours
    f = torch.minimum(want, avail) / avail.clamp(min=1e-30)  # (B, V) the share of it each code asks for
    share = (At @ f.T).T  # (B, V) the shares asked of each code, summed
    asked = excess * share
    give = torch.where(asked > excess, excess / asked.clamp(min=1e-30), torch.ones_like(r))
    given = excess * give  # (B, V) what each code gives per unit share asked
    pulled, pushed = f * (A @ given.T).T, given * share  # (B, V) mass in, mass out
    if budget is not None:
        total = pulled.sum(-1, keepdim=True)
        scale = torch.where(total > budget, budget / total.clamp(min=1e-30), torch.ones_like(total))
        pulled, pushed = pulled * scale, pushed * scale
    return r + pulled - pushed


_EDGES: dict[tuple, tuple] = {}


def neighbour_edges(table: Tensor, device=None) -> tuple[Tensor, Tensor]:
    """(V, k) neighbour table -> (A, A^T), sparse CSR (V, V) on `device`: A[v, u] = how often u is among v's k
    nearest codes (`transport`'s edges). Built once per table and device (cached in memory; the entry keeps the
    table alive, so its storage is not reused under the same key)."""
    device = torch.device(device or table.device)
    key = (table.data_ptr(), tuple(table.shape), table.stride(), str(table.device), str(device))
    if key not in _EDGES:
        V, k = table.shape
        rows = torch.arange(V).repeat_interleave(k)
        A = torch.sparse_coo_tensor(torch.stack([rows, table.cpu().reshape(-1)]), torch.ones(V * k), (V, V),
                                    check_invariants=True)
        A = A.coalesce().to(device)
        if len(_EDGES) >= 16:
            _EDGES.pop(next(iter(_EDGES)))
        with warnings.catch_warnings():  # "sparse CSR support is in beta": matrix products are all we use
            warnings.simplefilter("ignore", UserWarning)
            _EDGES[key] = (table, A.to_sparse_csr(), A.t().coalesce().to_sparse_csr())
    return _EDGES[key][1:]


def sample_residual(r: Tensor, generator: torch.Generator) -> Tensor:
    return torch.multinomial(r, 1, generator=generator).squeeze(-1)


def _normalise(r: Tensor) -> Tensor:
    return r / r.sum(-1, keepdim=True).clamp(min=1e-30)


def ratio(a: Tensor, b: Tensor) -> Tensor:
    """min(1, a / b), and 1 where b = 0 < a (rejection sampling's acceptance probability)."""
    return torch.where(b > 0, a / b.clamp(min=1e-30), (a > 0).to(a.dtype)).clamp(max=1.0)


def _needs_sampled(name: str, tree: Tree) -> None:
    if not tree.sampled or tree.q is None:
        raise ValueError(f"{name} verifies drafts sampled from the distributions in tree.q (Jacobi windows, "
                         f"lisa.decoding.generate.jacobi_generate); this tree's siblings are "
                         f"{'deterministic (top-k)' if not tree.sampled else 'missing tree.q'}: use exact, "
                         f"greedy, lantern or gasv on a drafter's trees")


@dataclass(frozen=True)
class NoOptions:
    """greedy, exact, sjd, scd-mc, scd-gumbel: no knobs."""


def option_keys(options_type: type) -> dict[str, dataclasses.Field]:
    """params.yaml key -> field of an options dataclass (a trailing '_' is dropped: `lambda_` is `lambda`)."""
    return {f.name.rstrip("_"): f for f in dataclasses.fields(options_type)}


def typed_options(name: str, options_type: type, options: Optional[Mapping[str, float]] = None):
    """The typed options (an `options_type`) of verifier `name` from a mapping of knobs (params.yaml's `options`);
    None = defaults. An unknown key, or a fractional value for an integer knob, is a ValueError naming the verifier
    and the key."""
    if isinstance(options, options_type):
        return options
    keys = option_keys(options_type)
    unknown = sorted(set(options or {}) - set(keys))
    if unknown:
        raise ValueError(f"verifier {name!r}: unknown options {unknown}; allowed: {sorted(keys) or 'none'}")
    values = {}
    for key, value in (options or {}).items():
        f = keys[key]
        if isinstance(f.default, int) and not float(value).is_integer():
            raise ValueError(f"verifier {name!r}: option {key!r} must be an integer, got {value!r}")
        values[f.name] = type(f.default)(value)
    return options_type(**values)
