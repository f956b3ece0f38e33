"""How the stages' results look: Markdown tables, plots and sample grids, written atomically beside the metrics."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from lisa.bench.speed import STEP_PARTS
from lisa.checkpoint import atomic_write
from lisa.data import datasets as data
from lisa.data.images import grid_image
from lisa.decoding.methods import method_spec
from lisa.decoding.verify import VERIFIERS, drafts_tree, method_options, option_keys
from lisa.quality import metrics as quality


def write_lines(path: str | Path, lines: list[str], end: str = "\n") -> None:
    """A text file of `lines`, written atomically."""
    atomic_write(path, lines_writer(lines, end))


def lines_writer(lines: list[str], end: str = "\n"):
    """A writer of `lines` as a text file, for atomic_write / atomic_write_all."""
    return lambda tmp: Path(tmp).write_text("\n".join(lines) + end)


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure_writer(fig):
    """A writer of the figure as a PNG (for atomic_write / atomic_write_all); the figure is closed once written."""
    fig.tight_layout()

    def write(tmp):
        fig.savefig(tmp, format="png", dpi=110)
        _pyplot().close(fig)

    return write


def plot_bench(report: dict, title: str):
    """Speedup per method and the acceptance-length distribution of each (one PNG beside the table): its writer."""
    ms = report["methods"]
    fig, (a, b) = _pyplot().subplots(1, 2, figsize=(12, 4.2))
    names = [m["name"] for m in ms]
    a.barh(names[::-1], [m.get("speedup", 0.0) for m in ms][::-1], color="tab:blue")
    a.axvline(1.0, color="grey", lw=1, ls="--")
    for i, m in enumerate(ms[::-1]):
        a.text(m.get("speedup", 0.0), i, f" {m.get('speedup', 0.0):.2f}x, tau {m['tau']:.2f}", va="center", fontsize=8)
    a.set_xlabel("wall-clock speedup over vanilla (same run)")
    width = max(max(m["accept_hist"]) for m in ms)
    for m in ms:
        if m["method"] == "vanilla":
            continue
        tot = sum(m["accept_hist"].values())
        b.plot(range(1, width + 1), [m["accept_hist"].get(i, 0) / tot for i in range(1, width + 1)], marker="o",
               label=m["name"])
    b.set_xlabel("tokens emitted per target forward (acceptance length, bonus included)")
    b.set_ylabel("share of rounds")
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _figure_writer(fig)


def pareto_plot(cells: dict[str, dict[str, dict]], pareto: list[str]):
    """tau against FID of every cell of each world (cells: world -> name -> metrics), the `pareto` sweep joined: the
    PNG's writer."""
    fig, axes = _pyplot().subplots(1, len(cells), figsize=(6 * len(cells), 4.5), squeeze=False)
    for ax, (w, wc) in zip(axes[0], cells.items()):
        ax.plot([wc[n]["fid"] for n in pareto], [wc[n]["tau"] for n in pareto], "o-", color="tab:red",
                label="GASV sweep (kappa, lambda)")
        for n, c in wc.items():
            ax.scatter(c["fid"], c["tau"], s=30, color="tab:red" if n in pareto else "tab:blue", zorder=3)
            ax.annotate(n, (c["fid"], c["tau"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if "vanilla" in wc:
            ax.axvline(wc["vanilla"]["fid"] * 1.05, color="grey", ls="--", lw=1, label="vanilla FID + 5%")
        ax.set_xlabel("FID (lower is better)")
        ax.set_ylabel("tau: tokens per target forward")
        ax.set_title(w)
        ax.legend(fontsize=8)
    return _figure_writer(fig)


def scoreboard_plot(world: str, fams: dict[str, dict], points: dict[str, dict], floor: dict):
    """The scoreboard's two panels: tau against the measured TV, one curve per sweep family (its points in TV order);
    the quality points' Inception FID with their 95% intervals against their TV, vanilla's seed band behind: the
    PNG's writer."""
    fig, (a, b) = _pyplot().subplots(1, 2, figsize=(13, 4.8))
    colors = _pyplot().get_cmap("tab20").colors
    for i, (f, sw) in enumerate(fams.items()):
        pts = sorted(sw["points"], key=lambda r: r["tv"])
        a.plot([r["tv"] for r in pts], [r["tau"] for r in pts], "o-" if len(pts) > 1 else "s", ms=4, label=f,
               color=colors[2 * i % 20 + (2 * i // 20) % 2])
    a.set_xlabel("measured per-token TV to the target (0 = lossless)")
    a.set_ylabel("tau: tokens per target forward")
    a.set_title(f"{world}: the sweep")
    a.legend(fontsize=7, ncol=2)
    shown = {n: r for n, r in points.items() if r.get("within_budget")}
    if "fid" in floor:
        b.axhspan(floor["fid"]["lo"], floor["fid"]["hi"], color="grey", alpha=0.2,
                  label=f"vanilla, {floor['fid']['seeds']} seeds")
    for n, r in shown.items():
        m = r["metrics"]["fid"]
        b.errorbar(r["tv"], m["value"], yerr=[[m["value"] - m["lo"]], [m["hi"] - m["value"]]], fmt="o", capsize=3)
        b.annotate(f"{n} (tau {r['tau']:.2f})", (r["tv"], m["value"]), fontsize=7, xytext=(4, 2),
                   textcoords="offset points")
    b.set_xlabel("measured per-token TV to the target")
    b.set_ylabel("Inception FID [95% interval] (lower is better)")
    b.set_title(f"{world}: quality points")
    if "fid" in floor:
        b.legend(fontsize=7)
    return _figure_writer(fig)


def leaders(cells: dict[str, dict]) -> dict[str, Optional[str]]:
    """Who leads at one TV budget: per metric (tau, eager, compiled), the name in `cells` (name -> {metric: value})
    with the highest value; a missing or None value does not compete; the first of equals wins."""
    return {m: max((n for n, c in cells.items() if c.get(m) is not None), key=lambda n: cells[n][m], default=None)
            for m in ("tau", "eager", "compiled")}


def describe_cell(c) -> str:
    """A table cell's settings in a few words: window, or tree and the verifier's knobs its registry entry shows."""
    if c.method == "vanilla":
        return "-"
    if not drafts_tree(c.method):
        return f"window {c.window}"
    o = method_options(c)
    tree = (method_spec(c).describe() if c.draft == "sample" else
            f"{c.tree} d{c.depth} top-{c.top_k_draft} {c.total_tokens} nodes")
    keys = option_keys(type(o))  # params.yaml key -> the options' field
    knobs = "".join(f", {key} {getattr(o, keys[key].name):g}" for key in VERIFIERS[c.method].shown)
    return tree + knobs + (", LID drafter" if c.drafter == "lid" else "")


def ablation_markdown(results: dict, spec, sampling, steps: int, conditions: int, ratio: float) -> list[str]:
    """ablate-lid's table: tau and held-out agreement / soft CE of the baseline and the LID drafter."""
    lines = [f"## LID vs baseline drafter loss ({steps} steps from the same logit cache; exact verification, "
             f"{spec.tree} tree depth {spec.depth}, {spec.total_tokens} nodes; T={sampling.temperature:g}, "
             f"CFG {sampling.cfg_scale:g}; {conditions} conditions)", "",
             "| loss | tau (exact) | held-out top-1 agreement (TTT steps) | held-out soft CE |", "|---|---|---|---|"]
    for name in ("baseline", "lid"):
        r = results[name]
        lines.append(f"| {name} | {r['tau_exact']:.3f} | "
                     f"{' / '.join(f'{a:.3f}' for a in r['heldout_top1_agreement'])} | "
                     f"{' / '.join(f'{c:.3f}' for c in r['heldout_soft_ce'])} |")
    return lines + ["", f"LID / baseline tau: {ratio:.3f}"]


def drafter_table_markdown(world: str, runs: dict, groups: dict) -> list[str]:
    """drafter-table's markdown: every named drafter of a world, then its entries pooled over seeds."""
    fmt = lambda v, f=".3f": "-" if v is None else format(v, f)  # noqa: E731
    lines = [f"## Drafters, {world}", "",
             "The release drafter (train-drafter) and ablate-lid's LID drafter as references, then the named drafters, "
             "each trained from the logit cache (lisa named-drafter). Held-out: 512 test sequences, TTT step 0 (a "
             "draft's first token): the target mass on the drafter's top-4, sum_x min(p, q) on the conditional rows "
             "and under the world's CFG (the acceptance of one sampled draft under exact); rise: its change over the "
             "last 20% of steps. tau / speedup: exact on the sampled tree against vanilla, interleaved, eager.", "",
             "| drafter | architecture | loss | guided | seed | steps | train min | top-4 mass | overlap | overlap CFG "
             "| rise (overlap CFG) | tau | vanilla ms | exact ms | speedup |", "|" + "---|" * 15]
    for name, r in runs.items():
        e, c, h = r["entry"], r["config"], r["heldout"]
        ffn = "SwiGLU" if c["ffn_dim"] is None else c["ffn_dim"]
        arch = f"D {c.get('width') or c['dim']}, ffn {ffn}" + (f", head rank {c['head_rank']}" if c.get("head_rank")
                                                               else "")
        minutes = None if r["train"].get("train_s") is None else r["train"]["train_s"] / 60
        label = f"{name} (reference)" if e.get("reference") else name
        lines.append(f"| {label} | {arch} | {e['loss']} | {e['guided']:g} | {r['seed']} | {r['steps']} | "
                     f"{fmt(minutes, '.1f')} | {h['heldout_topk_mass'][0]:.3f} | {h['heldout_overlap'][0]:.3f} | "
                     f"{h['heldout_overlap_cfg'][0]:.3f} | {fmt(r['rise_last_20pct'].get('heldout_overlap_cfg_s0'), '+.2%')} "
                     f"| {r['tau']:.2f} | {r['ms_per_image']['vanilla']:.0f} | {r['ms_per_image']['exact']:.0f} | "
                     f"{r['speedup_eager']:.2f}x |")
    lines += ["", "Pooled over seeds (mean, +- the 95% t-interval's half-width over seeds; - with one seed):", "",
              "| entry | seeds | tau | speedup | top-4 mass | overlap | overlap CFG |", "|---|---|---|---|---|---|---|"]
    for label, g in groups.items():
        cell = lambda k: f"{g[k]['mean']:.3f}" + (f" +- {g[k]['ci95']:.3f}" if g[k]["ci95"] is not None else "")  # noqa: E731
        lines.append(f"| {label} | {', '.join(map(str, g['seeds']))} | {cell('tau')} | {cell('speedup_eager')} | "
                     f"{cell('topk_mass_s0')} | {cell('overlap_s0')} | {cell('overlap_cfg_s0')} |")
    return lines


def drafter_curves_figure(world: str, curves: dict):
    """drafter-table's plot: each named drafter's held-out overlap (unguided, guided) against its training steps."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for name, df in curves.items():
        for ax, col in zip(axes, ("heldout_overlap_s0", "heldout_overlap_cfg_s0")):
            if col in df:
                ax.plot(df["step"], df[col], label=name)
    for ax, title in zip(axes, ("sum_x min(p, q), conditional rows", "sum_x min(p, q), guided (the world's CFG)")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{world}: held-out, TTT step 0")
    axes[1].legend(fontsize=8)
    return _figure_writer(fig)


def ddp_markdown(world: str, steps: int, rows: list[dict]) -> list[str]:
    """bench-ddp's table: steps/s of each run against 1 process with 2 threads."""
    lines = [f"## Drafter training throughput, {world} ({steps} steps each, same global batch)", "",
             "| run | steps/s | vs 1 process, 2 threads |", "|---|---|---|"]
    return lines + [f"| {r['run']} | {r['steps_per_s']:.2f} | {r['vs_1_process_2_threads']:.2f}x |" for r in rows]


def quality_grid(images: torch.Tensor, labels: torch.Tensor, captions: list[str], cfg, names, vq,
                 test_codes: torch.Tensor, rows: int = 10, per_row: int = 8):
    """The samples as a PIL image (save it with `.save(path, format="PNG")`). c2i: one row per class, its first
    samples (`names`: the class names, or None); t2i: one row per held-out caption, the held-out image (through the
    tokenizer) first, then the samples made for that caption."""
    if cfg.model_type == "c2i":
        nrow = max(1, min(per_row, len(images) // cfg.num_classes))
        pick = {c: torch.nonzero(labels == c).flatten()[:nrow] for c in range(min(rows, cfg.num_classes))}
        pick = {c: i for c, i in pick.items() if len(i) == nrow}
        grid = images[torch.cat(list(pick.values()))]
        text = [f"{c} {names[c]}" if names else str(c) for c in pick]
    else:
        n, n_test = len(images), len(test_codes)
        nrow = 1 + len(range(0, n, n_test))  # the real image, then every sample of its caption
        seen, parts, text = set(), [], []
        for j in range(min(n, n_test)):
            idx = torch.arange(j, n, n_test)[: nrow - 1]
            if captions[j] in seen or len(idx) < nrow - 1:
                continue
            seen.add(captions[j])
            parts += [quality.decode_tokens(vq, test_codes[j : j + 1]), images[idx]]
            text.append(captions[j])
            if len(text) == rows:
                break
        grid = torch.cat(parts)
    return grid_image(data.to_model_range(grid), nrow=nrow, labels=text)


def markdown_table(rows: list[dict], title: str) -> str:
    lines = [f"## {title}", "",
             "| cfg scale | batch | rows/forward | tokens | loop s | bare forwards s | tokens/s | ms/step | loop overhead |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cfg_scale']:g} | {r['batch_size']} | {r['rows_in_forward']} | {r['num_tokens']} | "
                     f"{r['loop_s']:.3f} | {r['bare_forwards_s']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['ms_per_token_step']:.2f} | {100 * r['loop_overhead']:+.1f}% |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Speculative decoding benchmark: every method on the same conditions and seeds, in one run.


def speculative_markdown(report: dict, title: str) -> str:
    """The benchmark as Markdown: the method table, acceptance-length histograms, per-condition rows, auto picks."""
    ms = report["methods"]
    lines = [f"## {title}", "",
             f"{report['images_per_method_pass']} images per method per pass, median of {report['repeats']} passes "
             f"after {report['warmup']} warm-up, methods interleaved; {report['rows_in_forward']} rows per forward "
             f"(CFG doubles the batch); {report['threads']} threads on {report['device']}. Times are the decode loop "
             "only; timed apart: the VQ decode"
             + (f" ({report['vq_decode_ms_per_image']:.1f} ms per image)" if report["vq_decode_ms_per_image"] else "")
             + (f" and the caption encoding ({report['text_encode_ms_per_prompt']:.1f} ms per prompt)"
                if report.get("text_encode_ms_per_prompt") else "") + ".", "",
             "| method | verifier | tree | ms / image | speedup | tau | target forwards / image | loop ms / forward "
             "| bare forward ms (tokens) | loop overhead | limit ms / forward | loop / limit | in target | in drafter |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in ms:
        tree = m.get("tree_desc") or "-"
        if m["auto"]:
            tree += " (auto)"
        lines.append(f"| {m['name']} | {m['method']} | {tree} | {m['ms_per_image']:.1f} | "
                     f"{m.get('speedup', float('nan')):.2f}x "
                     f"| {m['tau']:.2f} | {m['target_forwards_per_image']:.1f} | {m['loop_ms_per_forward']:.2f} | "
                     f"{m['bare_forward_ms']:.2f} ({m['forward_tokens']}) | {100 * m['loop_overhead']:+.0f}% | "
                     f"{m.get('limit_ms_per_forward', float('nan')):.2f} | {m.get('loop_to_limit', float('nan')):.2f} | "
                     f"{100 * m['target_share']:.0f}% | {100 * m['drafter_share']:.0f}% |")
    parts = list(dict.fromkeys(p for m in ms for p in m.get("round_ms", {})))
    if parts:
        lines += ["", "Per round, where the time goes (one instrumented pass apart from the timed ones: hooks on every "
                      "forward, a clock between the loop's parts; ms per round, the prefill's share included; bare "
                      "round: the bare forwards a round makes, timed alone; round / forwards: the round over its own "
                      "target and drafter forwards as the hooks timed them in the loop, the loop's overhead without "
                      "the bare timings' bias: a forward timed alone, at 2 threads, costs more than the same forward "
                      "in the loop, so round / bare understates the overhead)", "",
                  "| method | " + " | ".join(parts) + " | round | bare round | round / bare | round / forwards |",
                  "|---|" + "---|" * (len(parts) + 4)]
        for m in ms:
            r = m.get("round_ms", {})
            fw = r.get("target forward", 0.0) + r.get("drafter forwards", 0.0)
            lines.append(f"| {m['name']} | " + " | ".join(f"{r[p]:.2f}" if p in r else "-" for p in parts)
                         + f" | {m['round_ms_total']:.2f} | {m['bare_round_ms']:.2f} | "
                           f"{m['round_ms_total'] / m['bare_round_ms']:.2f} | "
                           + (f"{m['round_ms_total'] / fw:.2f} |" if fw > 0 else "- |"))
    for which, st in (report.get("drafter_step") or {}).items():
        lines += ["", f"Drafter step ({which} drafter), where it goes: ms per step at w pairs per row, {st['rows']} rows, "
                      f"after {st['context']} cached pairs; cold: right after a target forward over "
                      f"{st['cold_after_tokens']} tokens (as in the loop), warm: right after another drafter step; "
                      f"parts by hooks on its submodules (glue: what lies between them); t(1) = {st['t1_ms']:.2f} ms "
                      f"(the one-token target forward, same repetitions); the fc over the fused taps, once per round "
                      f"in the commit: {st['fc_ms']:.3f} ms", "",
                  "| w | when | step ms | step / t(1) | " + " | ".join(STEP_PARTS) + " | glue |",
                  "|---|---|---|---|" + "---|" * (len(STEP_PARTS) + 1)]
        for w, modes in st["widths"].items():
            for mode, x in modes.items():
                lines.append(f"| {w} | {mode} | {x['step_ms']:.3f} | {x['step_over_t1']:.2f} | "
                             + " | ".join(f"{x[part]:.3f}" for part in (*STEP_PARTS, "glue")) + " |")
    if report.get("compiled"):
        lines += ["", "Eager and compiled, side by side (the same interleaved passes; compiled: the target's and the "
                      "drafter's forwards under torch.compile, inductor, static shapes, one graph per shape, with the "
                      "loop's pure bookkeeping steps fused (lisa.decoding.fused; the random draws and cache moves stay "
                      "eager)). "
                      "Each speedup is against vanilla of the same mode, never across modes; loop / limit: the loop's "
                      "time per target forward against the bare forwards a round makes, timed in the same mode.",
                  "", "| method | eager ms / image | eager speedup | compiled ms / image | compiled speedup | "
                      "eager / compiled | tau (eager, compiled) | compile s | loop / limit (eager, compiled) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in report["compiled"]:
            ratio = (f"{c['eager_loop_to_limit']:.2f}, {c['loop_to_limit']:.2f}"
                     if c.get("loop_to_limit") is not None and c.get("eager_loop_to_limit") is not None else "-")
            lines.append(f"| {c['name']} | {c['eager_ms_per_image']:.1f} | {c['eager_speedup']:.2f}x | "
                         f"{c['ms_per_image']:.1f} | {c['speedup']:.2f}x | {c['compiled_over_eager']:.2f} | "
                         f"{c['eager_tau']:.2f}, {c['tau']:.2f} | {c['compile_s']:.0f} | {ratio} |")
        eager_tree = {m["name"]: m["tree_desc"] for m in report["methods"]}
        for c in report["compiled"]:
            if c.get("auto"):
                same = "the same tree as eager" if c["tree_desc"] == eager_tree.get(c["name"]) else \
                    f"eager: {eager_tree.get(c['name'])}"
                lines += ["", f"{c['name']} compiled: tree auto priced with compiled costs: {c['tree_desc']} ({same})."]
    tp = report.get("throughput")
    if tp:
        lines += ["", f"Throughput: images per second decoding a batch of b images in one call (each row accepts its "
                      f"own length; CFG doubles the rows), median of {tp['repeats']} passes after a warm-up; speedup "
                      "against vanilla of the same batch and mode.", "",
                  "| method | mode | " + " | ".join(f"b = {b}" for b in tp["batch_sizes"]) + " |",
                  "|---|---|" + "---|" * len(tp["batch_sizes"])]
        cell = {(r["batch"], r["method"], r["mode"]): r for r in tp["rows"]}
        for n, mode in dict.fromkeys((r["method"], r["mode"]) for r in tp["rows"]):
            lines.append(f"| {n} | {mode} | " + " | ".join(
                f"{cell[b, n, mode]['images_per_s']:.2f} img/s"
                + (f" ({cell[b, n, mode]['speedup']:.2f}x, tau {cell[b, n, mode]['tau']:.2f})"
                   if cell[b, n, mode]["speedup"] is not None else "")
                for b in tp["batch_sizes"]) + " |")
    width = max(max(m["accept_hist"]) for m in ms)
    lines += ["", "Acceptance length per round (tokens emitted per target forward, bonus included): share of rounds",
              "", "| method | " + " | ".join(str(i) for i in range(1, width + 1)) + " |",
              "|---|" + "---|" * width]
    for m in ms:
        tot = sum(m["accept_hist"].values())
        lines.append(f"| {m['name']} | " + " | ".join(f"{100 * m['accept_hist'].get(i, 0) / tot:.0f}%"
                                                      for i in range(1, width + 1)) + " |")
    names = [m["name"] for m in ms]
    lines += ["", "Per condition: ms per image (speedup, tau)", "", "| condition | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    conds = list(dict.fromkeys(x["condition"] for x in report["per_condition"]))
    cell = {(x["condition"], x["method"]): x for x in report["per_condition"]}
    for c in conds:
        lines.append(f"| {c} | " + " | ".join(
            f"{cell[c, n]['ms_per_image']:.0f} ({cell[c, n].get('speedup', float('nan')):.2f}x, "
            f"{cell[c, n]['tau']:.2f})"
            for n in names) + " |")
    autos = [m for m in ms if m["auto"]]
    for m in autos:
        a = m["auto"]
        lines += ["", f"Auto tree for {m['name']}: {a['why']}. Measured: tau {m['tau']:.2f}, "
                      f"{m.get('speedup', float('nan')):.2f}x."]
        top = sorted(a["grid"], key=lambda g: -g["speedup"])[:8]
        lines += ["", "| draft | depth | total_tokens | branching | predicted tau | round ms | predicted speedup |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {g.get('draft', 'topk')} | {g['depth']} | {g['total_tokens']} | {g.get('branching') or '-'} | "
                  f"{g['tau']:.2f} | {g['round_ms']:.2f} | {g['speedup']:.2f}x |" for g in top]
    return "\n".join(lines) + "\n"
