"""Verifiers: greedy follows the argmax; `exact` emits tokens distributed exactly as the target (chi-square,
>= 1e5 draws, trees with several siblings per node, deterministic and sampled siblings)."""
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from lisa.decoding.tree import Tree, chain
from lisa.decoding.verify import (VERIFIERS, Geometry, GSDOptions, LanternOptions, VerifyContext, children_table,
                                  get_verifier, option_keys, verifier_options)

V = 6


def chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    probs = probs.double() / probs.double().sum()
    return chisquare(counts.double().numpy(), (probs * counts.sum()).numpy()).pvalue


def emitted(tree: Tree, verdict, n: int) -> torch.Tensor:
    """The first n emitted tokens of each row (accepted drafts, then the correction / bonus), -1 if fewer."""
    B = tree.tokens.shape[0]
    out = torch.full((B, n), -1)
    for i in range(n):
        acc = verdict.n_accepted > i
        node = verdict.path[:, i].clamp(min=0) if i < verdict.path.shape[1] else torch.zeros(B, dtype=torch.long)
        out[:, i] = torch.where(acc, tree.tokens.gather(1, node[:, None]).squeeze(1),
                                torch.where(verdict.n_accepted == i, verdict.next_token, torch.tensor(-1)))
    return out


def tree_batch(B, sampled=None, seed=0):
    """Root with 3 children; the first child has 2 children. Target p: p0 at the root, P2[token] at a child of
    the root, P3[token] at a grandchild. Drafter q: q0 at the root, Q2[token] below. sampled: None (top-k
    siblings), "iid" or "wor" (drawn from q, without replacement in draw order)."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.rand(V, generator=g).softmax(-1)
    P2 = (2 * torch.rand(V, V, generator=g)).softmax(-1)
    P3 = (2 * torch.rand(V, V, generator=g)).softmax(-1)
    q0 = (2 * torch.rand(V, generator=g)).softmax(-1)
    Q2 = (2 * torch.rand(V, V, generator=g)).softmax(-1)
    parents = torch.tensor([-1, -1, -1, 0, 0]).expand(B, 5)
    depth = torch.tensor([1, 1, 1, 2, 2]).expand(B, 5)
    if sampled:  # draws from q
        c = torch.multinomial(q0.expand(B, V), 3, replacement=sampled == "iid", generator=g)
        gc = torch.multinomial(Q2[c[:, 0]], 2, replacement=sampled == "iid", generator=g)
    else:  # deterministic: top-3 of q0, top-2 of Q2 (the same in every row)
        c = q0.topk(3).indices.expand(B, 3)
        gc = Q2[c[:, 0]].topk(2, dim=-1).indices
    tokens = torch.cat([c, gc], 1)
    p = torch.stack([p0.expand(B, V), P2[c[:, 0]], P2[c[:, 1]], P2[c[:, 2]], P3[gc[:, 0]], P3[gc[:, 1]]], 1)
    q = torch.stack([q0.expand(B, V), Q2[c[:, 0]], Q2[c[:, 1]], Q2[c[:, 2]], Q2[gc[:, 0]], Q2[gc[:, 1]]], 1)
    return Tree(tokens, parents.clone(), depth.clone(), torch.zeros(B, 5), q, sampled or None), p, p0, P2


def test_children_table():
    t = Tree(torch.zeros(1, 5, dtype=torch.long), torch.tensor([[-1, -1, 0, 0, 1]]), torch.tensor([[1, 1, 2, 2, 2]]),
             torch.zeros(1, 5))
    assert children_table(t)[0].tolist() == [[0, 1], [2, 3], [4, -1], [-1, -1], [-1, -1], [-1, -1]]


@pytest.mark.parametrize("sampled", [None, "iid", "wor"])
def test_exact_keeps_the_target_distribution(sampled):
    B = 200_000
    tree, p, p0, P2 = tree_batch(B, sampled)
    verdict = get_verifier("exact")(VerifyContext(p, tree), torch.Generator().manual_seed(1))
    out = emitted(tree, verdict, 2)
    # the first emitted token ~ p0
    counts = torch.bincount(out[:, 0], minlength=V).double()
    assert chi2_p(counts, p0) > 1e-3
    # given the first token x, the second ~ P2[x] (rows whose first token was an accepted draft)
    tested = 0
    for x in range(V):
        rows = (verdict.n_accepted >= 1) & (out[:, 0] == x)
        if rows.sum() < 2000:
            continue
        c2 = torch.bincount(out[rows, 1], minlength=V).double()
        assert chi2_p(c2, P2[x]) > 1e-3
        tested += 1
    assert tested >= 1 and (verdict.n_accepted == 2).any()  # the tree is really walked to depth 2


def test_exact_detects_a_wrong_rule():
    """The test has power: accepting by min(1, p/q) on deterministic siblings (EAGLE's shortcut) is biased."""
    B = 200_000
    tree, p, p0, _ = tree_batch(B)
    tree.sampled = "iid"  # top-k siblings verified as if they had been drawn from q
    verdict = get_verifier("exact")(VerifyContext(p, tree), torch.Generator().manual_seed(1))
    counts = torch.bincount(emitted(tree, verdict, 1)[:, 0], minlength=V).double()
    assert chi2_p(counts, p0) < 1e-6


def test_greedy_follows_argmax():
    p = torch.tensor([[[0.1, 0.6, 0.3], [0.7, 0.2, 0.1], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]])
    tree = chain(torch.tensor([[1, 0, 1]]))
    v = get_verifier("greedy")(VerifyContext(p, tree), torch.Generator())
    # root argmax 1 == draft 1 (accept); at node 0 argmax 0 == draft 0 (accept); at node 1 argmax 2 != draft 1
    assert v.n_accepted.tolist() == [2] and v.path[0, :2].tolist() == [0, 1] and v.next_token.tolist() == [2]
    with pytest.raises(ValueError, match="unknown verifier"):
        get_verifier("optimistic")


def test_lantern_boost_budgets():
    from lisa.decoding.verify import lantern_boost

    r = torch.tensor([[0.4, 0.05, 0.1, 0.2, 0.25]])
    nn = torch.tensor([[1, 2, 3, 4]] * 5)  # code 0's neighbours in order 1, 2, 3, 4
    boosted, absorbed = lantern_boost(r, torch.tensor([0]), nn, k=4, delta=0.2)  # absolute: 0.05 + 0.1 <= 0.2
    assert absorbed.tolist() == [[True, True, False, False]] and boosted.item() == pytest.approx(0.55)
    boosted, absorbed = lantern_boost(r, torch.tensor([0]), nn, k=4, delta=2.0)  # relative: <= 1.0 * 0.4
    assert absorbed.tolist() == [[True, True, True, False]] and boosted.item() == pytest.approx(0.75)


def test_lantern_relaxes_towards_neighbours():
    """With delta = 0, lantern is exact; with a budget it accepts more, and its output distribution moves mass
    from the neighbours of drafted tokens onto the drafts (measured, not assumed)."""
    from lisa.decoding.verify import Geometry

    B = 100_000
    tree, p, p0, _ = tree_batch(B)
    codebook = torch.randn(V, 4, generator=torch.Generator().manual_seed(5))
    geo = Geometry.from_codebook(codebook, k=V - 1)
    g = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    strict = get_verifier("lantern")(VerifyContext(p, tree, geometry=geo, options={"k": 3, "delta": 0.0}), g())
    relaxed = get_verifier("lantern")(VerifyContext(p, tree, geometry=geo, options={"k": 3, "delta": 0.3}), g())
    assert chi2_p(torch.bincount(emitted(tree, strict, 1)[:, 0], minlength=V), p0) > 1e-3
    assert relaxed.n_accepted.float().mean() > strict.n_accepted.float().mean() + 0.05
    with pytest.raises(ValueError, match="geometry"):
        get_verifier("lantern")(VerifyContext(p, tree), g())


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_unknown_option_is_an_error_naming_it(name):
    """Every verifier checks its options against its options type: a typo names the verifier, the key and the
    keys it allows; the verifier itself refuses it too."""
    allowed = sorted(option_keys(VERIFIERS[name].options))
    with pytest.raises(ValueError, match=rf"verifier '{name}': unknown options \['kk'\]; allowed: .*{'.*'.join(allowed)}"):
        verifier_options(name, {"kk": 1.0})
    tree, p, _, _ = tree_batch(4)
    with pytest.raises(ValueError, match="unknown options"):
        get_verifier(name)(VerifyContext(p, tree, logits=p.log(), geometry=Geometry.from_codebook(torch.randn(V, 3), 4),
                                         options={"kk": 1.0}), torch.Generator())


def test_option_defaults_and_types():
    """The defaults live in the options types (as they were in the verifiers); integer knobs refuse fractions."""
    assert verifier_options("lantern") == LanternOptions(k=5, delta=0.1)
    assert verifier_options("gsd", {"dist": 1}) == GSDOptions(rank_window=7, prob_gap=0.15, dist=1.0)
    o = verifier_options("gasv", {"lambda": 2, "k": 4.0})
    assert (o.kappa, o.lambda_, o.a_kappa, o.a_lambda, o.k, o.eps) == (1.0, 2.0, 1.0, 1.0, 4, 1e-6)
    assert isinstance(o.k, int)
    with pytest.raises(ValueError, match="'k' must be an integer"):
        verifier_options("lantern", {"k": 2.5})


def test_verifiers_refuse_drafts_they_have_no_law_for():
    """sjd / gsd assume drafts sampled from tree.q: a top-k tree is refused (it used to be verified as if
    sampled: with p = [.5, .5, 0, 0], q = [.9, .1, 0, 0] and one deterministic child 1, token 1 came out with
    probability 1). Sampled drafts without q are refused by every verifier; gsd refuses siblings."""
    from lisa.decoding.generate import SpecConfig

    p = torch.tensor([[[0.5, 0.5, 0, 0], [0.25] * 4]])
    q = torch.tensor([[[0.9, 0.1, 0, 0], [0.25] * 4]])
    det = chain(torch.tensor([[1]]), q=q)
    geo = Geometry.from_codebook(torch.randn(4, 3), k=2)
    for name in ("sjd", "gsd"):
        with pytest.raises(ValueError, match="deterministic"):
            get_verifier(name)(VerifyContext(p, det, geometry=geo), torch.Generator())
    for name in ("exact", "greedy", "sjd"):
        with pytest.raises(ValueError, match="tree.q"):
            get_verifier(name)(VerifyContext(p, chain(torch.tensor([[1]]), sampled="iid")), torch.Generator())
    tree, pt, _, _ = tree_batch(4, "iid")
    with pytest.raises(ValueError, match="chains"):
        get_verifier("gsd")(VerifyContext(pt, tree, geometry=Geometry.from_codebook(torch.randn(V, 3), k=2)),
                            torch.Generator())
    with pytest.raises(ValueError, match="Jacobi"):
        SpecConfig("sjd")
    with pytest.raises(ValueError, match="shape fixed"):
        SpecConfig("exact", "dynamic", draft="sample")
    with pytest.raises(ValueError, match="branching"):
        SpecConfig("exact", "dynamic", branching=(2, 1))
    with pytest.raises(ValueError, match="draft"):
        SpecConfig("exact", "chain", draft="beam")
    s = SpecConfig("exact", "dynamic", draft="sample", branching=(3, 2, 1, 1))
    assert s.nodes == s.drafted_pairs == 21 and "sampled (wor)" in s.describe()
    assert SpecConfig("exact", "chain", depth=5, draft="sample", siblings="iid").nodes == 5


@pytest.mark.parametrize("budget", [None, 0.05])
def test_transport_moves_mass_along_edges_as_defined(budget):
    """transport's three sparse products equal its definition edge by edge: v asks each neighbour u for the share
    min(want(v), d(v), avail(v)) / avail(v) of u's excess, a code asked for more than its excess gives pro rata,
    the budget scales every flow; mass is conserved and acceptance sum_x min(r~, q) rises by the mass moved."""
    from lisa.decoding.verify import neighbour_edges, transport

    g = torch.Generator().manual_seed(0)
    B, Vt, k = 3, 12, 4
    r = torch.softmax(3 * torch.randn(B, Vt, generator=g), -1)
    r[0, 5] = 0.0  # outside r's support: never receives
    r = r / r.sum(-1, keepdim=True)
    q = torch.softmax(2 * torch.randn(B, Vt, generator=g), -1)
    table = torch.stack([torch.randperm(Vt, generator=g)[:k] for _ in range(Vt)])
    table[1, 1] = table[1, 0]  # a repeated neighbour counts twice
    want = torch.rand(B, Vt, generator=g)
    ref = r.double().clone()
    for b in range(B):
        e = (r[b] - q[b]).clamp(min=0).double()
        w = torch.minimum(want[b].double(), torch.where(r[b] > 0, (q[b] - r[b]).clamp(min=0), 0.0).double())
        req = torch.zeros(Vt, k, dtype=torch.float64)
        for v in range(Vt):
            avail = sum(e[u] for u in table[v])
            if avail > 0:
                for j, u in enumerate(table[v]):
                    req[v, j] = e[u] * min(w[v], avail) / avail
        asked = torch.zeros(Vt, dtype=torch.float64).index_add_(0, table.flatten(), req.flatten())
        give = torch.where(asked > e, e / asked.clamp(min=1e-300), torch.ones_like(e))
        flow = req * give[table]
        if budget is not None and flow.sum() > budget:
            flow = flow * budget / flow.sum()
        ref[b] += flow.sum(-1)
        ref[b].index_add_(0, table.flatten(), -flow.flatten())
    out = transport(r, q, neighbour_edges(table), want, budget)
    assert torch.allclose(out.double(), ref, atol=1e-6)
    assert torch.allclose(out.sum(-1), torch.ones(B), atol=1e-6) and (out >= -1e-7).all() and out[0, 5] == 0
    moved = 0.5 * (out - r).abs().sum(-1)
    gain = torch.minimum(out, q).sum(-1) - torch.minimum(r, q).sum(-1)
    assert torch.allclose(gain, moved, atol=1e-6) and (moved > 0).all()
    if budget is not None:
        assert (moved <= budget + 1e-6).all()


def jacobi_chain(B, D=3, seed=0):
    """A Jacobi-style chain of i.i.d. drafts: node i drawn from Q[i], the target p at its parent a function of the
    token drafted before it (so acceptance depends on the path), an empty-residual level (p = q) included."""
    from lisa.decoding.tree import tree_shape
    g = torch.Generator().manual_seed(seed)
    Q = (2 * torch.rand(D + 1, V, generator=g)).softmax(-1)
    P = (2 * torch.rand(V, V, generator=g)).softmax(-1)
    P[2] = Q[2]  # after token 2 the target equals the next node's law: nothing is ever rejected there
    tokens = torch.stack([torch.multinomial(Q[i], B, replacement=True, generator=g) for i in range(D)], 1)
    p = torch.cat([P[0].expand(B, 1, V), P[tokens]], 1)  # row 0: the root's target, row i + 1: P[x_i]
    q = Q.expand(B, D + 1, V)
    shape = tree_shape([(0,) * d for d in range(1, D + 1)])
    tree = Tree(tokens, shape.parents.expand(B, D), shape.depth.expand(B, D), torch.zeros(B, D), q, "iid", shape)
    return tree, p


def test_chain_walk_equals_the_level_by_level_walk():
    """walk_chain (every level at once, sjd / scd-mc's windows) has walk_sampled's law: the same measured law and
    TV at every node, and the same joint law of (accepted length, emitted tokens) over 200k windows."""
    from lisa.decoding.verify import walk_chain, walk_sampled
    B, D = 200_000, 3
    tree, p = jacobi_chain(B, D)
    a = walk_chain(VerifyContext(p, tree, measure=True), torch.Generator().manual_seed(1))
    b = walk_sampled(VerifyContext(p, tree, measure=True), torch.Generator().manual_seed(2))
    torch.testing.assert_close(a.tv[:, 0], b.tv[:, 0])  # every row stands on the root
    both = ~a.tv.isnan() & ~b.tv.isnan()
    torch.testing.assert_close(a.tv[both], b.tv[both], atol=1e-6, rtol=0)
    assert (a.n_accepted == D).any() and (a.n_accepted == 0).any()
    key = lambda v: (v.n_accepted * V + v.next_token).bincount(minlength=(D + 1) * V).double()  # (m, next token)
    ca, cb = key(a), key(b)
    seen = (ca + cb) > 0
    assert chi2_contingency(torch.stack([ca[seen], cb[seen]]).numpy()).pvalue > 1e-4  # two samples, one law
    assert chi2_p(torch.bincount(emitted(tree, a, 1)[:, 0], minlength=V), p[0, 0]) > 1e-3  # the first token ~ p


def test_jacobi_verifiers_take_the_chain_walk_on_chains_only():
    """sjd / scd-mc walk a chain window all at once and a tree window (sjd-pac's) level by level."""
    from lisa.decoding import verify
    tree, p = jacobi_chain(64)
    calls = []
    orig = verify.walk_chain, verify.walk_sampled
    try:
        verify.walk_chain = lambda ctx, g: calls.append("chain") or orig[0](ctx, g)
        verify.walk_sampled = lambda ctx, g, *a, **k: calls.append("levels") or orig[1](ctx, g, *a, **k)
        get_verifier("scd-mc")(VerifyContext(p, tree), torch.Generator())
        wide, pw, *_ = tree_batch(64, "wor")
        get_verifier("sjd")(VerifyContext(pw, wide), torch.Generator())
    finally:
        verify.walk_chain, verify.walk_sampled = orig
    assert calls == ["chain", "levels"]
