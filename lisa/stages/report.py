"""The `table` stage: the headline (per world and method, tau and wall-clock speedup at each TV budget and where
quality is indistinguishable from vanilla, read from the world's scoreboard: the only source of the README's
claims), then the per-method quality cells (bench-spec speed, eval-method quality) and the tau-FID Pareto plot;
`summary`: each world's headline from it, the metrics file `dvc metrics show` lists."""
from __future__ import annotations

import json
from pathlib import Path

from lisa.checkpoint import atomic_write_all, json_writer, write_json
from lisa.config import TableParams
from lisa.stages.paths import SharedPaths, Stage, WorldPaths
from lisa.stages.render import describe_cell, leaders, lines_writer, pareto_plot


def _header(p: TableParams) -> list[str]:
    return ["# LISA against the baselines", "",
            "Headline, per world: each method's highest tau within a per-token TV budget (the scoreboard's sweep: "
            "`lisa sweep`, 100 images per point, TV measured exactly; lossless rows sit at TV 0 in every column), "
            "with its wall-clock speedup against vanilla of the same mode, eager / compiled (`lisa bench-spec`, "
            "batch 1, this machine), and the highest tau whose image-quality point is indistinguishable from "
            "vanilla's seeds (`lisa quality-point`: every bootstrap interval overlaps vanilla's). "
            f"{', '.join(f'{k} = the scoreboard family {v}' for k, v in p.headline.items())}; the other rows "
            "are the peers' families. Details: reports/scoreboard/<world>.md.", ""]


def _cells_header(p: TableParams) -> list[str]:
    return ["## Quality cells (not the basis of any claim)", "",
            f"Speedup and tau: `lisa bench-spec --world W` (every method in one run, batch 1, wall clock on this "
            f"machine). Quality: {p.num_samples} samples per cell (`lisa eval-method`), FID / KID against the held-out "
            "images; CLIP score (t2i) or class consistency (c2i) from the world's judge. TV: mean total variation "
            "between the distribution each token was drawn from and the target's (0 for lossless methods). tau "
            "(quality run): acceptance length measured in the batched quality run itself. At this sample count "
            "vanilla's own FID spread covers every row (the scoreboard's 1000-sample points with intervals do not "
            "have that problem).", ""]


def headline(board: dict, p: TableParams) -> dict:
    """A world's headline from its scoreboard (reports/scoreboard/<world>.json): {"rows": {name: {"family",
    "lossless", "lisa", budget key: {"tau", "tv", "label", "eager", "compiled"} | None, "indistinguishable"}},
    "leaders": {budget key: {"tau" | "eager" | "compiled": name}}, "goals": {...}}. LISA rows first (p.headline's
    names), then the peers by their tau at the loosest budget; families missing from the scoreboard are skipped."""
    fams, keys = board["families"], [f"tv<={b:g}" for b in board["budgets"]]
    lisa = {f: n for n, f in p.headline.items() if f in fams}
    peers = sorted((f for f in fams if f not in lisa), key=lambda f: (f == "vanilla", -max(
        (fams[f][k]["tau"] for k in keys if fams[f][k]), default=0.0)))
    rows = {}
    for f in [*lisa, *peers]:
        r = fams[f]
        row = {"family": f, "lossless": r["lossless"], "lisa": f in lisa}
        for k in keys:
            c = r[k]
            row[k] = None if c is None else {"tau": c["tau"], "tv": c["tv"], "label": c["label"],
                                             "eager": (c["timed"] or {}).get("eager"),
                                             "compiled": (c["timed"] or {}).get("compiled")}
        row["indistinguishable"] = r["indistinguishable"]
        rows[lisa.get(f, f)] = row
    lead = {k: leaders({n: r[k] for n, r in rows.items() if r["family"] != "vanilla" and r[k]}) for k in keys}
    return {"rows": rows, "leaders": lead, "goals": _goals(rows, keys)}


def _goals(rows: dict, keys: list[str]) -> dict:
    """The LISA issue's ratios: LISA-lossless tau over the best lossless peer's, and at each budget the LISA row's
    tau over the best relaxed peer's (the lossless rows count at every budget)."""
    lossless = next((n for n, r in rows.items() if r["lisa"] and r["lossless"]), None)
    relaxed = next((n for n, r in rows.items() if r["lisa"] and not r["lossless"]), None)
    peers = {n: r for n, r in rows.items() if not r["lisa"] and r["family"] != "vanilla"}
    out = {}
    best = max((n for n, r in peers.items() if r["lossless"] and r[keys[0]]), key=lambda n: peers[n][keys[0]]["tau"],
               default=None)
    if lossless and best:
        out["lossless"] = {"lisa": lossless, "peer": best,
                           "ratio": rows[lossless][keys[0]]["tau"] / peers[best][keys[0]]["tau"]}
    for k in keys:
        best = max((n for n, r in peers.items() if r[k]), key=lambda n: peers[n][k]["tau"], default=None)
        if relaxed and best and rows[relaxed][k]:
            out[k] = {"lisa": relaxed, "peer": best, "ratio": rows[relaxed][k]["tau"] / peers[best][k]["tau"]}
    return out


def _headline_lines(w: str, board: dict, head: dict) -> list[str]:
    keys = [f"tv<={b:g}" for b in board["budgets"]]
    lines = [f"## {w}", "", "| method | family | lossless | " + " | ".join(
        f"TV <= {b:g}: tau (TV), eager / compiled" for b in board["budgets"]) + " | indistinguishable from vanilla |",
             "|---|---|---|" + "---|" * len(keys) + "---|"]
    speed = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    for n, r in head["rows"].items():
        cells = ["-" if r[k] is None else f"{r[k]['tau']:.2f} ({r[k]['tv']:.3f}), {speed(r[k]['eager'])} / "
                 f"{speed(r[k]['compiled'])}" for k in keys]
        ind = r["indistinguishable"]
        ind = "not measured" if ind is None else f"tau {ind['tau']:.2f} at TV {ind['tv']:.3f}"
        name = f"**{n}**" if r["lisa"] else n
        lines.append(f"| {name} | {r['family']} | {'yes' if r['lossless'] else 'no'} | " + " | ".join(cells)
                     + f" | {ind} |")
    lines += ["", "| TV budget | highest tau | fastest eager | fastest compiled |", "|---|---|---|---|"]
    for b, k in zip(board["budgets"], keys):
        lead = head["leaders"][k]
        fmt = lambda m: "-" if lead[m] is None else (  # noqa: E731
            f"{lead[m]} ({head['rows'][lead[m]][k][m]:.2f}{'' if m == 'tau' else 'x'})")
        lines.append(f"| <= {b:g} | {fmt('tau')} | {fmt('eager')} | {fmt('compiled')} |")
    g = head["goals"]
    said = []
    if "lossless" in g:
        said.append(f"{g['lossless']['lisa']} tau / the best lossless peer's ({g['lossless']['peer']}): "
                    f"{g['lossless']['ratio']:.2f}x")
    for b, k in zip(board["budgets"], keys):
        if k in g:
            said.append(f"at TV <= {b:g}, {g[k]['lisa']} / the best peer ({g[k]['peer']}): {g[k]['ratio']:.2f}x")
    return lines + ([""] + ["Ratios of tau: " + "; ".join(said) + "."] if said else []) + [""]


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


def results_table(p: TableParams, cells_dirs: dict[str, Path], boards: dict[str, Path], shared: SharedPaths) -> dict:
    """table_file (+ .json): per world the headline from its scoreboard (boards: world -> reports/scoreboard/<w>.json;
    `headline`), then the quality cells in the layout of the paper's main table (world x method: speedup, tau, FID,
    CLIP score or class consistency, plus KID and the measured TV relaxation) and the tau-FID Pareto plot of the
    `pareto` cells (pareto_file). The cells' speedup and tau come from the world's bench-spec run (same run for every
    method); their quality columns from each eval-method cell. cells_dirs: world -> folder of its cells. JSON:
    {world: {"headline": ..., "cells": {cell: row}}}."""
    names = list(dict.fromkeys(p.rows + p.pareto))
    cells = {w: {n: json.loads((Path(d) / f"{n}.json").read_text()) for n in names} for w, d in cells_dirs.items()}
    lines, rows_out = _header(p), {}
    for w in cells_dirs:
        if not Path(boards[w]).is_file():
            raise FileNotFoundError(f"{boards[w]}: no scoreboard of {w} (`lisa scoreboard --world {w}`)")
        board = json.loads(Path(boards[w]).read_text())
        rows_out[w] = {"headline": headline(board, p)}
        lines += _headline_lines(w, board, rows_out[w]["headline"])
    lines += _cells_header(p)
    for w in cells_dirs:
        bench = json.loads((shared.bench_dir / f"{w}.json").read_text())
        section, rows_out[w]["cells"] = _world_rows(w, p, bench, cells[w])
        lines += ["#" + section[0]] + section[1:]
    lines += [f"Pareto plot (tau against FID over the cells {', '.join(p.pareto)}): `{shared.pareto_file.name}`.", ""]
    atomic_write_all({shared.pareto_file: pareto_plot(cells, p.pareto),  # one output: renamed into place together
                      shared.table_file: lines_writer(lines, end=""),
                      shared.table_file.with_suffix(".json"): json_writer(rows_out)})
    return rows_out


def _budget_key(k: str) -> str:
    """"tv<=0.05" -> "05", "tv<=0.3" -> "30", "tv<=1" -> "100": a TV budget in hundredths."""
    return f"{round(100 * float(k[4:])):02d}"


def summary(world: str, p: TableParams, shared: SharedPaths, out: Path) -> dict:
    """The world's headline, from the results table's (table.json) headline: the fastest lossless row (eager speedup
    `x`, batch 1) and the LISA row's cells (per TV budget: tau and the eager speedup x), and vanilla's FID
    from the quality cells -> out, a small metrics file: these files are what `dvc metrics show` lists, one row per
    world."""
    table = shared.table_file.with_suffix(".json")
    rows = json.loads(table.read_text())
    if world not in rows:
        raise ValueError(f"{table}: no world {world!r} (worlds: {sorted(rows)}); run `lisa table` first")
    head, cells = rows[world]["headline"]["rows"], rows[world]["cells"]
    first = next(k for r in head.values() for k in r if k.startswith("tv<="))
    timed = {n: r for n, r in head.items() if r["family"] != "vanilla" and r["lossless"] and r[first]
             and r[first]["eager"] is not None}
    lossless = max(timed, key=lambda n: timed[n][first]["eager"], default=None)
    vanilla = next((n for n in cells if p.cells[n].method == "vanilla"), None)
    metrics = {"vanilla_fid": cells[vanilla]["fid"]} if vanilla else {}
    if lossless:
        metrics["lossless"] = {"method": lossless, "x": timed[lossless][first]["eager"],
                               "tau": timed[lossless][first]["tau"]}
    lisa = next((n for n, r in head.items() if r["lisa"] and not r["lossless"]), None)
    if lisa:  # short keys, so that `dvc metrics show` fits a terminal: tau05 / x05 = tau / eager speedup at TV <= 0.05
        cells = {_budget_key(k): c for k, c in head[lisa].items() if k.startswith("tv<=") and c}
        metrics["lisa"] = {f"{n}{b}": c[key] for b, c in cells.items() for n, key in (("tau", "tau"), ("x", "eager"))}
    write_json(out, metrics)
    return metrics


STAGES = {
    "table": Stage(lambda c: results_table(
        c.params.table, {w: WorldPaths.of(w, c.shared.root).cells_dir for w in c.params.worlds},
        {w: WorldPaths.of(w, c.shared.root).scoreboard_report.with_suffix(".json") for w in c.params.worlds},
        c.shared), out="reports_dir", world=False),
    "summary": Stage(lambda c: summary(c.paths.world, c.params.table, c.shared, c.paths.summary_file),
                     out="summary_file"),
}
