"""The GPU benchmark: a LlamaGen-GPT-XL-sized target with random weights and an EAGLE-3 drafter of its width,
vanilla against speculative decoding, in one run (`lisa bench-gpu`; it runs on a CPU too, for small presets).

What it measures, CUDA-synchronised (lisa.decoding.costmodel.sync around every timed call):
  * t(N): one target forward over N new tokens per row after a half-full cache, as the speculative loop calls it
    (explicit tree mask, per-row positions), for N = 1 .. 128: how flat the cost of a tree is on this device;
  * the decode loop of every method (lisa.bench.speed.bench_speculative: same conditions and seeds, methods
    interleaved, median over passes): ms per image, speedup over vanilla, tau, loop overhead.
Random weights make the target's distribution nearly uniform, so tau is ~1 and the speedup here is the cost side
of speculative decoding (what a round costs against a vanilla step); the toy worlds and real checkpoints give the
acceptance side. bf16 by default; `compile=True` wraps the target's and the drafter's forwards in torch.compile
(dynamic shapes; the first passes include compilation, hence the warm-up).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lisa.decoding import costmodel
from lisa.bench.speed import bench_speculative
from lisa.config import BenchMethod
from lisa.models.gpt import Transformer, gpt_config
from lisa.decoding.sampling import SamplingConfig

DEFAULT_METHODS = [
    BenchMethod("vanilla"),
    BenchMethod("exact-chain", "exact", "chain", depth=4),
    BenchMethod("exact-tree-16", "exact", "dynamic", depth=4, top_k_draft=4, total_tokens=16),
    BenchMethod("exact-tree-60", "exact", "dynamic", depth=7, top_k_draft=10, total_tokens=60),  # EAGLE-3's default
]


@dataclass
class GPUBenchConfig:
    preset: str = "GPT-XL"  # 36 layers, dim 1280, 775M (LlamaGen-XL)
    image_tokens: int = 256  # 16x16 codes: 256 px
    vocab_size: int = 16384
    batch_size: int = 1
    cfg_scale: float = 4.0
    dtype: str = "bf16"  # bf16 | fp16 | fp32
    compile: bool = False
    repeats: int = 3
    warmup: int = 1
    conditions: int = 2
    forward_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])
    seed: int = 0


def gpu_bench(cfg: GPUBenchConfig, methods=None, device=None, progress: bool = True) -> dict:
    """Run the benchmark; returns the report (JSON-able)."""
    from lisa.training.drafter import new_drafter

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.dtype]
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    target = Transformer(gpt_config(cfg.preset, vocab_size=cfg.vocab_size, block_size=cfg.image_tokens,
                                    num_classes=1000)).eval().to(device=device, dtype=dtype)
    drafter = new_drafter(target).eval().to(device=device, dtype=dtype)
    build_s = time.perf_counter() - t0
    if cfg.compile:
        target.forward = torch.compile(target.forward, dynamic=True)
        drafter.forward = torch.compile(drafter.forward, dynamic=True)
    sampling = SamplingConfig(temperature=1.0, cfg_scale=cfg.cfg_scale)
    rows = (2 if sampling.use_cfg else 1) * cfg.batch_size
    gen = torch.Generator().manual_seed(cfg.seed)
    conditions = [{"label": f"classes {c.tolist()}", "cond": c.to(device)}
                  for c in torch.randint(0, 1000, (cfg.conditions, cfg.batch_size), generator=gen)]
    with torch.inference_mode():
        context = target.config.cls_token_num + cfg.image_tokens // 2
        t_of_n = {n: costmodel.time_target_forward(target, rows, n, context) for n in cfg.forward_sizes}
        report = bench_speculative(target, drafter, conditions, methods or DEFAULT_METHODS, sampling, cfg.repeats,
                                   cfg.warmup, cfg.seed, progress=progress)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return {"device": name, "config": cfg.__dict__, "target_params": target.num_params(),
            "drafter_params": sum(p.numel() for p in drafter.parameters()), "build_s": build_s,
            "t_of_n_ms": {int(n): 1000 * s for n, s in t_of_n.items()},
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "methods": report["methods"], "rows_in_forward": rows}


def gpu_markdown(r: dict) -> str:
    """The one table (plus the t(N) row) the benchmark prints."""
    c = r["config"]
    lines = [f"## {c['preset']} ({r['target_params'] / 1e6:.0f}M, random weights) + EAGLE-3 drafter "
             f"({r['drafter_params'] / 1e6:.0f}M) on {r['device']}, {c['dtype']}"
             f"{', torch.compile' if c['compile'] else ''}: {c['image_tokens']} tokens, batch {c['batch_size']}, "
             f"CFG {c['cfg_scale']:g} ({r['rows_in_forward']} rows per forward)", "",
             "t(N), one target forward over N new tokens per row: " + ", ".join(
                 f"N={n}: {ms:.2f} ms" for n, ms in r["t_of_n_ms"].items()), "",
             "| method | ms / image | speedup | tau | target forwards / image | loop ms / forward | in target |",
             "|---|---|---|---|---|---|---|"]
    for m in r["methods"]:
        lines.append(f"| {m['name']} | {m['ms_per_image']:.1f} | {m.get('speedup', float('nan')):.2f}x | "
                     f"{m['tau']:.2f} | {m['target_forwards_per_image']:.1f} | {m['loop_ms_per_forward']:.2f} | "
                     f"{100 * m['target_share']:.0f}% |")
    if r["peak_memory_gib"] is not None:
        lines += ["", f"Peak GPU memory: {r['peak_memory_gib']:.1f} GiB"]
    return "\n".join(lines) + "\n"
