"""GPU memory and time of a profile, estimated from its config alone, before anything runs (`lisa estimate`).

Models are built on the meta device (no memory, no checkpoint read) to count parameters. Memory: bf16 weights of
the target and the drafter, the KV caches of a decode (CFG doubles the rows; a draft tree adds its nodes), the
fp32 logits of one verification forward, and for drafter training the drafter's AdamW state (fp32 master, two
moments) plus activations. Time: decoding is memory-bound, so one target forward costs its weight bytes over the
GPU's HBM bandwidth (times an efficiency) plus a kernel-launch overhead per block; a speculative decode does T / tau forwards plus its drafting steps;
training and the logit cache are compute-bound: 2 (forward) or 6 (forward + backward) FLOPs per parameter and
token over the GPU's bf16 peak times an MFU. These are planning numbers (+-50%), printed so a user can see that a
run fits the GPU and roughly how long it takes; `lisa bench-gpu` measures the real ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lisa.decoding.verify import drafts_tree
from lisa.models.drafter import DrafterConfig, Eagle3Drafter
from lisa.models.gpt import Transformer, gpt_config

GPUS = {  # name: (memory GiB, HBM TB/s, dense bf16 TFLOP/s)
    "H200": (141, 4.8, 989),
    "H100": (80, 3.35, 989),
    "A100-80G": (80, 2.0, 312),
    "A100-40G": (40, 1.55, 312),
    "L40S": (48, 0.86, 362),
    "RTX4090": (24, 1.0, 165),
}
BW_EFFICIENCY = 0.6  # achieved / peak HBM bandwidth in a batch-1 decode step
MFU = 0.35  # achieved / peak FLOP/s in training and teacher-forced passes
LAYER_OVERHEAD_S = 1e-4  # eager PyTorch: ~10 kernel launches of ~10 us per block and forward (torch.compile: less)


@dataclass
class WorldEstimate:
    world: str
    target_params: float
    drafter_params: float
    decode_gib: float
    train_gib: float
    vanilla_s_per_image: float
    spec_s_per_image: float
    stage_hours: dict

    def fits(self, gpu_gib: float) -> bool:
        return max(self.decode_gib, self.train_gib) <= gpu_gib


def _params(module_fn) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in module_fn().parameters())


def estimate_world(name: str, world, params, gpu: str = "H200", tau: float = 2.5) -> WorldEstimate:
    """Memory and time of one world's stages on `gpu`; tau: the acceptance length assumed for speculative decoding
    (LISA.md: ~2.5-3.5 on the paper's targets)."""
    mem_gib, tbs, tflops = GPUS[gpu]
    cfg = gpt_config(**world.target)
    dcfg = DrafterConfig.for_target(cfg)
    P, Pd = _params(lambda: Transformer(cfg)), _params(lambda: Eagle3Drafter(dcfg))
    C, T, V = cfg.cls_token_num, cfg.block_size, cfg.vocab_size
    methods = params.bench_spec.methods
    nodes = max([m.total_tokens for m in methods if drafts_tree(m.method)] or [16])
    rows = 2 * params.bench_spec.batch_size  # CFG
    kv = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * (C + T + nodes + 2) * rows * 2  # bf16 K and V
    kv_d = 2 * dcfg.kv_heads * dcfg.head_dim * (T + 2 * nodes) * rows * 2
    logits = rows * (nodes + 1) * V * 4 * 3  # fp32 logits, guided copy, probabilities
    decode = 2 * (P + Pd) + kv + kv_d + logits
    td = params.train_drafter
    tokens_step = td.batch_size * T
    act = tokens_step * (cfg.dim * 3 * 2 + td.ttt_steps * (dcfg.dim * 12 * 2 + V * 4 * 2))  # taps + drafter steps
    train = 2 * P + 16 * Pd + act + 2 * cfg.n_layer * tokens_step * cfg.dim * 2  # + target activations (no grad)
    t_fwd = 2 * P / (tbs * 1e12 * BW_EFFICIENCY) + cfg.n_layer * LAYER_OVERHEAD_S  # one target forward
    t_draft = 2 * Pd / (tbs * 1e12 * BW_EFFICIENCY) + LAYER_OVERHEAD_S
    depth = max([m.depth for m in methods if drafts_tree(m.method)] or [4])
    vanilla = T * t_fwd
    spec = T / tau * (t_fwd + depth * t_draft)
    flop = tflops * 1e12 * MFU
    hours = {
        "train-drafter": td.steps * tokens_step * (2 * P + 6 * Pd * td.ttt_steps) / flop / 3600,
        "cache-logits": (params.cache_logits.max_sequences or 0) * T * 2 * P / flop / 3600,
        "evaluate (vanilla)": params.evaluate.num_samples * vanilla / 3600,
        "eval-method cells": len(params.table.cells) * params.table.num_samples * spec / 3600,
        "bench-spec": (len(methods) * params.bench_spec.repeats * params.bench_spec.per_class
                       * max(1, len(params.sample.prompts or params.sample.classes)) * spec) / 3600,
    }
    return WorldEstimate(name, P, Pd, decode / 2**30, train / 2**30, vanilla, spec, hours)


def estimate_markdown(params, gpu: str = "H200", tau: float = 2.5) -> str:
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; known: {sorted(GPUS)}")
    mem_gib = GPUS[gpu][0]
    lines = [f"Estimated on one {gpu} ({mem_gib} GiB, {GPUS[gpu][1]} TB/s, {GPUS[gpu][2]} bf16 TFLOP/s), bf16, "
             f"tau {tau} assumed for speculative decoding (planning numbers, +-50%):", "",
             "| world | target | drafter | decode GiB | drafter-training GiB | fits | vanilla s/img | spec s/img | "
             "hours per stage |", "|---|---|---|---|---|---|---|---|---|"]
    for name, world in params.worlds.items():
        e = estimate_world(name, world, params, gpu, tau)
        stages = ", ".join(f"{k} {v:.2f}" for k, v in e.stage_hours.items())
        lines.append(f"| {name} | {e.target_params / 1e9:.2f}B | {e.drafter_params / 1e6:.1f}M | {e.decode_gib:.1f} | "
                     f"{e.train_gib:.1f} | {'yes' if e.fits(mem_gib) else 'NO'} | {e.vanilla_s_per_image:.2f} | "
                     f"{e.spec_s_per_image:.2f} | {stages} |")
    return "\n".join(lines) + "\n"


def missing_checkpoints(params) -> list[str]:
    """The checkpoints, caption encoders, datasets and prompt files the params name that do not exist (what to
    download, see README)."""
    from pathlib import Path

    out = []
    for name, w in params.worlds.items():
        for what in ("target_checkpoint", "tokenizer_checkpoint"):
            path = getattr(w, what)
            if path and not Path(path).exists():
                out.append(f"worlds.{name}.{what}: {path}")
        enc = w.caption_encoder
        if enc not in (None, "minilm") and not Path(enc).exists():
            out.append(f"worlds.{name}.caption_encoder: {enc}")
        for what in ("path", "captions", "test_path", "test_captions"):
            path = getattr(w.dataset, what) if w.dataset else None
            if path and not Path(path).exists():
                out.append(f"worlds.{name}.dataset.{what}: {path}")
    if params.sample.prompts_file and not Path(params.sample.prompts_file).exists():
        out.append(f"sample.prompts_file: {params.sample.prompts_file}")
    return out
