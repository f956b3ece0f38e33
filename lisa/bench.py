"""Decode-speed benchmark of the vanilla loop against the bare forward passes it makes (the loop's overhead).

Both are measured in one run, interleaved, after a warm-up: the loop is `generate()` (sampling, CFG arithmetic,
cache bookkeeping); the bare run replays the same sequence of model forwards (prefill of the condition prefix,
then T-1 one-token steps on the same cache) with precomputed tokens and nothing else.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
from tqdm import tqdm

from lisa.generate import generate, prefix_embeddings
from lisa.models.gpt import Transformer
from lisa.sampling import SamplingConfig


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        _sync(device)
        t0 = time.perf_counter()
        tokens, _ = generate(model, cond, sampling, gen, num_tokens=num_tokens)
        _sync(device)
        t1 = time.perf_counter()
        bare_forwards(model, cond, tokens, sampling.use_cfg)
        _sync(device)
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


def markdown_table(rows: list[dict], title: str) -> str:
    lines = [f"## {title}", "",
             "| cfg scale | batch | rows/forward | tokens | loop s | bare forwards s | tokens/s | ms/step | loop overhead |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cfg_scale']:g} | {r['batch_size']} | {r['rows_in_forward']} | {r['num_tokens']} | "
                     f"{r['loop_s']:.3f} | {r['bare_forwards_s']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['ms_per_token_step']:.2f} | {100 * r['loop_overhead']:+.1f}% |")
    return "\n".join(lines) + "\n"
