"""Speed stages: `bench` (vanilla decode of a random-weight target against its bare forwards) and `bench-spec` (every
decoding method on a world's target and drafters, same conditions and seeds, in one run)."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from lisa.bench.speed import bench_speculative, bench_vanilla, markdown_table, speculative_markdown
from lisa.checkpoint import atomic_write_all, json_writer, read_json
from lisa.config import BenchMethod, BenchParams, BenchSpecParams, SampleParams, ScoreboardParams, WorldParams
from lisa.decoding.sampling import sampling_config
from lisa.models.gpt import Transformer, gpt_config
from lisa.models.llamagen import load_target, load_tokenizer
from lisa.stages.common import check_pair, class_names, method_resources, text_encoder
from lisa.stages.paths import SharedPaths, Stage, WorldPaths
from lisa.stages.render import lines_writer, plot_bench
from lisa.stages.scoreboard import pick


def bench(p: BenchParams, shared: SharedPaths) -> dict:
    """Vanilla decode speed of a random-weight target (e.g. GPT-B) on this machine, loop vs bare forwards
    -> bench_dir/vanilla.{json,md}."""
    if p.threads:
        torch.set_num_threads(p.threads)
    torch.manual_seed(p.seed)
    cfg = gpt_config(**p.target)
    model = Transformer(cfg).eval()
    rows = bench_vanilla(model, min(p.num_tokens, cfg.block_size), p.batch_size, p.cfg_scales, p.repeats,
                         p.warmup, p.seed)
    name = p.target.get("preset", "custom")
    result = {"target": p.target, "params": model.num_params(), "threads": torch.get_num_threads(),
              "device": "cpu", "rows": rows}
    title = (f"Vanilla decode, {name} ({model.num_params() / 1e6:.0f}M params, random weights), "
             f"{result['threads']} threads")
    atomic_write_all({shared.bench_dir / "vanilla.md": lines_writer([markdown_table(rows, title)], end=""),
                      shared.bench_dir / "vanilla.json": json_writer(result)})
    return result


def _bench_conditions(world: WorldParams, cfg, sample_p: SampleParams, p: BenchSpecParams, target_path):
    """(conditions, text encoding ms per prompt): batches of `p.per_class` seeds per class / prompt of `sample_p`,
    each {"label", "cond"}; the text encoder is timed after a warm-up (None for c2i)."""
    text_s = None
    if cfg.model_type == "c2i":
        names = class_names(world)
        labels = [f"{c} {names[c]}" if names else str(c) for c in sample_p.classes for _ in range(p.per_class)]
        cond = torch.tensor([c for c in sample_p.classes for _ in range(p.per_class)])
    else:
        if not sample_p.prompts:
            raise ValueError(f"{target_path} is text-conditional: sample.prompts must list captions")
        encode_text = text_encoder(world, cfg)
        encode_text(sample_p.prompts[:1])  # warm-up
        t0 = time.perf_counter()
        feats = encode_text(list(sample_p.prompts))
        text_s = (time.perf_counter() - t0) / len(sample_p.prompts)
        labels = [q for q in sample_p.prompts for _ in range(p.per_class)]
        cond = feats.repeat_interleave(p.per_class, dim=0)
    conditions = [{"label": ", ".join(labels[i : i + p.batch_size]), "cond": cond[i : i + p.batch_size]}
                  for i in range(0, len(cond), p.batch_size)]
    return conditions, 1000 * text_s if text_s is not None else None


def scoreboard_picks(methods: list[BenchMethod], sb: ScoreboardParams, sweep_dir: Path) -> list[BenchMethod]:
    """The scoreboard's choices that no bench method already is: per family of `sb.families` whose sweep exists
    (sweep_dir/<family>.json), the point each TV budget picks (lisa.stages.scoreboard.pick), named
    `<family>[<label>]`. bench-spec times them beside its own methods, so that the scoreboard's headline table has
    a wall-clock speedup at every budget."""
    have = [_fields(m) for m in methods]
    out = {}
    for family in sb.families:
        f = sweep_dir / f"{family}.json"
        if not f.is_file():
            continue
        points = read_json(f)["points"]
        for budget in sb.budgets:
            best = pick(points, budget)
            if best is None or best["method"]["method"] == "vanilla" or best["method"] in have:
                continue
            out.setdefault(f"{family}[{best['label']}]", best["method"])
    return [BenchMethod(name=name, **fields) for name, fields in out.items()]


def _fields(m: BenchMethod) -> dict:
    """A bench method's DecodeMethod fields (what a sweep point records as its method)."""
    return {k: v for k, v in dataclasses.asdict(m).items() if k != "name"}


def bench_spec(world: WorldParams, sample_p: SampleParams, p: BenchSpecParams, paths: WorldPaths,
               sb: ScoreboardParams | None = None) -> dict:
    """Speculative decoding benchmark of a world's target and drafters: every method of `p.methods` on the same
    classes / prompts (`sample_p`) with the same seeds, in one run -> bench_dir/<world>.{json,md,png}. Methods use
    the release drafter or the LID one (BenchMethod.drafter); gasv reads the calibration. With `sb` (the
    scoreboard's settings) the points its budgets pick from the world's sweeps run too (`scoreboard_picks`), eager
    and, when `p.compiled` names any method, compiled. Each method's row records its DecodeMethod fields."""
    if p.threads:
        torch.set_num_threads(p.threads)
    picks = scoreboard_picks(p.methods, sb, paths.sweep_dir) if sb is not None else []
    methods = [*p.methods, *picks]
    if len({m.name for m in methods}) != len(methods):
        raise ValueError(f"bench_spec.methods: names must be unique, got {[m.name for m in methods]}")
    model, target_meta = load_target(paths.target_file)
    vq, vq_meta = load_tokenizer(paths.tokenizer_file)
    check_pair(paths.target_file, target_meta, paths.tokenizer_file, vq_meta)
    cfg = model.config
    res = method_resources(methods, model, target_meta, vq, paths, p.neighbours)
    conditions, text_ms = _bench_conditions(world, cfg, sample_p, p, paths.target_file)
    sampling = sampling_config(world, p)  # the world's own values over the section's

    def vq_decode(tokens):
        with torch.inference_mode():
            return vq.decode(model.image_codes(tokens))

    compiled = [*p.compiled, *(m.name for m in picks)] if p.compiled else []
    report = bench_speculative(model, res.modules, conditions, methods, sampling,
                               p.repeats, p.warmup, p.seed, res.geometry, p.auto, vq_decode, compiled=compiled,
                               throughput=p.throughput)
    fields = {m.name: _fields(m) for m in methods}
    for row in report["methods"]:
        row["decode_method"] = fields[row["name"]]  # an auto row: its method as configured, before the cost model
    report["scoreboard_picks"] = [m.name for m in picks]
    report |= {"world": paths.world, "text_encode_ms_per_prompt": text_ms,
               "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                            "cfg_scale": sampling.cfg_scale},
               "target_sha256": target_meta["sha256"], "tokenizer_sha256": vq_meta["sha256"],
               "drafter_sha256": res.drafter_sha, "calibration_sha256": res.calibration_sha}
    out, w = paths.bench_dir, paths.world
    title = (f"Speculative decoding, {paths.world}: {cfg.n_layer}-layer dim-{cfg.dim} target "
             f"({model.num_params() / 1e6:.1f}M), T={sampling.temperature:g}, CFG {sampling.cfg_scale:g}, "
             f"top-k {sampling.top_k or 'off'}")
    atomic_write_all({out / f"{w}.png": plot_bench(report, title),  # one output: renamed into place together
                      out / f"{w}.md": lines_writer([speculative_markdown(report, title)], end=""),
                      out / f"{w}.json": json_writer(report)})
    return {m["name"]: {"ms_per_image": m["ms_per_image"], "speedup": m.get("speedup"), "tau": m["tau"]}
            for m in report["methods"]}


STAGES = {
    "bench": Stage(lambda c: bench(c.params.bench, c.shared), out="bench_dir", world=False),
    "bench-spec": Stage(lambda c: bench_spec(c.world, c.params.sample, c.params.bench_spec, c.paths,
                                             c.params.scoreboard), out="bench_dir"),
}
