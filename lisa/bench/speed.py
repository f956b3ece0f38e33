"""Decode-speed benchmark of the vanilla loop against the bare forward passes it makes (the loop's overhead).

Both are measured in one run, interleaved, after a warm-up: the loop is `generate()` (sampling, CFG arithmetic,
cache bookkeeping); the bare run replays the same sequence of model forwards (prefill of the condition prefix,
then T-1 one-token steps on the same cache) with precomputed tokens and nothing else.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from lisa.config import seed_for
from lisa.bench.regime import drafter_call, target_call, timed
from lisa.decoding import costmodel
from lisa.decoding.costmodel import sync
from lisa.decoding.generate import Clock, generate, pooled_tau, prefix_embeddings
from lisa.decoding.generate import compiled as compiled_model
from lisa.decoding.methods import auto_tree, method_decoder, method_spec, resolve_auto
from lisa.models.gpt import Transformer
from lisa.decoding.sampling import SamplingConfig
from lisa.decoding.verify import drafts_tree


@torch.inference_mode()
def bare_forwards(model: Transformer, cond: torch.Tensor, tokens: torch.Tensor, use_cfg: bool):
    """The forwards of one vanilla decode of tokens (B, T), with no sampling: prefill + T-1 one-token steps."""
    C, T = model.config.cls_token_num, tokens.shape[1]
    model.setup_caches((2 if use_cfg else 1) * tokens.shape[0], C + T)
    prefix = prefix_embeddings(model, cond, use_cfg)
    model(prefix, torch.arange(C, device=cond.device))
    feed = torch.cat([tokens, tokens]) if use_cfg else tokens
    for t in range(1, T):
        model(model.embed_tokens(feed[:, t - 1 : t]), torch.tensor([C + t - 1], device=cond.device))


def condition_batch(model: Transformer, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """Random classes (c2i) or random caption features (t2i) for a benchmark batch."""
    cfg = model.config
    if cfg.model_type == "c2i":
        return torch.randint(0, cfg.num_classes, (batch_size,), generator=generator)
    return torch.randn(batch_size, cfg.cls_token_num, cfg.caption_dim, generator=generator)


def bench_vanilla(model: Transformer, num_tokens: int, batch_size: int, cfg_scales: list[float], repeats: int,
                  warmup: int, seed: int = 0, device: Optional[torch.device] = None) -> list[dict]:
    """One row per cfg scale: median wall time of the loop and of its bare forwards, tokens/s, overhead."""
    device = device or next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    cond = condition_batch(model, batch_size, torch.Generator().manual_seed(seed)).to(device)
    times: dict[float, dict[str, list[float]]] = {s: {"loop": [], "bare": []} for s in cfg_scales}
    runs = [(r, s) for r in range(warmup + repeats) for s in cfg_scales]
    for r, scale in tqdm(runs, desc="bench vanilla", unit="run"):
        sampling = SamplingConfig(temperature=1.0, cfg_scale=scale)
        sync(device)
        t0 = time.perf_counter()
        tokens, _ = generate(model, cond, sampling, gen, num_tokens=num_tokens)
        sync(device)
        t1 = time.perf_counter()
        bare_forwards(model, cond, tokens, sampling.use_cfg)
        sync(device)
        t2 = time.perf_counter()
        if r >= warmup:
            times[scale]["loop"].append(t1 - t0)
            times[scale]["bare"].append(t2 - t1)
    rows = []
    for scale in cfg_scales:
        loop, bare = statistics.median(times[scale]["loop"]), statistics.median(times[scale]["bare"])
        rows.append({
            "cfg_scale": scale,
            "batch_size": batch_size,
            "rows_in_forward": batch_size * (2 if scale != 1.0 else 1),
            "num_tokens": num_tokens,
            "loop_s": loop,
            "bare_forwards_s": bare,
            "tokens_per_s": batch_size * num_tokens / loop,
            "ms_per_token_step": 1000 * loop / num_tokens,
            "loop_overhead": loop / bare - 1.0,
            "loop_s_all": times[scale]["loop"],
            "bare_forwards_s_all": times[scale]["bare"],
        })
    return rows


class ForwardTimer:
    """Wall time and call count of a module's forwards (pre/post hooks; CUDA-synchronised): how much of the
    decode loop is spent inside the target or the drafter. `first`: the first call's time since the last reset
    (a decode's prefill)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.seconds, self.calls, self.first, self._t0, self.device = 0.0, 0, 0.0, 0.0, device
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_):
        sync(self.device)
        self._t0 = time.perf_counter()

    def _post(self, *_):
        sync(self.device)
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        self.first = self.first if self.calls else dt
        self.calls += 1

    def reset(self):
        self.seconds, self.calls, self.first = 0.0, 0, 0.0

    def remove(self):
        for h in self._handles:
            h.remove()


STEP_PARTS = {"inputs": ("tok_embeddings", "embed_norm", "hidden_norm"), "attention": ("attention",),
              "ffn": ("ffn_norm", "feed_forward"), "head": ("norm", "head_in", "output")}


@torch.inference_mode()
def drafter_step_parts(target: Transformer, drafter, rows: int, widths: Sequence[int], context: int,
                       new: int, reps: int = 15) -> dict:
    """Where one drafter step goes, in the decode loop's conditions and back to back: per width w (pairs per row)
    the step "cold", each right after a target forward over `new` tokens (the round's tree: the target's weights
    and caches pass through the CPU's caches in between, as in the loop), and "warm", right after another drafter
    step; each split by forward hooks on the drafter's submodules into the token embedding and input norms, the
    attention (over the drafter's cache), the SwiGLU, the head (final norm and the output layer) and the glue
    between them (concatenation, residuals, RoPE lookup), with the fc over the fused taps (once per round, in the
    commit of the accepted pairs) timed apart; and t(1), the one-token target forward it is compared with, timed
    in the same interleaved repetitions. Returns {"t1_ms", "fc_ms", "widths": {w: {"cold" | "warm": {"step_ms",
    "step_over_t1", part: ms}}}}."""
    dev = next(target.parameters()).device
    cfg = drafter.config
    L = context + max(max(widths), new) + 1
    target.setup_caches(rows, L)
    drafter.setup_caches(rows, L)

    taps = [torch.randn(rows, 3, cfg.dim, device=dev, dtype=drafter.fc.weight.dtype) for _ in range(3)]
    spent = {part: 0.0 for part in STEP_PARTS}
    hooks = []
    for part, names in STEP_PARTS.items():
        for name in names:
            module = getattr(drafter, name, None)
            if module is None:
                continue
            start = {}

            def pre(*_, start=start):
                sync(dev)
                start["t"] = time.perf_counter()

            def post(*_, start=start, part=part):
                sync(dev)
                spent[part] += time.perf_counter() - start["t"]

            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    big, one = target_call(target, target, rows, new, context), target_call(target, target, rows, 1, context)
    steps = {w: drafter_call(drafter, drafter, rows, w, context) for w in widths}
    got = {(w, mode): [] for w in widths for mode in ("cold", "warm")}
    t1, fc = [], []
    try:
        for r in range(reps + 1):
            t1.append(timed(one, dev))
            fc.append(timed(lambda: drafter.fuse(taps), dev))
            for w, step in steps.items():
                for mode in ("cold", "warm"):
                    big() if mode == "cold" else step()
                    for part in spent:
                        spent[part] = 0.0
                    got[w, mode].append((timed(step, dev), dict(spent)))
    finally:
        for h in hooks:
            h.remove()
    t1_s = statistics.median(t1[1:])
    out = {"t1_ms": 1000 * t1_s, "fc_ms": 1000 * statistics.median(fc[1:]), "rows": rows, "context": context,
           "cold_after_tokens": new, "widths": {}}
    for w in widths:
        out["widths"][w] = {}
        for mode in ("cold", "warm"):
            xs = got[w, mode][1:]
            step = statistics.median(x[0] for x in xs)
            row = {"step_ms": 1000 * step, "step_over_t1": step / t1_s}
            row |= {part: 1000 * statistics.median(x[1][part] for x in xs) for part in STEP_PARTS}
            row["glue"] = max(0.0, row["step_ms"] - sum(row[part] for part in STEP_PARTS))
            out["widths"][w][mode] = row
    return out


def forward_size(m) -> int:
    """New tokens per row in one target forward of method m (a lisa.config.DecodeMethod): 1 (vanilla), root + tree
    nodes, or last + window."""
    if m.method == "vanilla":
        return 1
    return method_spec(m).nodes + 1 if drafts_tree(m.method) else m.window + 1


def breakdown_pass(target: Transformer, drafters: dict, decoders: dict, methods: list, conditions: list[dict],
                   sampling: SamplingConfig, seed: int, device, bar=None) -> dict:
    """One instrumented pass, apart from the timed ones, the methods interleaved per condition: per method, where its
    rounds go. Hooks time every target and drafter forward, and a lisa.decoding.generate.Clock the parts of each
    round; returns per method the totals
    (wall_s, target_s, drafter_s, drafter_calls, forwards, rounds) and round_s: target forward, drafter forwards,
    drafting (sampling and tree bookkeeping around the drafter's forwards: the draft and the commit of the
    accepted pairs), tree forward set-up (masks, positions, embeddings), verification, cache moves and the rest
    (the prefill's sampling, the commit of the emitted tokens, the loop's exit test)."""
    timers = {"target": ForwardTimer(target, device)}
    for i, d in enumerate({id(d): d for d in drafters.values() if d is not None}.values()):
        timers[f"drafter{i}"] = ForwardTimer(d, device)
    totals = {m.name: {"wall_s": 0.0, "target_s": 0.0, "drafter_s": 0.0, "drafter_calls": 0, "forwards": 0,
                       "rounds": 0, "target_prefill_s": 0.0, "drafter_prefill_s": 0.0,
                       "clock": {p: 0.0 for p in Clock.PARTS}} for m in methods}
    out = {}
    try:
        for ci, c in enumerate(conditions):  # methods interleaved per condition: a slow spell hits them all alike
            for m in methods:
                tot = totals[m.name]
                gen = torch.Generator(device=device).manual_seed(seed_for(seed, ci * 7919))
                for t in timers.values():
                    t.reset()
                clock = Clock(device)
                sync(device)
                t0 = time.perf_counter()
                _, stats = decoders[m.name](c["cond"], sampling, gen, cond_mask=c.get("cond_mask"), clock=clock)
                sync(device)
                tot["wall_s"] += time.perf_counter() - t0
                tot["target_s"] += timers["target"].seconds
                tot["target_prefill_s"] += timers["target"].first
                tot["drafter_s"] += sum(t.seconds for k, t in timers.items() if k.startswith("drafter"))
                tot["drafter_prefill_s"] += sum(t.first for k, t in timers.items() if k.startswith("drafter"))
                tot["drafter_calls"] += sum(t.calls for k, t in timers.items() if k.startswith("drafter"))
                tot["forwards"] += stats["forwards"]
                tot["rounds"] += stats.get("rounds", stats["forwards"])
                for p, v in clock.seconds.items():
                    tot["clock"][p] += v
                if bar is not None:
                    bar.update()
        for m in methods:
            tot = totals[m.name]
            k = tot.pop("clock")
            if m.method == "vanilla":
                rs = {"target forward": tot["target_s"], "rest": tot["wall_s"] - tot["target_s"]}
            else:  # the prefill (its target forward and first drafter pair) apart; the rest is what no part holds
                target_s = tot["target_s"] - tot["target_prefill_s"]
                drafter_s = tot["drafter_s"] - tot["drafter_prefill_s"]
                rs = {"prefill": k["prefill"], "target forward": target_s, "drafter forwards": drafter_s,
                      "drafting": k["draft"] + k["commit"] - drafter_s, "tree forward set-up": k["target"] - target_s,
                      "verification": k["verify"], "cache moves": k["move"]}
                rs["rest"] = tot["wall_s"] - sum(rs.values())
            out[m.name] = tot | {"round_s": rs}
    finally:
        for t in timers.values():
            t.remove()
    return out


def bench_speculative(target: Transformer, drafter, conditions: list[dict], methods: list, sampling: SamplingConfig,
                      repeats: int, warmup: int, seed: int, geometry=None, auto=None,
                      vq_decode: Optional[Callable] = None, progress: bool = True,
                      compiled: Sequence[str] = (), throughput=None) -> dict:
    """Time every method on every condition batch, interleaved (the method order rotates each pass), after
    `warmup` passes. drafter: one drafter, or {BenchMethod.drafter: drafter} when methods use different ones.
    conditions: dicts {"label", "cond" (b, ...), "cond_mask" or None}; methods: lisa.config.BenchMethod (a named
    DecodeMethod). Each (condition, pass) has one seed
    shared by all methods. A method with tree "auto" is first resolved by the cost model (lisa.decoding.costmodel) on the
    first `auto.calib_conditions` conditions. compiled: names of methods also timed with their forwards under
    torch.compile (lisa.decoding.generate.compiled), in the same interleaved passes, against compiled vanilla
    (which joins them); their graphs compile in the warm-up pass. The bare forwards (the loop's limit) are timed
    inside every timed pass, next to the loops they bound. throughput: lisa.config.ThroughputParams (images per
    second at several batch sizes) or None. Returns the report dict (see lisa.stages.render.speculative_markdown)."""
    device = next(target.parameters()).device
    rows = (2 if sampling.use_cfg else 1) * conditions[0]["cond"].shape[0]
    T = target.config.block_size
    drafters = drafter if isinstance(drafter, dict) else {getattr(m, "drafter", "release"): drafter for m in methods}

    def drafter_of(m):
        return drafters.get(getattr(m, "drafter", "release"))

    # (verifier, knobs, mode) -> costmodel.Choice; method name -> its Choice, eager and compiled (an auto tree is
    # priced in the mode that runs it: the compiled row may draft another tree)
    choices, picked, cpicked = {}, {}, {}
    methods, cmethods = list(methods), {}
    for i, m in enumerate(methods):
        if m.tree == "auto":
            for mode in ("eager", "compiled") if m.name in set(compiled) else ("eager",):
                key = (m.method, tuple(sorted(m.options.items())), m.top_k_draft, getattr(m, "drafter", "release"),
                       m.draft, m.siblings, mode)
                if key not in choices:
                    choices[key] = auto_tree(target, drafter_of(m), conditions[: auto.calib_conditions], m, sampling,
                                             seed, geometry, auto, progress, compile=mode == "compiled")
                (picked if mode == "eager" else cpicked)[m.name] = choices[key]
            if m.name in cpicked:
                cmethods[m.name] = resolve_auto(m, cpicked[m.name])
            methods[i] = resolve_auto(m, picked[m.name])

    decoders = {m.name: method_decoder(m, target, drafter_of(m), geometry) for m in methods}
    methods_by = {m.name: m for m in methods}
    names = [m.name for m in methods]
    unknown = sorted(set(compiled) - set(names))
    if unknown:
        raise ValueError(f"bench_spec.compiled names {unknown}, not methods of this bench ({names})")
    vanilla = next((m.name for m in methods if m.method == "vanilla"), None)
    if compiled and vanilla is None:
        raise ValueError("bench_spec.compiled needs a vanilla method: compiled rows are timed against compiled vanilla")
    compiled = [n for n in names if n in set(compiled) | ({vanilla} if compiled else set())]
    cmethods = {m.name: cmethods.get(m.name, m) for m in methods if m.name in compiled}  # what each compiled row runs
    cdecoders = {n: method_decoder(cm, target, drafter_of(cm), geometry, compile=True) for n, cm in cmethods.items()}
    entries = [(m, "eager") for m in methods] + [(m, "compiled") for m in methods if m.name in compiled]
    runs = {(m.name, mode): [] for m, mode in entries}  # per (pass >= warmup, condition): time and stats
    first_call = {}  # compiled: the wall time of each method's first call (its graphs compile there)
    images = sum(c["cond"].shape[0] for c in conditions)
    bar = tqdm(total=(warmup + repeats) * len(conditions) * len(entries) + len(conditions) * len(methods),
               desc="bench speculative", unit="run", disable=not progress)

    def timed_pass(r: int) -> None:
        order = entries[r % len(entries):] + entries[: r % len(entries)]
        for ci, c in enumerate(conditions):
            for m, mode in order:
                gen = torch.Generator(device=device).manual_seed(seed_for(seed, ci * 7919 + r))
                dec = (decoders if mode == "eager" else cdecoders)[m.name]
                sync(device)
                t0 = time.perf_counter()
                tokens, stats = dec(c["cond"], sampling, gen, cond_mask=c.get("cond_mask"))
                sync(device)
                wall = time.perf_counter() - t0
                bar.update()
                if mode == "compiled" and m.name not in first_call:
                    first_call[m.name] = (ci, wall)
                if r < warmup:
                    continue
                runs[m.name, mode].append({
                    "pass": r - warmup, "condition": ci, "wall_s": wall, "forwards": stats["forwards"],
                    "accept_lengths": stats.get("accept_lengths", [[1] * (T - 1)] * c["cond"].shape[0]),
                    "tokens": tokens})

    # the bare forwards that bound each method's round: the target over root + tree (or window), and drafter steps
    # as wide as a round's drafted pairs spread over the drafter calls it made (the instrumented pass counts them);
    # timed in every timed pass, beside the loops, so that a slow or a quiet spell of the machine hits both
    sizes = sorted({forward_size(m) for m in methods})
    context = target.config.cls_token_num + T // 2
    bare_t: dict[int, list[float]] = {s: [] for s in sizes}
    bare_d: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(warmup):
            timed_pass(r)
        parts = breakdown_pass(target, drafters, decoders, methods, conditions, sampling, seed, device, bar)
        calls = {m.name: parts[m.name]["drafter_calls"] / parts[m.name]["forwards"] if drafts_tree(m.method) else 0.0
                 for m in methods}
        widths = {m.name: (getattr(m, "drafter", "release"),
                           max(1, math.ceil(method_spec(m).drafted_pairs / calls[m.name])))
                  for m in methods if drafts_tree(m.method) and drafter_of(m) is not None and calls[m.name] > 0}
        bare_d = {w: [] for w in set(widths.values())}
        # compiled: the same bare forwards under torch.compile (the compiled loops' limit); first calls compile here.
        # A compiled row that drafts another tree than its eager one (auto) makes a drafter call per level
        ccalls = {n: calls[n] if method_spec(cm) == method_spec(methods_by[n]) else float(method_spec(cm).max_depth)
                  for n, cm in cmethods.items() if drafts_tree(cm.method)}
        cwidth_of = {n: (getattr(cm, "drafter", "release"),
                         max(1, math.ceil(method_spec(cm).drafted_pairs / ccalls[n])))
                     for n, cm in cmethods.items() if n in ccalls and drafter_of(cm) is not None and ccalls[n] > 0}
        csizes = sorted({forward_size(cm) for cm in cmethods.values()})
        cwidths = set(cwidth_of.values())
        cbare_t, cbare_d = {s: [] for s in csizes}, {w: [] for w in cwidths}
        for s in csizes:
            costmodel.time_target_forward(compiled_model(target), rows, s, context, reps=1)
        for which, w in cwidths:
            costmodel.time_drafter_forward(compiled_model(drafters[which]), rows, w, context, reps=1)
        for r in range(warmup, warmup + repeats):
            timed_pass(r)
            for s in sorted(set(sizes) | set(csizes)):
                if s in bare_t:
                    bare_t[s].append(costmodel.time_target_forward(target, rows, s, context, reps=3))
                if s in cbare_t:
                    cbare_t[s].append(costmodel.time_target_forward(compiled_model(target), rows, s, context, reps=3))
            for which, w in sorted(set(bare_d) | set(cbare_d)):
                if (which, w) in bare_d:
                    bare_d[which, w].append(costmodel.time_drafter_forward(drafters[which], rows, w, context, reps=3))
                if (which, w) in cbare_d:
                    cbare_d[which, w].append(costmodel.time_drafter_forward(compiled_model(drafters[which]), rows, w,
                                                                            context, reps=3))
        # where one drafter step goes, per drafter the tree methods use, at the widths they draft (eager)
        tree_ms = [m for m in methods if drafts_tree(m.method) and drafter_of(m) is not None]
        step = {which: drafter_step_parts(target, drafters[which], rows,
                                          sorted({1} | {w for (d, w) in widths.values() if d == which}), context,
                                          max(forward_size(m) for m in tree_ms))
                for which in sorted({getattr(m, "drafter", "release") for m in tree_ms})} if tree_ms else {}
        tput = (bench_throughput(target, drafter_of, methods, conditions, sampling, seed, throughput, geometry,
                                 set(compiled), device, progress)
                if throughput is not None and throughput.batch_sizes and throughput.methods else None)
    finally:
        bar.close()
    bare = {s: statistics.median(v) for s, v in bare_t.items()}
    bare_drafter = {k: statistics.median(v) for k, v in bare_d.items()}

    def drafter_limit(m) -> float:
        return calls[m.name] * bare_drafter[widths[m.name]] if m.name in widths else 0.0

    vq_s = None
    if vq_decode is not None:
        tok = runs[methods[0].name, "eager"][0]["tokens"]
        vq_s = costmodel.median_time(lambda: vq_decode(tok), 3, device) / tok.shape[0]

    report_methods, per_condition = [], []
    ref = {(x["pass"], x["condition"]): x["tokens"] for x in runs[vanilla, "eager"]} if vanilla else {}
    for m in methods:
        rs = runs[m.name, "eager"]
        per_pass = [sum(x["wall_s"] for x in rs if x["pass"] == p) for p in range(repeats)]
        wall = statistics.median(per_pass)
        forwards = sum(x["forwards"] for x in rs)
        hist = {}
        for a in (a for x in rs for row in x["accept_lengths"] for a in row if a > 0):
            hist[a] = hist.get(a, 0) + 1
        loop_per_forward = sum(x["wall_s"] for x in rs) / forwards
        part = parts[m.name]
        target_per_forward = part["target_s"] / part["forwards"]
        s = forward_size(m)
        calls_per_round = calls[m.name]
        limit, tree = bare[s] + drafter_limit(m), drafts_tree(m.method)
        report_methods.append({
            "name": m.name, "method": m.method, "tree": m.tree if tree else None,
            "tree_desc": (method_spec(m).describe() if tree
                          else f"window {m.window}" if m.method != "vanilla" else "-"),
            "draft": m.draft if tree else None, "siblings": m.siblings if tree else None,
            "branching": list(m.branching) if tree else None,
            "depth": m.depth, "top_k_draft": m.top_k_draft, "total_tokens": m.total_tokens, "window": m.window,
            "options": dict(m.options), "auto": picked[m.name].as_dict() if m.name in picked else None,
            "ms_per_image": 1000 * wall / images,
            "tau": pooled_tau(rs),
            "target_forwards_per_image": forwards / (repeats * images) if m.method != "vanilla" else float(T),
            "accept_hist": {int(k): v for k, v in sorted(hist.items())},
            "forward_tokens": s,
            "loop_ms_per_forward": 1000 * loop_per_forward,
            "target_ms_per_forward_in_loop": 1000 * target_per_forward,
            "bare_forward_ms": 1000 * bare[s],
            "loop_overhead": loop_per_forward / bare[s] - 1.0,
            "drafter_calls_per_round": calls_per_round,
            "limit_ms_per_forward": 1000 * limit,
            "loop_to_limit": loop_per_forward / limit,
            "target_share": part["target_s"] / part["wall_s"],
            "drafter_share": part["drafter_s"] / part["wall_s"],
            "round_ms": {k: 1000 * v / max(part["rounds"], 1) for k, v in part["round_s"].items()},
            "round_ms_total": 1000 * part["wall_s"] / max(part["rounds"], 1),
            "bare_round_ms": 1000 * limit,
            "ms_per_image_all": [1000 * p / images for p in per_pass],
            # same seed, same condition: the share of images identical to vanilla's (1 under greedy decoding for
            # every lossless method; at temperature 1 the random streams differ, so only the distribution matches)
            "same_tokens_as_vanilla": (sum(int((x["tokens"] == ref[x["pass"], x["condition"]]).all(1).sum())
                                           for x in rs) / (repeats * images)) if ref else None,
        })
        for ci, c in enumerate(conditions):
            xs = [x for x in rs if x["condition"] == ci]
            per_condition.append({"condition": c["label"], "method": m.name,
                                  "ms_per_image": 1000 * statistics.median(x["wall_s"] for x in xs)
                                  / c["cond"].shape[0],
                                  "tau": pooled_tau(xs)})
    if vanilla is not None:
        base = next(x for x in report_methods if x["name"] == vanilla)["ms_per_image"]
        for x in report_methods:
            x["speedup"] = base / x["ms_per_image"]
        vrow = {x["condition"]: x["ms_per_image"] for x in per_condition if x["method"] == vanilla}
        for x in per_condition:
            x["speedup"] = vrow[x["condition"]] / x["ms_per_image"]
    return {"images_per_method_pass": images, "repeats": repeats, "warmup": warmup, "rows_in_forward": rows,
            "num_tokens": T, "threads": torch.get_num_threads(), "device": str(device),
            "vq_decode_ms_per_image": 1000 * vq_s if vq_s is not None else None,
            "bare_forward_ms": {int(s): 1000 * v for s, v in bare.items()},
            "bare_forward_ms_all": {int(s): [1000 * x for x in v] for s, v in bare_t.items()},
            "methods": report_methods, "per_condition": per_condition,
            "compiled": compiled_rows(runs, report_methods, first_call, images, repeats, vanilla, {
                n: statistics.median(cbare_t[forward_size(cm)]) + (
                    ccalls[n] * statistics.median(cbare_d[cwidth_of[n]]) if n in cwidth_of else 0.0)
                for n, cm in cmethods.items()}, {n: (method_spec(cm).describe(), cpicked[n].as_dict())
                                                 for n, cm in cmethods.items() if n in cpicked}),
            "throughput": tput, "drafter_step": step}


def compiled_rows(runs: dict, eager: list[dict], first_call: dict, images: int, repeats: int,
                  vanilla: Optional[str], limit: Optional[dict] = None, auto: Optional[dict] = None) -> list[dict]:
    """Per method timed compiled too: ms per image eager and compiled (the same interleaved passes), each mode's
    speedup against its own vanilla (never across modes), compiled over eager, tau, the compile time (its first
    call less a timed call of the same condition), and the compiled loop's time per target forward against its
    limit (limit: method -> seconds of the compiled bare forwards a round makes, as for the eager rows). auto:
    method -> (its compiled tree, the cost model's choice priced with compiled costs), for tree "auto"."""
    if not any(mode == "compiled" for _, mode in runs):
        return []
    def per_image(name, mode):
        rs = runs[name, mode]
        return 1000 * statistics.median(sum(x["wall_s"] for x in rs if x["pass"] == p) for p in range(repeats)) / images
    base = per_image(vanilla, "compiled")
    out = []
    for e in eager:
        if (e["name"], "compiled") not in runs:
            continue
        rs = runs[e["name"], "compiled"]
        ci, first = first_call[e["name"]]
        steady = statistics.median(x["wall_s"] for x in rs if x["condition"] == ci)
        ms = per_image(e["name"], "compiled")
        per_forward = sum(x["wall_s"] for x in rs) / sum(x["forwards"] for x in rs)
        lim = (limit or {}).get(e["name"])
        out.append({"name": e["name"], "eager_ms_per_image": e["ms_per_image"], "eager_speedup": e.get("speedup"),
                    "loop_ms_per_forward": 1000 * per_forward, "eager_loop_to_limit": e.get("loop_to_limit"),
                    "limit_ms_per_forward": 1000 * lim if lim else None,
                    "loop_to_limit": per_forward / lim if lim else None,
                    "ms_per_image": ms, "speedup": base / ms, "compiled_over_eager": e["ms_per_image"] / ms,
                    "tau": pooled_tau(rs), "eager_tau": e["tau"], "compile_s": max(first - steady, 0.0),
                    "ms_per_image_all": [1000 * sum(x["wall_s"] for x in rs if x["pass"] == p) / images
                                         for p in range(repeats)]}
                   | ({"tree_desc": auto[e["name"]][0], "auto": auto[e["name"]][1]} if e["name"] in (auto or {})
                      else {}))
    return out


def bench_throughput(target: Transformer, drafter_of: Callable, methods: list, conditions: list[dict],
                     sampling: SamplingConfig, seed: int, tp, geometry, compiled: set, device,
                     progress: bool = True) -> dict:
    """Images per second at each of tp.batch_sizes for the methods tp.methods names (eager, and compiled where the
    bench compiles them and tp.compiled is set): one decode call of b images (the bench's conditions cycled),
    methods and modes interleaved, median of tp.repeats passes after a warm-up pass (the compiled graphs of a new
    batch size compile there)."""
    by_name = {m.name: m for m in methods}
    unknown = sorted(set(tp.methods) - set(by_name))
    if unknown:
        raise ValueError(f"bench_spec.throughput.methods names {unknown}, not methods of this bench ({sorted(by_name)})")
    pool = [(c["cond"][i : i + 1], None if c.get("cond_mask") is None else c["cond_mask"][i : i + 1])
            for c in conditions for i in range(c["cond"].shape[0])]
    entries = [(n, "eager") for n in tp.methods] + [(n, "compiled") for n in tp.methods if tp.compiled and n in compiled]
    decs = {(n, mode): method_decoder(by_name[n], target, drafter_of(by_name[n]), geometry, compile=mode == "compiled")
            for n, mode in entries}
    times = {(b, n, mode): [] for b in tp.batch_sizes for n, mode in entries}
    taus = {}
    bar = tqdm(total=len(tp.batch_sizes) * (tp.repeats + 1) * len(entries), desc="throughput", unit="run",
               disable=not progress)
    try:
        for b in tp.batch_sizes:
            picks = [pool[i % len(pool)] for i in range(b)]
            cond = torch.cat([c for c, _ in picks])
            mask = torch.cat([mk for _, mk in picks]) if picks[0][1] is not None else None
            for r in range(tp.repeats + 1):
                order = entries[r % len(entries):] + entries[: r % len(entries)]
                for n, mode in order:
                    gen = torch.Generator(device=device).manual_seed(seed_for(seed, b * 7919 + r))
                    sync(device)
                    t0 = time.perf_counter()
                    _, stats = decs[n, mode](cond, sampling, gen, cond_mask=mask)
                    sync(device)
                    bar.update()
                    if r:
                        times[b, n, mode].append(time.perf_counter() - t0)
                        taus[b, n, mode] = stats.get("tau", 1.0)
    finally:
        bar.close()
    vanilla = next((n for n in tp.methods if by_name[n].method == "vanilla"), None)
    rows = []
    for b in tp.batch_sizes:
        for n, mode in entries:
            wall = statistics.median(times[b, n, mode])
            van = statistics.median(times[b, vanilla, mode]) if (b, vanilla, mode) in times else None
            rows.append({"batch": b, "method": n, "mode": mode, "images_per_s": b / wall, "tau": taus[b, n, mode],
                         "speedup": van / wall if van else None})
    return {"methods": list(tp.methods), "batch_sizes": list(tp.batch_sizes), "repeats": tp.repeats, "rows": rows}
