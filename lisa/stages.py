"""Pipeline stages: one function each, paths and config in, files and a metrics dict out.

The CLI (`lisa <stage>`, called by dvc.yaml) and the Prefect tasks (tasks/) call these same functions.
Stages of the foundation: `init-target` (random init from a config, or import an official LlamaGen checkpoint),
`init-tokenizer` (likewise for the VQ tokenizer), `sample` (vanilla sampling to a PNG grid) and `bench`
(vanilla decode speed against the bare forwards). Later issues add training, caching, calibration, evaluation.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from lisa.bench import bench_vanilla, markdown_table
from lisa.checkpoint import atomic_write, file_sha256, save_artifact, write_json
from lisa.config import BenchParams, InitTargetParams, InitTokenizerParams, SampleParams, WorldParams
from lisa.generate import generate
from lisa.images import save_grid
from lisa.load import import_llamagen_gpt, import_llamagen_vq, load_target, load_tokenizer
from lisa.models.gpt import Transformer, gpt_config
from lisa.models.vq import VQModel
from lisa.sampling import SamplingConfig

TARGET_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.safetensors"


def layout(world: str, root: str | Path = ".") -> dict[str, Path]:
    """Where each stage writes for a world (dvc.yaml spells out the same paths)."""
    root = Path(root)
    return {
        "tokenizer": root / "data" / "tokenizer" / world,
        "target": root / "data" / "target" / world,
        "samples": root / "reports" / "samples" / world,
        "bench": root / "reports" / "bench",
    }


def _save_initial(model, out: Path, kind: str, seed: int, checkpoint) -> dict:
    """Write an imported (checkpoint set) or randomly initialised model as a step-0 artifact."""
    made_from = ({"llamagen_checkpoint": str(checkpoint), "sha256": file_sha256(checkpoint)} if checkpoint
                 else {"init": "random"})
    meta = save_artifact(model, out, kind, model.config, step=0, seed=seed, made_from=made_from)
    return {"params": sum(x.numel() for x in model.parameters()), "sha256": meta["sha256"], "path": str(out)}


def init_target(world: WorldParams, p: InitTargetParams, out_dir: str | Path) -> dict:
    """Target artifact for a world: imported from `world.target_checkpoint` if set, else seeded random init."""
    torch.manual_seed(p.seed)
    if world.target_checkpoint:
        vq = world.vq_config()
        overrides = {k: v for k, v in world.target.items() if k != "preset"}
        model = import_llamagen_gpt(world.target_checkpoint, world.target.get("preset"), vq.image_size,
                                    vq.downsample, **overrides)
    else:
        model = Transformer(world.gpt_config())
    return _save_initial(model, Path(out_dir) / TARGET_FILE, "gpt", p.seed, world.target_checkpoint)


def init_tokenizer(world: WorldParams, p: InitTokenizerParams, out_dir: str | Path) -> dict:
    """Tokenizer artifact for a world: imported from `world.tokenizer_checkpoint` if set, else random init."""
    torch.manual_seed(p.seed)
    if world.tokenizer_checkpoint:
        overrides = {k: v for k, v in world.tokenizer.items() if k != "preset"}
        model = import_llamagen_vq(world.tokenizer_checkpoint, world.tokenizer.get("preset", "VQ-16"), **overrides)
    else:
        model = VQModel(world.vq_config())
    return _save_initial(model, Path(out_dir) / TOKENIZER_FILE, "vq", p.seed, world.tokenizer_checkpoint)


def sample(target_path: str | Path, tokenizer_path: str | Path, p: SampleParams, out_dir: str | Path) -> dict:
    """Vanilla sampling: `per_class` images for each class in `classes`, one grid row per class."""
    model, target_meta = load_target(target_path)
    vq, vq_meta = load_tokenizer(tokenizer_path)
    if model.config.model_type != "c2i":
        raise ValueError(f"{target_path}: the sample stage draws class-conditional grids; this target is "
                         f"{model.config.model_type!r} (use lisa.generate.generate with caption features)")
    if model.config.vocab_size != vq.config.codebook_size:
        raise ValueError(f"{target_path} has vocab_size {model.config.vocab_size} but {tokenizer_path} has "
                         f"codebook_size {vq.config.codebook_size}")
    bad = [c for c in p.classes if not 0 <= c < model.config.num_classes]
    if bad:
        raise ValueError(f"sample.classes {bad} out of range for {model.config.num_classes} classes ({target_path})")
    sampling = SamplingConfig(p.temperature, p.top_k, p.top_p, p.cfg_scale)
    gen = torch.Generator().manual_seed(p.seed)
    labels = torch.tensor([c for c in p.classes for _ in range(p.per_class)])
    tokens, images, decode_s = [], [], 0.0
    t0 = time.perf_counter()
    for batch in tqdm(labels.split(p.batch_size), desc="sample", unit="batch"):
        tok, _ = generate(model, batch, sampling, gen)
        t1 = time.perf_counter()
        with torch.inference_mode():
            images.append(vq.decode(tok))
        decode_s += time.perf_counter() - t1
        tokens.append(tok)
    total_s = time.perf_counter() - t0
    out = Path(out_dir)
    save_grid(torch.cat(images), out / "grid.png", nrow=p.per_class)
    tokens = torch.cat(tokens)
    atomic_write(out / "tokens.pt", lambda tmp: torch.save({"labels": labels, "tokens": tokens}, tmp))
    metrics = {
        "images": len(labels),
        "decode_loop_s": total_s - decode_s,
        "vq_decode_s": decode_s,
        "s_per_image": (total_s - decode_s) / len(labels),
        "target_sha256": target_meta["sha256"],
        "tokenizer_sha256": vq_meta["sha256"],
    }
    write_json(out / "metrics.json", metrics)
    return metrics


def bench(p: BenchParams, out_dir: str | Path) -> dict:
    """Vanilla decode speed of a random-weight target (e.g. GPT-B) on this machine, loop vs bare forwards."""
    if p.threads:
        torch.set_num_threads(p.threads)
    torch.manual_seed(p.seed)
    cfg = gpt_config(**p.target)
    model = Transformer(cfg).eval()
    rows = bench_vanilla(model, min(p.num_tokens, cfg.block_size), p.batch_size, p.cfg_scales, p.repeats,
                         p.warmup, p.seed)
    name = p.target.get("preset", "custom")
    result = {"target": p.target, "params": model.num_params(), "threads": torch.get_num_threads(),
              "device": "cpu", "rows": rows}
    out = Path(out_dir)
    write_json(out / "vanilla.json", result)
    title = f"Vanilla decode, {name} ({model.num_params() / 1e6:.0f}M params, random weights), {result['threads']} threads"
    atomic_write(out / "vanilla.md", lambda tmp: Path(tmp).write_text(markdown_table(rows, title)))
    return result
