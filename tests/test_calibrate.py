"""GASV's calibration (artifact, refusals, re-calibration trigger), the GASV verifier, and the measured relaxation:
the TV the walk computes is the TV of what it really samples (checked against 2e5 draws)."""
import json
import math
import os

import pytest
import torch

from lisa.training.cache import CacheSpec, open_cache, write_cache, write_manifest
from lisa.training.calibrate import Calibration, CalibrateConfig, CalibrationError, calibrate, load_calibration, save_calibration
from lisa.checkpoint import file_sha256
from lisa.decoding.tree import Tree, chain
from lisa.decoding.verify import Geometry, VerifyContext, get_verifier, neighbour_table
from tests.helpers import micro_gpt
from tests.test_verify import V, emitted, tree_batch

SHA = "cd" * 32


def tiny_calibration(seed=0, D=4, C=2) -> Calibration:
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(V, D, generator=g)
    cluster = torch.arange(V) % C
    return Calibration(torch.ones(D), head, (head * head).sum(-1), cluster, torch.full((C,), 0.5),
                       neighbour_table(torch.randn(V, 3, generator=g), V - 1), 0.4, {})


def ctx_for(p, tree, cal, **kw):
    return VerifyContext(p, tree, logits=p.clamp(min=1e-9).log(), geometry=Geometry(cal.neighbours, None, cal), **kw)


def empirical_tv(first: torch.Tensor, p0: torch.Tensor) -> float:
    freq = torch.bincount(first, minlength=V).double() / len(first)
    return 0.5 * float((freq - p0.double()).abs().sum())


@pytest.mark.parametrize("name,options", [("exact", {}), ("lantern", {"k": 3, "delta": 0.3}),
                                          ("gasv", {"kappa": 1.0, "lambda": 0.5, "k": 3}),
                                          ("gasv", {"kappa": 4.0, "lambda": 0.2, "k": 5})])
def test_measured_tv_is_the_tv_of_what_is_sampled(name, options):
    """Deterministic siblings: the law the walk computes at the root gives the TV of the first emitted token's
    empirical distribution over 2e5 walks (same tree, fresh randomness)."""
    B = 200_000
    tree, p, p0, _ = tree_batch(B)
    v = get_verifier(name)(ctx_for(p, tree, tiny_calibration(), options=options, measure=True),
                           torch.Generator().manual_seed(3))
    tv0 = v.tv[:, 0]
    assert torch.allclose(tv0, tv0[0].expand_as(tv0), atol=1e-5)  # one tree, one law
    emp = empirical_tv(emitted(tree, v, 1)[:, 0], p0)
    assert abs(emp - float(tv0[0])) < 0.006  # sampling error of a TV over 6 tokens at 2e5 draws: ~0.002
    if name == "exact":
        assert float(v.tv.nan_to_num(0).abs().max()) < 1e-5
    else:
        assert float(tv0[0]) > 0.01  # relaxed verifiers really move mass
    assert torch.isnan(v.tv[v.n_accepted == 0, 1:]).all()  # only nodes the walk stood on are measured


@pytest.mark.parametrize("name", ["sjd", "gsd", "gasv"])
def test_measured_tv_over_sampled_drafts(name):
    """Jacobi-style chains (one draft drawn from q per node): the law is taken over the draft too; SJD is exact."""
    from lisa.decoding.verify import Geometry

    B = 200_000
    g = torch.Generator().manual_seed(0)
    p0 = torch.rand(V, generator=g).softmax(-1)
    q0 = (2 * torch.rand(V, generator=g)).softmax(-1)
    drafts = torch.multinomial(q0, B, replacement=True, generator=g)[:, None]
    p1 = (2 * torch.rand(V, V, generator=g)).softmax(-1)[drafts[:, 0]]
    tree = chain(drafts, q=torch.stack([q0.expand(B, V), q0.expand(B, V)], 1), sampled="iid")
    p = torch.stack([p0.expand(B, V), p1], 1)
    cal = tiny_calibration()
    geo = Geometry(cal.neighbours, torch.randn(V, 3, generator=g), cal)
    ctx = VerifyContext(p, tree, logits=p.log(), geometry=geo,
                        options={"gsd": {"dist": 4.0, "prob_gap": 0.3, "rank_window": 2},
                                 "gasv": {"kappa": 1.0, "lambda": 0.5, "k": 3}}.get(name, {}),
                        measure=True)
    v = get_verifier(name)(ctx, torch.Generator().manual_seed(4))
    emp = empirical_tv(emitted(tree, v, 1)[:, 0], p0)
    assert abs(emp - float(v.tv[0, 0])) < 0.006
    if name == "sjd":
        assert float(v.tv[:, 0].abs().max()) < 1e-5
    else:
        assert float(v.tv[0, 0]) > 0.005


@pytest.mark.parametrize("sampled", ["iid", "wor"])
@pytest.mark.parametrize("name,options", [("exact", {}), ("greedy", {}), ("lantern", {"k": 3, "delta": 0.3}),
                                          ("lantern", {"k": 3, "delta": 2.0}),
                                          ("gasv", {"kappa": 1.0, "lambda": 0.5, "k": 3})])
def test_measured_tv_over_sampled_trees(name, options, sampled):
    """Trees whose siblings are drawn from q (3 at the root, i.i.d. or without replacement): the law the walk
    reports is over the drafts and the verifier's randomness, the same in every row, and matches the empirical
    law of the first emitted token over 2e5 rows (each with its own draws)."""
    B = 200_000
    tree, p, p0, _ = tree_batch(B, sampled)
    v = get_verifier(name)(ctx_for(p, tree, tiny_calibration(), options=options, measure=True),
                           torch.Generator().manual_seed(3))
    tv0 = v.tv[:, 0]
    assert not torch.isnan(tv0).any() and torch.allclose(tv0, tv0[0].expand_as(tv0), atol=1e-5)
    emp = empirical_tv(emitted(tree, v, 1)[:, 0], p0)
    assert abs(emp - float(tv0[0])) < 0.006
    deeper = v.tv[v.n_accepted >= 1, 1]
    assert not torch.isnan(deeper).any()  # the node below an accepted child is measured too
    if name == "exact":
        assert float(v.tv.nan_to_num(0).abs().max()) < 1e-5
    else:
        assert float(tv0[0]) > 0.01
    if name in ("lantern", "gasv"):  # relaxing toward q only ever raises acceptance
        ex = get_verifier("exact")(VerifyContext(p, tree), torch.Generator().manual_seed(3))
        assert v.n_accepted.float().mean() > ex.n_accepted.float().mean() + 0.01


def test_gasv_knobs():
    """kappa = 0, lambda huge, k = 0: no mass moves and GASV is `exact` draw for draw; kappa up -> longer
    acceptance and more TV; lambda up -> stricter."""
    B = 50_000
    tree, p, _, _ = tree_batch(B)
    cal = tiny_calibration()

    def run(**o):
        return get_verifier("gasv")(ctx_for(p, tree, cal, options=o, measure=True), torch.Generator().manual_seed(5))

    ex = get_verifier("exact")(VerifyContext(p, tree, measure=True), torch.Generator().manual_seed(5))
    off = run(kappa=0.0, **{"lambda": 1e9}, k=0)
    assert torch.equal(off.n_accepted, ex.n_accepted) and torch.equal(off.next_token, ex.next_token)
    taus = [run(kappa=k, **{"lambda": 1e9}, k=4).n_accepted.float().mean().item() for k in (0.0, 0.5, 2.0, 8.0)]
    assert taus == sorted(taus) and taus[-1] > taus[0] + 0.05
    strict = run(kappa=0.0, **{"lambda": 2.0}, k=4).n_accepted.float().mean().item()
    loose = run(kappa=0.0, **{"lambda": 0.05}, k=4).n_accepted.float().mean().item()
    assert loose > strict
    with pytest.raises(ValueError, match="calibration"):
        get_verifier("gasv")(VerifyContext(p, tree, logits=p.log()), torch.Generator())
    with pytest.raises(ValueError, match="unknown options"):
        run(kapa=1.0)


@pytest.mark.parametrize("sampled", [None, "wor"])
def test_gasv_never_emits_outside_the_targets_support(sampled):
    """After top-k the target gives some codes probability 0; GASV at its loosest (g = 1 everywhere) still never
    accepts or emits one, on top-k trees (a draft of p = 0 takes no neighbour mass) and sampled trees (transport
    stays inside p's support), while it does move mass on the top-k tree (TV > 0)."""
    B = 100_000
    tree, p, p0, _ = tree_batch(B, sampled)
    top = p.topk(3, dim=-1).indices
    p = torch.zeros_like(p).scatter(-1, top, p.gather(-1, top))  # top-3 of 6 at every node
    p = p / p.sum(-1, keepdim=True)
    dead = p[:, 0] == 0
    assert dead.gather(1, tree.tokens[:, :3]).any()  # some root drafts lie outside the support
    v = get_verifier("gasv")(ctx_for(p, tree, tiny_calibration(), options={"kappa": 1e6, "lambda": 1e-9, "k": 5},
                                     measure=True), torch.Generator().manual_seed(3))
    first = emitted(tree, v, 1)[:, 0]
    assert not dead.gather(1, first[:, None]).any()
    nodes = torch.cat([torch.zeros(B, 1, dtype=torch.long), v.path.clamp(min=0) + 1], 1)  # the nodes walked
    for i in range(v.path.shape[1]):
        ok = v.n_accepted > i
        tok = tree.tokens.gather(1, v.path[:, i : i + 1].clamp(min=0)).squeeze(1)
        at = p[torch.arange(B), nodes[:, i]].gather(1, tok[:, None]).squeeze(1)
        assert (at[ok] > 0).all()
    if sampled is None:  # (on this sampled tree no code of the support has a deficit to q: nothing to move)
        assert float(v.tv[:, 0].nan_to_num(0).max()) > 0.01


def test_gasv_in_speculative_decoding_with_cfg_and_batch():
    from lisa.training.drafter import new_drafter
    from lisa.decoding.generate import SpecConfig, speculative_generate
    from lisa.decoding.sampling import SamplingConfig

    torch.manual_seed(0)
    target = micro_gpt()
    drafter = new_drafter(target).eval()
    W = target.output.weight.detach()
    cal = Calibration(torch.ones(W.shape[1]), W, (W * W).sum(-1), torch.arange(64) % 4, torch.full((4,), 0.3),
                      neighbour_table(torch.randn(64, 8), 8), 0.4, {})
    geo = Geometry(cal.neighbours, None, cal)
    s = SamplingConfig(1.0, 16, 0.9, 2.0)
    for method in ("exact", "gasv"):
        tokens, st = speculative_generate(target, drafter, torch.tensor([1, 2, 3]), s, SpecConfig(method, "dynamic", 3, 2, 5),
                                          torch.Generator().manual_seed(0), geometry=geo,
                                          options={"kappa": 1.0, "lambda": 0.5, "k": 4} if method == "gasv" else {},
                                          measure=True)
        assert tokens.shape == (3, 16) and st["tv"].shape == (3, 16) and not torch.isnan(st["tv"]).any()
        assert (st["tv"][:, 0] == 0).all()
        if method == "exact":
            assert float(st["tv"].max()) < 1e-5
        else:
            assert float(st["tv"].max()) > 0


def build_cache(tmp_path):
    torch.manual_seed(0)
    target = micro_gpt()
    g = torch.Generator().manual_seed(0)
    tokens, cond = torch.randint(0, 64, (40, 16), generator=g), torch.randint(0, 10, (40,), generator=g)
    spec = CacheSpec(K=8, shard_size=16, batch_size=8, uncond_every=4)
    write_cache(target, SHA, tokens, cond, spec, tmp_path / "cache", progress=False)
    write_manifest(tmp_path / "cache", SHA, spec, len(tokens), tokens.shape[1])
    return target, open_cache(tmp_path / "cache", SHA)


def test_calibration_artifact_and_refusals(tmp_path):
    target, lc = build_cache(tmp_path)
    codebook = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    cfg = CalibrateConfig(clusters=4, min_count=16, positions=10_000, neighbours=8)
    cal = calibrate(target.output.weight, codebook, lc, cfg, {"target": "t.safetensors", "target_sha256": SHA})
    assert cal.cluster.shape == (64,) and set(cal.cluster.tolist()) == {0, 1, 2, 3}
    assert (cal.beta > 0).all() and cal.neighbours.shape == (64, 8)
    assert abs(cal.meta["share_within_budget"] - cfg.budget_quantile) < 0.05  # beta_c is that quantile per cluster
    assert cal.meta["positions"] == 40 * 16  # the conditional passes only (every 4th also has an unconditional one)
    W = target.output.weight.detach()
    assert torch.allclose(cal.invstd, 1 / W.std(0))
    meta = save_calibration(cal, tmp_path / "cal")
    path = tmp_path / "cal" / "calibration.safetensors"
    again = load_calibration(path, target.output.weight, SHA)
    assert torch.equal(again.cluster, cal.cluster) and torch.allclose(again.head, cal.head)
    assert again.looseness_ref == pytest.approx(cal.looseness_ref) and meta["sha256"] == file_sha256(path)
    with pytest.raises(CalibrationError, match=f"made for target {SHA}.*sha256 {'ef' * 32}"):
        load_calibration(path, target.output.weight, "ef" * 32)
    with pytest.raises(CalibrationError, match="head"):
        load_calibration(path, torch.randn(64, 5), SHA)
    with pytest.raises(CalibrationError, match="no calibration"):
        load_calibration(tmp_path / "nothing.safetensors", target.output.weight)
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    with pytest.raises(CalibrationError, match="changed after calibration"):
        load_calibration(path, target.output.weight, SHA)


def test_recalibration_trigger_is_content_not_mtime(tmp_path):
    from lisa.stages.drafter import needs_recalibration

    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(b"weights v1")
    cal = tmp_path / "cal"
    assert "no calibration" in needs_recalibration(ckpt, cal)
    cal.mkdir()
    (cal / "calibration.json").write_text(json.dumps({"made_from": {"target_sha256": file_sha256(ckpt)}}))
    assert needs_recalibration(ckpt, cal) is None
    os.utime(ckpt, (1e9, 1e9))  # a touch
    assert needs_recalibration(ckpt, cal) is None
    ckpt.write_bytes(b"weights v2")
    assert "calibration was made for" in needs_recalibration(ckpt, cal)


def test_gasv_scores_follow_the_definition():
    """g = max(g_geo, g_clu) by hand for one node (a_kappa = a_lambda = 0: the knobs act as set)."""
    from lisa.decoding.verify import gasv_scores

    cal = tiny_calibration()
    logits = torch.tensor([[[2.0, 1.5, 0.0, -1.0, 0.5, 1.0]]])
    p = logits.softmax(-1)
    g = gasv_scores(logits, p, cal, kappa=0.7, lam=0.9, a_kappa=0.0, a_lambda=0.0, eps=1e-6)[0, 0]
    i = 0
    for v in range(V):
        drift = (logits[0, 0, i] - logits[0, 0, v]) / ((cal.head[i] - cal.head[v]).norm() + 1e-6)
        g_geo = 1.0 if drift == 0 else min(1.0, 0.7 * 0.5 / float(drift))
        mass = float(p[0, 0][cal.cluster == cal.cluster[v]].sum())
        assert g[v].item() == pytest.approx(max(g_geo, min(1.0, mass / 0.9)), rel=1e-4)
    assert math.isclose(g[i].item(), 1.0)
