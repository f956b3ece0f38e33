"""How the stages' results look: Markdown tables, plots and sample grids, written atomically beside the metrics."""
from __future__ import annotations

from pathlib import Path

import torch

from lisa.checkpoint import atomic_write
from lisa.data import datasets as data
from lisa.data.images import grid_image
from lisa.decoding.methods import method_spec
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


def describe_cell(c) -> str:
    """A table cell's settings in a few words: window, or tree and verifier knobs."""
    if c.method == "vanilla":
        return "-"
    if not c.drafts_tree:
        return f"window {c.window}"
    o = c.verifier_options()
    tree = (method_spec(c).describe() if c.draft == "sample" else
            f"{c.tree} d{c.depth} top-{c.top_k_draft} {c.total_tokens} nodes")
    if c.method == "lantern":
        tree += f", k {o.k:g}, delta {o.delta:g}"
    if c.method == "gasv":
        tree += f", kappa {o.kappa:g}, lambda {o.lambda_:g}, k {o.k:g}"
    return tree + (", LID drafter" if c.drafter == "lid" else "")


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
