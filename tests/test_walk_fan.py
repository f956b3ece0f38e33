"""walk_fan (a fan of chains, every chain level at once) gives the level-by-level walk's verdicts bit for bit from
the same generator, and leaves the generator where that walk does; exact through it keeps the target's law."""
import pytest
import torch

from lisa.decoding import walk
from lisa.decoding.tree import Tree, draw_siblings, tree_shape
from lisa.decoding.verify import Geometry, VerifyContext, get_verifier
from tests.test_calibrate import ctx_for, tiny_calibration
from tests.test_verify import V, chi2_p, emitted


def fan_tree(B, k, D, scheme, seed=0, narrow=False):
    """k chains of depth D under the root: the root's children drawn from q0 (i.i.d. or without replacement),
    each chain node's child from Q[its token]; the target p0 at the root and P[token] at a node. narrow: q0 has
    two tokens of support, so a third sibling drawn without replacement has an empty q."""
    g = torch.Generator().manual_seed(seed)
    p0, q0 = torch.rand(V, generator=g).softmax(-1), (2 * torch.rand(V, generator=g)).softmax(-1)
    P, Q = (2 * torch.rand(V, V, generator=g)).softmax(-1), (2 * torch.rand(V, V, generator=g)).softmax(-1)
    P[1] = Q[1]  # after token 1 the target is the next node's law: an empty residual
    if narrow:
        q0 = torch.zeros(V).index_fill(0, torch.tensor([1, 4]), 0.5)
    shape = tree_shape([(c,) + (0,) * d for c in range(k) for d in range(D)])
    chains = walk.fan_chains(shape)
    tokens = torch.zeros(B, k * D, dtype=torch.long)
    tokens[:, chains[:, 0]] = draw_siblings(q0.expand(B, V), q0.log().expand(B, V), k, scheme, g)
    for d in range(1, D):
        parent = tokens[:, chains[:, d - 1]]  # (B, k)
        tokens[:, chains[:, d]] = torch.multinomial(Q[parent.reshape(-1)], 1, generator=g).view(B, k)
    leaf = torch.zeros(k * D, dtype=torch.bool)
    leaf[chains[:, -1]] = True
    p = torch.cat([p0.expand(B, 1, V), P[tokens]], 1)
    q = torch.cat([q0.expand(B, 1, V), torch.where(leaf[None, :, None], 0.0, Q[tokens])], 1)
    tree = Tree(tokens, shape.parents.expand(B, -1), shape.depth.expand(B, -1), torch.zeros(B, k * D), q, scheme,
                shape)
    return tree, p, p0, P


def contexts(p, tree):
    """One VerifyContext per verifier that walks sampled trees (name -> (verifier name, context))."""
    cal = tiny_calibration()
    geo = Geometry.from_codebook(torch.randn(V, 4, generator=torch.Generator().manual_seed(5)), k=V - 1)
    return {"exact": ("exact", VerifyContext(p, tree)), "greedy": ("greedy", VerifyContext(p, tree)),
            "lantern": ("lantern", VerifyContext(p, tree, geometry=geo, options={"k": 3, "delta": 0.3})),
            "lantern++": ("lantern", VerifyContext(p, tree, geometry=geo, options={"k": 3, "delta": 3.0})),
            "gasv": ("gasv", ctx_for(p, tree, cal, options={"kappa": 4.0, "lambda": 0.2, "k": 5}))}


@pytest.mark.parametrize("scheme", ["iid", "wor"])
@pytest.mark.parametrize("B,k,D,narrow", [(1, 3, 4, False), (7, 4, 3, False), (64, 3, 3, True), (5, 2, 1, False),
                                          (9, 1, 5, False)])
def test_fan_walk_is_the_level_by_level_walk_bit_for_bit(monkeypatch, scheme, B, k, D, narrow):
    tree, p, _, _ = fan_tree(B, k, D, scheme, seed=B + k, narrow=narrow)
    for name, (verifier, ctx) in contexts(p, tree).items():
        out = {}
        for fan in (True, False):
            monkeypatch.setattr(walk, "_use_fan", lambda ctx, relax, fan=fan: fan)
            g = torch.Generator().manual_seed(11)
            runs = [get_verifier(verifier)(ctx, g) for _ in range(5)]  # five rounds in a row: the state carries
            out[fan] = [(v.path, v.n_accepted, v.next_token) for v in runs], g.get_state()
        for a, b in zip(out[True][0], out[False][0]):
            for x, y in zip(a, b):
                assert torch.equal(x, y), name
        assert torch.equal(out[True][1], out[False][1]), name  # the generator left in the same state
        if D > 1 and B > 1 and name == "exact":
            assert any((v[1] >= 2).any() for v in out[True][0]), name  # chains really walked


def test_fan_walk_keeps_the_target_distribution(monkeypatch):
    """exact through walk_fan, 200k rows: the first emitted token ~ p0, the second ~ P[first] after an accepted
    draft."""
    monkeypatch.setattr(walk, "_use_fan", lambda ctx, relax: True)
    B = 200_000
    tree, p, p0, P = fan_tree(B, 3, 3, "wor", seed=3)
    verdict = get_verifier("exact")(VerifyContext(p, tree), torch.Generator().manual_seed(1))
    out = emitted(tree, verdict, 2)
    assert chi2_p(torch.bincount(out[:, 0], minlength=V).double(), p0) > 1e-3
    tested = 0
    for x in range(V):
        rows = (verdict.n_accepted >= 1) & (out[:, 0] == x)
        if rows.sum() >= 2000:
            assert chi2_p(torch.bincount(out[rows, 1], minlength=V).double(), P[x]) > 1e-3
            tested += 1
    assert tested >= 2 and (verdict.n_accepted == 3).any()


def test_fan_chains_only_for_fans():
    assert walk.fan_chains(tree_shape([(0,), (1,), (0, 0), (1, 0)])).tolist() == [[0, 2], [1, 3]]
    assert walk.fan_chains(tree_shape([(0,), (0, 0), (0, 1)])) is None  # a sibling below the root
    assert walk.fan_chains(tree_shape([(0,), (1,), (0, 0)])) is None  # chains of unequal depth
