"""The `table` stage: the paper's main table (world x method) and the tau-FID Pareto plot, from the bench-spec runs
and the eval-method cells; `summary`: each world's headline from it, the metrics file `dvc metrics show` lists."""
from __future__ import annotations

import json
from pathlib import Path

from lisa.checkpoint import atomic_write_all, json_writer, write_json
from lisa.config import TableParams
from lisa.stages.paths import SharedPaths, Stage, WorldPaths
from lisa.stages.render import describe_cell, lines_writer, pareto_plot


def _header(p: TableParams) -> list[str]:
    return ["# LISA against the baselines", "",
            f"Speedup and tau: `lisa bench-spec --world W` (every method in one run, batch 1, wall clock on this "
            f"machine). Quality: {p.num_samples} samples per cell (`lisa eval-method`), FID / KID against the held-out "
            "images; CLIP score (t2i) or class consistency (c2i) from the world's judge. TV: mean total variation "
            "between the distribution each token was drawn from and the target's (0 for lossless methods). tau "
            "(quality run): acceptance length measured in the batched quality run itself.", ""]


def _world_rows(w: str, p: TableParams, bench: dict, cells: dict[str, dict]) -> tuple[list[str], dict]:
    """One world's section of the table (Markdown lines) and its rows (JSON): `p.rows` with speedup and tau from
    bench-spec, then the other `p.pareto` cells (quality only)."""
    bm = {m["name"]: m for m in bench["methods"]}
    score = "clip_score" if "clip_score" in next(iter(cells.values())) else "class_consistency"
    van = cells.get("vanilla")
    lines = [f"## {w}", "", f"| method | settings | speedup | tau | FID | FID vs vanilla | KID | "
             f"{'CLIP score' if score == 'clip_score' else 'class consistency'} | TV | tau (quality run) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = {}
    for n in p.rows:
        b, c = bm[p.cells[n].bench or n], cells[n]
        rel = c["fid"] / van["fid"] - 1 if van else float("nan")
        lines.append(f"| {n} | {describe_cell(p.cells[n])} | {b.get('speedup', float('nan')):.2f}x | "
                     f"{b['tau']:.2f} | {c['fid']:.2f} | {100 * rel:+.1f}% | {c['kid']:.4f} | {c[score]:.2f} | "
                     f"{c['tv_mean']:.3f} | {c['tau']:.2f} |")
        rows[n] = {"speedup": b.get("speedup"), "tau": b["tau"], "fid": c["fid"], "fid_vs_vanilla": rel,
                   "kid": c["kid"], score: c[score], "tv": c["tv_mean"], "tau_quality_run": c["tau"],
                   "bench_method": b["name"]}
    for n in [x for x in p.pareto if x not in p.rows]:
        c = cells[n]
        rows[n] = {"fid": c["fid"], "fid_vs_vanilla": c["fid"] / van["fid"] - 1 if van else None,
                   "kid": c["kid"], score: c[score], "tv": c["tv_mean"], "tau_quality_run": c["tau"]}
    return lines + [""], rows


def results_table(p: TableParams, cells_dirs: dict[str, Path], shared: SharedPaths) -> dict:
    """table_file (+ .json) in the layout of the paper's main table (world x method: speedup, tau, FID, CLIP score or
    class consistency, plus KID and the measured TV relaxation) and the tau-FID Pareto plot of the `pareto` cells
    (pareto_file). Speedup and tau come from the world's bench-spec run (same run for every method); the quality
    columns from each eval-method cell. cells_dirs: world -> folder of its cells."""
    names = list(dict.fromkeys(p.rows + p.pareto))
    cells = {w: {n: json.loads((Path(d) / f"{n}.json").read_text()) for n in names} for w, d in cells_dirs.items()}
    lines, rows_out = _header(p), {}
    for w in cells_dirs:
        bench = json.loads((shared.bench_dir / f"{w}.json").read_text())
        section, rows_out[w] = _world_rows(w, p, bench, cells[w])
        lines += section
    lines += [f"Pareto plot (tau against FID over the cells {', '.join(p.pareto)}): `{shared.pareto_file.name}`.", ""]
    atomic_write_all({shared.pareto_file: pareto_plot(cells, p.pareto),  # one output: renamed into place together
                      shared.table_file: lines_writer(lines, end=""),
                      shared.table_file.with_suffix(".json"): json_writer(rows_out)})
    return rows_out


def summary(world: str, p: TableParams, shared: SharedPaths, out: Path) -> dict:
    """The world's headline, from the results table (table.json): vanilla's FID; the fastest lossless row (TV 0)
    and the fastest LISA row (GASV) with their speedup against vanilla (bench-spec, eager, batch 1), tau, and for
    LISA the TV and FID against vanilla's -> out, a metrics file of nine keys: these files are what `dvc metrics
    show` lists, one row per world."""
    table = shared.table_file.with_suffix(".json")
    rows = json.loads(table.read_text())
    if world not in rows:
        raise ValueError(f"{table}: no world {world!r} (worlds: {sorted(rows)}); run `lisa table` first")
    rows = rows[world]
    timed = {n: r for n, r in rows.items() if n in p.cells and r.get("speedup") is not None}
    vanilla = next(n for n in timed if p.cells[n].method == "vanilla")
    fastest = lambda names: max(names, key=lambda n: timed[n]["speedup"], default=None)  # noqa: E731
    lossless = fastest([n for n, r in timed.items() if n != vanilla and r["tv"] < 1e-3])
    lisa = fastest([n for n in timed if p.cells[n].method == "gasv"])
    metrics = {"vanilla_fid": rows[vanilla]["fid"]}
    if lossless:
        metrics["lossless"] = {"method": lossless} | {k: timed[lossless][k] for k in ("speedup", "tau")}
    if lisa:
        r = timed[lisa]
        metrics["lisa"] = {"method": lisa, "speedup": r["speedup"], "tau": r["tau"], "tv": r["tv"],
                           "fid_rel": r["fid_vs_vanilla"]}
    write_json(out, metrics)
    return metrics


STAGES = {
    "table": Stage(lambda c: results_table(c.params.table, {w: WorldPaths.of(w, c.shared.root).cells_dir
                                                            for w in c.params.worlds}, c.shared),
                   out="reports_dir", world=False),
    "summary": Stage(lambda c: summary(c.paths.world, c.params.table, c.shared, c.paths.summary_file),
                     out="summary_file"),
}
