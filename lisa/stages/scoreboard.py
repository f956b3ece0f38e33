"""The matched-quality scoreboard: which method has the highest tau at equal quality.

- `sweep` (per world and family of params scoreboard.families): every point of the family's knob grid decodes the
  same `sweep_images` conditions with the same seeds and measures tau and the per-token TV between the law each
  token was drawn from and the target's (`measure=True`; 0 for a lossless method) -> <family>.json. Points are
  cached one by one (data/work/scoreboard/<world>/sweep, keyed by everything the decode reads, the decoding code
  included): a killed run resumes at the next point.
- `quality-point` (per world and point of scoreboard.points): a family at a TV budget (its highest-tau sweep point
  whose TV is within it) decodes `num_samples` images, scored against the held-out reference with bootstrap 95%
  intervals (lisa.quality.compare: Inception FID / KID / precision / recall, the judge-space FD / KID, the judge's
  score) -> <point>.json. Vanilla at other seeds gives the noise floor; a control (vanilla at another temperature)
  shows what the metrics can see at this sample count.
- `scoreboard` (per world): the frontier (tau against TV, every family; the quality points with their intervals) and
  the headline table: each family's tau at TV <= each budget, lossless rows marked, and whether its quality points
  are indistinguishable from vanilla (every interval overlapping the union of vanilla's seed intervals).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import torch

from lisa.checkpoint import atomic_write_all, json_writer, read_json, write_json
from lisa.config import DecodeMethod, QualityParams, ScoreboardParams, TableParams, WorldParams
from lisa.data import datasets as data
from lisa.decoding.sampling import sampling_config
from lisa.quality import compare, fid, judges
from lisa.quality import metrics as quality
from lisa.stages.common import load_images
from lisa.stages.paths import Stage, WorldPaths
from lisa.stages.quality import _method_decoder, _scored, decode_conditions
from lisa.stages.render import leaders, lines_writer, scoreboard_plot

LOSSLESS_TV = 1e-4  # a measured mean TV below this: the method kept the target's distribution (float error)


def _hash(parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _table(p: ScoreboardParams, batch_size: int) -> TableParams:
    """The decoding settings `_method_decoder` reads (eager forwards)."""
    return TableParams(seed=p.seed, batch_size=batch_size, compile=False)


@functools.cache
def decode_code(root: Optional[Path] = None) -> str:
    """A hash of the source that turns a method into tokens (every module of lisa/decoding and lisa/models under
    root, default this package): a decode cached by older code is never reused, e.g. after a change to how a
    method draws its randomness."""
    root = Path(root or Path(__file__).resolve().parents[1])
    h = hashlib.sha256()
    for f in sorted([*(root / "decoding").glob("*.py"), *(root / "models").glob("*.py")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _recipe(s, m, res, world: WorldParams, extra) -> list:
    """What a cached decode depends on: the target, tokenizer, method, drafters, calibration (res:
    lisa.stages.common.MethodResources), settings and the decoding code."""
    return [s.target_meta["sha256"], s.vq_meta["sha256"], asdict(m), res.drafter_sha, res.calibration_sha,
            world.sampling or {}, extra, decode_code()]


def sweep(world: WorldParams, family: str, p: ScoreboardParams, paths: WorldPaths) -> dict:
    """Tau and the measured per-token TV of every grid point of scoreboard.families[family] on the same
    `sweep_images` conditions (the quality conditions' first ones) and seeds -> sweep_dir/<family>.json."""
    if family not in p.families:
        raise ValueError(f"--family {family!r}: not a key of params scoreboard.families {sorted(p.families)}")
    fam = p.families[family]
    s = _scored(paths, p.sweep_images)
    sampling = sampling_config(world, p)
    rows = []
    for label, m in fam.points():
        decode, res = _method_decoder(s, m, _table(p, p.sweep_batch), paths,
                                      paths.inputs_dir / "families" / f"{family}.json")
        key = _hash(_recipe(s, m, res, world, [p.sweep_images, p.sweep_batch, p.seed, asdict(sampling)]))
        cached = paths.sweep_work / family / f"{label}-{key}.json"
        if cached.is_file():
            stats = read_json(cached)
        else:
            _, stats = decode_conditions(decode, s.conds, sampling, p.sweep_batch, p.seed, f"sweep {family} {label}",
                                         s.model.config.block_size)
            write_json(cached, stats)  # one point at a time: a killed sweep resumes at the next
        rows.append({"label": label, "method": asdict(m), "tau": stats["tau"], "tv": stats["tv_mean"],
                     "lossless": stats["tv_mean"] < LOSSLESS_TV, "decode_s": stats["decode_s"]})
    out = {"world": paths.world, "family": family, "images": p.sweep_images, "seed": p.seed,
           "sampling": asdict(sampling), "threads": torch.get_num_threads(), "points": rows}
    write_json(paths.sweep_dir / f"{family}.json", out)
    return {"family": family, "points": len(rows), "tau_max": max(r["tau"] for r in rows),
            "tv_min": min(r["tv"] for r in rows)}


def pick(points: list[dict], budget: Optional[float]) -> Optional[dict]:
    """The sweep point a budget selects: the highest tau among the points whose measured TV is within it (ties: the
    lower TV); no budget: the family's only point; None when no point is within the budget."""
    if budget is None:
        if len(points) != 1:
            raise ValueError(f"a family of {len(points)} sweep points needs a TV budget to pick one")
        return points[0]
    inside = [r for r in points if r["tv"] <= budget]
    return max(inside, key=lambda r: (r["tau"], -r["tv"])) if inside else None


def quality_point(world: WorldParams, name: str, p: ScoreboardParams, q: QualityParams, paths: WorldPaths) -> dict:
    """Image quality of scoreboard.points[name] with bootstrap 95% intervals -> points_dir/<name>.json (and the sweep
    point it stands for). A budget no sweep point of the family reaches is written as such, without decoding."""
    if name not in p.points:
        raise ValueError(f"--point {name!r}: not a key of params scoreboard.points {sorted(p.points)}")
    pt = p.points[name]
    if pt.world != paths.world:
        raise ValueError(f"--point {name!r} is a point of world {pt.world!r}, not of {paths.world!r}")
    sweep_file = paths.sweep_dir / f"{pt.family}.json"
    if not sweep_file.is_file():
        raise FileNotFoundError(f"{sweep_file}: no sweep of family {pt.family!r} yet: run "
                                f"`lisa sweep --world {paths.world} --family {pt.family}` first")
    chosen = pick(read_json(sweep_file)["points"], pt.budget)
    out = {"point": name, "family": pt.family, "budget": pt.budget, "seed": p.seed + pt.seed}
    if chosen is None:
        out |= {"within_budget": False}
        write_json(paths.points_dir / f"{name}.json", out)
        return out
    m = DecodeMethod(**chosen["method"])  # the very method the sweep measured
    s = _scored(paths, p.num_samples)
    sampling = sampling_config(world, p)
    sampling = replace(sampling, temperature=pt.temperature if pt.temperature is not None else sampling.temperature,
                       top_k=pt.top_k if pt.top_k is not None else sampling.top_k)
    decode, res = _method_decoder(s, m, _table(p, p.batch_size), paths,
                                  paths.inputs_dir / "families" / f"{pt.family}.json")
    work = paths.points_work / (name + "-" + _hash(_recipe(s, m, res, world,
                                                          [p.num_samples, p.batch_size, p.seed + pt.seed,
                                                           asdict(sampling)])))
    stats_file = work / "decode.json"

    def make_tokens():
        tokens, stats = decode_conditions(decode, s.conds, sampling, p.batch_size, p.seed + pt.seed,
                                          f"point {name}", s.model.config.block_size)
        write_json(stats_file, stats)
        return tokens

    tokens = quality.cached(work / "tokens.safetensors", "tokens", make_tokens)
    stats = read_json(stats_file)
    images = quality.decode_tokens(s.vq, tokens)
    inception = quality.cached(work / "features.safetensors", "features",
                               lambda: fid.features(images, q.inception_batch))
    _, test_u8, _ = load_images(paths.dataset_dir, paths.dataset_identity)
    _, ref_idx, _ = quality.read_reference(paths.reference_file)
    x = data.to_model_range(images)
    score_name, scores = judges.per_image_scores(s.judge, x, s.labels, s.captions)
    metrics = compare.image_metrics(s.ref, inception, judges.image_features(s.judge, data.to_model_range(
        test_u8[ref_idx])), judges.image_features(s.judge, x), scores, score_name, p.bootstrap, p.nearest_k,
                                    p.seed)
    out |= {"within_budget": True, "label": chosen["label"], "method": asdict(m), "sampling": asdict(sampling),
            "samples": len(tokens), "sweep_tau": chosen["tau"], "sweep_tv": chosen["tv"], "tau": stats["tau"],
            "tv": stats["tv_mean"], "decode_s": stats["decode_s"], "bootstrap": p.bootstrap,
            "reference_images": len(ref_idx), "metrics": metrics,
            "target_sha256": s.target_meta["sha256"], "judge_sha256": s.judge_meta["sha256"]}
    write_json(paths.points_dir / f"{name}.json", out)
    return {k: v for k, v in out.items() if k not in ("method", "sampling", "metrics")}


def _vanilla_floor(points: dict[str, dict], p: ScoreboardParams) -> dict[str, dict]:
    """Per metric, the union of the intervals of vanilla's seed points (family vanilla, no control change)."""
    seeds = [r for n, r in points.items() if r.get("within_budget") and p.points[n].family == "vanilla"
             and p.points[n].temperature is None and p.points[n].top_k is None]
    if not seeds:
        return {}
    keys = seeds[0]["metrics"].keys()
    return {k: {"lo": min(r["metrics"][k]["lo"] for r in seeds), "hi": max(r["metrics"][k]["hi"] for r in seeds),
                "seeds": len(seeds)} for k in keys}


def _bench_speedups(bench_methods: list, bench_file: Path) -> dict[str, dict]:
    """{bench-spec method name: {"method": its DecodeMethod fields, "eager", "compiled"}}: the wall-clock speedups
    against vanilla of the same mode that the world's bench-spec run measured (compiled: for the methods it
    compiles)."""
    if not bench_file.is_file():
        return {}
    report = read_json(bench_file)
    eager = {m["name"]: m.get("speedup") for m in report["methods"]}
    compiled = {m["name"]: m.get("speedup") for m in report.get("compiled", [])}
    fields = [f.name for f in dataclasses.fields(DecodeMethod)]
    method = {m.name: {f: getattr(m, f) for f in fields} for m in bench_methods}
    method |= {m["name"]: m["decode_method"] for m in report["methods"] if "decode_method" in m}  # the picks too
    return {name: {"method": method[name], "eager": eager[name], "compiled": compiled.get(name)}
            for name in eager if name in method}


def _timed(point: dict, speedups: dict[str, dict]) -> Optional[dict]:
    """The bench-spec timing of a sweep point's very method, if bench-spec runs it ({"bench", "eager",
    "compiled"})."""
    for name, b in speedups.items():
        if b["method"] == point["method"]:
            return {"bench": name, "eager": b["eager"], "compiled": b["compiled"]}
    return None


def scoreboard(world: WorldParams, p: ScoreboardParams, bench_methods: list, paths: WorldPaths) -> dict:
    """The frontier and the headline table of the world from the sweep and the quality points run so far ->
    scoreboard_report.{md,json,png}. bench_methods: bench_spec.methods; a sweep point that is one of them gets the
    wall-clock speedups of the world's bench-spec run (reports/bench/<world>.json)."""
    fams = {f: read_json(paths.sweep_dir / f"{f}.json") for f in p.families
            if (paths.sweep_dir / f"{f}.json").is_file()}
    points = {n: read_json(paths.points_dir / f"{n}.json") for n, pt in p.points.items()
              if pt.world == paths.world and (paths.points_dir / f"{n}.json").is_file()}
    floor = _vanilla_floor(points, p)
    speedups = _bench_speedups(bench_methods, paths.bench_dir / f"{paths.world}.json")
    rows = {}
    for f, sw in fams.items():
        pts = sw["points"]
        row = {"lossless": all(r["lossless"] for r in pts), "points": len(pts)}
        for b in p.budgets:
            best = pick(pts, b)
            row[f"tv<={b:g}"] = None if best is None else {"tau": best["tau"], "tv": best["tv"], "label": best["label"],
                                                           "timed": _timed(best, speedups)}
        same = [n for n, r in points.items() if r.get("within_budget") and p.points[n].family == f and floor
                and p.points[n].temperature is None and p.points[n].top_k is None
                and all(compare.overlaps(r["metrics"][k], floor[k]) for k in floor)]
        best_same = max(same, key=lambda n: points[n]["tau"], default=None)
        row["indistinguishable"] = None if best_same is None else {
            "point": best_same, "tau": points[best_same]["tau"], "tv": points[best_same]["tv"]}
        rows[f] = row
    out = {"world": paths.world, "budgets": p.budgets, "families": rows, "vanilla_floor": floor,
           "points": {n: {k: v for k, v in r.items() if k not in ("method", "sampling")} for n, r in points.items()}}
    lines = _markdown(paths.world, p, fams, rows, points, floor)
    base = paths.scoreboard_report
    atomic_write_all({base.with_suffix(".png"): scoreboard_plot(paths.world, fams, points, floor),
                      base.with_suffix(".md"): lines_writer(lines),
                      base.with_suffix(".json"): json_writer(out)})
    return {"families": len(rows), "points": len(points)}


def _markdown(world: str, p: ScoreboardParams, fams: dict, rows: dict, points: dict, floor: dict) -> list[str]:
    images = next(iter(fams.values()))["images"] if fams else 0
    lines = [f"# Scoreboard, {world}: tau at matched quality", "",
             f"Sweep: {images} images per point (the quality conditions' first ones, the same seeds for every point), "
             "tau = tokens per target forward, TV = mean per-token total variation between the law each token was "
             "drawn from and the target's, measured exactly (0: lossless). `lisa sweep`, one stage per family. Each "
             "chosen point's wall-clock speedup against vanilla of the same mode follows, eager and compiled "
             "(reports/bench, batch 1: bench-spec times every point a budget picks beside its own methods, "
             "named after the bench method it is or <family>[<label>]).", "",
             "| family | lossless | points | " + " | ".join(f"tau at TV <= {b:g}" for b in p.budgets)
             + " | indistinguishable from vanilla |",
             "|---|---|---|" + "---|" * len(p.budgets) + "---|"]
    for f, r in sorted(rows.items(), key=lambda kv: -max((v["tau"] for k, v in kv[1].items()
                                                          if k.startswith("tv<=") and v), default=0)):
        cells = []
        for b in p.budgets:
            v = r[f"tv<={b:g}"]
            t = v and v["timed"]
            clock = "" if not t else (f"; {t['eager']:.2f}x eager" + (f", {t['compiled']:.2f}x compiled"
                                                                      if t["compiled"] else "") + f" as {t['bench']}")
            cells.append("-" if v is None else f"{v['tau']:.2f} (TV {v['tv']:.3f}, {v['label']}{clock})")
        ind = r["indistinguishable"]
        ind = "not measured" if ind is None else f"tau {ind['tau']:.2f} at TV {ind['tv']:.3f} ({ind['point']})"
        lines.append(f"| {f} | {'yes' if r['lossless'] else 'no'} | {r['points']} | " + " | ".join(cells)
                     + f" | {ind} |")
    lines += ["", "Who leads at each budget (lossless rows at every budget; speedups of the same bench-spec run):", "",
              "| TV budget | highest tau | fastest eager | fastest compiled |", "|---|---|---|---|"]
    for b in p.budgets:
        cells = {f: {"tau": r[f"tv<={b:g}"]["tau"], **(r[f"tv<={b:g}"]["timed"] or {})} for f, r in rows.items()
                 if f != "vanilla" and r[f"tv<={b:g}"]}
        lead = [("-" if n is None else f"{n} ({cells[n][m]:.2f}{'' if m == 'tau' else 'x'})")
                for m, n in leaders(cells).items()]
        lines.append(f"| <= {b:g} | " + " | ".join(lead) + " |")
    lines += ["", "Quality points: each decodes its own images (tau and TV measured there too), scored against the "
              "held-out reference; value [bias-corrected bootstrap 95% interval] over resamples of the generated "
              "images (lisa.quality.compare). Vanilla's seeds give the noise floor: a point is indistinguishable "
              "from vanilla when every interval overlaps the union of vanilla's seed intervals.", ""]
    if points:
        keys = list(next(r for r in points.values() if r.get("within_budget"))["metrics"]) if any(
            r.get("within_budget") for r in points.values()) else []
        lines += ["| point | family | budget | samples | tau | TV | " + " | ".join(keys) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(keys)]
        for n, r in points.items():
            if not r.get("within_budget"):
                lines.append(f"| {n} | {r['family']} | {r['budget']} | no sweep point within the budget |"
                             + " |" * (len(keys) + 2))
                continue
            ms = [f"{r['metrics'][k]['value']:.4g} [{r['metrics'][k]['lo']:.4g}, {r['metrics'][k]['hi']:.4g}]"
                  for k in keys]
            lines.append(f"| {n} | {r['family']} | {r['budget'] if r['budget'] is not None else '-'} | "
                         f"{r['samples']} | {r['tau']:.2f} | {r['tv']:.3f} | " + " | ".join(ms) + " |")
    return lines + [""]


STAGES = {
    "sweep": Stage(lambda c, family: sweep(c.world, family, c.params.scoreboard, c.paths), out="sweep_dir"),
    "quality-point": Stage(lambda c, point: quality_point(c.world, point, c.params.scoreboard, c.params.quality,
                                                          c.paths), out="points_dir"),
    "scoreboard": Stage(lambda c: scoreboard(c.world, c.params.scoreboard, c.params.bench_spec.methods, c.paths),
                        out="scoreboard_report"),
}
