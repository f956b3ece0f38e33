"""Baseline drafter training: the TTT mask mirrors drafting, training learns, resume is exact, and a drafter
refuses a target it was not trained against."""
import pytest
import torch

from lisa.config import TrainDrafterParams
from lisa.training.drafter import new_drafter, train_drafter, ttt_mask
from lisa.decoding.generate import generate
from lisa.decoding.sampling import SamplingConfig
from tests.helpers import micro_gpt


def test_ttt_mask_is_the_drafting_mask():
    m = ttt_mask(T=5, steps=3)
    idx = lambda s, j: s * 5 + j  # noqa: E731
    # step 2, pair 4: committed pairs 0..2 (step 0), its chain: step 1 pair 3, itself
    seen = {(k // 5, k % 5) for k in m[idx(2, 4)].nonzero().flatten().tolist()}
    assert seen == {(0, 0), (0, 1), (0, 2), (1, 3), (2, 4)}
    assert m[idx(0, 3)].nonzero().flatten().tolist() == [0, 1, 2, 3]  # step 0 is causal
    assert m.any(-1).all()


def data(target, n=64):
    cond = torch.randint(0, 10, (n,))
    tokens, _ = generate(target, cond, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    return tokens, cond


def test_training_learns_and_resumes(tmp_path):
    torch.manual_seed(0)
    target = micro_gpt(vocab_size=16)
    with torch.no_grad():
        target.output.weight.mul_(30)  # peaked next-token distributions: something to learn
    tokens, cond = data(target)
    cfg = TrainDrafterParams(steps=40, batch_size=16, lr=3e-3, warmup=2, checkpoint_every=20, eval_batch_size=32,
                             ttt_steps=3)
    torch.manual_seed(0)
    fresh = new_drafter(target)
    from lisa.training.drafter import heldout_ttt

    before = heldout_ttt(fresh, target, tokens[:32], cond[:32], cfg)
    torch.manual_seed(0)
    a = new_drafter(target)
    m = train_drafter(a, target, tokens, cond, tokens[:32], cond[:32], cfg, tmp_path / "a", progress=False)
    assert len(m["heldout_soft_ce"]) == 3 and m["heldout_soft_ce"][0] < before["heldout_soft_ce"][0] - 0.1
    assert m["heldout_top1_agreement"][0] > before["heldout_top1_agreement"][0]
    assert not a.tok_embeddings.weight.requires_grad  # the target's embedding, frozen
    # a run killed after 20 steps resumes to the same weights
    half = TrainDrafterParams(**{**cfg.__dict__})
    torch.manual_seed(0)
    b = new_drafter(target)
    import lisa.training.drafter as dt

    orig, calls = dt.save_resume, []

    def die_after_first(*args, **kw):
        orig(*args, **kw)
        calls.append(1)
        raise KeyboardInterrupt

    dt.save_resume = die_after_first
    with pytest.raises(KeyboardInterrupt):
        train_drafter(b, target, tokens, cond, tokens[:32], cond[:32], half, tmp_path / "b", progress=False)
    dt.save_resume = orig
    torch.manual_seed(0)
    b = new_drafter(target)
    train_drafter(b, target, tokens, cond, tokens[:32], cond[:32], half, tmp_path / "b", progress=False)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(va, vb, rtol=0, atol=0, msg=k)


def test_drafter_artifact_checks_its_target(tmp_path):
    from lisa.checkpoint import CheckpointError, save_artifact
    from lisa.models.llamagen import load_drafter

    target = micro_gpt()
    d = new_drafter(target)
    save_artifact(d, tmp_path / "drafter.safetensors", "drafter", d.config, made_from={"target_sha256": "abc"})
    back, meta = load_drafter(tmp_path / "drafter.safetensors", {"sha256": "abc"})
    torch.testing.assert_close(back.fc.weight, d.fc.weight)
    with pytest.raises(CheckpointError, match="trained against target abc.*`lisa train-drafter"):
        load_drafter(tmp_path / "drafter.safetensors", {"sha256": "def"})
    save_artifact(d, tmp_path / "lid.safetensors", "drafter", d.config,  # ablate-lid's: the stage to re-run
                  made_from={"target_sha256": "abc", "loss": "lid"})
    with pytest.raises(CheckpointError, match="`lisa ablate-lid --world W`"):
        load_drafter(tmp_path / "lid.safetensors", {"sha256": "def"})


def test_taps_only_forward_matches_the_full_one():
    torch.manual_seed(0)
    target = micro_gpt()
    tokens, cond = torch.randint(0, 64, (3, 16)), torch.tensor([1, 2, 3])
    full = target.teacher_forced(cond, tokens, taps=(0, 1))
    part = target.teacher_forced(cond, tokens, taps=(0, 1), logits=False)
    assert part.logits is None and all(torch.equal(a, b) for a, b in zip(full.hidden, part.hidden))


@pytest.mark.parametrize("loss", ["cached-soft-ce", "lid"])
def test_training_from_a_logit_cache_learns(tmp_path, loss):
    """Labels from the Parquet logit cache (top-K), target run up to its highest tap: the baseline loss and
    LISA's LID both teach the drafter the target."""
    from lisa.training.distill import LIDConfig
    from lisa.training.drafter import heldout_ttt

    target = peaked_target()
    tokens, cond = data(target)
    cache = micro_cache(tmp_path, target, tokens, cond)
    cfg = TrainDrafterParams(steps=40, batch_size=16, lr=3e-3, warmup=2, checkpoint_every=40, eval_batch_size=32,
                             ttt_steps=2)
    torch.manual_seed(0)
    before = heldout_ttt(new_drafter(target), target, tokens[:32], cond[:32], cfg)
    torch.manual_seed(0)
    d = new_drafter(target)
    lid = (torch.randn(16, 4), LIDConfig(top_kc=4, joint_k=4, veto_steps=20)) if loss == "lid" else None
    m = train_drafter(d, target, tokens, cond, tokens[:32], cond[:32], cfg, tmp_path / "w", progress=False,
                      cache=cache, lid=lid)
    assert m["heldout_soft_ce"][0] < before["heldout_soft_ce"][0] - 0.1
    assert m["heldout_top1_agreement"][0] > before["heldout_top1_agreement"][0]


def micro_cache(tmp_path, target, tokens, cond):
    """A logit cache of the target over (tokens, cond): top-8, every 10th sequence also unconditional."""
    from lisa.training.cache import CacheSpec, open_cache, write_cache, write_manifest

    spec = CacheSpec(K=8, shard_size=32, batch_size=16, uncond_every=10)
    write_cache(target, "t" * 64, tokens, cond, spec, tmp_path / "cache", progress=False)
    write_manifest(tmp_path / "cache", "t" * 64, spec, len(tokens), tokens.shape[1])
    return open_cache(tmp_path / "cache", "t" * 64)


def peaked_target():
    torch.manual_seed(0)
    target = micro_gpt(vocab_size=16)
    with torch.no_grad():
        target.output.weight.mul_(30)
    return target


def trained(target, tokens, cond, work, **over):
    cfg = TrainDrafterParams(**({"steps": 6, "batch_size": 8, "lr": 3e-3, "warmup": 2, "checkpoint_every": 3,
                                 "eval_batch_size": 32, "ttt_steps": 2, "eval_every": 3, "eval_sequences": 8,
                                 "eval_topk": 2} | over))
    torch.manual_seed(0)
    d = new_drafter(target)
    m = train_drafter(d, target, tokens, cond, tokens[:16], cond[:16], cfg, work, progress=False, curves=work / "curves")
    return d, m


def test_gradient_accumulation_computes_the_same_step(tmp_path):
    """grad_accum 2 / 4 split each step's batch into micro-batches: the same weights as one batch."""
    target = peaked_target()
    tokens, cond = data(target, n=32)
    ref, _ = trained(target, tokens, cond, tmp_path / "one")
    for k in (2, 4):
        d, m = trained(target, tokens, cond, tmp_path / f"acc{k}", grad_accum=k)
        assert m["grad_accum"] == k
        for (name, a), b in zip(ref.state_dict().items(), d.state_dict().values()):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="not divisible"):
        trained(target, tokens, cond, tmp_path / "bad", grad_accum=3)


def test_curves_are_written_and_survive_a_resume(tmp_path):
    import pandas as pd

    import lisa.training.drafter as dt

    target = peaked_target()
    tokens, cond = data(target, n=32)
    trained(target, tokens, cond, tmp_path / "clean")
    orig = dt.save_resume

    def die(*args, **kw):
        orig(*args, **kw)
        raise KeyboardInterrupt

    dt.save_resume = die
    try:
        with pytest.raises(KeyboardInterrupt):
            trained(target, tokens, cond, tmp_path / "killed")
    finally:
        dt.save_resume = orig
    trained(target, tokens, cond, tmp_path / "killed")  # resumes at step 3
    for name in ("train.csv", "heldout.csv"):
        a = pd.read_csv(tmp_path / "clean" / "curves" / name)
        b = pd.read_csv(tmp_path / "killed" / "curves" / name)
        pd.testing.assert_frame_equal(a, b)
    train = pd.read_csv(tmp_path / "clean" / "curves" / "train.csv")
    held = pd.read_csv(tmp_path / "clean" / "curves" / "heldout.csv")
    assert train["step"].tolist() == [1, 2, 3, 4, 5, 6] and {"loss", "top1_s0", "loss_s1"} <= set(train.columns)
    assert held["step"].tolist() == [3, 6] and ((held["heldout_topk_mass_s0"] > 0) & (held["heldout_topk_mass_s0"] <= 1)).all()


def test_bf16_autocast_trains(tmp_path):
    target = peaked_target()
    tokens, cond = data(target, n=32)
    d, m = trained(target, tokens, cond, tmp_path, precision="bf16", steps=4)
    assert m["precision"] == "bfloat16" and all(torch.isfinite(p).all() for p in d.parameters())
    assert next(d.parameters()).dtype == torch.float32  # autocast: fp32 master weights


def test_heldout_topk_mass_is_the_exact_acceptance_of_k_children():
    """heldout_topk_mass at TTT step 0 = sum of the target's probabilities over the drafter's top-k."""
    from lisa.training.drafter import heldout_ttt, target_features

    target = peaked_target()
    tokens, cond = data(target, n=8)
    torch.manual_seed(0)
    d = new_drafter(target)
    cfg = TrainDrafterParams(ttt_steps=1, eval_batch_size=8, eval_topk=3)
    m = heldout_ttt(d, target, tokens, cond, cfg)
    hidden, p = target_features(target, cond, tokens, None, tuple(d.config.taps))
    from lisa.training.drafter import ttt_losses

    seen = []
    ttt_losses(d, hidden, p, tokens, 1, target.config.cls_token_num,
               lambda tp, logits: seen.append(tp.gather(-1, logits.topk(3, -1).indices).sum(-1).mean()) or
               tp.sum(-1))
    assert m["heldout_topk_mass"][0] == pytest.approx(seen[0].item(), rel=1e-5)


def test_incremental_ttt_is_the_concatenated_one():
    # step s over its own pairs, attending the earlier steps' keys / values, = step s over the concatenation of
    # steps 0..s: the same losses and agreement, the same gradients up to float summation order
    from lisa.training.drafter import target_features, ttt_losses

    target = peaked_target()
    tokens, cond = data(target, n=6)
    torch.manual_seed(0)
    d = new_drafter(target)
    hidden, p = target_features(target, cond, tokens, None, tuple(d.config.taps))
    runs = {}
    for incremental in (False, True):
        d.zero_grad()
        losses = ttt_losses(d, hidden, p, tokens, 3, target.config.cls_token_num, incremental=incremental)
        sum(0.8**s * l for s, l in enumerate(losses)).backward()
        runs[incremental] = (torch.stack(losses).detach(), list(d.last_acc),
                             {n: q.grad.clone() for n, q in d.named_parameters() if q.grad is not None})
    (l0, a0, g0), (l1, a1, g1) = runs[False], runs[True]
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    assert a1 == a0 and g1.keys() == g0.keys() and len(g0) > 5
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_guided_loss_ends():
    """The CFG-aware loss: weight 0 is each row's own loss; at cfg_scale 1 the guided distributions are the
    conditional ones, so its guided term is the conditional row's soft CE, counted on both rows of the pair."""
    from lisa.training.drafter import (GuidedTargets, cached_soft_ce, cached_targets, guided_loss_fn, guided_probs,
                                       soft_ce)

    torch.manual_seed(0)
    B, T, V = 3, 5, 16
    target_logits, logits = torch.randn(2 * B, T, V) * 3, torch.randn(2 * B, T, V)
    for scale in (1.0, 4.0):
        s = SamplingConfig(temperature=1.0, cfg_scale=scale)
        t = GuidedTargets(cached_targets(target_logits, V), guided_probs(target_logits, s))
        own = cached_soft_ce(t.halves, logits)
        assert torch.allclose(guided_loss_fn(cached_soft_ce, s, 0.0)(t, logits), own)
        g = guided_loss_fn(cached_soft_ce, s, 1.0)(t, logits)
        assert torch.allclose(g[:B], g[B:])
        if scale == 1.0:
            assert torch.allclose(g[:B], soft_ce(target_logits[:B].softmax(-1), logits[:B]), atol=1e-5)
        assert t[:, 1:].halves.topk_idx.shape == (2 * B, T - 1, V) and t[:, 1:].guided.shape == (B, T - 1, V)


def test_heldout_overlap_is_the_acceptance_of_a_sampled_draft():
    """heldout_overlap at TTT step 0 = sum_x min(p, q) of the target's and drafter's distributions on the
    conditional rows; guided at cfg_scale 1 it is the same number, and at another scale a number in (0, 1]."""
    from lisa.training.drafter import heldout_overlap, target_features, ttt_losses

    target = peaked_target()
    tokens, cond = data(target, n=8)
    torch.manual_seed(0)
    d = new_drafter(target)
    cfg = TrainDrafterParams(ttt_steps=2, eval_batch_size=4)
    one = heldout_overlap(d, target, tokens, cond, cfg, SamplingConfig(temperature=1.0, cfg_scale=1.0))
    assert one["heldout_overlap"] == pytest.approx(one["heldout_overlap_cfg"], rel=1e-5)
    hidden, p = target_features(target, cond, tokens, None, tuple(d.config.taps))
    seen = []
    ttt_losses(d, hidden, p, tokens, 1, target.config.cls_token_num,
               lambda tp, logits: seen.append(torch.minimum(tp, logits.softmax(-1)).sum(-1).mean()) or tp.sum(-1))
    assert one["heldout_overlap"][0] == pytest.approx(seen[0].item(), rel=1e-4)
    four = heldout_overlap(d, target, tokens, cond, cfg, SamplingConfig(temperature=1.0, cfg_scale=4.0))
    assert all(0 < x <= 1 for x in four["heldout_overlap_cfg"])
    assert four["heldout_overlap"] == pytest.approx(one["heldout_overlap"], rel=1e-5)


@pytest.mark.parametrize("lid", [False, True])
def test_guided_distillation_learns_the_guided_distribution(tmp_path, lid):
    """CFG-aware training (pairs of conditional / unconditional rows from the logit cache's sequences, the target's
    guided distribution as label) raises the held-out guided overlap, alone and with LID on the rows; the curves
    carry the overlap columns."""
    from lisa.training.distill import LIDConfig
    from lisa.training.drafter import heldout_overlap

    target = peaked_target()
    tokens, cond = data(target)
    cache = micro_cache(tmp_path, target, tokens, cond)
    cfg = TrainDrafterParams(steps=30, batch_size=16, lr=3e-3, warmup=2, checkpoint_every=30, eval_batch_size=32,
                             ttt_steps=2, eval_every=15, eval_sequences=16)
    s = SamplingConfig(temperature=1.0, cfg_scale=3.0)
    torch.manual_seed(0)
    before = heldout_overlap(new_drafter(target), target, tokens[:32], cond[:32], cfg, s)
    torch.manual_seed(0)
    d = new_drafter(target)
    loss = (torch.randn(16, 4), LIDConfig(top_kc=4, joint_k=4, veto_steps=20)) if lid else None
    m = train_drafter(d, target, tokens, cond, tokens[:32], cond[:32], cfg, tmp_path / "w", progress=False,
                      cache=cache, lid=loss, guided=(s, 0.5), overlap=s, curves=tmp_path / "curves")
    assert m["heldout_overlap_cfg"][0] > before["heldout_overlap_cfg"][0] + 0.05
    held = (tmp_path / "curves" / "heldout.csv").read_text().splitlines()
    assert len(held) == 1 + 2 and "heldout_overlap_cfg_s1" in held[0]
    assert float(held[-1].split(",")[held[0].split(",").index("heldout_overlap_cfg_s0")]) == pytest.approx(
        heldout_overlap(d, target, tokens[:16], cond[:16], cfg, s)["heldout_overlap_cfg"][0], rel=1e-4)


def test_plateau_rise():
    from lisa.stages.drafter import plateau_rise

    curve = [[100, 0.2], [200, 0.3], [300, 0.38], [400, 0.39], [500, 0.40]]
    assert plateau_rise(curve, 1) == pytest.approx((0.40 - 0.39) / 0.40)  # from step 400 = 0.8 x 500
    assert plateau_rise([[500, 0.4]], 1) is None


def test_drafter_table_pools_seeds(tmp_path):
    """drafter-table: the reference rows (release, LID), then one row per run, the seeds of an entry pooled (mean and
    95% t-interval over seeds); a drafter without its report is an error naming the file and the command that
    writes it."""
    import json

    import yaml

    from lisa.config import parse_params, profile_text
    from lisa.stages.drafter import drafter_table, seed_groups
    from lisa.stages.paths import WorldPaths

    raw = yaml.safe_load(profile_text("micro"))
    raw["drafters"]["named"] |= {"cfg-s1": raw["drafters"]["named"]["cfg"] | {"seed": 1},
                                 "base": {"ffn_dim": 0, "steps": 4}}
    raw["drafters"]["runs"] |= {"fashion-c2i-cfg-s1": {"world": "fashion-c2i", "drafter": "cfg-s1"},
                                "fashion-c2i-base": {"world": "fashion-c2i", "drafter": "base"}}
    p, paths = parse_params(raw), WorldPaths.of("fashion-c2i", tmp_path)
    assert seed_groups(p.drafters, "fashion-c2i") == {"cfg": ["cfg", "cfg-s1"], "base": ["base"]}
    with pytest.raises(FileNotFoundError, match=r"release.json: no report .*lisa drafter-reference --world fashion"):
        drafter_table(p.drafters, paths)
    taus = {"release": 1.9, "lid": 1.7, "cfg": 2.0, "cfg-s1": 2.2, "base": 1.8}
    for i, (name, tau) in enumerate(taus.items()):
        if name == "cfg":
            with pytest.raises(FileNotFoundError, match=r"cfg.json: no report .*lisa named-drafter --drafter cfg"):
                drafter_table(p.drafters, paths)
        held = {k: [0.3 + i / 10, 0.2] for k in ("heldout_topk_mass", "heldout_overlap", "heldout_overlap_cfg")}
        report = {"entry": {"loss": "lid", "guided": 0.5} | ({"reference": True} if i < 2 else {}),
                  "config": {"dim": 32, "ffn_dim": None if i < 2 else 0}, "seed": i - 2,
                  "steps": 4, "train": {"train_s": 60.0}, "heldout": held | {"heldout_soft_ce": [1.0, 1.1]},
                  "rise_last_20pct": {"heldout_overlap_cfg_s0": 0.001}, "tau": tau,
                  "ms_per_image": {"vanilla": 10.0, "exact": 5.0}, "speedup_eager": 2.0}
        (paths.named_report / name).mkdir(parents=True)
        (paths.named_report / f"{name}.json").write_text(json.dumps(report))
        (paths.named_report / name / "heldout.csv").write_text(
            "step,heldout_overlap_s0,heldout_overlap_cfg_s0\n2,0.1,0.1\n4,0.2,0.2\n")
    drafter_table(p.drafters, paths)
    out = json.loads(paths.named_report.with_suffix(".json").read_text())
    g = out["groups"]["cfg"]
    assert g["tau"]["mean"] == pytest.approx(2.1) and g["seeds"] == [0, 1] and set(out["groups"]) == {"cfg", "base"}
    assert g["tau"]["ci95"] == pytest.approx(12.706 * 0.1, rel=1e-3)  # t(0.975, 1) x sd (0.1 x sqrt 2) / sqrt 2
    assert out["groups"]["base"]["tau"]["ci95"] is None
    md = paths.named_report.with_suffix(".md").read_text()
    assert "| cfg | 0, 1 | 2.100 +- 1.271 |" in md and "| base | 2 | 1.800 |" in md
    assert "| release (reference) | D 32, ffn SwiGLU | lid |" in md
    assert paths.named_report.with_suffix(".png").stat().st_size > 0
