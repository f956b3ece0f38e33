"""Draft trees: masks, paths, chains, the dynamic (EAGLE-2/3) expansion and static trees."""
import pytest
import torch

from lisa.decoding.tree import Tree, chain, dynamic_tree, select


def small_tree():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    #    |
    #    5
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2]])
    depth = torch.tensor([[1, 1, 2, 2, 2, 3]])
    return Tree(torch.arange(6)[None] + 10, parents, depth, torch.zeros(1, 6))


def test_ancestor_mask_and_paths():
    t = small_tree()
    m = t.ancestor_mask()[0]
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert m[4].nonzero().flatten().tolist() == [1, 4]
    assert m[0].nonzero().flatten().tolist() == [0]
    assert t.leaves()[0].tolist() == [False, False, False, True, True, True]
    assert t.paths()[0].tolist() == [[0, 3, -1], [1, 4, -1], [0, 2, 5]]


def test_chain():
    c = chain(torch.tensor([[5, 6, 7]]))
    assert c.parents.tolist() == [[-1, 0, 1]] and c.depth.tolist() == [[1, 2, 3]]
    assert c.ancestor_mask()[0].equal(torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    assert c.paths()[0].tolist() == [[0, 1, 2]]


def fixed_drafter(V=12, seed=0):
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)).log_softmax(-1)

    def expand(tree, nodes):
        return table[tree.tokens.gather(1, nodes)]  # next-token log-probs depend on the node's token only

    return table, expand


def test_dynamic_tree_scores_and_closure():
    V = 12
    table, expand = fixed_drafter(V)
    root = torch.randn(2, V).log_softmax(-1)
    t = dynamic_tree(root, expand, depth=4, top_k=3, total_tokens=10)
    assert t.tokens.shape == (2, 10) and t.q.shape == (2, 11, V)
    for b in range(2):
        assert set(t.tokens[b, t.depth[b] == 1].tolist()) <= set(root[b].topk(3).indices.tolist())
        for i in range(10):
            p = int(t.parents[b, i])
            assert p < i  # breadth-first, ancestor-closed
            prev_tok_lp = root[b] if p < 0 else table[t.tokens[b, p]]
            prev_score = 0.0 if p < 0 else t.scores[b, p]
            torch.testing.assert_close(t.scores[b, i], prev_score + prev_tok_lp[t.tokens[b, i]])
            assert int(t.depth[b, i]) == (1 if p < 0 else int(t.depth[b, p]) + 1)
        torch.testing.assert_close(t.q[b, 0], root[b].exp())


def test_dynamic_tree_top1_is_the_greedy_chain():
    V = 12
    table, expand = fixed_drafter(V)
    root = torch.randn(1, V).log_softmax(-1)
    t = dynamic_tree(root, expand, depth=5, top_k=1, total_tokens=5)
    tok, greedy = int(root.argmax()), []
    for _ in range(5):
        greedy.append(tok)
        tok = int(table[tok].argmax())
    assert t.tokens[0].tolist() == greedy and t.parents[0].tolist() == [-1, 0, 1, 2, 3]


def test_select_reindexes():
    t = small_tree()
    s = select(t, torch.tensor([[0, 2, 5]]))
    assert s.parents.tolist() == [[-1, 0, 1]] and s.tokens.tolist() == [[10, 12, 15]]


def test_ancestor_mask_on_random_trees():
    """The level-by-level ancestor mask equals a node-by-node walk up the parents, on random BFS-ordered trees."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        B, N = 3, 12
        parents = torch.full((B, N), -1, dtype=torch.long)
        depth = torch.ones(B, N, dtype=torch.long)
        for b in range(B):
            for i in range(N):
                p = int(torch.randint(-1, i, (1,), generator=gen))
                parents[b, i], depth[b, i] = p, 1 if p < 0 else int(depth[b, p]) + 1
        ref = torch.eye(N, dtype=torch.bool).expand(B, N, N).clone()
        for b in range(B):
            for i in range(N):
                node = int(parents[b, i])
                while node >= 0:
                    ref[b, i, node] = True
                    node = int(parents[b, node])
        tree = Tree(torch.zeros(B, N, dtype=torch.long), parents, depth, torch.zeros(B, N))
        assert torch.equal(tree.ancestor_mask(), ref)


def test_static_choices_and_tree():
    from lisa.decoding.tree import static_choices, static_tree

    ch = static_choices(depth=3, top_k=3, total_tokens=8)
    assert ch[:4] == [(0,), (0, 0), (0, 0, 0), (1,)] and len(ch) == 8
    assert all(p[:-1] in ch for p in ch if len(p) > 1)  # prefix-closed
    assert len(static_choices(2, 2, 100)) == 6  # every path of ranks < 2, depth <= 2
    gen = torch.Generator().manual_seed(0)
    root = torch.randn(2, 6, generator=gen).log_softmax(-1)
    calls = []

    def expand(tree, pick):
        calls.append(pick.shape[1])
        return torch.randn(2, pick.shape[1], 6, generator=gen).log_softmax(-1)

    tree = static_tree(root, expand, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.tokens[:, 0].tolist() == root.argmax(-1).tolist()
    assert tree.tokens[:, 1].tolist() == root.topk(2).indices[:, 1].tolist()
    assert tree.parents[0].tolist() == [-1, -1, 0, 0, 1, 2] and tree.depth[0].tolist() == [1, 1, 2, 2, 2, 3]
    assert calls == [2, 1]  # level 2 expands nodes (0,) and (1,); level 3 expands (0, 0)
    assert torch.allclose(tree.q[:, 0], root.exp()) and (tree.scores[:, 2] < tree.scores[:, 0]).all()
    with pytest.raises(ValueError, match="prefix-closed"):
        static_tree(root, expand, [(0,), (1, 0)])


def test_sampled_tree_shape_and_draws():
    """Sampled trees: the shape is the branching's, tokens come from the given generator (reproducible, never
    the global RNG), draws without replacement give distinct siblings, scores are cumulative log q."""
    from lisa.decoding.tree import branching_choices, sampled_tree

    assert len(branching_choices((3, 2, 1, 1))) == 3 + 6 + 6 + 6
    assert branching_choices((1, 1, 1)) == [(0,), (0, 0), (0, 0, 0)]
    with pytest.raises(ValueError, match="branching"):
        branching_choices((2, 0))
    V, B = 12, 64
    root = torch.randn(B, V, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    Q = torch.randn(V, V, generator=torch.Generator().manual_seed(1)).log_softmax(-1)

    def expand(tree, pick):  # each picked node's children come from Q[its token]
        return Q[tree.tokens.gather(1, pick)]

    ch = branching_choices((3, 2))
    for scheme in ("iid", "wor"):
        a = sampled_tree(root, expand, ch, scheme, torch.Generator().manual_seed(5))
        torch.manual_seed(123)
        b = sampled_tree(root, expand, ch, scheme, torch.Generator().manual_seed(5))
        assert torch.equal(a.tokens, b.tokens) and a.sampled == scheme
        assert a.parents[0].tolist() == [-1, -1, -1, 0, 0, 1, 1, 2, 2] and a.depth[0].tolist() == [1] * 3 + [2] * 6
        assert torch.allclose(a.q[:, 0], root.exp())
        assert torch.allclose(a.q[:, 1:4], Q[a.tokens[:, :3]].exp())  # each node's distribution, for its children
        first = root.gather(1, a.tokens[:, :3])
        assert torch.allclose(a.scores[:, :3], first)
        assert torch.allclose(a.scores[:, 3], first[:, 0] + Q[a.tokens[:, 0], a.tokens[:, 3]])
        if scheme == "wor":
            assert all(len(set(r)) == 3 for r in a.tokens[:, :3].tolist())
    with pytest.raises(ValueError, match="sibling-closed"):
        sampled_tree(root, expand, [(0,), (2,)], "iid", None)


@pytest.mark.parametrize("scheme", ["iid", "wor"])
def test_draw_siblings_laws(scheme):
    """The first sibling ~ q; the second ~ q (iid) or q without the first (wor): checked on 2e5 draws."""
    from scipy.stats import chisquare

    from lisa.decoding.tree import draw_siblings

    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    B = 200_000
    d = draw_siblings(q.expand(B, 4), q.log().expand(B, 4), 2, scheme, torch.Generator().manual_seed(0))
    qd = q.double() / q.double().sum()
    assert chisquare(torch.bincount(d[:, 0], minlength=4).double().numpy(), (qd * B).numpy()).pvalue > 1e-3
    rows = d[:, 0] == 0
    second = torch.bincount(d[rows, 1], minlength=4).double()
    want = qd if scheme == "iid" else torch.tensor([0.0, 0.6, 0.3, 0.1], dtype=torch.float64)
    keep = want > 0
    assert second[~keep].sum() == 0
    assert chisquare(second[keep].numpy(), (want[keep] / want[keep].sum() * second.sum()).numpy()).pvalue > 1e-3
