"""Verifiers of a draft tree against the target: pure functions with one signature, in a registry.

    verifier(ctx: VerifyContext, generator) -> Verdict

`VerifyContext` carries what any verifier may need: the target's processed probabilities p at the root and at
every node (after CFG, temperature, top-k / top-p: the distribution vanilla sampling draws from), its raw guided
logits (entropy, margin: GASV's uncertainty), the tree with the drafter's distributions q, whether siblings
were chosen deterministically (top-k trees) or sampled, and `geometry` (codebook, neighbour table, calibration)
for the geometry-aware verifiers. Everything is batched: each row walks its own tree and accepts its own length.

The walk (all verifiers): start at the root with the residual r = p(root). Try the current node's children in
order; a verifier decides acceptance and how r changes on rejection. An accepted child becomes the current node
(r = p(child)); when no child is accepted (or there are none) the row emits one token sampled from r: the
correction after a rejection, or the bonus token after a leaf. Acceptance length tau counts both.

`exact` is lossless:
  * deterministic siblings (top-k trees): accept child x with probability r(x) (r normalised); on rejection set
    r(x) = 0 and renormalise. The emitted token is then distributed exactly as p: P(x_i) = prod_{j<i} (1 -
    r_j(x_j)) * r_i(x_i) = p(x_i), and what is left is p conditioned on not any x_j.
  * sampled siblings (i.i.d. from q, SpecInfer): accept x with probability min(1, r(x) / q(x)); on rejection
    r = norm(max(r - q, 0)) (recursive rejection sampling).
`greedy` accepts the child equal to argmax p and emits argmax p: speculative greedy = vanilla greedy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lisa.tree import Tree


@dataclass
class VerifyContext:
    p: Tensor  # (B, N + 1, V) target probabilities at the root (row 0) and each node (row i + 1)
    tree: Tree
    logits: Optional[Tensor] = None  # (B, N + 1, V) raw guided target logits (uncertainty measures)
    sampled_siblings: bool = False  # True: siblings drawn i.i.d. from q (SpecInfer); False: top-k (deterministic)
    geometry: Any = None  # codebook / neighbour table / calibration, for relaxed verifiers
    options: Optional[dict] = None  # verifier knobs (lantern k and delta, gasv kappa and lambda, ...)


@dataclass
class Verdict:
    path: Tensor  # (B, D) accepted node indices, root side first, padded -1
    n_accepted: Tensor  # (B,) accepted draft tokens
    next_token: Tensor  # (B,) the token emitted after them (correction or bonus)


def children_table(tree: Tree) -> Tensor:
    """(B, N + 1, C) child node indices of the root (row 0) and every node (row i + 1), in node order, pad -1."""
    B, N = tree.parents.shape
    rows = tree.parents + 1  # (B, N) row of each node's parent
    counts = torch.zeros(B, N + 1, dtype=torch.long, device=rows.device).scatter_add_(1, rows, torch.ones_like(rows))
    C = max(int(counts.max()), 1)
    out = torch.full((B, N + 1, C), -1, dtype=torch.long, device=rows.device)
    # slot of each node among its siblings: how many earlier nodes share its parent
    same = rows[:, :, None] == rows[:, None, :]  # (B, N, N)
    slot = (same & torch.ones(N, N, dtype=torch.bool, device=rows.device).tril(-1)).sum(-1)  # (B, N)
    b = torch.arange(B, device=rows.device)[:, None].expand(B, N)
    out[b, rows, slot] = torch.arange(N, device=rows.device).expand(B, N)
    return out


AcceptFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, "VerifyContext"], tuple[Tensor, Tensor]]


def walk(ctx: VerifyContext, generator: torch.Generator, accept_fn: AcceptFn,
         emit_fn: Optional[Callable[[Tensor, torch.Generator], Tensor]] = None) -> Verdict:
    """The shared tree walk, vectorised over the batch. accept_fn(r, tok, q_parent, u, row, ctx) -> (accept (B,)
    bool, the residual after a rejection (B, V)); emit_fn(r, generator) -> (B,) tokens (default: sample r)."""
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
    for level in range(depth + 1):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for s in range(kids.shape[-1]):
            child = kids[ar, row, s]  # (B,)
            active = (child >= 0) & ~moved & ~done
            if not active.any():
                continue
            tok = tree.tokens[ar, child.clamp(min=0)]
            q_parent = tree.q[ar, row] if tree.q is not None else None
            u = torch.rand(B, generator=generator, device=dev)
            acc, r_rejected = accept_fn(r, tok, q_parent, u, row, ctx)
            acc = acc & active
            r = torch.where((active & ~acc)[:, None], r_rejected, r)
            path[acc, level] = child[acc]  # a child of a node at depth `level` has depth level + 1 <= depth
            moved |= acc
        n_acc += moved.long()
        done |= ~moved
        if done.all():
            break
        row = torch.where(moved, path[:, level] + 1, row)
        r = torch.where(moved[:, None], p[ar, row], r)
    emit = emit_fn or sample_residual
    return Verdict(path, n_acc, emit(r, generator))


def sample_residual(r: Tensor, generator: torch.Generator) -> Tensor:
    return torch.multinomial(r, 1, generator=generator).squeeze(-1)


def _normalise(r: Tensor) -> Tensor:
    return r / r.sum(-1, keepdim=True).clamp(min=1e-30)


# ---------------------------------------------------------------------------------------------------------------
# The registry


VERIFIERS: dict[str, Callable[[VerifyContext, torch.Generator], Verdict]] = {}


def register(name: str):
    def wrap(fn):
        if name in VERIFIERS:
            raise ValueError(f"verifier {name!r} is already registered")
        VERIFIERS[name] = fn
        return fn

    return wrap


def get_verifier(name: str):
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; known: {sorted(VERIFIERS)}")
    return VERIFIERS[name]


@register("greedy")
def greedy(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Accept the child equal to the target's argmax; emit the argmax (ties: lowest id, like torch.argmax)."""

    def accept(r, tok, q_parent, u, row, ctx):
        return tok == r.argmax(-1), r  # r never changes: a rejected child is simply not the argmax

    return walk(ctx, generator, accept, emit_fn=lambda r, g: r.argmax(-1))


@register("exact")
def exact(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Lossless: the sequential rule for deterministic siblings, recursive rejection sampling for sampled ones."""
    if ctx.sampled_siblings and ctx.tree.q is None:
        raise ValueError("exact verification of sampled siblings needs the drafter's q (tree.q)")

    def accept(r, tok, q_parent, u, row, ctx):
        r = _normalise(r)
        r_tok = r.gather(1, tok[:, None]).squeeze(1)
        if ctx.sampled_siblings:
            q_tok = q_parent.gather(1, tok[:, None]).squeeze(1)
            acc = u * q_tok < r_tok  # u < min(1, r / q)
            return acc, _normalise((r - q_parent).clamp(min=0))
        return u < r_tok, _normalise(r.scatter(1, tok[:, None], 0.0))

    return walk(ctx, generator, accept)


# ---------------------------------------------------------------------------------------------------------------
# Codebook geometry and LANTERN's relaxed acceptance


@dataclass
class Geometry:
    """What geometry-aware verifiers read: each code's nearest codes on the L2-normalised codebook (V, K),
    nearest first (LANTERN's table; cosine order = L2 order on the sphere), and the codebook itself (V, d)."""
    neighbours: Tensor
    codebook: Optional[Tensor] = None

    @classmethod
    def from_codebook(cls, codebook: Tensor, k: int) -> "Geometry":
        return cls(neighbour_table(codebook, k), codebook)


_NEIGHBOURS: dict[tuple, Tensor] = {}


def neighbour_table(codebook: Tensor, k: int) -> Tensor:
    """(V, d) codes -> (V, k) indices of each code's k nearest other codes (cosine), computed once per codebook
    content and k (cached in memory)."""
    import hashlib

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


@register("lantern")
def lantern(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Relaxed acceptance: a draft is accepted with its boosted probability (the mass of the neighbours it may
    stand for, within the budget delta); on rejection it and the neighbours it absorbed leave the residual.
    Options: k (neighbours, default 5), delta (default 0.1). Deterministic siblings: accept if u < boosted mass;
    sampled siblings: u < boosted / q(x), as LANTERN."""
    if ctx.geometry is None:
        raise ValueError("lantern needs the codebook geometry (VerifyContext.geometry = Geometry.from_codebook)")
    opts = ctx.options or {}
    k, delta = int(opts.get("k", 5)), float(opts.get("delta", 0.1))
    table = ctx.geometry.neighbours
    if table.shape[1] < k:
        raise ValueError(f"lantern k={k} but the neighbour table holds {table.shape[1]} neighbours per code")

    def accept(r, tok, q_parent, u, row, ctx):
        r = _normalise(r)
        boosted, absorbed = lantern_boost(r, tok, table, k, delta)
        if ctx.sampled_siblings:
            acc = u * q_parent.gather(1, tok[:, None]).squeeze(1) < boosted
        else:
            acc = u < boosted
        drop = torch.zeros_like(r, dtype=torch.bool).scatter(1, tok[:, None], True)
        drop.scatter_(1, table[tok, :k], absorbed)
        return acc, _normalise(r.masked_fill(drop, 0.0))

    return walk(ctx, generator, accept)


# ---------------------------------------------------------------------------------------------------------------
# Drafter-free baselines on a chain of Jacobi drafts (lisa.generate.jacobi_generate): tree.q[:, i] is the
# distribution draft i was sampled from (the target's own, one iteration earlier; uniform for fresh positions).


@register("sjd")
def sjd(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Speculative Jacobi decoding: accept draft x if u < min(1, p_t(x) / p_{t-1}(x)); the first rejection
    resamples from norm(max(0, p_t - p_{t-1})) (the recursive rejection rule on a chain)."""
    if ctx.tree.q is None:
        raise ValueError("sjd needs the distributions the drafts were sampled from (tree.q)")
    return exact(VerifyContext(ctx.p, ctx.tree, ctx.logits, True, ctx.geometry, ctx.options), generator)


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


@register("gsd")
def gsd(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Grouped speculative decoding on Jacobi drafts: accept x if u < min(1, p(G(x)) / q(G(x))); on rejection
    the SJD residual norm(max(0, p - q)). Options: rank_window (7), prob_gap (0.15), dist (0.5); the embeddings
    are the geometry's codebook."""
    if ctx.tree.q is None or ctx.geometry is None or ctx.geometry.codebook is None:
        raise ValueError("gsd needs tree.q (Jacobi drafts) and the codebook (VerifyContext.geometry)")
    opts = ctx.options or {}
    w, gap, dist = int(opts.get("rank_window", 7)), float(opts.get("prob_gap", 0.15)), float(opts.get("dist", 0.5))
    emb = ctx.geometry.codebook

    def accept(r, tok, q_parent, u, row, ctx):
        r = _normalise(r)
        g = gsd_groups(r, tok, emb, w, gap, dist)
        p_g, q_g = (r * g).sum(-1), (q_parent * g).sum(-1)
        return u * q_g < p_g, _normalise((r - q_parent).clamp(min=0))

    return walk(ctx, generator, accept)
