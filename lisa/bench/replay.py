"""The speculative loop timed at a real target's shape, its acceptance replayed from a built-in world (issue 33,
item 4).

The regime table prices a round at its bare forwards; this times the round itself at a LlamaGen shape. A target and
an EAGLE-3 drafter of that shape with random weights would accept nothing, so only the verifier's decision is
replayed: each round every row accepts a length drawn from the method's measured acceptance-length histogram in a
built-in world's bench report (reports/bench/<world>.json), along the tree's first-child chain, and the next token
is drawn from the target's p after the last accepted node. Everything else is the real loop
(lisa.decoding.generate.speculative_generate): the drafter's expansions and sampled siblings, the tree forward,
the exact verifier's walk (run first for its cost; its decision is then replaced), the cache moves and the commit.
Vanilla runs the same target. Methods and modes (eager; compiled: lisa.decoding.generate.compiled) interleave in
every pass, and the bare forwards that bound a round (t(N) and the drafter steps) are timed inside the same passes.
The figures say what the loop costs at that size, not what any real drafter of that size would accept.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from tqdm import tqdm

from lisa.bench.regime import machine
from lisa.config import seed_for
from lisa.decoding import costmodel, verify
from lisa.decoding.generate import SpecConfig, generate, pooled_tau, speculative_generate
from lisa.decoding.sampling import SamplingConfig
from lisa.models.drafter import DrafterConfig, Eagle3Drafter
from lisa.models.gpt import Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class ReplayConfig:
    shape: str = "GPT-B"  # a GPT preset at LlamaGen's c2i size (lisa.bench.regime.shape_config)
    methods: list[str] = field(default_factory=lambda: ["exact-sampled", "lisa-sampled"])  # tree methods of the report
    image_tokens: int = 64  # tokens decoded per image (of the shape's 256): enough rounds to time, a quarter the cost
    images: int = 2  # per pass, one per call (batch 1; CFG: 2 rows)
    repeats: int = 3  # timed passes (median) after one warm-up pass (compiled graphs compile there)
    modes: list[str] = field(default_factory=lambda: ["eager", "compiled"])
    dtype: str = "fp32"
    threads: int = 0  # torch threads (0: torch's default)
    seed: int = 0
    # drafter architectures (name -> lisa.models.drafter.DrafterConfig overrides, e.g. {"ffn_dim": 0, "head_rank":
    # 256}): every method runs with each, all replaying the method's acceptance from the report
    drafters: dict = field(default_factory=lambda: {"eagle3": {}})

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"replay: dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        bad = [m for m in self.modes if m not in ("eager", "compiled")]
        if bad or not self.modes:
            raise ValueError(f"replay: modes must be eager and / or compiled, got {self.modes}")
        if min(self.image_tokens, self.images, self.repeats) < 1:
            raise ValueError("replay: image_tokens, images and repeats must be >= 1")
        if not self.drafters:
            raise ValueError("replay: drafters must name at least one drafter architecture")
        for name, arch in self.drafters.items():
            DrafterConfig.from_dict(DrafterConfig().to_dict() | dict(arch))  # an unknown field or a bad value names it


def spec_of(m: dict) -> SpecConfig:
    """The tree of a bench report's method entry, verified by exact (the replay replaces only its decision)."""
    if m.get("tree") is None:
        raise ValueError(f"replay: method {m['name']!r} drafts no tree (vanilla / Jacobi): nothing to replay")
    return SpecConfig(verifier="exact", tree=m["tree"], depth=m["depth"], top_k_draft=m["top_k_draft"],
                      total_tokens=m["total_tokens"], draft=m["draft"] or "topk", siblings=m["siblings"] or "wor",
                      branching=tuple(m["branching"] or ()))


def replay_verifier(accept_hist: dict, generator: torch.Generator) -> Callable:
    """A verifier function (VerifyContext, generator) -> Verdict that runs exact's walk for its cost, then accepts
    per row a length drawn from accept_hist ({tokens emitted per round: rounds}, bonus included) along the tree's
    first-child chain (as deep as the tree goes), and draws the next token from p after the last accepted node.
    `generator` drives the replay's own draws, apart from the loop's."""
    lengths = torch.tensor([int(k) for k in accept_hist], dtype=torch.long)
    weights = torch.tensor([float(v) for v in accept_hist.values()])
    exact = verify.get_verifier("exact")

    def fn(ctx: verify.VerifyContext, gen: torch.Generator) -> verify.Verdict:
        v = exact(ctx, gen)
        B, dev = ctx.p.shape[0], ctx.p.device
        m = (lengths[torch.multinomial(weights, B, replacement=True, generator=generator)] - 1).to(dev)  # (B,)
        kids = ctx.tree.children()  # (B, N + 1, C): row 0 the root, row i + 1 node i
        ar = torch.arange(B, device=dev)
        path = torch.full_like(v.path, -1)  # (B, D)
        row = torch.zeros(B, dtype=torch.long, device=dev)
        for level in range(path.shape[1]):
            child = kids[ar, row, 0]
            ok = (level < m) & (child >= 0)
            path[:, level] = torch.where(ok, child, -1)
            row = torch.where(ok, child + 1, row)
        nxt = torch.multinomial(ctx.p[ar, row], 1, generator=gen).squeeze(1)
        return verify.Verdict(path, (path >= 0).sum(1), nxt)

    return fn


def replay_bench(rc: ReplayConfig, report: dict, target_config, device: Optional[str] = None,
                 progress: bool = True) -> dict:
    """Time vanilla and rc.methods (entries of a bench report, `report`) on random-weight models of target_config
    (a GPTConfig) with the report's acceptance replayed; returns the report dict (see `replay_markdown`)."""
    if rc.threads:
        torch.set_num_threads(rc.threads)
    dev = torch.device(device or "cpu")
    entries = {m["name"]: m for m in report["methods"]}
    unknown = [n for n in rc.methods if n not in entries]
    if unknown:
        raise ValueError(f"replay: methods {unknown} are not in the bench report (it has {sorted(entries)})")
    specs = {n: spec_of(entries[n]) for n in rc.methods}
    torch.manual_seed(rc.seed)
    dtype = DTYPES[rc.dtype]
    target = Transformer(target_config).eval().to(dev, dtype)
    drafters = {d: Eagle3Drafter(DrafterConfig.for_target(target_config, **arch)).eval().to(dev, dtype)
                for d, arch in rc.drafters.items()}
    default = next(iter(drafters))
    s = report.get("sampling", {})
    sampling = SamplingConfig(s.get("temperature", 1.0), s.get("top_k", 0), s.get("top_p", 1.0),
                              s.get("cfg_scale", 4.0))
    T, rows = min(rc.image_tokens, target_config.block_size), 2 if sampling.use_cfg else 1
    conds = [torch.tensor([c % target_config.num_classes], device=dev) for c in range(rc.images)]
    replay_gen = torch.Generator().manual_seed(rc.seed)

    def decode(name: str, mode: str, cond, gen):
        if name == "vanilla":
            return generate(target, cond, sampling, gen, num_tokens=T, compile=mode == "compiled")
        method, d = split(name)
        return speculative_generate(target, drafters[d], cond, sampling, specs[method], gen, num_tokens=T,
                                    compile=mode == "compiled",
                                    verifier_fn=replay_verifier(entries[method]["accept_hist"], replay_gen))

    split = lambda name: tuple(name.split(" @ ")) if " @ " in name else (name, default)  # noqa: E731
    labels = [m if d == default else f"{m} @ {d}" for d in drafters for m in rc.methods]
    names = ["vanilla", *labels]
    runs = [(n, mode) for mode in rc.modes for n in names]
    # drafter calls per round and their width (one untimed eager decode per method, a counting hook)
    calls = {}
    counter = [0]
    hook = drafters[default].register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    try:
        for n in rc.methods:
            counter[0] = 0
            _, st = decode(n, "eager", conds[0], torch.Generator(device=dev).manual_seed(rc.seed))
            calls[n] = (counter[0] - 1) / max(st["rounds"], 1)  # the prefill's commit apart
    finally:
        hook.remove()
    widths = {n: max(1, round(specs[n].drafted_pairs / calls[n])) if calls[n] else 1 for n in rc.methods}
    sizes = sorted({1} | {specs[n].nodes + 1 for n in rc.methods})
    context = target_config.cls_token_num + T // 2
    wall = {r: [] for r in runs}
    stats = {r: [] for r in runs}
    bare_t = {n: [] for n in sizes}
    bare_q = {(d, w): [] for d in drafters for w in set(widths.values())}
    first = {}
    bar = tqdm(total=(rc.repeats + 1) * len(conds) * len(runs), desc=f"replay {target_config.n_layer} layers",
               unit="run", disable=not progress)
    try:
        for r in range(rc.repeats + 1):
            order = runs[r % len(runs):] + runs[: r % len(runs)]
            per_pass = {x: 0.0 for x in runs}
            for ci, cond in enumerate(conds):
                for name, mode in order:
                    gen = torch.Generator(device=dev).manual_seed(seed_for(rc.seed, ci * 7919 + r))
                    costmodel.sync(dev)
                    t0 = time.perf_counter()
                    _, st = decode(name, mode, cond, gen)
                    costmodel.sync(dev)
                    dt = time.perf_counter() - t0
                    first.setdefault((name, mode), dt)
                    per_pass[name, mode] += dt
                    if r:
                        stats[name, mode].append(st)
                    bar.update()
            if r:
                for x in runs:
                    wall[x].append(per_pass[x])
                for n in sizes:
                    bare_t[n].append(costmodel.time_target_forward(target, rows, n, context, reps=3))
                for d, w in bare_q:
                    bare_q[d, w].append(costmodel.time_drafter_forward(drafters[d], rows, w, context, reps=3))
    finally:
        bar.close()
    t = {n: statistics.median(v) for n, v in bare_t.items()}
    q = {w: statistics.median(v) for w, v in bare_q.items()}
    out = []
    for name, mode in runs:
        ms = 1000 * statistics.median(wall[name, mode]) / len(conds)
        van = 1000 * statistics.median(wall["vanilla", mode]) / len(conds)
        sts = stats[name, mode]
        forwards = sum(x["forwards"] - 1 for x in sts) / len(sts)  # after the prefill
        row = {"method": name, "mode": mode, "ms_per_image": ms, "speedup": van / ms, "forwards_per_image": forwards,
               "compile_s": max(first[name, mode] - statistics.median(wall[name, mode]) / len(conds), 0.0)
               if mode == "compiled" else None}
        if name == "vanilla":
            row |= {"tau": 1.0, "round_ms": ms / max(forwards, 1), "bare_round_ms": 1000 * t[1]}
        else:
            tau, (method, d) = pooled_tau(sts), split(name)
            bare_round = t[specs[method].nodes + 1] + calls[method] * q[d, widths[method]]
            row |= {"drafter": d, "tau": tau, "report_tau": entries[method]["tau"], "round_ms": ms / max(forwards, 1),
                    "bare_round_ms": 1000 * bare_round, "drafter_calls_per_round": calls[method],
                    "drafter_width": widths[method], "tree": specs[method].describe(), "tokens_per_forward":
                    specs[method].nodes + 1, "ceiling": tau * t[1] / bare_round}
        row["round_over_bare"] = row["round_ms"] / row["bare_round_ms"]
        out.append(row)
    return {"config": asdict(rc), "shape": {"n_layer": target_config.n_layer, "dim": target_config.dim,
                                            "vocab_size": target_config.vocab_size, "params": target.num_params(),
                                            "drafter_params": sum(p.numel() for p in drafters[default].parameters()),
                                            "drafters": {d: {"arch": dict(rc.drafters[d]), "params": sum(
                                                p.numel() for p in m.parameters()), "step_weights": step_weights(m)}
                                                for d, m in drafters.items()}},
            "world": report.get("world"), "sampling": asdict(sampling), "machine": machine(),
            "threads": torch.get_num_threads(), "device": str(dev), "rows": rows, "image_tokens": T,
            "bare_target_ms": {int(n): 1000 * v for n, v in t.items()},
            "bare_drafter_ms": {f"{d}:{w}": 1000 * v for (d, w), v in q.items()}, "methods": out}


def step_weights(drafter: Eagle3Drafter) -> int:
    """Weights a drafting step reads: every parameter but the token embedding (one row gathered per token) and the
    fc over the fused taps (once per round, in the commit)."""
    skip = {id(drafter.tok_embeddings.weight), id(drafter.fc.weight)}
    return sum(p.numel() for p in drafter.parameters() if id(p) not in skip)


def replay_markdown(r: dict) -> str:
    sh, c = r["shape"], r["config"]
    lines = [f"## The loop at {c['shape']} shape ({sh['params'] / 1e6:.0f}M target, {sh['drafter_params'] / 1e6:.1f}M "
             f"drafter, random weights), acceptance replayed from {r['world']}", "",
             f"{r['image_tokens']} tokens per image, {c['images']} images per pass, median of {c['repeats']} passes "
             f"after a warm-up, methods and modes interleaved; {r['rows']} rows per forward (CFG); {c['dtype']}, "
             f"{r['threads']} threads on {r['device']} ({r['machine']['cpu']}). Each round accepts a length drawn "
             f"from the method's acceptance histogram in reports/bench/{r['world']}.json (the exact walk runs first, for its cost); "
             "the rest is the real loop. Speedups are against vanilla of the same mode. Bare round: the target "
             "forward over root + tree plus the drafter calls a round makes, timed alone in the same passes; "
             "ceiling: tau x t(1) / bare round, the speedup of a round that cost only its forwards.", "",
             "| method | mode | tree | ms / image | speedup | tau (report's) | round ms | bare round ms | round / bare "
             "| ceiling | compile s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in r["methods"]:
        tau = f"{m['tau']:.2f}" + (f" ({m['report_tau']:.2f})" if "report_tau" in m else "")
        lines.append(f"| {m['method']} | {m['mode']} | {m.get('tree', '-')} | {m['ms_per_image']:.0f} | "
                     f"{m['speedup']:.2f}x | {tau} | {m['round_ms']:.1f} | {m['bare_round_ms']:.1f} | "
                     f"{m['round_over_bare']:.2f} | " + (f"{m['ceiling']:.2f}x" if "ceiling" in m else "-") + " | "
                     + (f"{m['compile_s']:.0f}" if m["compile_s"] is not None else "-") + " |")
    t = ", ".join(f"t({n}) {v:.1f}" for n, v in r["bare_target_ms"].items())
    q = ", ".join(f"q({k.split(':')[1]}) {k.split(':')[0]} {v:.1f}" for k, v in r["bare_drafter_ms"].items())
    lines += ["", f"Bare forwards (ms, medians over the passes): {t}; drafter steps {q}."]
    ds = sh.get("drafters", {})
    if len(ds) > 1:
        about = lambda a: a["arch"] or "EAGLE-3 (the target width, its SwiGLU, a full head)"  # noqa: E731
        lines += ["", "Drafters (`method @ name` rows; the first is the release architecture, the others replay the "
                  "same acceptance: what they accept on a built-in world is in reports/ablate-arch): " + "; ".join(
                      f"{d} {about(a)}: {a['params'] / 1e6:.1f}M parameters, {a['step_weights'] / 1e6:.1f}M read "
                      "per step" for d, a in ds.items()) + "."]
    return "\n".join(lines) + "\n"
