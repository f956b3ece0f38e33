"""Verifiers of a draft tree against the target: pure functions with one signature, in a registry.

    verifier(ctx: VerifyContext, generator) -> Verdict

`VerifyContext` carries what any verifier may need: the target's processed probabilities p at the root and at
every node (after CFG, temperature, top-k / top-p: the distribution vanilla sampling draws from), its raw guided
logits (entropy, margin: GASV's uncertainty), the tree with the drafter's distributions q and how its siblings were
drafted (`tree.sampled`: None for the drafter's top-k, "iid" or "wor" for draws from q), and `geometry` (codebook,
neighbour table, calibration) for the geometry-aware verifiers. Everything is batched: each row walks its own tree
and accepts its own length.

The walk (all verifiers): start at the root. Try the current node's children in order; a verifier decides
acceptance and how the residual r changes on rejection. An accepted child becomes the current node; when no child
is accepted (or there are none) the row emits one token sampled from r: the correction after a rejection, or the
bonus token after a leaf. Acceptance length tau counts both. Two walks, by how the siblings were drafted:

  * deterministic siblings (top-k trees, `walk`): r = p at the node; `exact` accepts child x with probability r(x)
    (r normalised) and on rejection sets r(x) = 0 and renormalises. The emitted token is then distributed exactly
    as p: P(x_i) = prod_{j<i} (1 - r_j(x_j)) * r_i(x_i) = p(x_i), and what is left is p conditioned on not any x_j.
    Relaxed verifiers change the acceptance probability and the residual per draft (LANTERN's boosted mass, GASV's
    soft target).
  * sampled siblings (`walk_sampled`): the verifier fixes one target p~ per node (p for `exact`, a relaxation of p
    toward q for the relaxed ones: `transport`) and the walk runs recursive rejection sampling of p~: child x_i,
    drawn from q_i (q for i.i.d. siblings; q without the earlier siblings for draws without replacement), is
    accepted with probability min(1, r_i(x_i) / q_i(x_i)), r_1 = p~, and on rejection r_{i+1} = norm(max(r_i -
    q_i, 0)). The emitted token is distributed exactly as p~ for either scheme (SpecInfer; Jeon et al.'s recursive
    rejection without replacement), so a relaxed verifier's TV to p is TV(p~, p) at each node.
`greedy` accepts the child equal to argmax p and emits argmax p: speculative greedy = vanilla greedy.
A verifier refuses drafts it has no law for: sjd / gsd need sampled drafts (Jacobi windows), and the tree
verifiers check `tree.q` where they need it.

Each verifier registers with a frozen dataclass of its knobs (LanternOptions, GSDOptions, GASVOptions; NoOptions
for greedy / exact / sjd), the only place their defaults live; `verifier_options(name, dict)` checks a mapping of
knobs against it (an unknown key is a ValueError naming the verifier and the keys it allows).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional

import torch
from torch import Tensor

from lisa.decoding.fused import fused
from lisa.decoding.sampling import sample_inverse
from lisa.decoding.tree import Tree


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

    relax_fn(p, q, row, ctx) -> p~ (B, V): the target the node's token is drawn from (default: p, `exact`); it may
    depend on the node's p and q, never on the drawn children. The children are tried in draw order by recursive
    rejection sampling of p~ (module docstring); a child whose remaining q_i is empty (a draw without replacement
    past q's support) is skipped. emit_fn(r, row, ctx): the distribution the correction / bonus token comes from
    (default r normalised; greedy: its argmax). With ctx.measure, the law of the token emitted at each node the
    walk stands on, over the drafts and the verifier's randomness, and its TV to p (Verdict.tv): for i.i.d.
    siblings computed by the recursion law_i = q a_i + (1 - sum q a_i) law_{i+1} (the residuals do not depend on
    the drawn tokens there), for siblings drawn without replacement p~ itself (the recursive rejection theorem)."""
    p, tree = ctx.p, ctx.tree
    if tree.q is None:
        raise ValueError("verifying sampled drafts needs the distributions they were drawn from (tree.q)")
    B, V = p.shape[0], p.shape[-1]
    kids = children_table(tree)
    depth = len(tree.shape.levels) if tree.shape is not None else int(tree.depth.max()) if tree.size else 0
    dev = p.device
    ar = torch.arange(B, device=dev)
    relax = relax_fn or (lambda p_node, q, row, ctx: p_node)
    emit = emit_fn or (lambda r, row, ctx: _normalise(r))
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


# ---------------------------------------------------------------------------------------------------------------
# The registry


VerifierFn = Callable[[VerifyContext, torch.Generator], Verdict]


class Verifier(NamedTuple):
    """A registry entry: the function, its knobs and what it needs beside the target's p and the drafts."""
    fn: VerifierFn
    options: type  # a frozen dataclass of the verifier's knobs; its defaults are the only defaults
    drafts: Literal["tree", "jacobi"]  # verifies a drafter's trees (needs a drafter), or drafter-free Jacobi windows
    # what it reads of the codebook geometry (VerifyContext.geometry): "codebook" (the code vectors), "neighbours"
    # (a table of each code's nearest codes, its option k wide), "calibration" (GASV's, its option k wide)
    reads: frozenset = frozenset()


VERIFIERS: dict[str, Verifier] = {}
GEOMETRY = ("codebook", "neighbours", "calibration")


def register(name: str, options: type, drafts: Literal["tree", "jacobi"] = "tree", reads: tuple[str, ...] = ()):
    def wrap(fn):
        if name in VERIFIERS:
            raise ValueError(f"verifier {name!r} is already registered")
        if not set(reads) <= set(GEOMETRY):
            raise ValueError(f"verifier {name!r}: reads {sorted(reads)}, not a part of the geometry {GEOMETRY}")
        VERIFIERS[name] = Verifier(fn, options, drafts, frozenset(reads))
        return fn

    return wrap


def _entry(name: str) -> Verifier:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; known: {sorted(VERIFIERS)}")
    return VERIFIERS[name]


def get_verifier(name: str) -> VerifierFn:
    return _entry(name).fn


def is_jacobi(name: str) -> bool:
    """Whether verifier `name` runs drafter-free on Jacobi windows (sjd, gsd) rather than on a drafter's trees."""
    return _entry(name).drafts == "jacobi"


def reads(name: str) -> frozenset:
    """What verifier `name` reads of the codebook geometry (Verifier.reads); vanilla reads nothing."""
    return frozenset() if name == "vanilla" else _entry(name).reads


def needs(name: str) -> list[str]:
    """What method `name` needs beside the target, in words (the CLI's help, reports): a drafter's trees or a
    Jacobi window, and the geometry it reads."""
    if name == "vanilla":
        return []
    e = _entry(name)
    words = {"codebook": "the codebook", "neighbours": "a neighbour table", "calibration": "a calibration"}
    return ["a drafter" if e.drafts == "tree" else "a Jacobi window"] + [words[r] for r in GEOMETRY if r in e.reads]


def option_keys(options_type: type) -> dict[str, dataclasses.Field]:
    """params.yaml key -> field of an options dataclass (a trailing '_' is dropped: `lambda_` is `lambda`)."""
    return {f.name.rstrip("_"): f for f in dataclasses.fields(options_type)}


def verifier_options(name: str, options: Optional[Mapping[str, float]] = None):
    """The typed options of verifier `name` from a mapping of knobs (params.yaml's `options`); None = defaults.
    An unknown key, or a fractional value for an integer knob, is a ValueError naming the verifier and the key."""
    entry = _entry(name)
    if isinstance(options, entry.options):
        return options
    keys = option_keys(entry.options)
    unknown = sorted(set(options or {}) - set(keys))
    if unknown:
        raise ValueError(f"verifier {name!r}: unknown options {unknown}; allowed: {sorted(keys) or 'none'}")
    values = {}
    for key, value in (options or {}).items():
        f = keys[key]
        if isinstance(f.default, int) and not float(value).is_integer():
            raise ValueError(f"verifier {name!r}: option {key!r} must be an integer, got {value!r}")
        values[f.name] = type(f.default)(value)
    return entry.options(**values)


@dataclass(frozen=True)
class NoOptions:
    """greedy, exact, sjd, scd-mc, scd-gumbel: no knobs."""


def _argmax(r: Tensor, row=None, ctx=None) -> Tensor:
    return torch.nn.functional.one_hot(r.argmax(-1), r.shape[-1]).to(r.dtype)


@register("greedy", NoOptions)
def greedy(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Accept the child equal to the target's argmax; emit the argmax (ties: lowest id, like torch.argmax). On
    sampled drafts: recursive rejection of the one-hot argmax, which accepts exactly the child equal to it."""
    verifier_options("greedy", ctx.options)
    if ctx.tree.sampled:
        return walk_sampled(ctx, generator, lambda p, q, row, ctx: _argmax(p), emit_fn=_argmax)

    def accept(r, tok, q_parent, row, ctx):
        return (tok == r.argmax(-1)).float(), r  # r never changes: a rejected child is simply not the argmax

    return walk(ctx, generator, accept, emit_fn=_argmax)


@register("exact", NoOptions)
def exact(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Lossless: the sequential rule for deterministic siblings, recursive rejection sampling for sampled ones
    (i.i.d. or without replacement; `walk_sampled` with p~ = p)."""
    verifier_options("exact", ctx.options)
    if ctx.tree.sampled:
        return walk_sampled(ctx, generator)

    def accept(r, tok, q_parent, row, ctx):
        r = _normalise(r)
        return r.gather(1, tok[:, None]).squeeze(1), _normalise(r.scatter(1, tok[:, None], 0.0))

    return walk(ctx, generator, accept)


def ratio(a: Tensor, b: Tensor) -> Tensor:
    """min(1, a / b), and 1 where b = 0 < a (rejection sampling's acceptance probability)."""
    return torch.where(b > 0, a / b.clamp(min=1e-30), (a > 0).to(a.dtype)).clamp(max=1.0)


# ---------------------------------------------------------------------------------------------------------------
# Codebook geometry and LANTERN's relaxed acceptance


@dataclass
class Geometry:
    """What geometry-aware verifiers read: each code's nearest codes on the L2-normalised codebook (V, K),
    nearest first (LANTERN's table; cosine order = L2 order on the sphere; None where no verifier reads it), and
    the codebook itself (V, d)."""
    neighbours: Optional[Tensor]
    codebook: Optional[Tensor] = None
    calibration: Any = None  # lisa.training.calibrate.Calibration with the target's whitened head rows (gasv)

    @classmethod
    def from_codebook(cls, codebook: Tensor, k: int) -> "Geometry":
        return cls(neighbour_table(codebook, k), codebook)


_NEIGHBOURS: dict[tuple, Tensor] = {}


def neighbour_table(codebook: Tensor, k: int) -> Tensor:
    """(V, d) codes -> (V, k) indices of each code's k nearest other codes (cosine), computed once per codebook
    content and k (cached in memory)."""
    import hashlib

    if not 0 < k < codebook.shape[0]:
        raise ValueError(f"neighbour table: k={k} nearest codes asked of a {codebook.shape[0]}-entry codebook "
                         f"(k must be 1 .. {codebook.shape[0] - 1})")
    key = (hashlib.sha256(codebook.detach().float().cpu().numpy().tobytes()).hexdigest(), k)
    if key not in _NEIGHBOURS:
        e = torch.nn.functional.normalize(codebook.float(), dim=-1)
        sim = e @ e.T
        sim.fill_diagonal_(-float("inf"))
        _NEIGHBOURS[key] = sim.topk(k, dim=-1).indices
    return _NEIGHBOURS[key]


def lantern_boost(r: Tensor, tok: Tensor, neighbours: Tensor, k: int, delta: float) -> tuple[Tensor, Tensor]:
    """LANTERN: the boosted probability of each draft token and the neighbours it absorbed.

    r (B, V) normalised residual, tok (B,). Over the k nearest codes of tok, cum_j = their first j masses; the
    largest j with cum_j <= delta (delta <= 1: an absolute total-variation budget) or cum_j <= (delta - 1) * r(tok)
    (delta > 1: LANTERN++'s relative budget) is taken. Returns (r(tok) + cum_j (B,), absorbed (B, k) bool)."""
    nn = neighbours[tok, :k]  # (B, k)
    mass = r.gather(1, nn)  # (B, k)
    cum = mass.cumsum(-1)
    r_tok = r.gather(1, tok[:, None]).squeeze(1)
    budget = torch.full_like(r_tok, delta) if delta <= 1 else (delta - 1) * r_tok
    absorbed = cum <= budget[:, None] + 1e-12  # a prefix: cum is non-decreasing
    boost = (mass * absorbed).sum(-1)
    return r_tok + boost, absorbed


@dataclass(frozen=True)
class LanternOptions:
    k: int = 5  # nearest codes a draft may stand for (<= the geometry's neighbour table)
    delta: float = 0.1  # the budget: <= 1 absolute TV mass, > 1 LANTERN++'s relative budget (lantern_boost)


@register("lantern", LanternOptions, reads=("neighbours",))
def lantern(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Relaxed acceptance: a draft is accepted with its boosted probability (the mass of the neighbours it may
    stand for, within the budget delta); on rejection it and the neighbours it absorbed leave the residual.
    Options: LanternOptions. Sampled drafts: LANTERN's per-draft boost has no tractable law over several siblings,
    so the same neighbourhood (k) and budget (delta: total moved mass; > 1: each code may gain (delta - 1) times
    its own mass) move p toward q once per node (`transport`), and the node is verified exactly against that."""
    if ctx.geometry is None or ctx.geometry.neighbours is None:
        raise ValueError("lantern needs the codebook geometry (VerifyContext.geometry = Geometry.from_codebook)")
    o = verifier_options("lantern", ctx.options)
    k, delta = o.k, o.delta
    table = ctx.geometry.neighbours
    if table.shape[1] < k:
        raise ValueError(f"lantern k={k} but the neighbour table holds {table.shape[1]} neighbours per code")

    if ctx.tree.sampled:  # LANTERN's neighbourhood and budget as a transport of p toward q (docs/method.md)
        edges = neighbour_edges(table[:, :k], ctx.p.device)

        def relax(p_node, q, row, ctx):
            p_node = _normalise(p_node)
            want = torch.ones_like(p_node) if delta <= 1 else (delta - 1) * p_node
            return transport(p_node, q, edges, want, budget=delta if delta <= 1 else None)

        return walk_sampled(ctx, generator, relax)

    def accept(r, tok, q_parent, row, ctx):
        r = _normalise(r)
        boosted, absorbed = lantern_boost(r, tok, table, k, delta)
        drop = torch.zeros_like(r, dtype=torch.bool).scatter(1, tok[:, None], True)
        drop.scatter_(1, table[tok, :k], absorbed)
        return boosted.clamp(max=1), _normalise(r.masked_fill(drop, 0.0))

    return walk(ctx, generator, accept)


# ---------------------------------------------------------------------------------------------------------------
# Drafter-free baselines on a chain of Jacobi drafts (lisa.decoding.generate.jacobi_generate): tree.q[:, i] is the
# distribution draft i was sampled from (the target's own, one iteration earlier; uniform for fresh positions).


@register("sjd", NoOptions, drafts="jacobi")
def sjd(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Speculative Jacobi decoding: accept draft x if u < min(1, p_t(x) / p_{t-1}(x)); the first rejection
    resamples from norm(max(0, p_t - p_{t-1})) (the recursive rejection rule on a chain)."""
    verifier_options("sjd", ctx.options)
    _needs_sampled("sjd", ctx.tree)
    return _jacobi_walk(ctx, generator)


@dataclass(frozen=True)
class PACOptions:
    """SJD-PAC's knobs (lisa.decoding.generate.jacobi_generate builds the window from them)."""
    width: int = 3  # Proactive Drafting: siblings per node on the branching levels (the reference README's 3; paper: 4)
    depth: int = 3  # levels of the proactive tree, its root (the last emitted token) counted as in the reference:
    #                 the first depth - 1 draft levels branch, then one chain runs out to the window
    continuation: bool = True  # Adaptive Continuation: keep the untested drafts through maximal coupling


@register("sjd-pac", PACOptions, drafts="jacobi")
def sjd_pac(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """SJD-PAC (Kang et al., CVPR 2026) verified exactly: the proactive tree's siblings are drawn without replacement
    from the distribution in tree.q (the cached one of their position), so the walk is recursive rejection
    sampling level by level, taking the first sibling that passes (walk_sampled)."""
    verifier_options("sjd-pac", ctx.options)
    _needs_sampled("sjd-pac", ctx.tree)
    return walk_sampled(ctx, generator)


@register("scd-mc", NoOptions, drafts="jacobi")
def scd_mc(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Speculative coupled decoding, maximal coupling (So et al., ICML 2026): verified as SJD; what differs is the
    re-drafting of the window (lisa.decoding.generate.couple), which keeps a draft whose distribution barely moved."""
    verifier_options("scd-mc", ctx.options)
    _needs_sampled("scd-mc", ctx.tree)
    return _jacobi_walk(ctx, generator)


def _jacobi_walk(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """A Jacobi window's exact walk: all levels at once on a chain of i.i.d. drafts (walk_chain), else level by
    level (walk_sampled)."""
    shape = ctx.tree.shape
    if ctx.tree.sampled == "iid" and shape is not None and all(len(lv.groups) == 1 and lv.width == 1
                                                                 for lv in shape.levels):
        return walk_chain(ctx, generator)
    return walk_sampled(ctx, generator)


@register("scd-gumbel", NoOptions, drafts="jacobi")
def scd_gumbel(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Speculative coupled decoding, Gumbel coupling: every token of a position, drafted or emitted, is
    argmax(log dist + g) with one Gumbel noise g per position and code (ctx.noise), shared by every iteration. A
    draft is accepted iff it equals argmax(log p + g), the token the target itself would emit with that noise, and
    the correction / bonus token is that argmax: the output is vanilla sampling driven by g, exact by the
    Gumbel-max theorem (g of a position is independent of everything before it). With measure, the law of each
    emitted token over g is p itself: TV 0."""
    verifier_options("scd-gumbel", ctx.options)
    _needs_sampled("scd-gumbel", ctx.tree)
    if ctx.noise is None or ctx.noise.shape != ctx.p.shape:
        raise ValueError("scd-gumbel needs the Gumbel noise of every row (VerifyContext.noise, shaped like p)")
    B = ctx.p.shape[0]
    want = (ctx.p.log() + ctx.noise).argmax(-1)  # (B, N + 1): the target's token at each row's children position
    ar = torch.arange(B, device=ctx.p.device)

    def accept(r, tok, q_parent, row, ctx):
        return (tok == want[ar, row]).float(), r

    def emit(r, row, ctx):
        return torch.nn.functional.one_hot(want[ar, row], r.shape[-1]).to(r.dtype)

    v = walk(dataclasses.replace(ctx, measure=False), generator, accept, emit_fn=emit)
    if ctx.measure:
        levels = torch.arange(v.path.shape[1] + 1, device=ar.device)[None]
        v.tv = torch.where(levels <= v.n_accepted[:, None], 0.0, float("nan")).expand(B, -1).clone()
    return v


def _needs_sampled(name: str, tree: Tree) -> None:
    if not tree.sampled or tree.q is None:
        raise ValueError(f"{name} verifies drafts sampled from the distributions in tree.q (Jacobi windows, "
                         f"lisa.decoding.generate.jacobi_generate); this tree's siblings are "
                         f"{'deterministic (top-k)' if not tree.sampled else 'missing tree.q'}: use exact, "
                         f"greedy, lantern or gasv on a drafter's trees")


def gsd_groups(r: Tensor, tok: Tensor, embeddings: Tensor, rank_window: int, prob_gap: float,
               dist: float) -> Tensor:
    """(B, V) bool: GSD's group of each draft token: the tokens within +-rank_window ranks of it in the sorted
    target distribution whose probability differs by < prob_gap and whose squared L2 embedding distance is
    < dist (the token itself included)."""
    B, V = r.shape
    order = r.argsort(-1, descending=True)  # (B, V)
    rank = order.argsort(-1)  # (B, V): rank of each token
    pos = rank.gather(1, tok[:, None])  # (B, 1)
    window = (pos + torch.arange(-rank_window, rank_window + 1, device=r.device)[None]).clamp(0, V - 1)
    cand = order.gather(1, window)  # (B, 2w+1)
    r_tok = r.gather(1, tok[:, None])
    close_p = (r.gather(1, cand) - r_tok).abs() < prob_gap
    e = embeddings.float()
    close_e = ((e[cand] - e[tok][:, None]) ** 2).sum(-1) < dist
    group = torch.zeros(B, V, dtype=torch.bool, device=r.device)
    group.scatter_(1, cand, close_p & close_e)
    return group.scatter(1, tok[:, None], True)


def gsd_group_masses(r: Tensor, q: Tensor, embeddings: Tensor, rank_window: int, prob_gap: float,
                     dist: float) -> tuple[Tensor, Tensor]:
    """(B, V) each: r(G(x)) and q(G(x)) for every token x at once (gsd_groups, vectorised over x)."""
    B, V = r.shape
    order = r.argsort(-1, descending=True)
    rank = order.argsort(-1)  # (B, V)
    offs = torch.arange(-rank_window, rank_window + 1, device=r.device)
    at = rank[..., None] + offs  # (B, V, W)
    inside = (at >= 0) & (at < V)
    cand = order.gather(1, at.clamp(0, V - 1).reshape(B, -1)).reshape(B, V, -1)  # (B, V, W)
    r_c = r.gather(1, cand.reshape(B, -1)).reshape(cand.shape)
    e = embeddings.float()
    close = ((r_c - r[..., None]).abs() < prob_gap) & (((e[cand] - e[None, :, None, :]) ** 2).sum(-1) < dist)
    member = inside & (close | (offs == 0))
    q_c = q.gather(1, cand.reshape(B, -1)).reshape(cand.shape)
    return (r_c * member).sum(-1), (q_c * member).sum(-1)


@dataclass(frozen=True)
class GSDOptions:
    rank_window: int = 7  # a group spans +- this many ranks of the sorted target distribution
    prob_gap: float = 0.15  # ... and tokens whose probability differs by less than this
    dist: float = 0.5  # ... and whose squared L2 embedding distance is below this


@register("gsd", GSDOptions, drafts="jacobi", reads=("codebook",))
def gsd(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Grouped speculative decoding on Jacobi drafts: accept x if u < min(1, p(G(x)) / q(G(x))); on rejection
    the SJD residual norm(max(0, p - q)). Options: GSDOptions; the embeddings are the geometry's codebook."""
    o = verifier_options("gsd", ctx.options)
    _needs_sampled("gsd", ctx.tree)
    if ctx.geometry is None or ctx.geometry.codebook is None:
        raise ValueError("gsd needs the codebook (VerifyContext.geometry)")
    if int(children_table(ctx.tree).shape[-1]) > 1:
        raise ValueError("gsd verifies chains (one draft per position, Jacobi windows), not trees with siblings")
    w, gap, dist = o.rank_window, o.prob_gap, o.dist
    emb = ctx.geometry.codebook

    def accept(r, tok, q_parent, row, ctx):
        r = _normalise(r)
        g = gsd_groups(r, tok, emb, w, gap, dist)
        return ratio((r * g).sum(-1), (q_parent * g).sum(-1)), _normalise((r - q_parent).clamp(min=0))

    def marginal(r, q, row, ctx):  # every token's acceptance probability, its own group each
        r = _normalise(r)
        p_g, q_g = gsd_group_masses(r, q, emb, w, gap, dist)
        return ratio(p_g, q_g), _normalise((r - q).clamp(min=0))

    return walk(ctx, generator, accept, marginal_fn=marginal)


# ---------------------------------------------------------------------------------------------------------------
# GASV: geometry-aware soft verification (LISA, inference side). The choices the paper leaves open:
#
#   U = H(softmax(l)) / log V, m = sigmoid(l_(1) - l_(2)) on the raw guided logits l of the node; the looseness
#   s = U * 2 (1 - m) in [0, 1] is high where the target is uncertain (flat, small margin).
#   f_kappa(kappa; U, m) = kappa * exp(a_kappa * (s - s_ref)),  f_lambda(lambda; U, m) = lambda * exp(-a_lambda *
#   (s - s_ref)), s_ref = the median looseness of the calibration pass: at typical uncertainty the knobs act as set,
#   looser (kappa up, lambda down) where the target is unsure, tighter where it is confident; a = 0 turns it off.
#   Drift: s_geo(v) = (l_i - l_v) / (||(w_i - w_v) * invstd|| + eps), i the top-1, w the output-head rows.
#   g_geo(v) = min(1, kappa_eff * beta_{c_i} / s_geo(v)) (1 at s_geo = 0: the top-1 and ties).
#   g_clu(v) = min(1, P(c_v) / lambda_eff), P(c) = the target's probability of cluster c (exp pi_c).
#   g = max(g_geo, g_clu).
#   The soft target of a draft v: p_soft = p with the share g(v) of the residual mass of v's k nearest codes (the
#   calibration's neighbour table) moved onto v, i.e. p_soft(v) = r(v) + g(v) * sum_{u in N_k(v)} r(u) and
#   p_soft(u) = (1 - g(v)) r(u) on the neighbours. Acceptance uses p_soft(v) (deterministic siblings; sampled:
#   min(1, p_soft(v) / q(v))); on rejection the residual is p_soft without v, renormalised, so the correction
#   and bonus tokens are drawn from it. Mass only ever moves between codebook neighbours, by the share g: the
#   sampled law is p with that transport applied, its TV to p is at most g(v) * r(N_k(v)) per tried child, and
#   kappa up -> larger g -> longer acceptance, lambda up -> smaller g -> stricter; g = 0 is `exact`.
#   Sampled drafts (siblings drawn from the drafter's q): a per-draft soft mass has no tractable law over several
#   siblings, so GASV fixes one soft target per node instead: every code v of the target's support pulls up to
#   g(v) times its deficit max(q(v) - p(v), 0) from the excess max(p(u) - q(u), 0) of its k nearest codes u
#   (`transport`), and the node is verified exactly against that target. The same knobs act the same way
#   (g = 0 is exact), mass still moves only between neighbours, never outside the target's support, and every
#   unit moved buys one unit of a draft's acceptance sum_x min(p~, q).
# Options: GASVOptions below.


@dataclass(frozen=True)
class GASVOptions:
    kappa: float = 1.0  # geometric budget scale: up -> larger g -> longer acceptance
    lambda_: float = 0.5  # params.yaml `lambda`: cluster-mass threshold: up -> smaller g -> stricter
    a_kappa: float = 1.0  # how strongly kappa follows the looseness (0 = constant)
    a_lambda: float = 1.0  # how strongly lambda follows the looseness (0 = constant)
    k: int = 8  # calibration neighbours a draft may take mass from (<= the calibration's table)
    eps: float = 1e-6  # drift denominator guard


def gasv_scores(logits: Tensor, p: Tensor, cal, kappa: float, lam: float, a_kappa: float, a_lambda: float,
                eps: float) -> Tensor:
    """g(v) in [0, 1] for every token at every node: logits, p (B, S, V) -> (B, S, V)."""
    B, S, V = logits.shape
    l = logits.float().reshape(B * S, V)
    lp = l.log_softmax(-1)
    U = -(lp.exp() * lp).sum(-1) / math.log(V)
    top2 = l.topk(2, dim=-1).values
    loose = U * 2 * (1 - torch.sigmoid(top2[:, 0] - top2[:, 1]))
    k_eff = kappa * torch.exp(a_kappa * (loose - cal.looseness_ref))
    l_eff = lam * torch.exp(-a_lambda * (loose - cal.looseness_ref))
    i = l.argmax(-1)
    W = cal.head.to(l.device)  # (V, D) whitened
    wi = W[i]
    d2 = (wi * wi).sum(-1, keepdim=True) + cal.head_sq.to(l.device)[None] - 2 * wi @ W.T
    drift = (l.gather(1, i[:, None]) - l) / (d2.clamp(min=0).sqrt() + eps)  # (BS, V) >= 0
    cluster = cal.cluster.to(l.device)
    budget = k_eff * cal.beta.to(l.device)[cluster[i]]
    g_geo = torch.where(drift > 0, budget[:, None] / drift.clamp(min=1e-30), torch.ones_like(drift)).clamp(max=1)
    mass = torch.zeros(B * S, int(cal.beta.shape[0]), device=l.device).scatter_add_(
        1, cluster[None].expand(B * S, V), p.float().reshape(B * S, V))
    g_clu = (mass.gather(1, cluster[None].expand(B * S, V)) / l_eff[:, None]).clamp(max=1)
    return torch.maximum(g_geo, g_clu).reshape(B, S, V)


@register("gasv", GASVOptions, reads=("calibration",))
def gasv(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """LISA's geometry-aware soft verification (see the block above): needs the raw guided logits and a
    calibration (geometry.calibration, `lisa calibrate`). Options: GASVOptions."""
    o = verifier_options("gasv", ctx.options)
    cal = getattr(ctx.geometry, "calibration", None)
    if cal is None or ctx.logits is None:
        raise ValueError("gasv needs the target's raw guided logits and a calibration (VerifyContext.geometry = "
                         "Geometry(..., calibration=lisa.training.calibrate.load_calibration(...)))")
    if cal.head.shape[0] != ctx.p.shape[-1]:
        raise ValueError(f"gasv: calibration covers {cal.head.shape[0]} tokens, the target's vocabulary has "
                         f"{ctx.p.shape[-1]}")
    k = o.k
    if not 0 <= k <= cal.neighbours.shape[1]:
        raise ValueError(f"gasv k={k} but the calibration's neighbour table holds {cal.neighbours.shape[1]}")
    g_all = fused(gasv_scores, ctx.fuse)(ctx.logits, ctx.p, cal, o.kappa, o.lambda_, o.a_kappa, o.a_lambda, o.eps)
    table = cal.neighbours[:, :k].to(ctx.p.device)
    ar = torch.arange(ctx.p.shape[0], device=ctx.p.device)

    def soft(r, tok, row):  # p_soft for draft tok: (its soft mass (B,), the soft residual with tok removed (B, V))
        g = g_all[ar, row].gather(1, tok[:, None])  # (B, 1)
        nn = table[tok]  # (B, k)
        moved = r.gather(1, nn) * g  # (B, k)
        rest = r.scatter(1, nn, r.gather(1, nn) - moved).scatter(1, tok[:, None], 0.0)
        return r.gather(1, tok[:, None]).squeeze(1) + moved.sum(-1), rest

    if ctx.tree.sampled:  # the share g(v) of v's deficit to q, pulled from its k nearest codes (docs/method.md)
        edges = neighbour_edges(cal.neighbours[:, :k], ctx.p.device)

        def relax(p_node, q, row, ctx):
            p_node = _normalise(p_node)
            return transport(p_node, q, edges, g_all[ar, row] * (q - p_node).clamp(min=0))

        return walk_sampled(ctx, generator, relax)

    def accept(r, tok, q_parent, row, ctx):
        r = _normalise(r)
        p_tok, rest = soft(r, tok, row)
        return p_tok.clamp(max=1), _normalise(rest)

    return walk(ctx, generator, accept)
