"""Draft trees: structure, attention masks, positions, root-to-leaf paths; the EAGLE-2/3 dynamic expansion, static
trees (a fixed shape of child ranks, Medusa / EAGLE-1) and plain chains.

A tree holds N draft nodes per batch row under an implicit root (the last accepted token, index -1). Rows of a
batch have the same N but their own tokens and shapes. Node arrays are in breadth-first order (a parent comes
before its children), which every function here relies on.

  tokens  (B, N) long   the drafted token of each node
  parents (B, N) long   index of the parent node, -1 for children of the root
  depth   (B, N) long   1 for children of the root
  scores  (B, N) float  cumulative draft log-probability of the path root -> node
  q       (B, N + 1, V) optional: the drafter's distribution at the root (row 0) and at each node (row i + 1),
                        the distribution each node's children were drafted from (what `exact` verification needs)
  sampled None: siblings chosen deterministically (the drafter's top-k); "iid": each node's children drawn
          independently from q; "wor": drawn from q without replacement, in draw order (sibling i from q with
          siblings 0 .. i-1 removed). Verifiers read it to pick their rule (lisa.decoding.verify).
"""
from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

import torch
from torch import Tensor


@dataclass
class Tree:
    tokens: Tensor
    parents: Tensor
    depth: Tensor
    scores: Tensor
    q: Optional[Tensor] = None
    sampled: Optional[Literal["iid", "wor"]] = None
    shape: Optional["Shape"] = None  # the shape every row shares, when it was fixed before drafting (tree_shape)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def ancestor_mask(self) -> Tensor:
        """(B, N, N) bool: node i may attend to node j iff j is i or one of its ancestors (tree attention)."""
        if self.shape is not None:
            return self.shape.ancestors.expand(self.tokens.shape[0], -1, -1)
        B, N = self.parents.shape
        dev = self.parents.device
        mask = torch.eye(N, dtype=torch.bool, device=dev).expand(B, N, N).clone()
        anc = self.parents.clone()  # each node's ancestor `step` levels up (-1 past the root)
        parents_ext = torch.cat([self.parents, torch.full((B, 1), -1, dtype=torch.long, device=dev)], 1)
        for _ in range(int(self.depth.max()) - 1 if N else 0):  # one pass per level, not per node
            mask.scatter_(2, anc.clamp(min=0)[..., None], (anc >= 0)[..., None] | mask.gather(2, anc.clamp(min=0)[..., None]))
            anc = parents_ext.gather(1, torch.where(anc >= 0, anc, N))
        return mask

    def children(self) -> Tensor:
        """(B, N + 1, C) child node indices of the root (row 0) and every node (row i + 1), in node order, pad -1."""
        if self.shape is not None:
            return self.shape.kids.expand(self.tokens.shape[0], -1, -1)
        B, N = self.parents.shape
        rows = self.parents + 1  # (B, N) row of each node's parent
        counts = torch.zeros(B, N + 1, dtype=torch.long, device=rows.device).scatter_add_(1, rows, torch.ones_like(rows))
        C = max(int(counts.max()), 1)
        out = torch.full((B, N + 1, C), -1, dtype=torch.long, device=rows.device)
        # slot of each node among its siblings: how many earlier nodes share its parent
        same = rows[:, :, None] == rows[:, None, :]  # (B, N, N)
        slot = (same & torch.ones(N, N, dtype=torch.bool, device=rows.device).tril(-1)).sum(-1)  # (B, N)
        b = torch.arange(B, device=rows.device)[:, None].expand(B, N)
        out[b, rows, slot] = torch.arange(N, device=rows.device).expand(B, N)
        return out

    def leaves(self) -> Tensor:
        """(B, N) bool: nodes without children."""
        B, N = self.parents.shape
        is_parent = torch.zeros(B, N + 1, dtype=torch.bool, device=self.parents.device)
        is_parent.scatter_(1, self.parents + 1, True)  # index 0 collects the root's children
        return ~is_parent[:, 1:]

    def paths(self) -> Tensor:
        """(B, P, D) node indices of every root-to-leaf path (P = most leaves in a row, D = deepest), padded -1."""
        B, N = self.parents.shape
        leaves = self.leaves()
        P, D = int(leaves.sum(1).max()), int(self.depth.max()) if N else 0
        out = torch.full((B, max(P, 1), max(D, 1)), -1, dtype=torch.long, device=self.parents.device)
        for b in range(B):
            for p, leaf in enumerate(torch.nonzero(leaves[b]).flatten().tolist()):
                node, d = leaf, int(self.depth[b, leaf])
                while node >= 0:
                    out[b, p, d - 1] = node
                    node, d = int(self.parents[b, node]), d - 1
        return out


@dataclass(frozen=True, eq=False)
class Level:
    """The nodes of one depth of a fixed shape, for filling them in one indexing op per level."""
    nodes: Tensor  # (n,) node indices, in node order
    parents: Tensor  # (P,) the distinct parents of these nodes, in node order (-1: the root)
    j: Tensor  # (n,) each node's parent, as a position in `parents`
    s: Tensor  # (n,) each node's index among its siblings
    width: int  # most children of one parent on this level
    built: int  # nodes on the earlier levels (the arrays' prefix before this level)
    groups: tuple[list[int], ...]  # per parent in `parents`: its children's node indices, in node order (host)
    rows: Tensor  # (P,) parents + 1: the parents' rows of a tree's q (row 0 = the root)
    up: Tensor  # (n,) each node's parent node index (parents[j])


@dataclass(frozen=True, eq=False)
class Shape:
    """A tree shape fixed before any token is drafted (sampled and static trees, chains): every row and every round
    share it, so its structure is built once (`tree_shape`) and reused instead of recomputed each round."""
    paths: tuple[tuple[int, ...], ...]  # sibling-index paths in node (breadth-first) order
    parents: Tensor  # (N,) long
    depth: Tensor  # (N,) long
    ancestors: Tensor  # (N, N) bool: Tree.ancestor_mask
    kids: Tensor  # (N + 1, C) long: Tree.children
    levels: tuple[Level, ...]  # depth 1, 2, ...
    widths: tuple[int, ...]  # (D + 1,) most children of a node at depth 0 (the root), 1, ..., D (0 at the leaves)


def tree_shape(paths: Sequence[tuple[int, ...]], device=None) -> Shape:
    """The Shape of prefix-closed sibling-index paths (each node's path of child indices from the root, e.g. (0, 1)
    = the second child of the first child), built once per (paths, device)."""
    return _tree_shape(tuple(sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))),
                       str(torch.device(device or "cpu")))


@functools.lru_cache(maxsize=256)
def _tree_shape(paths: tuple[tuple[int, ...], ...], device: str) -> Shape:
    index = {p: i for i, p in enumerate(paths)}
    N = len(paths)
    parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], device=device)
    depth = torch.tensor([len(p) for p in paths], device=device)
    plain = Tree(torch.zeros(1, N, dtype=torch.long, device=device), parents[None], depth[None],
                 torch.zeros(1, N, device=device))
    levels = []
    for d in range(1, max(len(p) for p in paths) + 1):
        nodes = [p for p in paths if len(p) == d]
        parent_paths = sorted({p[:-1] for p in nodes}, key=lambda p: index.get(p, -1))
        at = {pp: j for j, pp in enumerate(parent_paths)}
        up = [index.get(pp, -1) for pp in parent_paths]
        levels.append(Level(torch.tensor([index[p] for p in nodes], device=device), torch.tensor(up, device=device),
                            torch.tensor([at[p[:-1]] for p in nodes], device=device),
                            torch.tensor([p[-1] for p in nodes], device=device),
                            max(p[-1] for p in nodes) + 1, index[nodes[0]],
                            tuple([index[p] for p in nodes if p[:-1] == pp] for pp in parent_paths),
                            torch.tensor(up, device=device) + 1,
                            torch.tensor([index.get(p[:-1], -1) for p in nodes], device=device)))
    widths = tuple(lv.width for lv in levels) + (0,)
    return Shape(paths, parents, depth, plain.ancestor_mask()[0], plain.children()[0], tuple(levels), widths)


def chain(tokens: Tensor, scores: Optional[Tensor] = None, q: Optional[Tensor] = None,
          sampled: Optional[Literal["iid", "wor"]] = None) -> Tree:
    """A plain chain of drafts (B, N): node i's parent is i - 1."""
    B, N = tokens.shape
    shape = tree_shape([(0,) * d for d in range(1, N + 1)], tokens.device) if N else None
    ar = torch.arange(N, device=tokens.device)
    return Tree(tokens, (ar - 1).expand(B, N).clone(), (ar + 1).expand(B, N).clone(),
                scores if scores is not None else torch.zeros(B, N, device=tokens.device), q, sampled, shape)


def dynamic_tree(root_logprobs: Tensor, expand: Callable[[Tree, Tensor], Tensor], depth: int, top_k: int,
                 total_tokens: int) -> Tree:
    """EAGLE-2/3 dynamic tree. root_logprobs (B, V): the drafter's log-probs after the last accepted token.

    Depth 1 takes the root's top_k children. At each further depth the top_k frontier nodes of the last layer
    (by cumulative log-prob) are expanded: `expand(tree, nodes)` runs the drafter on those nodes of the tree
    built so far (nodes (B, k) indices into it) and returns their log-probs (B, k, V); each gets its top_k
    children. Finally all drafted nodes are reranked by cumulative log-prob and the best `total_tokens` kept
    (ancestor-closed: a child never scores above its parent). `q` records each node's full distribution."""
    B, V = root_logprobs.shape
    top, idx = root_logprobs.topk(top_k, dim=-1)  # (B, k)
    tokens, scores = idx, top
    parents = torch.full((B, top_k), -1, dtype=torch.long, device=idx.device)
    depths = torch.ones(B, top_k, dtype=torch.long, device=idx.device)
    q_rows = [root_logprobs.exp()]  # row 0: root
    q_nodes = torch.zeros(B, top_k, V, device=idx.device)  # filled once a node is expanded
    frontier = torch.arange(top_k, device=idx.device).expand(B, top_k)  # the last layer's nodes
    for _ in range(depth - 1):
        layer_scores = scores.gather(1, frontier)
        pick = frontier.gather(1, layer_scores.topk(min(top_k, frontier.shape[1]), dim=-1).indices)  # (B, k)
        tree = Tree(tokens, parents, depths, scores)
        logp = expand(tree, pick)  # (B, k, V)
        q_nodes.scatter_(1, pick[..., None].expand(-1, -1, V), logp.exp())
        ctop, cidx = logp.topk(top_k, dim=-1)  # (B, k, k)
        cand = (scores.gather(1, pick)[..., None] + ctop).flatten(1)  # (B, k*k)
        n0 = tokens.shape[1]
        tokens = torch.cat([tokens, cidx.flatten(1)], 1)
        scores = torch.cat([scores, cand], 1)
        parents = torch.cat([parents, pick.repeat_interleave(top_k, dim=1)], 1)
        depths = torch.cat([depths, depths.gather(1, pick).repeat_interleave(top_k, dim=1) + 1], 1)
        q_nodes = torch.cat([q_nodes, torch.zeros(B, cand.shape[1], V, device=idx.device)], 1)
        frontier = torch.arange(n0, tokens.shape[1], device=idx.device).expand(B, -1)
    # a child never scores above its parent (log-probs <= 0, and float addition is monotone); at a tie (a child of
    # log-prob 0, e.g. a forced grammar token) the stable sort keeps the parent, which was created first
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    keep = order[:, : min(total_tokens, tokens.shape[1])].sort(dim=-1).values  # (B, N), BFS order
    return select(Tree(tokens, parents, depths, scores, torch.cat([q_rows[0][:, None], q_nodes], 1)), keep)


def static_choices(depth: int, top_k: int, total_tokens: int) -> list[tuple[int, ...]]:
    """A fixed tree shape (Medusa / EAGLE-1 "choices"): each node is the path of child ranks from the root, e.g.
    (0, 1) = the second most likely child of the most likely first token. Takes the `total_tokens` paths of
    smallest rank sum (then shorter, then lexicographic) with ranks < top_k and length <= depth: prefix-closed,
    since a prefix never sorts after its extension."""
    heap = [(r, 1, (r,)) for r in range(top_k)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < total_tokens:
        s, n, path = heapq.heappop(heap)
        out.append(path)
        if n < depth:
            for r in range(top_k):
                heapq.heappush(heap, (s + r, n + 1, path + (r,)))
    return out


def static_tree(root_logprobs: Tensor, expand: Callable[[Tree, Tensor], Tensor],
                choices: list[tuple[int, ...]]) -> Tree:
    """A static tree: the same shape every round (`choices`, see static_choices), filled with the drafter's ranked
    tokens. Level by level, the nodes that have children are expanded with `expand(tree, nodes)` as in
    dynamic_tree; node path[-1] is its parent's child of that rank. No reranking; `q` as in dynamic_tree."""
    paths = sorted({tuple(int(r) for r in p) for p in choices}, key=lambda p: (len(p), p))  # breadth-first
    index = {p: i for i, p in enumerate(paths)}
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in index]
    if not paths or missing or min(min(p) for p in paths) < 0:
        raise ValueError(f"static tree choices must be non-empty, non-negative and prefix-closed; "
                         f"missing parents of {missing[:3]}")
    B, V = root_logprobs.shape
    dev = root_logprobs.device
    N = len(paths)
    tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
    scores = torch.zeros(B, N, device=dev)
    parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], device=dev).expand(B, N).clone()
    depths = torch.tensor([len(p) for p in paths], device=dev).expand(B, N).clone()
    q = torch.zeros(B, N + 1, V, device=dev)
    q[:, 0] = root_logprobs.exp()
    logp_of = {(): root_logprobs}
    for level in range(1, max(len(p) for p in paths) + 1):
        nodes = [p for p in paths if len(p) == level]
        if level > 1:
            parent_paths = sorted({p[:-1] for p in nodes}, key=lambda p: index[p])
            pick = torch.tensor([index[p] for p in parent_paths], device=dev).expand(B, -1)
            built = index[nodes[0]]  # nodes of the earlier levels: a prefix of the arrays
            logp = expand(Tree(tokens[:, :built], parents[:, :built], depths[:, :built], scores[:, :built]), pick)
            for j, p in enumerate(parent_paths):
                logp_of[p] = logp[:, j]
                q[:, index[p] + 1] = logp[:, j].exp()
        for p in nodes:
            parent = logp_of[p[:-1]]
            top, idx = parent.topk(p[-1] + 1, dim=-1)
            i = index[p]
            tokens[:, i] = idx[:, -1]
            scores[:, i] = top[:, -1] + (scores[:, index[p[:-1]]] if level > 1 else 0.0)
    return Tree(tokens, parents, depths, scores, q, shape=tree_shape(paths, dev))


def select(tree: Tree, keep: Tensor) -> Tree:
    """The sub-tree of nodes `keep` (B, N) (sorted, ancestor-closed), parents re-indexed."""
    B, M = tree.tokens.shape
    new_index = torch.full((B, M + 1), -1, dtype=torch.long, device=keep.device)  # old + 1 -> new (-1 = root)
    new_index.scatter_(1, keep + 1, torch.arange(keep.shape[1], device=keep.device).expand(B, -1))
    old_parent = tree.parents.gather(1, keep)
    if ((old_parent >= 0) & (new_index.gather(1, old_parent + 1) < 0)).any():
        raise ValueError("tree selection is not ancestor-closed")
    q = None
    if tree.q is not None:
        rows = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=keep.device), keep + 1], 1)
        q = tree.q.gather(1, rows[..., None].expand(-1, -1, tree.q.shape[-1]))
    return Tree(tree.tokens.gather(1, keep), new_index.gather(1, old_parent + 1), tree.depth.gather(1, keep),
                tree.scores.gather(1, keep), q, tree.sampled)


# ---------------------------------------------------------------------------------------------------------------
# Sampled trees: siblings drawn from the drafter's q. The shape (how many children each node gets) is fixed before
# any token is drawn, so that each node's children are a plain i.i.d. or without-replacement draw from its q: a
# shape that depended on the drawn values (EAGLE-2's reranking) would bias the draw and break exact verification.


def branching_choices(branching: Sequence[int]) -> list[tuple[int, ...]]:
    """Sibling-index paths of a tree where every node at level l gets branching[l] children, e.g. (3, 2, 1, 1):
    3 + 6 + 6 + 6 nodes. (1,) * d is a chain of depth d."""
    if not branching or min(branching) < 1:
        raise ValueError(f"branching must be a non-empty list of counts >= 1, got {list(branching)}")
    level, out = [()], []
    for b in branching:
        level = [p + (i,) for p in level for i in range(b)]
        out += level
    return out


def draw_siblings(q: Tensor, logq: Tensor, c: int, scheme: Literal["iid", "wor"],
                  generator: Optional[torch.Generator]) -> Tensor:
    """c children per row of q (..., V) -> (..., c) token ids in draw order. iid: c independent draws (the
    exponential race); wor: without replacement, in sequential draw order (the race's c best = Gumbel-top-c,
    Plackett-Luce). Rows whose support has fewer than c tokens get arbitrary ids past it (q = 0 there); the
    verifier skips a sibling whose remaining q is empty."""
    if scheme == "iid":
        e = torch.empty(*q.shape[:-1], c, q.shape[-1], device=q.device).exponential_(1.0, generator=generator)
        return torch.argmax(q[..., None, :] / e, dim=-1)
    e = torch.empty_like(q).exponential_(1.0, generator=generator)
    return (logq - e.log()).topk(c, dim=-1).indices


@functools.lru_cache(maxsize=256)
def _sampled_shape(choices: tuple[tuple[int, ...], ...], device: str) -> Shape:
    """The Shape of a sampled tree's choices, checked once per (choices, device): prefix- and sibling-closed."""
    paths = sorted({tuple(int(r) for r in p) for p in choices}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    bad = [p for p in paths if (len(p) > 1 and p[:-1] not in index) or (p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index)]
    if not paths or bad or min(min(p) for p in paths) < 0:
        raise ValueError(f"sampled tree choices must be non-empty, non-negative, prefix- and sibling-closed; "
                         f"offending {bad[:3]}")
    return tree_shape(paths, device)


def sampled_tree(root_logq: Tensor, expand: Callable[[Tree, Tensor], Tensor], choices: list[tuple[int, ...]],
                 scheme: Literal["iid", "wor"], generator: Optional[torch.Generator]) -> Tree:
    """A tree whose siblings are drawn from the drafter: root_logq (B, V) the log of the distribution the root's
    children are drawn from; `expand(tree, nodes)` as in dynamic_tree returns the log-distribution (B, k, V) the
    picked nodes' children are drawn from. choices: sibling-index paths (branching_choices, static_choices, or a
    chain (0,), (0, 0), ...): node (2, 0) is the first child drawn for the third child drawn at the root. Prefix-
    and sibling-closed (a node (.., i) needs (.., i - 1)). scores: cumulative log q; q: every node's distribution."""
    B, V = root_logq.shape
    dev = root_logq.device
    shape = _sampled_shape(tuple(map(tuple, choices)), str(dev))
    paths = shape.paths
    N = len(paths)
    tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
    scores = torch.zeros(B, N, device=dev)
    parents, depths = shape.parents.expand(B, N).clone(), shape.depth.expand(B, N).clone()
    q = torch.zeros(B, N + 1, V, device=dev)
    q[:, 0] = root_logq.exp()
    for lv in shape.levels:
        if lv.built == 0:  # depth 1: the root's children
            logq, qx = root_logq[:, None], q[:, :1]  # (B, 1, V)
        else:
            pick = lv.parents.expand(B, -1)  # (B, P)
            logq = expand(Tree(tokens[:, :lv.built], parents[:, :lv.built], depths[:, :lv.built],
                               scores[:, :lv.built]), pick)  # (B, P, V)
            qx = logq.exp()
            q[:, lv.rows] = qx
        drawn = draw_siblings(qx, logq, lv.width, scheme, generator)  # (B, P, width)
        tokens[:, lv.nodes] = drawn[:, lv.j, lv.s]
        lq = logq.gather(2, drawn)[:, lv.j, lv.s]  # (B, n)
        scores[:, lv.nodes] = lq + scores[:, lv.up] if lv.built else lq
    return Tree(tokens, parents, depths, scores, q, scheme, shape)
