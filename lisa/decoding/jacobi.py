"""Drafter-free Jacobi windows (lisa.decoding.generate.jacobi_generate): how each iteration drafts its window, and
what it keeps for the next one. One loop serves SJD, its coupled successors and SJD-PAC; they differ only here.

The state between iterations, per row, over the window's positions n .. n + L (n: the row's next position):
  Q      (B, L + 1, V)  the cached distribution of each position: the target's p there from the last forward (a
                        stale context: it conditioned on drafts that may since have been replaced), uniform where
                        no forward reached yet. Drafts of a position are drawn from its Q, and verified against it.
  old    (B, L + 1)     the untested draft the last iteration had at each position (-1: none), drawn from q_old
  q_old  (B, L + 1, V)
  noise  (B, L + 1, V)  scd-gumbel: one Gumbel noise per position and code, fixed from the iteration a position
                        enters the window until it is emitted; it shifts with the window (`shift_noise`).

How each method drafts position k (depth k + 1 of the window's tree):
  sjd         a fresh draw from Q[k] (Teng et al.'s re-drafting of every not-yet-accepted position);
  scd-mc      maximal coupling of the old draft to Q[k] (`couple`): kept with probability min(1, Q(x) / q_old(x)),
              else drawn from norm(max(Q - q_old, 0)); distributed as Q[k], which is what it is verified against.
  scd-gumbel  argmax(log Q[k] + noise[k]); verified by equality with argmax(log p + noise[k]) (verify.scd_gumbel).
  sjd-pac     Adaptive Continuation = the maximal coupling above (the stale tail is kept, no full resampling), plus
              Proactive Drafting: the window is a tree (`proactive_paths`): K siblings per node on the first D - 1
              levels, then one chain out to the window, L nodes in all (one forward, as SJD). Every node of depth
              k + 1 is drawn from Q[k] (the cached distribution of its position, whatever its parent); a node's
              children are a draw without replacement, its first child the coupled old draft where it is on the
              first-child chain from the root. verify.walk_sampled then walks the tree level by level.

Where ours departs from the released code (docs/method.md#coupled-jacobi-decoding): SJD-PAC's release picks the
longest accepted row instead of walking level by level, draws the extra siblings from the residual while verifying
them as draws without replacement from the stored q, and commits a uniform bonus token after a fully accepted
window; SCD's Lumina-mGPT / Janus-Pro release keeps the old q for a draft the coupling kept (its Cosmos release
stores the new one, as we do). Each of these biases the law; ours passes the chi-square test of every lossless
method (tests/test_speculative.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lisa.decoding.sampling import sample_inverse
from lisa.decoding.tree import Shape, Tree, branching_choices, draw_siblings, tree_shape
from lisa.decoding.walk import ratio, _normalise


def proactive_paths(window: int, width: int, depth: int) -> list[tuple[int, ...]]:
    """SJD-PAC's window as sibling-index paths (lisa.decoding.tree): a full `width`-ary tree over the first depth - 1
    draft levels (the reference counts the root as a level), then the first-child chain out to `window` nodes."""
    if width < 1 or depth < 1:
        raise ValueError(f"sjd-pac: width and depth must be >= 1, got width {width}, depth {depth}")
    paths = branching_choices([width] * (depth - 1)) if depth > 1 else []
    if len(paths) > window:
        raise ValueError(f"sjd-pac: a width-{width}, depth-{depth} proactive tree has {len(paths)} draft nodes, more "
                         f"than the window of {window}: raise `window` or lower width / depth")
    main = (0,) * (depth - 1)
    while len(paths) < window:
        main = main + (0,)
        paths.append(main)
    return paths


@dataclass
class Layout:
    """A window's static shape, shared by every row and iteration. Node arrays in breadth-first order (N,)."""
    parents: Tensor  # (N,) -1 for children of the root
    depth: Tensor  # (N,) 1 for children of the root
    follow: Tensor  # (N + 1, L + 1) from each row (0 = root, i + 1 = node i), one node per depth below it: its
    #                 first-child chain, continued by the main chain's nodes where it ends; pad -1
    main: Tensor  # (L,) the first-child chain from the root (depth 1, 2, ...), pad -1
    shape: Shape  # the same structure as a tree Shape (its ancestor mask, children table, level widths): built once
    is_chain: bool  # every node is its parent's first child
    main_depth: int  # nodes on the first-child chain from the root
    main_nodes: tuple[int, ...]  # `main` on the host

    @property
    def size(self) -> int:
        return self.parents.shape[0]

    @classmethod
    def of(cls, paths: list[tuple[int, ...]], window: int, device=None) -> "Layout":
        paths = sorted(paths, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        N = len(paths)
        first = [index.get((0,), -1)] + [index.get(p + (0,), -1) for p in paths]  # per row: its first child
        main = []  # the first-child chain from the root: main[d - 1] at depth d
        while first[main[-1] + 1 if main else 0] >= 0:
            main.append(first[main[-1] + 1 if main else 0])
        follow = torch.full((N + 1, window + 1), -1, dtype=torch.long)
        for row in range(N + 1):
            node, d = first[row], len(paths[row - 1]) + 1 if row else 1
            for j in range(window + 1):
                if node < 0 and d <= len(main):  # below a side branch's end: the main chain's deeper drafts
                    node = main[d - 1]
                if node < 0:
                    break
                follow[row, j] = node
                node, d = first[node + 1], d + 1
        return cls(torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], device=device),
                   torch.tensor([len(p) for p in paths], device=device),
                   follow.to(device), torch.tensor((main + [-1] * window)[:window], device=device),
                   tree_shape(paths, device), all(p[-1] == 0 for p in paths), len(main), tuple(main))


def couple(old: Tensor, q_old: Tensor, q_new: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """Maximal coupling of drafts old (...,) drawn from q_old (..., V) to q_new: old is kept with probability
    min(1, q_new(x) / q_old(x)), else replaced by a draw from norm(max(q_new - q_old, 0)). The result is distributed
    exactly as q_new, and equals old with the largest probability any such draw can, 1 - TV(q_old, q_new)."""
    a = ratio(q_new.gather(-1, old[..., None]).squeeze(-1), q_old.gather(-1, old[..., None]).squeeze(-1))
    rest = _normalise((q_new - q_old).clamp(min=0))
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, q_new)  # q_new == q_old: always kept
    fresh = sample_inverse(rest, generator)
    u = torch.rand(old.shape, generator=generator, device=old.device)
    return torch.where(u < a, old, fresh)


def gumbel(shape, generator: Optional[torch.Generator], device=None) -> Tensor:
    """Standard Gumbel noise -log(E), E = -log(1 - U) ~ Exp(1) from uniforms U (4-5x cheaper on a CPU than torch's
    exponential_; E is kept above float32's smallest normal, so the noise is finite)."""
    u = torch.rand(shape, generator=generator, device=device)
    return -(-torch.log1p(-u)).clamp(min=torch.finfo(u.dtype).tiny).log()


def shift_noise(noise: Tensor, s: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """The noise of the window after each row emitted s (B,) tokens: position n + s + k takes row s + k; the positions
    entering the window get fresh noise."""
    B, R, V = noise.shape
    at = s[:, None] + torch.arange(R, device=noise.device)  # (B, R)
    kept = noise.gather(1, at.clamp(max=R - 1)[..., None].expand(-1, -1, V))
    return torch.where((at < R)[..., None], kept, gumbel(noise.shape, generator, noise.device))


def draft_window(layout: Layout, Q: Tensor, old: Optional[Tensor], q_old: Optional[Tensor], coupling: str,
                 noise: Optional[Tensor], generator: Optional[torch.Generator]) -> Tree:
    """This iteration's window as a Tree of sampled drafts; coupling "none" (sjd), "maximal" (scd-mc, sjd-pac's
    continuation) or "gumbel" (scd-gumbel). Q, old, q_old, noise: the module docstring's state."""
    B, _, V = Q.shape
    N, dev = layout.size, Q.device
    main_depth = layout.main_depth
    tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
    Qm = Q[:, :main_depth]  # (B, Dm, V) the first-child chain's positions
    if coupling == "gumbel":
        main = (Qm.log() + noise[:, :main_depth]).argmax(-1)
    else:
        main = sample_inverse(Qm, generator)
        if coupling == "maximal":
            has = old[:, :main_depth] >= 0
            kept = couple(old[:, :main_depth].clamp(min=0), q_old[:, :main_depth], Qm, generator)
            main = torch.where(has, kept, main)
    tokens[:, layout.main[:main_depth]] = main
    if not layout.is_chain:  # proactive siblings: per level, each parent's children without replacement
        for d, level in enumerate(layout.shape.levels, 1):
            q = Q[:, d - 1]  # (B, V)
            logq = q.log()
            for kids in level.groups:
                first = layout.main_nodes[d - 1] if d - 1 < main_depth else -1
                if first in kids:  # the first child is the (coupled) chain draft: the rest continue without it
                    rest = [i for i in kids if i != first]
                    if rest:
                        lq = logq.scatter(1, tokens[:, first, None], float("-inf"))
                        tokens[:, rest] = draw_siblings(lq.exp(), lq, len(rest), "wor", generator)
                else:
                    tokens[:, kids] = draw_siblings(q, logq, len(kids), "wor", generator)
    rows = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), layout.depth]).clamp(max=Q.shape[1] - 1)
    return Tree(tokens, layout.parents.expand(B, N), layout.depth.expand(B, N), torch.zeros(B, N, device=dev),
                Q[:, rows], "wor" if not layout.is_chain else "iid", layout.shape)


def next_state(layout: Layout, tree: Tree, p: Tensor, path: Tensor, m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(Q, old, q_old) of the next window, from this iteration's tree, its p (B, N + 1, V) and the walk's accepted
    path (B, D) / length m (B,). The emitted token sits at the depth of the first child f_1 of the node the walk
    stopped on; along Layout.follow from that node, f_1, f_2, ... (one node per depth: the first-child chain, then
    the main chain's deeper nodes, never tested: the walk only tries the children of nodes it stands on), the next
    window's position k gets Q = p at f_{k+1} and the old draft f_{k+2} with the q it was drawn from (tree.q at its
    parent); past them, positions start uniform without an old draft. Any Q fixed before a position's draft is a
    valid proposal; stale contexts only lower acceptance."""
    B, Np1, V = p.shape
    L = layout.follow.shape[1] - 1
    ar = torch.arange(B, device=p.device)
    stop = torch.where(m > 0, path.gather(1, (m - 1).clamp(min=0)[:, None]).squeeze(1) + 1, 0)  # (B,) row
    f = layout.follow[stop]  # (B, L + 1) f_1 .. f_{L+1}
    cached = f >= 0
    rows = (f + 1).clamp(max=Np1 - 1)[..., None].expand(-1, -1, V)
    Q = torch.where(cached[..., None], p.gather(1, rows), torch.full_like(p[:, :1], 1.0 / V))  # (B, L + 1, V)
    nxt = torch.cat([f[:, 1:], torch.full_like(f[:, :1], -1)], 1)  # f_{k+2}
    old = torch.where(nxt >= 0, tree.tokens[ar[:, None], nxt.clamp(min=0)], -1)
    parent = torch.where(nxt >= 0, tree.parents[ar[:, None], nxt.clamp(min=0)] + 1, 0)  # (B, L + 1) rows of tree.q
    q_old = tree.q.gather(1, parent[..., None].expand(-1, -1, V))
    return Q, old, q_old


def window_policy(verifier: str, options, window: int) -> tuple[list[tuple[int, ...]], str]:
    """(the window's sibling-index paths, the coupling) of Jacobi verifier `verifier` with its typed options."""
    if window < 1:
        raise ValueError(f"{verifier}: the Jacobi window must be >= 1, got {window}")
    chain = [(0,) * d for d in range(1, window + 1)]
    if verifier == "sjd-pac":
        return (proactive_paths(window, options.width, options.depth),
                "maximal" if options.continuation else "none")
    return chain, {"scd-mc": "maximal", "scd-gumbel": "gumbel"}.get(verifier, "none")
