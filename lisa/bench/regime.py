"""The regime table (issue 33, item 4): where on this machine tree drafting can win, measured, not assumed.

A speculative round verifies N tokens per row (the root and N - 1 draft nodes) in one target forward and runs the
drafter a few times; it pays off when t(N), the cost of that forward, stays near t(1), a vanilla step, and a
drafter step is cheap. Both depend on the machine (cores, AMX / AVX-512 bf16, a GPU), the dtype and whether the
forward is compiled, so this module measures them here, on random-weight models of the shapes that matter:

  * t(N) / t(1) for N = 1, 3, 5, 9, 17, 33: one target forward of N new tokens per row after a half-full KV cache,
    with an explicit tree mask and per-row positions, as the speculative loop calls it (the call of
    lisa.decoding.costmodel.time_target_forward; here every N shares one cache so that the calls interleave);
  * q(n) / t(1): one step of an EAGLE-3 drafter of the target's width over n = 1 and 4 nodes per row;
  * axes: shape (the built-in worlds' targets, LlamaGen GPT-B / L / XL at vocab 16384, 256 tokens, c2i), dtype
    (fp32, bf16) and mode (eager; compiled: torch.compile with static shapes, one graph per N, compiled once in the
    warm-up and reused, as gpt-fast does). All calls of one shape run side by side, interleaved, median over rounds;
  * for each method row of the committed bench reports (their measured tau, tokens per forward N and drafter calls
    per round), the speedup each regime allows: tau * t(1) / (t(N) + calls * q(width)), the round at its bare
    forwards (no loop overhead: an upper bound for that loop on that regime).
Rows are CFG rows: 2 per image (conditional and unconditional). Nothing here is a constant of the machine.
"""
from __future__ import annotations

import copy
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from lisa.decoding import costmodel
from lisa.models.drafter import DrafterConfig, Eagle3Drafter
from lisa.models.gpt import PRESETS, GPTConfig, Transformer, gpt_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("eager", "compiled")


@dataclass
class RegimeConfig:
    shapes: list[str] = field(default_factory=lambda: ["fashion-c2i", "emoji-t2i", "GPT-B", "GPT-L", "GPT-XL"])
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    sizes: list[int] = field(default_factory=lambda: [1, 3, 5, 9, 17, 33])  # N: new tokens per row
    draft_nodes: list[int] = field(default_factory=lambda: [1, 4])  # drafter step widths
    rows: int = 2  # rows per forward: one image with CFG (conditional + unconditional)
    repeats: int = 31  # interleaved rounds (fewer where a round is slow, see time_budget_s)
    warmup: int = 1  # untimed rounds after the first call (compilation happens in the first call)
    time_budget_s: float = 45.0  # per shape: timed rounds are cut to fit it (at least min_repeats)
    min_repeats: int = 5  # the budget never cuts below this (nor above repeats)
    compile_budget_s: float = 300.0  # per shape: compiled mode is skipped where its graphs would not compile in this
    threads: int = 0  # torch threads (0: torch's default)
    compile_shapes: Optional[list[str]] = None  # the shapes that run compiled (None: all, within the budget)
    seed: int = 0

    def __post_init__(self):
        for d in self.dtypes:
            if d not in DTYPES:
                raise ValueError(f"regime: dtype {d!r} is not one of {sorted(DTYPES)}")
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"regime: mode {m!r} is not one of {list(MODES)}")
        if 1 not in self.sizes:
            raise ValueError("regime: sizes must include 1 (every ratio is to t(1))")


def llamagen_config(preset: str) -> GPTConfig:
    """LlamaGen's c2i target at 256 px: vocab 16384, 16 x 16 tokens, 1000 classes."""
    return gpt_config(preset, vocab_size=16384, block_size=256, num_classes=1000, model_type="c2i")


def shape_config(name: str, target_root: Optional[Path] = None, params=None) -> tuple[GPTConfig, str]:
    """A shape by name -> (config, where it came from): a GPT preset at LlamaGen's c2i size, or a world's target,
    read from its checkpoint's sidecar (target_root/<world>/model.json) or else from params' world section."""
    if name in PRESETS:
        return llamagen_config(name), f"preset {name}, vocab 16384, 256 tokens, c2i"
    side = Path(target_root or "") / name / "model.json"
    if target_root is not None and side.is_file():
        return GPTConfig.from_dict(json.loads(side.read_text())["config"]), str(side)
    if params is not None and name in params.worlds:
        return gpt_config(**params.world(name).target), f"params world {name}"
    raise ValueError(f"regime: unknown shape {name!r}: not a GPT preset, no {side}, no such world in the params")


# ---------------------------------------------------------------------------------------------------------------
# the calls


def target_call(target: Transformer, fwd: Callable, rows: int, new: int, context: int) -> Callable[[], object]:
    """One target forward of `new` tokens per row after `context` cached slots, explicit (rows, new, L) mask and
    per-row positions (the speculative loop's call; the cache must hold context + max new slots)."""
    dev, L = target.tok_embeddings.weight.device, target.cache_length
    slots = (context + torch.arange(new, device=dev)).expand(rows, new)  # (rows, new)
    mask = (torch.arange(L, device=dev)[None, None, :] <= slots[:, :, None]).expand(rows, new, L)  # (rows, new, L)
    x = target.embed_tokens(torch.randint(0, target.config.vocab_size, (rows, new), device=dev))  # (rows, new, D)
    rope = slots.clamp(max=target.rope.shape[0] - 1)
    return lambda: fwd(x, slots, mask=mask, rope_pos=rope)


def drafter_call(drafter: Eagle3Drafter, fwd: Callable, rows: int, new: int, context: int) -> Callable[[], object]:
    """One drafter step over `new` nodes per row after `context` cached pairs (embedding, layer, LM head)."""
    dev, L = drafter.fc.weight.device, drafter.cache_length
    slots = (context + torch.arange(new, device=dev)).expand(rows, new)  # (rows, new)
    mask = (torch.arange(L, device=dev)[None, None, :] <= slots[:, :, None]).expand(rows, new, L)
    tokens = torch.randint(0, drafter.config.vocab_size, (rows, new), device=dev)  # (rows, new)
    D = drafter.config.model_dim
    hidden = torch.randn(rows, new, D, device=dev, dtype=drafter.fc.weight.dtype)  # (rows, new, D)
    rope = slots.clamp(max=drafter.rope.shape[0] - 1)
    return lambda: fwd(tokens, hidden, input_pos=slots, mask=mask, rope_pos=rope)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    costmodel.sync(device)
    t0 = time.perf_counter()
    fn()
    costmodel.sync(device)
    return time.perf_counter() - t0


def interleave(calls: dict, times: dict, rounds: range, device: torch.device) -> None:
    """Time every call once per round, appending to times[key]; round r starts at key r (rotated: no call always
    follows the same one)."""
    keys = list(calls)
    for r in rounds:
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            times[k].append(timed(calls[k], device))


def step_costs(target: Transformer, drafter: Eagle3Drafter, rows: int, nodes: list[int], rounds: int,
               modes: tuple[str, ...] = MODES) -> dict:
    """A trained drafter's step against its target's one-token step, side by side: per mode (eager; compiled as in
    the table), t(1) in ms and q(n) / t(1) for n nodes per row, the median over `rounds` interleaved rounds of the
    ratio within a round. A half-full cache, CFG rows as the loop calls them."""
    dev = target.tok_embeddings.weight.device
    context = target.config.cls_token_num + target.config.block_size // 2
    target.setup_caches(rows, context + 2)
    drafter.setup_caches(rows, context + max(nodes) + 1)
    out = {}
    for mode in modes:
        tf = torch.compile(target.forward, dynamic=False, fullgraph=True) if mode == "compiled" else target
        df = torch.compile(drafter.forward, dynamic=False, fullgraph=True) if mode == "compiled" else drafter
        calls = {0: target_call(target, tf, rows, 1, context)} | {n: drafter_call(drafter, df, rows, n, context)
                                                                  for n in nodes}
        for fn in calls.values():  # compiles (compiled mode), then one untimed call
            fn(), fn()
        times: dict[int, list[float]] = {k: [] for k in calls}
        interleave(calls, times, range(rounds), dev)
        ratio = lambda n: statistics.median(a / b for a, b in zip(times[n], times[0]))  # noqa: E731
        out[mode] = {"t1_ms": 1000 * statistics.median(times[0]), "q_ratio": {n: ratio(n) for n in nodes}}
    target.clear_caches()
    drafter.clear_caches()
    return out


# ---------------------------------------------------------------------------------------------------------------
# one shape


def measure_shape(cfg: GPTConfig, rc: RegimeConfig, device=None, log: Callable[[str], None] = lambda s: None,
                  compile_s_per_layer: Optional[float] = None) -> dict:
    """Every (dtype, mode) of one target shape, all calls interleaved: t(N) and q(n) medians (ms), their ratios to
    t(1), the first call of each (compilation included) and how many timed rounds ran. Compiled mode runs where its
    graphs fit rc.compile_budget_s: predicted from `compile_s_per_layer` (seconds per graph per target layer,
    measured on an earlier shape) when given, else from a pilot. The compiled graphs are dropped afterwards
    (torch._dynamo.reset), so that shapes do not share a recompile budget."""
    graphs = len(rc.dtypes) * max(len(rc.sizes), len(rc.draft_nodes))  # graphs per compiled forward
    try:
        with torch._dynamo.config.patch(recompile_limit=max(8, graphs)), torch.inference_mode():
            return _measure_shape(cfg, rc, torch.device(device or "cpu"), log, compile_s_per_layer)
    finally:
        torch._dynamo.reset()


def _measure_shape(cfg: GPTConfig, rc: RegimeConfig, device: torch.device, log: Callable[[str], None],
                   compile_s_per_layer: Optional[float]) -> dict:
    torch.manual_seed(rc.seed)
    target = Transformer(cfg).eval().to(device)
    drafter = Eagle3Drafter(DrafterConfig.for_target(cfg)).eval().to(device)
    context = cfg.cls_token_num + cfg.block_size // 2  # a half-full cache
    out = {"target_params": target.num_params(), "drafter_params": sum(p.numel() for p in drafter.parameters()),
           "context": context, "regimes": {}, "notes": []}
    calls: dict[tuple, Callable] = {}  # (dtype, mode, "target" | "drafter", n) -> call
    for dt in rc.dtypes:
        tgt = target if dt == "fp32" else copy.deepcopy(target).to(DTYPES[dt])
        dft = drafter if dt == "fp32" else copy.deepcopy(drafter).to(DTYPES[dt])
        tgt.setup_caches(rc.rows, context + max(rc.sizes) + 1)
        dft.setup_caches(rc.rows, context + max(rc.draft_nodes) + 1)
        for mode in rc.modes:
            # static shapes: one graph per N under each compiled forward, compiled on its first call, then reused
            tf = torch.compile(tgt.forward, dynamic=False, fullgraph=True) if mode == "compiled" else tgt
            df = torch.compile(dft.forward, dynamic=False, fullgraph=True) if mode == "compiled" else dft
            for n in rc.sizes:
                calls[dt, mode, "target", n] = target_call(tgt, tf, rc.rows, n, context)
            for n in rc.draft_nodes:
                calls[dt, mode, "drafter", n] = drafter_call(dft, df, rc.rows, n, context)

    first: dict[tuple, float] = {}
    graphs = len(rc.dtypes) * (len(rc.sizes) + len(rc.draft_nodes))
    # does compiled mode fit the budget on this machine? Predicted from an earlier shape's compile time per layer,
    # else from a pilot: the first two compiled graphs (the first of a process also pays inductor's start-up)
    pilot, why = [k for k in calls if k[1] == "compiled"][:2], ""
    if pilot and compile_s_per_layer is not None:
        per_graph = compile_s_per_layer * cfg.n_layer
        if per_graph * graphs > rc.compile_budget_s:
            why = (f"an earlier shape compiled at {compile_s_per_layer:.1f} s per graph per layer, so its {graphs} "
                   f"graphs of {cfg.n_layer} layers would take ~{per_graph * graphs:.0f} s")
    elif pilot:
        for k in pilot:
            first[k] = timed(calls[k], device)
            log(f"  compile pilot {k}: {first[k]:.1f} s")
        estimate = sum(first.values()) + first[pilot[-1]] * (graphs - len(pilot))
        out["compile_pilot_s"] = {f"{k[0]}/{k[2]}/{k[3]}": first[k] for k in pilot}
        if estimate > rc.compile_budget_s:
            why = (f"its graph ({pilot[-1][0]}, N={pilot[-1][3]}) took {first[pilot[-1]]:.0f} s to compile, so its "
                   f"{graphs} graphs would take ~{estimate:.0f} s")
    if why:
        note = f"compiled skipped: {why} > the {rc.compile_budget_s:.0f} s compile budget per shape on this machine"
        out["notes"].append(note)
        log("  " + note)
        calls = {k: v for k, v in calls.items() if k[1] != "compiled"}
        first.clear()
    for k, fn in calls.items():
        if k not in first:
            first[k] = timed(fn, device)
            if k[1] == "compiled":
                log(f"  first call {k}: {first[k]:.1f} s")
    compiled = [first[k] for k in first if k[1] == "compiled" and k[2] == "target"]
    if compiled:  # what the next shape's prediction reads
        out["compile_s_per_graph_layer"] = statistics.median(compiled) / cfg.n_layer
    for _ in range(rc.warmup):
        for fn in calls.values():
            fn()
    keys = list(calls)
    t0 = time.perf_counter()
    times: dict[tuple, list[float]] = {k: [timed(calls[k], device)] for k in keys}  # the first timed round
    round_s = time.perf_counter() - t0
    repeats = min(rc.repeats, max(rc.min_repeats, int(rc.time_budget_s / max(round_s, 1e-9))))
    interleave(calls, times, range(1, repeats), device)
    out["repeats"], out["round_s"] = repeats, round_s
    log(f"  {repeats} interleaved rounds of {round_s:.2f} s")

    for dt in rc.dtypes:
        for mode in rc.modes:
            if (dt, mode, "target", 1) not in times:
                continue
            med = {k: 1000 * statistics.median(v) for k, v in times.items() if k[:2] == (dt, mode)}
            t1 = med[dt, mode, "target", 1]
            one = times[dt, mode, "target", 1]
            # a ratio is the median over rounds of the ratio within a round: calls side by side see the same load
            ratio = lambda k: statistics.median(a / b for a, b in zip(times[k], one))  # noqa: E731
            out["regimes"][f"{dt}/{mode}"] = {
                "dtype": dt, "mode": mode, "t1_ms": t1,
                "t_ms": {n: med[dt, mode, "target", n] for n in rc.sizes},
                "t_ratio": {n: ratio((dt, mode, "target", n)) for n in rc.sizes},
                "q_ms": {n: med[dt, mode, "drafter", n] for n in rc.draft_nodes},
                "q_ratio": {n: ratio((dt, mode, "drafter", n)) for n in rc.draft_nodes},
                "first_call_s": {f"{k[2]}/{k[3]}": first[k] for k in first if k[:2] == (dt, mode)},
            }
    return out


# ---------------------------------------------------------------------------------------------------------------
# what each regime allows the measured methods


def bench_reports(folder: Path) -> dict[str, dict]:
    """world -> its bench-spec report (folder/<world>.json: the reports with a world and method rows)."""
    reports = {}
    for p in sorted(Path(folder).glob("*.json")):
        r = json.loads(p.read_text())
        if "world" in r and "methods" in r:
            reports[r["world"]] = r
    return reports


def method_rows(bench: dict) -> list[dict]:
    """The method rows of a bench-spec report: tau, tokens per target forward N, drafter calls per round and the
    nodes per drafter call (1 for chains, the first level's width for sampled trees, top_k for top-k trees)."""
    rows = []
    for m in bench["methods"]:
        calls = float(m.get("drafter_calls_per_round") or 0.0)
        if m.get("tree") == "chain" or calls == 0:
            width = 1
        elif m.get("draft") == "sample" and m.get("branching"):
            width = int(m["branching"][0])
        else:
            width = int(m.get("top_k_draft") or 1)
        rows.append({"name": m["name"], "tau": float(m["tau"]), "N": int(m.get("forward_tokens") or 1),
                     "drafter_calls": calls, "width": width, "measured_speedup": m.get("speedup")})
    return rows


def allowed_speedup(row: dict, regime: dict) -> float:
    """tau / (t(N) / t(1) + calls * q(width) / t(1)) = tau * t(1) / (t(N) + calls * q(width)): the round at its bare
    forwards, from the in-round ratios, interpolated between the measured sizes by the cost model's rule
    (lisa.decoding.costmodel.Costs)."""
    costs = costmodel.Costs(rows=0, target_s={int(n): x for n, x in regime["t_ratio"].items()},
                            drafter_s={int(n): x for n, x in regime["q_ratio"].items()})
    return row["tau"] / (costs.target(row["N"]) + row["drafter_calls"] * costs.drafter(row["width"]))


def machine() -> dict:
    """The CPU model, its bf16 / AMX flags, torch's threads and version, the GPU if any, the load average."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in _read("/proc/cpuinfo").splitlines()
                  if line.startswith("flags")), [])
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_bf16": sorted(f for f in flags if "bf16" in f or f.startswith("amx")),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def regime(rc: RegimeConfig, shapes: dict[str, tuple[GPTConfig, str]], benches: dict[str, dict], device=None,
           log: Callable[[str], None] = lambda s: None) -> dict:
    """The whole table: each shape measured (measure_shape, in the order given: put small shapes first, their
    compile times predict the big ones'), then each world's methods priced on each regime."""
    if rc.threads:
        torch.set_num_threads(rc.threads)
    report = {"machine": machine(), "config": asdict(rc), "device": str(device or "cpu"), "shapes": {},
              "methods": {w: method_rows(b) for w, b in benches.items()}}
    per_layer = None  # compile seconds per graph per layer, from the last shape that compiled
    graphs = len(rc.dtypes) * (len(rc.sizes) + len(rc.draft_nodes))
    for name, (cfg, source) in shapes.items():
        log(f"{name} ({source})")
        t0 = time.perf_counter()
        skip = rc.compile_shapes is not None and name not in rc.compile_shapes and "compiled" in rc.modes
        src = replace(rc, modes=[m for m in rc.modes if m != "compiled"]) if skip else rc
        s = measure_shape(cfg, src, device, log, per_layer)
        if skip:
            s["notes"].append("compiled not run: not one of the compile shapes" + (
                f" (an earlier shape compiled at {per_layer:.1f} s per graph per layer: its {graphs} graphs of "
                f"{cfg.n_layer} layers would take ~{per_layer * cfg.n_layer * graphs:.0f} s)" if per_layer else ""))
        per_layer = s.get("compile_s_per_graph_layer", per_layer)
        s |= {"source": source, "wall_s": time.perf_counter() - t0,
              "config": {k: getattr(cfg, k) for k in ("dim", "n_layer", "n_head", "vocab_size", "block_size",
                                                     "cls_token_num", "model_type")}}
        for reg in s["regimes"].values():
            reg["allowed_speedup"] = {w: {r["name"]: allowed_speedup(r, reg) for r in rows}
                                      for w, rows in report["methods"].items()}
        report["shapes"][name] = s
    report["loadavg_after"] = machine()["loadavg"]
    return report


def reprice(report: dict, benches: dict[str, dict]) -> dict:
    """A stored regime report with its methods priced again from newer bench-spec reports (no timing: the regimes
    are the stored measurements)."""
    report = copy.deepcopy(report) | {"methods": {w: method_rows(b) for w, b in benches.items()}}
    for s in report["shapes"].values():
        for reg in s["regimes"].values():
            reg["allowed_speedup"] = {w: {r["name"]: allowed_speedup(r, reg) for r in rows}
                                      for w, rows in report["methods"].items()}
    return report


# ---------------------------------------------------------------------------------------------------------------
# the markdown


def _at(d: dict, n: int):
    """d[n], also for a report read back from JSON (its keys are strings)."""
    return d[n] if n in d else d[str(n)]


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "-"


def _load(avg) -> str:
    return " / ".join(f"{x:.1f}" for x in avg) if avg else "-"


def regime_markdown(r: dict) -> str:
    mc, c = r["machine"], r["config"]
    lines = [f"# Regime table: {mc['cpu']}, {mc['threads']} threads, torch {mc['torch']}"
             f"{', GPU ' + mc['gpu'] if mc.get('gpu') else ''} (device {r['device']})", "",
             f"CPU bf16 / AMX flags: {', '.join(mc['cpu_bf16']) or 'none'}. Load average (1, 5, 15 min) before: "
             f"{_load(mc.get('loadavg'))}, after: {_load(r.get('loadavg_after'))}. Random-weight targets, "
             f"{c['rows']} rows per forward (one image with CFG), a half-full KV cache, explicit tree mask and per-row "
             "positions; all calls of a shape interleaved: t(1) is the median over rounds, a ratio the median of the "
             "ratios within a round. t(N): one target forward of N new tokens per row; q(n): one step of an "
             "EAGLE-3 drafter of the target's width over n nodes per row. Compiled: torch.compile, static shapes, "
             "one graph per N (its compile time is the first call).", "",
             "| shape | params | dtype | mode | t(1) ms | " + " | ".join(f"t({n})/t(1)" for n in c["sizes"][1:]) +
             " | " + " | ".join(f"q({n})/t(1)" for n in c["draft_nodes"]) + " | compile s | rounds |",
             "|---|---|---|---|---|" + "---|" * (len(c["sizes"]) - 1 + len(c["draft_nodes"])) + "---|---|"]
    for name, s in r["shapes"].items():
        for reg in s["regimes"].values():
            compile_s = (sum(reg["first_call_s"].values()) if reg["mode"] == "compiled" else float("nan"))
            lines.append(f"| {name} | {s['target_params'] / 1e6:.1f}M | {reg['dtype']} | {reg['mode']} | "
                         f"{reg['t1_ms']:.2f} | " + " | ".join(_f(_at(reg["t_ratio"], n)) for n in c["sizes"][1:]) +
                         " | " + " | ".join(_f(_at(reg["q_ratio"], n)) for n in c["draft_nodes"]) +
                         f" | {_f(compile_s, 0)} | {s['repeats']} |")
    notes = [f"- {name}: {n}" for name, s in r["shapes"].items() for n in s["notes"]]
    if notes:
        lines += ["", *notes]
    for world, rows in r["methods"].items():
        rows = [m for m in rows if m["name"] != "vanilla"]
        lines += ["", f"## Speedup each regime allows the methods of reports/bench/{world}.json",
                  "", "tau * t(1) / (t(N) + drafter calls * q(width)): the round at its bare forwards, no loop "
                  "overhead. Measured: the eager loop's speedup in that report (toy shape, this kind of CPU).", "",
                  "| shape | dtype | mode | " + " | ".join(m["name"] for m in rows) + " |",
                  "|---|---|---|" + "---|" * len(rows),
                  "| (tau, N, calls x width) | | | " + " | ".join(
                      f"{m['tau']:.2f}, {m['N']}, {m['drafter_calls']:.1f}x{m['width']}" for m in rows) + " |",
                  "| measured (eager loop) | | | " + " | ".join(
                      _f(m["measured_speedup"]) if m["measured_speedup"] is not None else "-" for m in rows) + " |"]
        for name, s in r["shapes"].items():
            for reg in s["regimes"].values():
                sp = reg["allowed_speedup"][world]
                lines.append(f"| {name} | {reg['dtype']} | {reg['mode']} | " +
                             " | ".join(_f(sp[m["name"]]) for m in rows) + " |")
    return "\n".join(lines) + "\n"
