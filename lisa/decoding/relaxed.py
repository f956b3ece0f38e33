"""The relaxed verifiers, which trade exactness for acceptance: LANTERN (a draft stands for its codebook
neighbours), GSD (grouped acceptance on Jacobi chains) and LISA's GASV (geometry-aware soft verification), with the
codebook geometry they read. Their registry entries (lisa.decoding.verify.VERIFIERS) say what each reads; the
walks are lisa.decoding.walk's."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lisa.decoding.fused import fused
from lisa.decoding.walk import (Verdict, VerifyContext, _at_rows, _needs_sampled, _normalise, children_table,
                                neighbour_edges, ratio, transport, typed_options, walk, walk_sampled)


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


def lantern(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Relaxed acceptance: a draft is accepted with its boosted probability (the mass of the neighbours it may
    stand for, within the budget delta); on rejection it and the neighbours it absorbed leave the residual.
    Options: LanternOptions. Sampled drafts: LANTERN's per-draft boost has no tractable law over several siblings,
    so the same neighbourhood (k) and budget (delta: total moved mass; > 1: each code may gain (delta - 1) times
    its own mass) move p toward q once per node (`transport`), and the node is verified exactly against that."""
    if ctx.geometry is None or ctx.geometry.neighbours is None:
        raise ValueError("lantern needs the codebook geometry (VerifyContext.geometry = Geometry.from_codebook)")
    o = typed_options("lantern", LanternOptions, ctx.options)
    k, delta = o.k, o.delta
    table = ctx.geometry.neighbours
    if table.shape[1] < k:
        raise ValueError(f"lantern k={k} but the neighbour table holds {table.shape[1]} neighbours per code")

    if ctx.tree.sampled:  # LANTERN's neighbourhood and budget as a transport of p toward q (docs/method.md)
        edges = neighbour_edges(table[:, :k], ctx.p.device)

        def relax(p_rows, q, rows, ctx):  # (B, S, V) at the nodes rows (B, S)
            p_rows = _normalise(p_rows)
            want = torch.ones_like(p_rows) if delta <= 1 else (delta - 1) * p_rows
            return _transport_rows(p_rows, q, edges, want, budget=delta if delta <= 1 else None)

        return walk_sampled(ctx, generator, relax)

    def accept(r, tok, q_parent, row, ctx):
        r = _normalise(r)
        boosted, absorbed = lantern_boost(r, tok, table, k, delta)
        drop = torch.zeros_like(r, dtype=torch.bool).scatter(1, tok[:, None], True)
        drop.scatter_(1, table[tok, :k], absorbed)
        return boosted.clamp(max=1), _normalise(r.masked_fill(drop, 0.0))

    return walk(ctx, generator, accept)

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


def gsd(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """Grouped speculative decoding on Jacobi drafts: accept x if u < min(1, p(G(x)) / q(G(x))); on rejection
    the SJD residual norm(max(0, p - q)). Options: GSDOptions; the embeddings are the geometry's codebook."""
    o = typed_options("gsd", GSDOptions, ctx.options)
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
#   and bonus tokens are drawn from it. A draft outside the target's support (p(v) = 0 after top-k / top-p) gets
#   g = 0 (the paper's form would move its neighbours' mass onto it and emit a token the target never samples).
#   Mass only ever moves between codebook neighbours, by the share g: the
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


def _transport_rows(r: Tensor, q: Tensor, edges, want: Tensor, budget: Optional[float] = None) -> Tensor:
    """`transport` of r, q, want (B, S, V): every (row, node) at once."""
    return transport(r.flatten(0, 1), q.flatten(0, 1), edges, want.flatten(0, 1), budget).view_as(r)


def gasv(ctx: VerifyContext, generator: torch.Generator) -> Verdict:
    """LISA's geometry-aware soft verification (see the block above): needs the raw guided logits and a
    calibration (geometry.calibration, `lisa calibrate`). Options: GASVOptions."""
    o = typed_options("gasv", GASVOptions, ctx.options)
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
    if ctx.tree.sampled:  # the share g(v) of v's deficit to q, pulled from its k nearest codes (docs/method.md)
        edges = neighbour_edges(cal.neighbours[:, :k], ctx.p.device)

        def relax(p_rows, q, rows, ctx):  # (B, S, V) at the nodes rows (B, S)
            p_rows = _normalise(p_rows)
            return _transport_rows(p_rows, q, edges, _at_rows(g_all, rows) * (q - p_rows).clamp(min=0))

        return walk_sampled(ctx, generator, relax)
    ar = torch.arange(ctx.p.shape[0], device=ctx.p.device)
    table = cal.neighbours[:, :k].to(ctx.p.device)

    def soft(r, tok, row):  # p_soft for draft tok: (its soft mass (B,), the soft residual with tok removed (B, V))
        g = g_all[ar, row].gather(1, tok[:, None])  # (B, 1)
        # a draft outside the target's support (p = 0 after top-k / top-p) takes no mass: never accepted
        g = torch.where(ctx.p[ar, row].gather(1, tok[:, None]) > 0, g, torch.zeros_like(g))
        nn = table[tok]  # (B, k)
        moved = r.gather(1, nn) * g  # (B, k)
        rest = r.scatter(1, nn, r.gather(1, nn) - moved).scatter(1, tok[:, None], 0.0)
        return r.gather(1, tok[:, None]).squeeze(1) + moved.sum(-1), rest

    def accept(r, tok, q_parent, row, ctx):
        r = _normalise(r)
        p_tok, rest = soft(r, tok, row)
        return p_tok.clamp(max=1), _normalise(rest)

    return walk(ctx, generator, accept)
