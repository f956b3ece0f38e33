"""Cost model for speculative decoding on the machine at hand, and the `auto` choice of tree depth and size.

A round of speculative decoding costs  t_round(d, N) = t_target(N + 1) + t_draft(d) + t_loop(N):
  t_target(S)  one target forward over S new tokens (root + N draft nodes) at this batch, with CFG rows;
  t_draft(d)   the drafter: d - 1 expansion levels of top_k nodes each, plus the commit of the accepted pairs;
  t_loop(N)    everything else in the round (tree building, verification, cache moves), a + b * N, fitted on
               two calibration runs.
The forwards are timed bare, here, on this device (`measure_costs`); on a GPU t_target is nearly flat up to
~64 tokens, on a CPU it grows with N, which is why the best tree differs between them.

Expected tokens per round tau(d, N) are predicted from acceptance statistics (`acceptance_profile`): one
calibration run with the largest tree (depth max_depth, every drafted node kept) records each round's node
scores and the accepted path. A tree of depth d and N nodes is the top-N nodes of depth <= d of that tree (the
dynamic tree keeps nodes by cumulative draft log-probability, and an ancestor always outranks its child), so the
path it would accept is the prefix of the recorded path whose nodes it holds. For greedy verification this is
exact; for `exact` it is exact in distribution when siblings are tried in score order (lisa.decoding.verify.walk): the
smaller tree holds a prefix of each node's siblings, and each sibling's acceptance test is the same.

speedup(d, N) = tau(d, N) * t_vanilla / t_round(d, N), t_vanilla = one vanilla decode step (forward + sampling).
`choose` maximises it over a grid and explains the pick.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from lisa.models.gpt import Transformer


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def time_target_forward(target: Transformer, rows: int, new: int, context: int, reps: int = 5) -> float:
    """Median seconds of one target forward over `new` tokens per row after `context` cached slots, with an
    explicit (rows, new, L) mask and per-row positions, as the speculative loop calls it."""
    dev = next(target.parameters()).device
    target.setup_caches(rows, context + new + 1)
    L = target.cache_length
    slots = (context + torch.arange(new, device=dev)).expand(rows, new)
    mask = (torch.arange(L, device=dev)[None, None, :] <= slots[:, :, None]).expand(rows, new, L)
    x = target.embed_tokens(torch.randint(0, target.config.vocab_size, (rows, new), device=dev))
    rope = slots.clamp(max=target.rope.shape[0] - 1)  # positions past the model's length: the cost is the same
    return median_time(lambda: target(x, slots, mask=mask, rope_pos=rope), reps, dev)


@torch.inference_mode()
def time_drafter_forward(drafter, rows: int, new: int, context: int, reps: int = 5) -> float:
    """Median seconds of one drafter forward over `new` pairs per row after `context` cached pairs."""
    dev = next(drafter.parameters()).device
    drafter.setup_caches(rows, context + new + 1)
    L = drafter.cache_length
    slots = (context + torch.arange(new, device=dev)).expand(rows, new)
    mask = (torch.arange(L, device=dev)[None, None, :] <= slots[:, :, None]).expand(rows, new, L)
    toks = torch.randint(0, drafter.config.vocab_size, (rows, new), device=dev)
    hidden = torch.randn(rows, new, drafter.config.model_dim, device=dev, dtype=next(drafter.parameters()).dtype)
    rope = slots.clamp(max=drafter.rope.shape[0] - 1)
    return median_time(lambda: drafter(toks, hidden, input_pos=slots, mask=mask, rope_pos=rope), reps, dev)


@dataclass
class Costs:
    """Measured bare forward times (seconds) on this device, at `rows` rows (batch x 2 with CFG)."""
    rows: int
    target_s: dict[int, float]  # new tokens S -> one target forward
    drafter_s: dict[int, float]  # new pairs S -> one drafter forward
    vanilla_step_s: float = 0.0  # one vanilla decode step, sampling included (measured in the loop)
    loop_a_s: float = 0.0  # per-round loop time besides the forwards: a + b * N
    loop_b_s: float = 0.0

    def target(self, s: int) -> float:
        return _interp(self.target_s, s)

    def drafter(self, s: int) -> float:
        return _interp(self.drafter_s, s)

    def draft(self, depth: int, top_k: int, chain: bool = False, commit: float = 2.0) -> float:
        """Drafter time of a round: depth - 1 expansions (top_k nodes each, one for a chain) and the commit."""
        return (depth - 1) * self.drafter(1 if chain else top_k) + self.drafter(max(1, round(commit)))

    def loop(self, n: int) -> float:
        return max(self.loop_a_s + self.loop_b_s * n, 0.0)

    def round(self, depth: int, n: int, top_k: int, chain: bool = False, commit: float = 2.0) -> float:
        return self.target(n + 1) + self.draft(depth, top_k, chain, commit) + self.loop(n)


def _interp(table: dict[int, float], s: int) -> float:
    """Piecewise-linear in S between measured sizes (linear extrapolation past the largest)."""
    xs = sorted(table)
    if s in table:
        return table[s]
    if s <= xs[0]:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if lo < s < hi:
            return table[lo] + (table[hi] - table[lo]) * (s - lo) / (hi - lo)
    lo, hi = xs[-2], xs[-1]
    return table[hi] + (table[hi] - table[lo]) * (s - hi) / (hi - lo)


def measure_costs(target: Transformer, drafter, rows: int, sizes: list[int], top_k: int, context: int,
                  reps: int = 5) -> Costs:
    """Bare target forwards over S = 1 and N + 1 for N in sizes, and drafter forwards over 1..top_k (+ a few)."""
    tgt = {s: time_target_forward(target, rows, s, context, reps) for s in sorted({1, 2} | {n + 1 for n in sizes})}
    dsizes = sorted({1, 2, 4, top_k, 8})
    dft = ({s: time_drafter_forward(drafter, rows, s, context, reps) for s in dsizes} if drafter is not None
           else {1: 0.0})
    return Costs(rows=rows, target_s=tgt, drafter_s=dft)


# ---------------------------------------------------------------------------------------------------------------
# acceptance statistics


@dataclass
class AcceptanceProfile:
    """Per recorded (round, live row): for each depth d <= max_depth, the tree size each accepted path node needs
    (its rank among the nodes of depth <= d, plus one); need[d][i] is a list over path nodes, root side first."""
    max_depth: int
    needs: list[list[list[int]]] = field(default_factory=list)  # [sample][d - 1] -> need of path nodes at depth <= d

    def accepted(self, depth: int, n: int) -> Tensor:
        """Accepted draft tokens of each recorded round for a tree of this depth and size."""
        out = [sum(1 for x in need[depth - 1] if x <= n) for need in self.needs]
        return torch.tensor(out, dtype=torch.float)

    def tau(self, depth: int, n: int) -> float:
        """Predicted tokens per round (bonus token included)."""
        return 1.0 + float(self.accepted(depth, n).mean()) if self.needs else 1.0


def acceptance_profile(trace: list[dict], max_depth: int) -> AcceptanceProfile:
    """From `speculative_generate(..., trace=)` rounds of a full tree (every drafted node kept)."""
    prof = AcceptanceProfile(max_depth)
    for rnd in trace:
        scores, depth, path, m, live = (rnd[k].cpu() for k in ("scores", "depth", "path", "m", "live"))
        rank = scores - 1e-6 * depth  # the same order dynamic_tree reranks by
        for b in torch.nonzero(live).flatten().tolist():
            nodes = path[b, : int(m[b])].tolist()
            per_depth = []
            for d in range(1, max_depth + 1):
                pool = rank[b][depth[b] <= d]
                per_depth.append([int((pool > rank[b, i]).sum()) + 1 for i in nodes if int(depth[b, i]) <= d])
            prof.needs.append(per_depth)
    return prof


@dataclass
class SampledProfile:
    """Sampled drafts of shape (c, 1, 1, ...): c siblings drawn at the root, a chain below each. Recorded from a
    traced decode with the widest, deepest such shape (C, 1^(D-1)): per (round, live row), the draw index of the
    accepted root child (-1: none) and the accepted length. The first c of C draws are a draw of c (i.i.d. or
    without replacement) and the first d - 1 drafts of a chain are a chain of d - 1, tried with the same
    randomness, so a shape (c, 1^(d-1)) accepts 0 where the root child's index >= c, else min(m, d): exact in
    distribution."""
    width: int
    max_depth: int
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (root child index or -1, accepted)

    def accepted(self, c: int, depth: int) -> Tensor:
        return torch.tensor([min(m, depth) if 0 <= i < c else 0 for i, m in self.rounds], dtype=torch.float)

    def tau(self, c: int, depth: int) -> float:
        return 1.0 + float(self.accepted(c, depth).mean()) if self.rounds else 1.0


def sampled_profile(trace: list[dict], width: int, max_depth: int) -> SampledProfile:
    """From `speculative_generate(..., trace=)` rounds of a sampled tree with branching (width, 1, ..., 1): its
    root children are nodes 0 .. width - 1, in draw order."""
    prof = SampledProfile(width, max_depth)
    for rnd in trace:
        path, m, live = (rnd[k].cpu() for k in ("path", "m", "live"))
        for b in torch.nonzero(live).flatten().tolist():
            mb = int(m[b])
            prof.rounds.append((int(path[b, 0]) if mb > 0 else -1, mb))
    return prof


# ---------------------------------------------------------------------------------------------------------------
# the choice


@dataclass
class Choice:
    depth: int
    total_tokens: int
    tau: float  # predicted
    round_ms: float
    speedup: float  # predicted, against vanilla on this device
    why: str
    grid: list[dict]  # every candidate: draft, depth, total_tokens (branching for sampled), tau, round_ms, speedup
    costs: dict
    draft: str = "topk"  # "sample": a sampled tree of shape `branching`
    branching: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def choose(profile: Optional[AcceptanceProfile], costs: Costs, top_k: int, sizes: list[int],
           sampled: Optional[SampledProfile] = None) -> Choice:
    """The draft policy and tree of highest predicted speedup: top-k dynamic trees (depth, total_tokens) from
    `profile`, and sampled trees (c, 1^(d-1)) from `sampled`; `why` states the trade-off in one sentence."""
    grid = []
    for d in range(1, profile.max_depth + 1) if profile is not None else ():
        for n in sorted(set(sizes)):
            if n < d:  # a tree of depth d needs d nodes to reach it
                continue
            tau = profile.tau(d, n)
            rt = costs.round(d, n, top_k, commit=tau)
            grid.append({"draft": "topk", "depth": d, "total_tokens": n, "branching": [], "tau": tau,
                         "round_ms": 1000 * rt, "speedup": tau * costs.vanilla_step_s / rt})
    for c in range(1, sampled.width + 1) if sampled is not None else ():
        for d in range(1, sampled.max_depth + 1):
            tau, n = sampled.tau(c, d), c * d
            rt = costs.round(d, n, c, chain=c == 1, commit=tau)
            grid.append({"draft": "sample", "depth": d, "total_tokens": n, "branching": [c] + [1] * (d - 1),
                         "tau": tau, "round_ms": 1000 * rt, "speedup": tau * costs.vanilla_step_s / rt})
    if not grid:
        raise ValueError("the cost model needs a traced profile of top-k or of sampled drafts")

    def name(g):
        return (f"sampled tree {g['branching']}" if g["draft"] == "sample" else
                f"top-k tree depth {g['depth']}, {g['total_tokens']} nodes")

    best = max(grid, key=lambda g: g["speedup"])
    d, n = best["depth"], best["total_tokens"]
    width = best["branching"][0] if best["draft"] == "sample" else top_k
    why = (f"{name(best)}: tau {best['tau']:.2f} per round of {best['round_ms']:.2f} ms (target forward of "
           f"{n + 1} tokens {1000 * costs.target(n + 1):.2f} ms, "
           f"drafter {1000 * costs.draft(d, width, chain=width == 1 and best['draft'] == 'sample', commit=best['tau']):.2f} ms, "
           f"loop {1000 * costs.loop(n):.2f} ms) against {1000 * costs.vanilla_step_s:.2f} ms per vanilla token: "
           f"{best['speedup']:.2f}x predicted")
    bigger = [g for g in grid if g["total_tokens"] > n and g["depth"] >= d]
    nxt = max(bigger, key=lambda g: g["tau"]) if bigger else None
    if nxt is not None:
        why += (f"; the bigger tree of highest tau ({name(nxt)}) would raise tau to {nxt['tau']:.2f} but cost "
                f"{nxt['round_ms']:.2f} ms per round ({nxt['speedup']:.2f}x)")
    other = [g for g in grid if g["draft"] != best["draft"]]
    if other:
        alt = max(other, key=lambda g: g["speedup"])
        why += f"; the best {'top-k' if alt['draft'] == 'topk' else 'sampled'} draft ({name(alt)}): {alt['speedup']:.2f}x"
    return Choice(d, n, best["tau"], best["round_ms"], best["speedup"], why, grid, asdict(costs), best["draft"],
                  best["branching"])


def fit_loop(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a + b * N through (N, per-round loop seconds) points (b = 0 with one distinct N)."""
    ns = torch.tensor([s[0] for s in samples], dtype=torch.float64)
    ts = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    if len(set(ns.tolist())) < 2:
        return float(ts.mean()), 0.0
    A = torch.stack([torch.ones_like(ns), ns], 1)
    a, b = torch.linalg.lstsq(A, ts[:, None]).solution.flatten().tolist()
    return a, b
