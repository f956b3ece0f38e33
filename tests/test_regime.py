"""The regime table (lisa.bench.regime) on a tiny preset: its structure, finite positive numbers, the speedup
arithmetic, the CLI. Never timings."""
import json
import math

import pytest
import torch

from lisa.bench.regime import (RegimeConfig, allowed_speedup, bench_reports, measure_shape, method_rows, regime,
                               regime_markdown, shape_config)
from lisa.cli import main
from lisa.models.gpt import gpt_config

TINY = dict(vocab_size=64, block_size=16, num_classes=10)
BENCH = {"world": "toy", "methods": [
    {"name": "vanilla", "tau": 1.0, "forward_tokens": 1, "drafter_calls_per_round": 0.0, "speedup": 1.0},
    {"name": "chain", "tree": "chain", "draft": "topk", "branching": [], "top_k_draft": 4, "tau": 2.0,
     "forward_tokens": 5, "drafter_calls_per_round": 4.0, "speedup": 0.5},
    {"name": "sampled", "tree": "dynamic", "draft": "sample", "branching": [3, 1, 1], "top_k_draft": 4, "tau": 2.5,
     "forward_tokens": 10, "drafter_calls_per_round": 3.0, "speedup": 0.6},
]}


def small(**kw) -> RegimeConfig:
    return RegimeConfig(**{"shapes": ["micro"], "modes": ["eager"], "sizes": [1, 5, 17], "repeats": 2,
                           "min_repeats": 2, "warmup": 0} | kw)


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_regime_structure_and_numbers():
    rc = small()
    r = regime(rc, {"micro": (gpt_config("GPT-micro", **TINY), "test")}, {"toy": BENCH})
    assert r["machine"]["threads"] >= 1 and r["machine"]["torch"] and "cpu" in r["machine"]
    s = r["shapes"]["micro"]
    assert set(s["regimes"]) == {"fp32/eager", "bf16/eager"} and s["repeats"] == 2
    for reg in s["regimes"].values():
        assert set(reg["t_ms"]) == {1, 5, 17} and set(reg["q_ms"]) == {1, 4}
        assert reg["t_ratio"][1] == pytest.approx(1.0)
        assert all(positive(v) for d in ("t_ms", "t_ratio", "q_ms", "q_ratio") for v in reg[d].values())
        sp = reg["allowed_speedup"]["toy"]
        assert set(sp) == {"vanilla", "chain", "sampled"} and all(positive(v) for v in sp.values())
        assert sp["vanilla"] == pytest.approx(1.0)
    md = regime_markdown(r)
    assert "| micro |" in md and "t(5)/t(1)" in md and "q(4)/t(1)" in md and "sampled" in md
    json.dumps(r)  # JSON-able


def test_allowed_speedup_arithmetic():
    rows = {m["name"]: m for m in method_rows(BENCH)}
    assert (rows["chain"]["width"], rows["sampled"]["width"], rows["vanilla"]["width"]) == (1, 3, 1)
    reg = {"t_ratio": {1: 1.0, 5: 1.5, 9: 2.0, 17: 3.0}, "q_ratio": {1: 0.25, 4: 0.55}}  # t(1) = 2 ms
    assert allowed_speedup(rows["chain"], reg) == pytest.approx(2.0 * 2.0 / (3.0 + 4 * 0.5))
    # N = 10 between 9 and 17, width 3 between 1 and 4: the cost model's linear interpolation
    assert allowed_speedup(rows["sampled"], reg) == pytest.approx(2.5 * 2.0 / (4.25 + 3 * 0.9))


def test_shapes():
    cfg, _ = shape_config("GPT-B")
    assert (cfg.vocab_size, cfg.block_size, cfg.model_type, cfg.dim) == (16384, 256, "c2i", 768)
    with pytest.raises(ValueError, match="unknown shape"):
        shape_config("no-such-world")
    with pytest.raises(ValueError, match="dtype"):
        RegimeConfig(dtypes=["fp8"])


def test_cli(tmp_path):
    # a world's shape read from its checkpoint sidecar, its methods from a bench report
    (tmp_path / "target" / "toy").mkdir(parents=True)
    (tmp_path / "target" / "toy" / "model.json").write_text(json.dumps(
        {"kind": "gpt", "config": gpt_config("GPT-micro", **TINY).__dict__, "sha256": ""}))
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "toy.json").write_text(json.dumps(BENCH))
    (tmp_path / "bench" / "vanilla.json").write_text(json.dumps({"methods": []}))  # not a bench-spec report
    assert set(bench_reports(tmp_path / "bench")) == {"toy"}
    out = tmp_path / "regime" / "regime"
    assert main(["regime", "--shapes", "toy", "--dtypes", "fp32", "--modes", "eager", "--repeats", "2",
                 "--targets", str(tmp_path / "target"), "--bench", str(tmp_path / "bench"),
                 "--params", str(tmp_path / "none.yaml"), "--out", str(out)]) == 0
    r = json.loads(out.with_suffix(".json").read_text())
    reg = r["shapes"]["toy"]["regimes"]["fp32/eager"]
    assert set(reg["t_ratio"]) == {"1", "3", "5", "9", "17", "33"}
    assert all(v > 0 for v in reg["allowed_speedup"]["toy"].values())
    assert "| toy |" in out.with_suffix(".md").read_text()


def test_compiled_skipped_where_it_would_not_fit_the_budget():
    rc = small(modes=["eager", "compiled"], dtypes=["fp32"], compile_budget_s=1.0)
    s = measure_shape(gpt_config("GPT-micro", **TINY), rc, compile_s_per_layer=10.0)  # predicted: no compiling
    assert set(s["regimes"]) == {"fp32/eager"}
    assert len(s["notes"]) == 1 and "compiled skipped" in s["notes"][0]


def test_compile_shapes():
    rc = small(modes=["eager", "compiled"], dtypes=["fp32"], compile_shapes=[])
    s = regime(rc, {"micro": (gpt_config("GPT-micro", **TINY), "test")}, {})["shapes"]["micro"]
    assert set(s["regimes"]) == {"fp32/eager"} and "not one of the compile shapes" in s["notes"][0]


def test_reprice_prices_new_bench_reports_on_the_stored_regimes():
    """--reprice times nothing: the stored t(N) / q ratios, the methods of the newer report."""
    from lisa.bench.regime import reprice

    r = json.loads(json.dumps(regime(small(), {"micro": (gpt_config("GPT-micro", **TINY), "test")}, {"toy": BENCH})))
    newer = json.loads(json.dumps(BENCH))
    newer["methods"][2]["tau"] = 5.0
    again = reprice(r, {"toy": newer})
    assert again["shapes"]["micro"]["regimes"] == {
        k: v | {"allowed_speedup": again["shapes"]["micro"]["regimes"][k]["allowed_speedup"]}
        for k, v in r["shapes"]["micro"]["regimes"].items()}
    for k, reg in again["shapes"]["micro"]["regimes"].items():
        old = r["shapes"]["micro"]["regimes"][k]["allowed_speedup"]["toy"]["sampled"]
        assert reg["allowed_speedup"]["toy"]["sampled"] == pytest.approx(2 * old)
        assert reg["allowed_speedup"]["toy"]["chain"] == r["shapes"]["micro"]["regimes"][k]["allowed_speedup"]["toy"]["chain"]


def test_replayed_loop_at_a_shape():
    """lisa.bench.replay: the real loop on random weights, each round's acceptance drawn from a report's histogram
    along the first-child chain; every image still gets its tokens, and the rounds accept only lengths the
    histogram holds (the last round of an image may be cut by its end)."""
    from lisa.bench.replay import ReplayConfig, replay_bench, replay_markdown
    from lisa.models.gpt import gpt_config

    report = {"world": "toy", "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 2.0},
              "methods": [{"name": "exact-sampled", "tree": "dynamic", "depth": 4, "top_k_draft": 4,
                           "total_tokens": 16, "draft": "sample", "siblings": "wor", "branching": [2, 1, 1],
                           "accept_hist": {"1": 5, "2": 3, "4": 2}, "tau": 1.9}]}
    cfg = gpt_config("GPT-micro", vocab_size=32, block_size=16, num_classes=4)
    r = replay_bench(ReplayConfig(methods=["exact-sampled"], image_tokens=16, images=2, repeats=1, modes=["eager"]),
                     report, cfg, progress=False)
    rows = {m["method"]: m for m in r["methods"]}
    spec = rows["exact-sampled"]
    assert rows["vanilla"]["speedup"] == 1.0 and spec["ms_per_image"] > 0 and spec["bare_round_ms"] > 0
    assert spec["drafter_calls_per_round"] > 0 and spec["ceiling"] > 0 and spec["tokens_per_forward"] == 7
    assert 1.0 < spec["tau"] <= 4.0 and spec["forwards_per_image"] < 15
    with pytest.raises(ValueError, match="not in the bench report"):
        replay_bench(ReplayConfig(methods=["nope"], modes=["eager"]), report, cfg, progress=False)
    assert "acceptance replayed from toy" in replay_markdown(r)


def test_replay_times_each_drafter_architecture():
    """ReplayConfig.drafters: every method runs with each architecture ("method @ name" rows), each with its own
    bare drafter step; a cheaper architecture reads fewer weights per step; a bad override names its field."""
    from lisa.bench.replay import ReplayConfig, replay_bench, replay_markdown
    from lisa.cli import drafter_archs
    from lisa.models.gpt import gpt_config

    report = {"world": "toy", "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 2.0},
              "methods": [{"name": "exact-sampled", "tree": "dynamic", "depth": 3, "top_k_draft": 2,
                           "total_tokens": 4, "draft": "sample", "siblings": "wor", "branching": [2, 1, 1],
                           "accept_hist": {"1": 5, "3": 2}, "tau": 1.6}]}
    cfg = gpt_config("GPT-micro", vocab_size=32, block_size=16, num_classes=4)
    archs = drafter_archs(["eagle3", "cheap:ffn_dim=0,head_rank=8"])
    assert archs == {"eagle3": {}, "cheap": {"ffn_dim": 0, "head_rank": 8}}
    r = replay_bench(ReplayConfig(methods=["exact-sampled"], image_tokens=12, images=1, repeats=1, modes=["eager"],
                                  drafters=archs), report, cfg, progress=False)
    rows = {m["method"]: m for m in r["methods"]}
    assert set(rows) == {"vanilla", "exact-sampled", "exact-sampled @ cheap"}
    assert rows["exact-sampled @ cheap"]["drafter"] == "cheap" and rows["exact-sampled"]["drafter"] == "eagle3"
    ds = r["shape"]["drafters"]
    assert ds["cheap"]["step_weights"] < ds["eagle3"]["step_weights"] / 2
    assert {k.split(":")[0] for k in r["bare_drafter_ms"]} == {"eagle3", "cheap"}
    assert "exact-sampled @ cheap" in replay_markdown(r) and "read per step" in replay_markdown(r)
    with pytest.raises(ValueError, match="head_rank"):
        ReplayConfig(drafters={"bad": {"head_rank": -3}})
    with pytest.raises(SystemExit, match="KEY=INTEGER"):
        drafter_archs(["x:head_rank"])


def test_replay_verifier_follows_the_histogram():
    from lisa.bench.replay import replay_verifier
    from lisa.decoding.generate import SpecConfig, speculative_generate
    from lisa.decoding.sampling import SamplingConfig
    from lisa.models.drafter import DrafterConfig, build_drafter
    from tests.helpers import micro_gpt

    target = micro_gpt(vocab_size=16)
    drafter = build_drafter(DrafterConfig.for_target(target.config)).eval()
    spec = SpecConfig("exact", "dynamic", draft="sample", branching=(2, 1, 1))
    fn = replay_verifier({"1": 1, "3": 1}, torch.Generator().manual_seed(0))
    tokens, st = speculative_generate(target, drafter, torch.tensor([1, 2, 3]), SamplingConfig(cfg_scale=2.0), spec,
                                      torch.Generator().manual_seed(0), verifier_fn=fn)
    assert tokens.shape == (3, 16) and all(sum(r) == 15 for r in st["accept_lengths"])
    body = [a for r in st["accept_lengths"] for a in [a for a in r if a > 0][:-1]]  # a row's last round may be cut
    assert set(body) <= {1, 3} and {1, 3} <= set(body)
