"""The speculative benchmark: every method on the same conditions and seeds in one run, and its report."""
import torch

from lisa.bench.speed import bench_speculative
from lisa.stages.render import speculative_markdown
import pytest

from lisa.config import AutoTreeParams, BenchMethod, ThroughputParams
from lisa.models.drafter import DrafterConfig, build_drafter
from lisa.decoding.sampling import SamplingConfig
from lisa.decoding.verify import Geometry
from tests.helpers import micro_gpt

METHODS = [
    BenchMethod("vanilla"),
    BenchMethod("exact-tree", "exact", "dynamic", depth=3, top_k_draft=2, total_tokens=5),
    BenchMethod("exact-static", "exact", "static", depth=3, top_k_draft=2, total_tokens=5),
    BenchMethod("exact-chain", "exact", "chain", depth=3),
    BenchMethod("greedy-auto", "greedy", "auto", top_k_draft=2),
    BenchMethod("lantern", "lantern", "dynamic", depth=3, top_k_draft=2, total_tokens=5, options={"k": 3, "delta": 0.2}),
    BenchMethod("sjd", "sjd", window=4),
    BenchMethod("gsd", "gsd", window=4),
]


def run_bench(sampling, repeats=1, **kw):
    torch.manual_seed(0)
    target = micro_gpt(vocab_size=8)
    drafter = build_drafter(DrafterConfig.for_target(target.config)).eval()
    geometry = Geometry.from_codebook(torch.randn(8, 4), 4)
    conditions = [{"label": f"class {c}", "cond": torch.tensor([c])} for c in (1, 4, 7)]
    auto = AutoTreeParams(max_depth=3, sizes=[1, 2, 4, 8], calib_conditions=2, reps=1)
    return bench_speculative(target, drafter, conditions, METHODS, sampling, repeats=repeats, warmup=1, seed=0,
                             geometry=geometry, auto=auto, vq_decode=lambda t: t.float(), progress=False, **kw)


def test_greedy_bench_every_method_emits_vanillas_tokens():
    report = run_bench(SamplingConfig(temperature=0.0, cfg_scale=2.0), repeats=2)
    ms = {m["name"]: m for m in report["methods"]}
    assert list(ms) == [m.name for m in METHODS]
    for m in ms.values():
        # lossless methods (and the relaxed ones, on one-hot greedy distributions) reproduce vanilla exactly
        assert m["same_tokens_as_vanilla"] == 1.0, m["name"]
        assert m["ms_per_image"] > 0 and m["bare_forward_ms"] > 0 and m["tau"] >= 1.0
        rounds = sum(m["accept_hist"].values())
        # every image emits 15 tokens after the prefill: sum of acceptance lengths = 15 per image and pass
        assert sum(k * v for k, v in m["accept_hist"].items()) == 15 * 3 * 2, m["name"]
        assert m["tau"] == sum(k * v for k, v in m["accept_hist"].items()) / rounds
    assert ms["vanilla"]["speedup"] == 1.0 and ms["vanilla"]["tau"] == 1.0
    assert ms["exact-chain"]["forward_tokens"] == 4 and ms["sjd"]["forward_tokens"] == 5
    auto = ms["greedy-auto"]["auto"]
    assert auto["depth"] == ms["greedy-auto"]["depth"] and auto["total_tokens"] == ms["greedy-auto"]["total_tokens"]
    assert len(report["per_condition"]) == 3 * len(METHODS) and report["vq_decode_ms_per_image"] > 0


def test_sampling_bench_report_and_markdown():
    tp = ThroughputParams(batch_sizes=[1, 3], methods=["vanilla", "exact-chain", "sjd"], repeats=1)
    report = run_bench(SamplingConfig(temperature=1.0, top_k=6, cfg_scale=2.0), throughput=tp)
    md = speculative_markdown(report, "micro")
    rows = {(r["batch"], r["method"]): r for r in report["throughput"]["rows"]}
    assert set(rows) == {(b, n) for b in (1, 3) for n in tp.methods} and {r["mode"] for r in rows.values()} == {"eager"}
    assert all(r["images_per_s"] > 0 for r in rows.values()) and rows[3, "vanilla"]["speedup"] == 1.0
    assert rows[3, "sjd"]["tau"] > 1.0 and "Throughput: images per second" in md and "| exact-chain | eager |" in md
    assert report["compiled"] == [] and len(report["bare_forward_ms_all"][4]) == 1
    for m in METHODS:
        assert f"| {m.name} |" in md
    assert "Auto tree for greedy-auto: " in md and "x predicted" in md and "Acceptance length per round" in md
    ms = {m["name"]: m for m in report["methods"]}
    assert ms["sjd"]["drafter_share"] == 0.0 and ms["exact-tree"]["drafter_share"] > 0.0
    assert 0.0 < ms["exact-tree"]["target_share"] < 1.0
    # where a drafter step goes: cold (after a target forward) and warm, at 1 pair and the tree methods' widths,
    # its parts (hooks on the submodules) never more than the step itself
    step = report["drafter_step"]["release"]
    assert step["t1_ms"] > 0 and step["fc_ms"] > 0 and 1 in step["widths"] and len(step["widths"]) >= 2
    for modes in step["widths"].values():
        for x in modes.values():
            parts = sum(x[p] for p in ("inputs", "attention", "ffn", "head"))
            assert 0 < parts <= x["step_ms"] and x["glue"] >= 0 and x["step_over_t1"] == pytest.approx(
                x["step_ms"] / step["t1_ms"])
    assert "Drafter step (release drafter), where it goes" in md and "| 1 | cold |" in md


@pytest.mark.slow
def test_compiled_rows_beside_the_eager_ones():
    """bench_spec.compiled: the named methods and vanilla also run with compiled forwards, in the same passes; each
    mode's speedup is against its own vanilla; the graphs compile in the warm-up (a compile time per method)."""
    report = run_bench(SamplingConfig(temperature=0.0, cfg_scale=2.0), compiled=["exact-chain", "sjd", "greedy-auto"])
    rows = {c["name"]: c for c in report["compiled"]}
    assert list(rows) == ["vanilla", "exact-chain", "greedy-auto", "sjd"] and rows["vanilla"]["speedup"] == 1.0
    # the first timed call compiles what nothing compiled before: vanilla's graphs were built while pricing
    # greedy-auto in compiled mode (its calibration decodes run compiled vanilla), exact-chain's cache shapes were not
    assert rows["exact-chain"]["compile_s"] > 0 and all(r["compile_s"] >= 0 for r in rows.values())
    assert all(r["ms_per_image"] > 0 for r in rows.values())
    # greedy: the compiled loops accept what the eager ones do
    assert rows["exact-chain"]["tau"] == rows["exact-chain"]["eager_tau"] and rows["sjd"]["tau"] > 1.0
    # each compiled loop against the compiled bare forwards its rounds make (timed in the same passes)
    assert all(r["limit_ms_per_forward"] > 0 and r["loop_to_limit"] > 0 for r in rows.values())
    # an auto tree is priced in the mode that runs it: the compiled row records its own choice and tree, and (greedy)
    # still emits vanilla's tokens
    auto = rows["greedy-auto"]["auto"]
    assert auto["speedup"] > 0 and rows["greedy-auto"]["tree_desc"]
    assert f"depth {auto['depth']}" in rows["greedy-auto"]["tree_desc"] or "chain" in rows["greedy-auto"]["tree_desc"]
    md = speculative_markdown(report, "micro")
    assert "Eager and compiled, side by side" in md and "| exact-chain |" in md
    assert "greedy-auto compiled: tree auto priced with compiled costs: " in md
    with pytest.raises(ValueError, match="not methods of this bench"):
        run_bench(SamplingConfig(temperature=0.0), compiled=["nope"])


def test_gpu_bench_runs_small_on_the_cpu():
    """`lisa bench-gpu` on a tiny preset (the GPU run uses GPT-XL): every method, t(N), one table; bf16 decodes."""
    from lisa.bench.gpu import GPUBenchConfig, gpu_bench, gpu_markdown

    r = gpu_bench(GPUBenchConfig(preset="GPT-micro", image_tokens=16, vocab_size=64, dtype="bf16", repeats=1,
                                 conditions=1, forward_sizes=[1, 4]), device="cpu", progress=False)
    assert [m["name"] for m in r["methods"]] == ["vanilla", "exact-chain", "exact-tree-16", "exact-tree-60"]
    assert all(m["tau"] >= 1.0 and m["speedup"] > 0 for m in r["methods"]) and set(r["t_of_n_ms"]) == {1, 4}
    text = gpu_markdown(r)
    assert "t(N)" in text and "| exact-tree-60 |" in text and "bf16" in text
