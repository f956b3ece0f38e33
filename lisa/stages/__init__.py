"""Pipeline stages: one function each, paths and config in, files and a metrics dict out.

The CLI (`lisa <stage>`, called by dvc.yaml) and the Prefect tasks (tasks/) call these same functions.
The built-in worlds run `build-dataset` -> `train-tokenizer` -> `encode` -> `train-target` -> `sample`; a world of
official checkpoints uses `init-tokenizer` / `init-target` (import, or random init) instead of the two training
stages. `bench` measures vanilla decode speed against the bare forwards. Then: logit caching, drafter training,
GASV calibration, the speculative benchmark, quality per method (`eval-method`) and the results table.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tqdm import tqdm

from lisa.training import cache
from lisa.data import datasets as data
from lisa.quality import fid
from lisa.quality import judges
from lisa.quality import metrics as quality
from lisa.bench.speed import auto_tree, bench_speculative, bench_vanilla, markdown_table, speculative_markdown
from lisa.checkpoint import (CheckpointError, atomic_write, file_sha256, load_artifact, read_state_dict, save_artifact,
                             write_json)
from lisa.config import (AblateLIDParams, AutoTreeParams, BenchMethod, BenchParams, BenchSpecParams, BuildDatasetParams,
                         CacheLogitsParams, CalibrateParams, TableParams, CorporaParams, EncodeParams, EvaluateParams, InitTargetParams, InitTokenizerParams,
                         PremiseParams, QualityParams, SampleParams, SelfGeneratedParams, TrainDrafterParams, TrainJudgeParams,
                         TrainTargetParams, TrainTokenizerParams, WorldParams)
from lisa.decoding.generate import generate
from lisa.data.images import save_grid
from lisa.models.llamagen import import_llamagen_gpt, import_llamagen_vq, load_target, load_tokenizer
from lisa.models.gpt import Transformer, gpt_config, grammar_grid
from lisa.models.vq import VQModel
from lisa.quality.premise import premise_stats
from lisa.decoding.sampling import SamplingConfig
from lisa.data.text import CaptionEncoder
from lisa.training.loops import evaluate_vq, heldout_nll, train_gpt, train_vq

TARGET_FILE = "model.safetensors"
CALIBRATION_FILE = "calibration.safetensors"
TOKENIZER_FILE = "tokenizer.safetensors"


CODES_FILE = "codes.safetensors"


def layout(world: str, root: str | Path = ".") -> dict[str, Path]:
    """Where each stage writes for a world (dvc.yaml spells out the same paths)."""
    root = Path(root)
    return {
        "dataset": root / "data" / "datasets" / world,
        "codes": root / "data" / "codes" / world,
        "tokenizer": root / "data" / "tokenizer" / world,
        "target": root / "data" / "target" / world,
        "samples": root / "reports" / "samples" / world,
        "tokenizer_work": root / "data" / "work" / "tokenizer" / world,
        "target_work": root / "data" / "work" / "target" / world,
        "tokenizer_report": root / "reports" / "tokenizer" / f"{world}.json",
        "target_report": root / "reports" / "target" / f"{world}.json",
        "premise_report": root / "reports" / "premise" / f"{world}.json",
        "bench": root / "reports" / "bench",
        "quality": root / "data" / "quality" / world,
        "quality_work": root / "data" / "work" / "quality" / world,
        "reference_report": root / "reports" / "quality" / f"{world}-reference.json",
        "judge": root / "data" / "judge" / world,
        "judge_work": root / "data" / "work" / "judge" / world,
        "judge_report": root / "reports" / "judge" / f"{world}.json",
        "evaluate": root / "reports" / "quality" / world,
        "drafter": root / "data" / "drafter" / world,
        "drafter_work": root / "data" / "work" / "drafter" / world,
        "drafter_report": root / "reports" / "drafter" / f"{world}.json",
        "drafter_curves": root / "reports" / "drafter" / world,
        "cache": root / "data" / "cache" / world,
        "ablation": root / "data" / "ablation" / world,
        "ablation_work": root / "data" / "work" / "ablation" / world,
        "ablation_report": root / "reports" / "ablation" / world,
        "cache_report": root / "reports" / "cache" / f"{world}.json",
        "calibration": root / "data" / "calibration" / world,
        "calibration_report": root / "reports" / "calibration" / f"{world}.json",
        "lid_drafter": root / "data" / "ablation" / world / "lid.safetensors",
        "cells": root / "reports" / "quality" / world / "methods",
        "cells_work": root / "data" / "work" / "quality" / world / "methods",
    }


def corpora_layout(root: str | Path = ".") -> dict[str, Path]:
    """Where the corpus stages write (dvc.yaml spells out the same paths); self-generated: per world."""
    root = Path(root)
    return {"fixture": root / "data" / "corpora" / "laion-coco-fixture",
            "laion": root / "data" / "corpora" / "laion-coco",
            "laion_report": root / "reports" / "corpora" / "laion-coco.json",
            "self": lambda world: root / "data" / "corpora" / "self-generated" / world,
            "self_report": lambda world: root / "reports" / "corpora" / f"self-generated-{world}.json"}


def _save_initial(model, out: Path, kind: str, seed: int, checkpoint) -> dict:
    """Write an imported (checkpoint set) or randomly initialised model as a step-0 artifact."""
    def sha(path):  # a transformers directory: the hash of its files' hashes (config, shards, tokenizer)
        path = Path(path)
        if path.is_file():
            return file_sha256(path)
        h = hashlib.sha256()
        for f in sorted(x for x in path.rglob("*") if x.is_file()):
            h.update(f"{f.relative_to(path)}:{file_sha256(f)}\n".encode())
        return h.hexdigest()

    made_from = ({"llamagen_checkpoint": str(checkpoint), "sha256": sha(checkpoint)} if checkpoint
                 else {"init": "random"})
    meta = save_artifact(model, out, kind, model.config, step=0, seed=seed, made_from=made_from)
    return {"params": sum(x.numel() for x in model.parameters()), "sha256": meta["sha256"], "path": str(out)}


def world_sampling(world: WorldParams, p) -> SamplingConfig:
    """The SamplingConfig of a sampling section `p`, with the world's own `sampling` values over it."""
    known = {"temperature", "top_k", "top_p", "cfg_scale"}
    over = world.sampling or {}
    if set(over) - known:
        raise ValueError(f"worlds.<world>.sampling: unknown keys {sorted(set(over) - known)}; known: {sorted(known)}")
    v = {k: over.get(k, getattr(p, k)) for k in known}
    return SamplingConfig(float(v["temperature"]), int(v["top_k"]), float(v["top_p"]), float(v["cfg_scale"]))


def text_encoder(world: WorldParams, cfg):
    """captions -> conditions of a text-conditional target, its encoder loaded once: caption-encoder features (T5:
    packed with their mask) for t2i; for lm targets (Lumina-mGPT) the prompt ids of the checkpoint's own tokenizer,
    -1 at padding."""
    if cfg.model_type == "lm":
        from lisa.models.lumina import prompt_encoder

        if not world.target_checkpoint:
            raise ValueError("an lm (Lumina-mGPT) world needs target_checkpoint: its tokenizer encodes the prompts")
        encode = prompt_encoder(world.target_checkpoint, cfg.cls_token_num, 16 * grammar_grid(cfg.block_size))
        def prompts(captions):
            ids, mask = encode(captions)
            return torch.where(mask, ids, -1)

        return prompts
    encoder = CaptionEncoder(None if world.caption_encoder in (None, "minilm") else world.caption_encoder)
    return lambda captions: encoder.features(captions, cfg.cls_token_num)


def text_conditions(world: WorldParams, cfg, captions: list[str]) -> torch.Tensor:
    """text_encoder(world, cfg)(captions), for one call."""
    return text_encoder(world, cfg)(captions)


def _caption_cond(t: dict, idx: torch.Tensor) -> torch.Tensor:
    """Conditions of the captions `idx` from a codes file: features as fp32, or an lm target's prompt ids (long)."""
    x = t["caption_feats"][idx]
    return x.float() if x.is_floating_point() else x.long()


def target_codebook(vq, cfg) -> torch.Tensor:
    """The geometry of the target's vocabulary: the VQ codebook, extended for an lm target's grammar ids
    (lisa.models.lumina.geometry_codebook)."""
    if cfg.model_type == "lm":
        from lisa.models.lumina import geometry_codebook

        return geometry_codebook(vq.codebook(), cfg.vocab_size)
    return vq.codebook()


class GrammarVQ:
    """A tokenizer that decodes an lm target's token sequences: the grammar tokens are dropped first."""

    def __init__(self, vq, cfg):
        from lisa.models.gpt import square_image_grammar

        self.vq, self.free = vq, square_image_grammar(cfg.free_vocab, cfg.block_size) < 0

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vq.decode(tokens[:, self.free.to(tokens.device)])

    def __getattr__(self, name):
        return getattr(self.vq, name)


def image_tokenizer(vq, cfg):
    """What decodes the target's token sequences to images: the VQ model, or GrammarVQ for lm targets."""
    return GrammarVQ(vq, cfg) if cfg.model_type == "lm" else vq


def init_target(world: WorldParams, p: InitTargetParams, out_dir: str | Path) -> dict:
    """Target artifact for a world: imported from `world.target_checkpoint` if set (an official LlamaGen .pt, or a
    Lumina-mGPT / Chameleon transformers directory), else seeded random init."""
    from lisa.models.lumina import LuminaGrammar, import_chameleon, is_chameleon_dir

    torch.manual_seed(p.seed)
    if world.target_checkpoint and is_chameleon_dir(world.target_checkpoint):
        want = world.gpt_config()
        grid = grammar_grid(want.block_size)
        grammar = LuminaGrammar(codebook_size=want.free_vocab, max_grid=want.vocab_size - want.free_vocab - 4)
        model = import_chameleon(world.target_checkpoint, image_size=16 * grid, prompt_len=want.cls_token_num,
                                 grammar=grammar)
        if model.config != want:
            diff = {k: (getattr(want, k), getattr(model.config, k)) for k in vars(want)
                    if getattr(want, k) != getattr(model.config, k)}
            raise CheckpointError(f"{world.target_checkpoint}: differs from worlds.<world>.target (params, checkpoint): "
                                  f"{diff}")
    elif world.target_checkpoint:
        vq = world.vq_config()
        # the vocabulary comes from the file and the grid from the image size; checked against the world below
        overrides = {k: v for k, v in world.target.items() if k not in ("preset", "vocab_size", "block_size")}
        model = import_llamagen_gpt(world.target_checkpoint, world.target.get("preset"), vq.image_size,
                                    vq.downsample, **overrides)
        want = world.gpt_config()
        diff = {k: (getattr(want, k), getattr(model.config, k)) for k in ("vocab_size", "block_size")
                if k in world.target and getattr(want, k) != getattr(model.config, k)}  # the ones the world names
        if diff:
            raise CheckpointError(f"{world.target_checkpoint}: differs from worlds.<world>.target (params, checkpoint "
                                  f"at {vq.image_size} px / downsample {vq.downsample}): {diff}")
    else:
        model = Transformer(world.gpt_config())
    return _save_initial(model, Path(out_dir) / TARGET_FILE, "gpt", p.seed, world.target_checkpoint)


def init_tokenizer(world: WorldParams, p: InitTokenizerParams, out_dir: str | Path) -> dict:
    """Tokenizer artifact for a world: imported from `world.tokenizer_checkpoint` if set, else random init."""
    torch.manual_seed(p.seed)
    if world.tokenizer_checkpoint and world.target.get("arch") == "chameleon":  # Lumina-mGPT: Chameleon's VQGAN
        from lisa.models.lumina import import_chameleon_vq

        model = import_chameleon_vq(world.tokenizer_checkpoint, 16 * grammar_grid(world.gpt_config().block_size))
    elif world.tokenizer_checkpoint:
        overrides = {k: v for k, v in world.tokenizer.items() if k != "preset"}
        model = import_llamagen_vq(world.tokenizer_checkpoint, world.tokenizer.get("preset", "VQ-16"), **overrides)
    else:
        model = VQModel(world.vq_config())
    return _save_initial(model, Path(out_dir) / TOKENIZER_FILE, "vq", p.seed, world.tokenizer_checkpoint)


def build_dataset(name: str, image_size: int, p: BuildDatasetParams, out_dir: str | Path, source=None) -> dict:
    """A built-in or local dataset (lisa/data/datasets.py) as a HuggingFace DatasetDict saved to out_dir; `source`: the
    world's DatasetParams (path, captions, test_path, test_captions of a local dataset)."""
    local = {k: getattr(source, k) for k in ("path", "captions", "test_path", "test_captions")} if source else {}
    ds = data.build(name, image_size, p.test_fraction, limits=(p.max_train, p.max_test), **local)
    for split, limit in (("train", p.max_train), ("test", p.max_test)):
        n = len(ds[split]) if limit is None else min(limit, len(ds[split]))
        # a fingerprint from the recipe, not a random one: the saved folder (and its DVC hash) is reproducible
        recipe = f"{name}/{image_size}/{p.test_fraction}/{split}/{n}"
        ds[split] = ds[split].select(range(n), new_fingerprint=hashlib.sha256(recipe.encode()).hexdigest()[:16])
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a crash never leaves a half-written dataset behind
    return {split: len(ds[split]) for split in ds} | {"classes": ds["train"].features["label"].names}


def _load_images(dataset_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, object]:
    from datasets import load_from_disk

    if not (Path(dataset_dir) / "dataset_dict.json").is_file():
        raise FileNotFoundError(f"{dataset_dir}: no dataset_dict.json (run `lisa build-dataset` first)")
    ds = load_from_disk(str(dataset_dir))
    return data.images_tensor(ds["train"]), data.images_tensor(ds["test"]), ds


def train_tokenizer(dataset_dir: str | Path, world: WorldParams, p: TrainTokenizerParams, out_dir: str | Path,
                    report: str | Path, work_dir: str | Path) -> dict:
    """Train the world's VQ tokenizer on its dataset; resumable (work_dir/resume.pt). Held-out PSNR and usage.
    A world with a `tokenizer_checkpoint` (the real profile) imports it instead (init_tokenizer), and reports the
    imported tokenizer's held-out reconstruction."""
    train_u8, test_u8, _ = _load_images(dataset_dir)
    if world.tokenizer_checkpoint:
        info = init_tokenizer(world, InitTokenizerParams(seed=p.seed), out_dir)
        vq, _ = load_tokenizer(Path(out_dir) / TOKENIZER_FILE)
        metrics = {"imported": world.tokenizer_checkpoint, **evaluate_vq(vq, test_u8, p.eval_batch_size)}
        write_json(report, metrics)
        return metrics | {"sha256": info["sha256"]}
    torch.manual_seed(p.seed)
    model = VQModel(world.vq_config())
    metrics = train_vq(model, train_u8, test_u8, p, work_dir)
    meta = save_artifact(model, Path(out_dir) / TOKENIZER_FILE, "vq", model.config, step=p.steps, seed=p.seed,
                         made_from={"dataset": str(dataset_dir)}, extra={"metrics": metrics})
    write_json(report, metrics)
    return metrics | {"sha256": meta["sha256"]}


@torch.no_grad()
def encode(dataset_dir: str | Path, tokenizer_path: str | Path, world: WorldParams, p: EncodeParams,
           out_dir: str | Path) -> dict:
    """VQ codes of every image, with its class, and (t2i) per-token caption features of every distinct caption."""
    vq, vq_meta = load_tokenizer(tokenizer_path)
    _, _, ds = _load_images(dataset_dir)
    cfg = world.gpt_config()
    tensors, captions = {}, sorted(set(ds["train"]["caption"]) | set(ds["test"]["caption"]))
    index = {c: i for i, c in enumerate(captions)}
    for split in ("train", "test"):
        images = data.images_tensor(ds[split])
        codes = torch.cat([vq.encode(data.to_model_range(b)).flatten(1) for b in
                           tqdm(images.split(p.batch_size), desc=f"encode {split}", unit="batch")])
        if cfg.model_type == "lm":  # the target's sequences: the codes inside its image grammar
            from lisa.models.gpt import square_image_grammar

            grammar = square_image_grammar(cfg.free_vocab, cfg.block_size)
            if codes.shape[1] != int((grammar < 0).sum()):
                raise ValueError(f"{tokenizer_path} gives {codes.shape[1]} codes per image, the target's grammar "
                                 f"holds {int((grammar < 0).sum())}: dataset.image_size does not fit")
            seq = grammar.expand(len(codes), -1).clone()
            seq[:, grammar < 0] = codes
            codes = seq
        tensors[f"{split}_codes"] = codes.to(torch.int16)  # (N, T)
        tensors[f"{split}_labels"] = torch.tensor(ds[split]["label"], dtype=torch.int64)
        tensors[f"{split}_caption_idx"] = torch.tensor([index[c] for c in ds[split]["caption"]], dtype=torch.int64)
    if cfg.model_type == "lm":  # prompt ids from the checkpoint's tokenizer, -1 at padding
        tensors["caption_feats"] = text_conditions(world, cfg, captions)
    if cfg.model_type == "t2i":
        encoder = CaptionEncoder(None if world.caption_encoder in (None, "minilm") else world.caption_encoder)
        if encoder.dim != cfg.caption_dim:
            raise ValueError(f"caption encoder {encoder.path} gives {encoder.dim}-d features, the target's "
                             f"caption_dim is {cfg.caption_dim}")
        # (U, C, D), or (U, C, D + 1) with the mask packed in for T5 (lisa.data.text.pack_caption)
        tensors["caption_feats"] = encoder.features(captions, cfg.cls_token_num).to(torch.float16)
    out = Path(out_dir) / CODES_FILE
    atomic_write(out, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp))
    write_json(out.with_suffix(".json"), {"captions": captions, "tokenizer_sha256": vq_meta["sha256"],
                                          "sha256": file_sha256(out)})
    return {"train": len(tensors["train_codes"]), "test": len(tensors["test_codes"]), "captions": len(captions),
            "codes_used": int(torch.cat([tensors["train_codes"], tensors["test_codes"]]).unique().numel())}


def load_codes(codes_path: str | Path, model_type: str) -> dict[str, torch.Tensor]:
    """codes.safetensors -> {"train_tokens", "train_cond", "test_tokens", "test_cond"} for the target's type."""
    t = read_state_dict(codes_path)
    out = {}
    for split in ("train", "test"):
        out[f"{split}_tokens"] = t[f"{split}_codes"].long()
        out[f"{split}_cond"] = (t[f"{split}_labels"] if model_type == "c2i" else
                                _caption_cond(t, t[f"{split}_caption_idx"]))
    return out


def train_target(codes_path: str | Path, world: WorldParams, p: TrainTargetParams, out_dir: str | Path,
                 report: str | Path, work_dir: str | Path) -> dict:
    """Train the world's target GPT on its VQ codes; resumable (work_dir/resume.pt). Held-out NLL per token.
    A world with a `target_checkpoint` (the real profile) imports it instead (init_target), and reports the
    imported target's held-out NLL on these codes."""
    cfg = world.gpt_config()
    d = load_codes(codes_path, cfg.model_type)
    if world.target_checkpoint:
        info = init_target(world, InitTargetParams(seed=p.seed), out_dir)
        model, _ = load_target(Path(out_dir) / TARGET_FILE)
        metrics = {"imported": world.target_checkpoint,
                   "heldout_nll_per_token": heldout_nll(model, d["test_tokens"], d["test_cond"], p.eval_batch_size)}
        write_json(report, metrics)
        return metrics | {"sha256": info["sha256"]}
    torch.manual_seed(p.seed)
    model = Transformer(cfg)
    metrics = train_gpt(model, d["train_tokens"], d["train_cond"], d["test_tokens"], d["test_cond"], p, work_dir)
    meta = save_artifact(model.eval(), Path(out_dir) / TARGET_FILE, "gpt", cfg, step=p.steps, seed=p.seed,
                         made_from={"codes": str(codes_path), "codes_sha256": file_sha256(codes_path)},
                         extra={"metrics": metrics})
    write_json(report, metrics)
    return metrics | {"sha256": meta["sha256"]}


def sample(target_path: str | Path, tokenizer_path: str | Path, world: WorldParams, p: SampleParams,
           out_dir: str | Path, drafter_path: Optional[str | Path] = None,
           calibration_path: Optional[str | Path] = None) -> dict:
    """Sampling, `per_class` images per grid row: one row per class (c2i) or per prompt (t2i); with
    `p.method` vanilla, or speculative (a verifier name; greedy / exact / lantern need `drafter_path`)."""
    model, target_meta = load_target(target_path)
    vq, vq_meta = load_tokenizer(tokenizer_path)
    cfg = model.config
    if (cfg.free_vocab or cfg.vocab_size) != vq.config.codebook_size:
        raise ValueError(f"{target_path} samples {cfg.free_vocab or cfg.vocab_size} codes but {tokenizer_path} has "
                         f"codebook_size {vq.config.codebook_size}")
    if cfg.model_type == "c2i":
        bad = [c for c in p.classes if not 0 <= c < cfg.num_classes]
        if bad:
            raise ValueError(f"sample.classes {bad} out of range for {cfg.num_classes} classes ({target_path})")
        rows = [str(c) for c in p.classes]
        cond = torch.tensor([c for c in p.classes for _ in range(p.per_class)])
    else:
        rows = data.coco_prompts(p.prompts_file, p.num_prompts) if p.prompts_file else list(p.prompts)
        if not rows:
            raise ValueError(f"{target_path} is text-conditional: sample.prompts (or prompts_file) must give captions")
        # (N, C, D); T5 (LlamaGen-T2I): 120 left-padded positions with their mask packed in; lm: prompt ids
        cond = text_conditions(world, cfg, rows).repeat_interleave(p.per_class, dim=0)
    sampling = world_sampling(world, p)
    gen = torch.Generator().manual_seed(p.seed)
    tokens, images, decode_s = [], [], 0.0
    t0 = time.perf_counter()
    auto = {}
    decode = _decoder(model, vq, target_meta, p, drafter_path, calib=cond[: p.batch_size], auto=auto,
                      calibration_path=calibration_path)
    taus = []
    for batch in tqdm(cond.split(p.batch_size), desc=f"sample ({p.method})", unit="batch"):
        tok, stats = decode(batch, sampling, gen)
        taus.append(stats.get("tau", 1.0))
        t1 = time.perf_counter()
        with torch.inference_mode():
            images.append(vq.decode(model.image_codes(tok)))
        decode_s += time.perf_counter() - t1
        tokens.append(tok)
    total_s = time.perf_counter() - t0
    out = Path(out_dir)
    names = data.class_names(world.dataset.name, world.dataset.path) if cfg.model_type == "c2i" and world.dataset else None
    labels = [f"{r} {names[int(r)]}" for r in rows] if names else rows
    save_grid(torch.cat(images), out / "grid.png", nrow=p.per_class, labels=labels)
    tokens = torch.cat(tokens)
    atomic_write(out / "tokens.pt", lambda tmp: torch.save({"rows": rows, "tokens": tokens}, tmp))
    metrics = {
        "images": len(cond),
        "rows": rows,
        "decode_loop_s": total_s - decode_s,
        "vq_decode_s": decode_s,
        "s_per_image": (total_s - decode_s) / len(cond),
        "method": p.method,
        "tau": sum(taus) / len(taus),
        **({"auto_tree": auto} if auto else {}),
        "target_sha256": target_meta["sha256"],
        "tokenizer_sha256": vq_meta["sha256"],
    }
    write_json(out / "metrics.json", metrics)
    return metrics


def _decoder(model, vq, target_meta: dict, p: SampleParams, drafter_path, calib=None, auto: Optional[dict] = None,
             calibration_path=None):
    """(cond, sampling, generator) -> (tokens, stats) for the method p.method. With p.tree "auto", the cost model
    picks depth and total_tokens from decoding the conditions `calib` on this machine (recorded in `auto`)."""
    from lisa.decoding.generate import SpecConfig, decoder
    from lisa.decoding.verify import VERIFIERS

    if p.method != "vanilla" and p.method not in VERIFIERS:
        raise ValueError(f"sample.method {p.method!r}: not 'vanilla' nor a verifier {sorted(VERIFIERS)}")
    # the neighbour table is V x V work: only for the verifiers that read it
    geometry = load_geometry(model, target_meta, vq, [BenchMethod(p.method, p.method)], p.neighbours, calibration_path)
    drafter = None
    if p.method not in ("vanilla", "sjd", "gsd"):
        if drafter_path is None or not Path(drafter_path).is_file():
            raise FileNotFoundError(f"sample.method {p.method!r} needs a drafter: {drafter_path} not found "
                                    "(`lisa train-drafter`)")
        drafter, _ = load_drafter(drafter_path, target_meta)
    depth, total = p.depth, p.total_tokens
    if p.tree == "auto" and drafter is not None:
        method = BenchMethod(p.method, p.method, "auto", top_k_draft=p.top_k_draft, options=p.options)
        sampling = SamplingConfig(p.temperature, p.top_k, p.top_p, p.cfg_scale)
        choice = auto_tree(model, drafter, [{"label": "calibration", "cond": calib}], method, sampling, p.seed,
                           geometry, AutoTreeParams(calib_conditions=1))
        depth, total = choice.depth, choice.total_tokens
        if auto is not None:
            auto.update(depth=depth, total_tokens=total, why=choice.why)
    spec = SpecConfig(p.method, "dynamic" if p.tree == "auto" else p.tree, depth, p.top_k_draft, total)
    return decoder(model, p.method, drafter, spec, p.window, geometry, p.options)


def premise(target_path: str | Path, tokenizer_path: str | Path, codes_path: str | Path, p: PremiseParams,
            report: str | Path) -> dict:
    """LISA's premise on held-out data: flat over ids (U, top-1 prob) yet gathered in codebook neighbourhoods."""
    model, target_meta = load_target(target_path)
    vq, _ = load_tokenizer(tokenizer_path)
    d = load_codes(codes_path, model.config.model_type)
    n = min(p.max_sequences, len(d["test_tokens"]))
    stats = premise_stats(model, target_codebook(vq, model.config), d["test_tokens"][:n], d["test_cond"][:n], p.cfg_scale,
                          tuple(p.neighbours), seed=p.seed)
    stats["target_sha256"] = target_meta["sha256"]
    write_json(report, stats)
    return stats


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


DRAFTER_VERIFIERS = ("greedy", "exact", "lantern", "gasv")  # verifiers of a drafter's trees (sjd / gsd draft themselves)


def method_drafters(methods, paths: dict, target_meta: dict) -> dict:
    """{"release" | "lid": drafter} for the drafters the methods use (BenchMethod.drafter), checked against the target."""
    out = {}
    for which in sorted({m.drafter for m in methods if m.method in DRAFTER_VERIFIERS or m.tree == "auto"}):
        path = paths.get(which)
        if path is None or not Path(path).is_file():
            users = [m.name for m in methods if m.drafter == which and m.method != "vanilla"]
            raise FileNotFoundError(f"methods {users} need the {which} drafter: {path} not found "
                                    f"({'`lisa train-drafter`' if which == 'release' else '`lisa ablate-lid`'})")
        out[which] = load_drafter(path, target_meta)
    return out


def load_geometry(target, target_meta: dict, vq, methods, neighbours: int,
                  calibration_path: Optional[str | Path] = None):
    """The codebook geometry the methods' verifiers read (None if none does): the neighbour table, and for gasv
    the calibration of this very target (lisa.training.calibrate; another checkpoint's is a CalibrationError)."""
    from lisa.training.calibrate import load_calibration
    from lisa.decoding.verify import Geometry

    used = {m.method for m in methods}
    if not used & {"lantern", "gsd", "gasv"}:
        return None
    geometry = Geometry.from_codebook(target_codebook(vq, target.config), neighbours)
    if "gasv" in used:
        if calibration_path is None:
            raise FileNotFoundError("gasv needs a calibration (`lisa calibrate`)")
        geometry.calibration = load_calibration(calibration_path, target.output.weight, target_meta["sha256"])
    return geometry


def bench_spec(target_path: str | Path, tokenizer_path: str | Path, drafter_path: Optional[str | Path],
               world: WorldParams, sample_p: SampleParams, p: BenchSpecParams, out_dir: str | Path,
               name: str = "world", lid_drafter_path: Optional[str | Path] = None,
               calibration_path: Optional[str | Path] = None) -> dict:
    """Speculative decoding benchmark of a world's target and drafters: every method of `p.methods` on the same
    classes / prompts (`sample_p`) with the same seeds, in one run -> out_dir/<name>.{json,md,png}. Methods use
    the release drafter (`drafter_path`) or the LID one (`lid_drafter_path`); gasv reads `calibration_path`."""
    from lisa.decoding.verify import VERIFIERS

    if p.threads:
        torch.set_num_threads(p.threads)
    model, target_meta = load_target(target_path)
    vq, vq_meta = load_tokenizer(tokenizer_path)
    cfg = model.config
    unknown = [m.method for m in p.methods if m.method != "vanilla" and m.method not in VERIFIERS]
    if unknown:
        raise ValueError(f"bench_spec.methods: unknown methods {unknown}; known: vanilla, {sorted(VERIFIERS)}")
    if len({m.name for m in p.methods}) != len(p.methods):
        raise ValueError(f"bench_spec.methods: names must be unique, got {[m.name for m in p.methods]}")
    drafters = method_drafters(p.methods, {"release": drafter_path, "lid": lid_drafter_path}, target_meta)
    geometry = load_geometry(model, target_meta, vq, p.methods, p.neighbours, calibration_path)
    text_s = None
    if cfg.model_type == "c2i":
        names = data.class_names(world.dataset.name, world.dataset.path) if world.dataset else None
        labels = [f"{c} {names[c]}" if names else str(c) for c in sample_p.classes for _ in range(p.per_class)]
        cond = torch.tensor([c for c in sample_p.classes for _ in range(p.per_class)])
    else:
        if not sample_p.prompts:
            raise ValueError(f"{target_path} is text-conditional: sample.prompts must list captions")
        encode_text = text_encoder(world, cfg)
        encode_text(sample_p.prompts[:1])  # warm-up
        t0 = time.perf_counter()
        feats = encode_text(list(sample_p.prompts))
        text_s = (time.perf_counter() - t0) / len(sample_p.prompts)
        labels = [q for q in sample_p.prompts for _ in range(p.per_class)]
        cond = feats.repeat_interleave(p.per_class, dim=0)
    conditions = [{"label": ", ".join(labels[i : i + p.batch_size]), "cond": cond[i : i + p.batch_size]}
                  for i in range(0, len(cond), p.batch_size)]
    sampling = world_sampling(world, p)  # the world's own values over the section's

    def vq_decode(tokens):
        with torch.inference_mode():
            return vq.decode(model.image_codes(tokens))

    report = bench_speculative(model, {k: d for k, (d, _) in drafters.items()}, conditions, p.methods, sampling,
                               p.repeats, p.warmup, p.seed, geometry, p.auto, vq_decode)
    report |= {"world": name, "text_encode_ms_per_prompt": 1000 * text_s if text_s is not None else None,
               "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                            "cfg_scale": sampling.cfg_scale},
               "target_sha256": target_meta["sha256"], "tokenizer_sha256": vq_meta["sha256"],
               "drafter_sha256": {k: meta["sha256"] for k, (_, meta) in drafters.items()},
               "calibration_sha256": geometry.calibration.meta["sha256"]
               if geometry is not None and geometry.calibration is not None else None}
    out = Path(out_dir)
    write_json(out / f"{name}.json", report)
    title = (f"Speculative decoding, {name}: {cfg.n_layer}-layer dim-{cfg.dim} target ({model.num_params() / 1e6:.1f}M), "
             f"T={sampling.temperature:g}, CFG {sampling.cfg_scale:g}, top-k {sampling.top_k or 'off'}")
    atomic_write(out / f"{name}.md", lambda tmp: Path(tmp).write_text(speculative_markdown(report, title)))
    plot_bench(report, out / f"{name}.png", title)
    return {m["name"]: {"ms_per_image": m["ms_per_image"], "speedup": m.get("speedup"), "tau": m["tau"]}
            for m in report["methods"]}


def plot_bench(report: dict, path: Path, title: str):
    """Speedup per method and the acceptance-length distribution of each (one PNG beside the table)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = report["methods"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
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
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


REFERENCE_FILE = "reference.safetensors"


def fid_reference(dataset_dir: str | Path, tokenizer_path: str | Path, codes_path: str | Path, world: WorldParams,
                  p: QualityParams, out_dir: str | Path, report: str | Path, work_dir: str | Path) -> dict:
    """Held-out Inception features (kept for `evaluate`) and the reference FID / KID: held-out vs train (the
    floor), vs VQ reconstructions, vs a unigram baseline. Resumable per set (work_dir)."""
    train_u8, test_u8, _ = _load_images(dataset_dir)
    vq, vq_meta = load_tokenizer(tokenizer_path)
    cfg = world.gpt_config()
    vq = image_tokenizer(vq, cfg)  # lm targets: the grammar is dropped before decoding
    codes = read_state_dict(codes_path)
    # cached sets are only reused by a run of the same tokenizer, dataset and settings
    recipe = json.dumps([vq_meta["sha256"], str(dataset_dir), len(train_u8), len(test_u8), p.max_images, p.seed])
    work = Path(work_dir) / hashlib.sha256(recipe.encode()).hexdigest()[:12]
    ref_idx = quality.subset(len(test_u8), p.max_images, p.seed)
    train_idx = quality.subset(len(train_u8), p.max_images, p.seed + 1)

    def feats(name, images):
        return quality.cached(work / f"{name}.safetensors", "features",
                              lambda: fid.features(images(), p.inception_batch))

    ref = feats("heldout", lambda: test_u8[ref_idx])
    sets = {
        "train": lambda: train_u8[train_idx],
        "reconstruction": lambda: quality.decode_tokens(vq, codes["test_codes"][ref_idx]),
        "unigram": lambda: quality.decode_tokens(vq, quality.unigram_tokens(
            codes["train_codes"], cfg.vocab_size if cfg.model_type == "lm" else vq.config.codebook_size,
            p.max_images, p.seed)),
    }
    metrics = {name: fid.fid_kid(ref, feats(name, images), p.kid_subsets, p.kid_subset_size, p.seed)
               for name, images in sets.items()}
    meta = {"dataset": str(dataset_dir), "heldout_images": len(ref_idx), "tokenizer_sha256": vq_meta["sha256"],
            "extractor": fid.EXTRACTOR}
    quality.write_reference(Path(out_dir) / REFERENCE_FILE, ref, ref_idx, meta)
    write_json(report, meta | {"vs_heldout": metrics})
    return metrics


JUDGE_FILE = "judge.safetensors"


def _judge_scores(judge, images_u8: torch.Tensor, labels: torch.Tensor, captions: list[str]) -> float:
    """Class consistency (%) or mean CLIP score of uint8 images for their labels / captions."""
    x = data.to_model_range(images_u8)
    if judge.config.kind == "classifier":
        return 100 * judges.class_consistency(judge, x, labels)
    return judges.clip_scores(judge, x, captions).mean().item()


def train_judge(dataset_dir: str | Path, world: WorldParams, p: TrainJudgeParams, out_dir: str | Path,
                report: str | Path, work_dir: str | Path) -> dict:
    """Train the world's judge on its real training images: a classifier (c2i) or a small CLIP (t2i)."""
    train_u8, test_u8, ds = _load_images(dataset_dir)
    classes = ds["train"].features["label"].names
    kind = "classifier" if world.gpt_config().model_type == "c2i" else "clip"
    config = judges.JudgeConfig(kind, image_size=train_u8.shape[-1], num_classes=len(classes), width=p.width,
                                layers=p.layers, patch_size=p.patch_size, classifier_width=p.classifier_width,
                                embed_dim=p.embed_dim, context_length=p.context_length)
    torch.manual_seed(p.seed)
    model = judges.build(config)
    labels = {s: torch.tensor(ds[s]["label"]) for s in ("train", "test")}
    captions = {s: list(ds[s]["caption"]) for s in ("train", "test")}
    metrics = judges.train_judge(model, data.to_model_range(train_u8), labels["train"], captions["train"], p,
                                 work_dir)
    with torch.no_grad():  # the judge is stored in fp16 (the CLIP's BPE embedding is most of it): measure that one
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.half().float())
    test_x = data.to_model_range(test_u8)
    if kind == "classifier":
        metrics["heldout_accuracy"] = judges.class_consistency(model, test_x, labels["test"])
    else:
        metrics["heldout_retrieval"] = judges.retrieval(model, test_x, captions["test"])
        metrics["heldout_clip_score"] = judges.clip_scores(model, test_x, captions["test"]).mean().item()
        gen = torch.Generator().manual_seed(p.seed)
        shuffled = [captions["test"][i] for i in torch.randperm(len(test_u8), generator=gen).tolist()]
        metrics["heldout_clip_score_mismatched"] = judges.clip_scores(model, test_x, shuffled).mean().item()
    meta = save_artifact(model, Path(out_dir) / JUDGE_FILE, "judge", config, step=p.steps, seed=p.seed,
                         made_from={"dataset": str(dataset_dir)}, extra={"metrics": metrics, "classes": classes},
                         store_dtype=torch.float16)
    write_json(report, metrics | {"kind": kind})
    return metrics | {"sha256": meta["sha256"]}


def load_judge(path: str | Path):
    model, meta = load_artifact(path, "judge", judges.build)
    return model.eval(), meta


def _save_quality_grid(images: torch.Tensor, labels: torch.Tensor, captions: list[str], cfg, world: WorldParams,
                       vq, test_codes: torch.Tensor, path: Path, rows: int = 10, per_row: int = 8) -> None:
    """c2i: one row per class, its first samples; t2i: one row per held-out caption, the held-out image (through
    the tokenizer) first, then the samples made for that caption."""
    if cfg.model_type == "c2i":
        names = data.class_names(world.dataset.name, world.dataset.path) if world.dataset else None
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
    save_grid(data.to_model_range(grid), path, nrow=nrow, labels=text)


def evaluate(target_path: str | Path, tokenizer_path: str | Path, codes_path: str | Path,
             reference_path: str | Path, judge_dir: str | Path, world: WorldParams, p: EvaluateParams,
             q: QualityParams, out_dir: str | Path, work_dir: str | Path) -> dict:
    """`num_samples` vanilla CFG samples (classes in turn, or held-out captions in turn): FID / KID against the
    held-out reference features, and the judge's score, next to the judge's score of real held-out images."""
    model, target_meta = load_target(target_path)
    vq, vq_meta = load_tokenizer(tokenizer_path)
    vq = image_tokenizer(vq, model.config)  # lm targets: the grammar is dropped before decoding
    judge, judge_meta = load_judge(Path(judge_dir) / JUDGE_FILE)
    ref, ref_idx, ref_meta = quality.read_reference(reference_path)
    if ref_meta.get("tokenizer_sha256") not in (None, vq_meta["sha256"]):
        raise ValueError(f"{reference_path} was made with another tokenizer than {tokenizer_path}: "
                         "rerun `lisa fid-reference`")
    cfg = model.config
    codes = read_state_dict(codes_path)
    captions_all = json.loads(Path(codes_path).with_suffix(".json").read_text())["captions"]
    n = p.num_samples
    if cfg.model_type == "c2i":
        labels = torch.arange(n) % cfg.num_classes
        conds, captions = labels, []
    else:
        idx = codes["test_caption_idx"][torch.arange(n) % len(codes["test_caption_idx"])]
        conds = _caption_cond(codes, idx)
        labels, captions = codes["test_labels"][torch.arange(n) % len(codes["test_labels"])], \
            [captions_all[i] for i in idx.tolist()]
    sampling = world_sampling(world, p)  # the world's own values over the section's
    recipe = json.dumps([target_meta["sha256"], vq_meta["sha256"], asdict(p)] + ([world.sampling] if world.sampling else []),
                        sort_keys=True)
    work = Path(work_dir) / ("samples-" + hashlib.sha256(recipe.encode()).hexdigest()[:12])
    timing = work / "tokens.json"  # the sampling time of the cached tokens, kept with them

    def make_tokens():
        t0 = time.perf_counter()
        tokens = quality.generate_samples(model, conds, sampling, p.batch_size, p.seed)
        write_json(timing, {"sample_s": time.perf_counter() - t0, "threads": torch.get_num_threads()})
        return tokens

    tokens = quality.cached(work / "tokens.safetensors", "tokens", make_tokens)
    sample_s = json.loads(timing.read_text())["sample_s"] if timing.is_file() else None
    images = quality.decode_tokens(vq, tokens)
    feats = quality.cached(work / "features.safetensors", "features",
                           lambda: fid.features(images, q.inception_batch))
    metrics = {"samples": n, "sampling": asdict(p), "sample_s": sample_s}
    metrics |= fid.fid_kid(ref, feats, q.kid_subsets, q.kid_subset_size, q.seed)
    score_name = "class_consistency" if judge.config.kind == "classifier" else "clip_score"
    metrics[score_name] = _judge_scores(judge, images, labels, captions)
    metrics[f"{score_name}_real_heldout"] = (100 * judge_meta["metrics"]["heldout_accuracy"]
                                             if judge.config.kind == "classifier"
                                             else judge_meta["metrics"]["heldout_clip_score"])
    metrics |= {"target_sha256": target_meta["sha256"], "judge_sha256": judge_meta["sha256"]}
    out = Path(out_dir)
    _save_quality_grid(images, labels, captions, cfg, world, vq, codes["test_codes"], out / "samples.png")
    atomic_write(out / "tokens.safetensors", lambda tmp: save_file({"tokens": tokens.to(torch.int16)}, tmp))
    write_json(out / "metrics.json", metrics)
    return metrics


DRAFTER_FILE = "drafter.safetensors"


def load_drafter(path: str | Path, target_meta: Optional[dict] = None):
    """A drafter artifact; with `target_meta` (the target's sidecar), refuse one trained against another target."""
    from lisa.checkpoint import CheckpointError
    from lisa.models.drafter import build_drafter

    model, meta = load_artifact(path, "drafter", build_drafter)
    trained_on = meta.get("made_from", {}).get("target_sha256")
    if target_meta is not None and trained_on != target_meta["sha256"]:
        raise CheckpointError(f"{path}: drafter trained against target {trained_on}, but the target given has "
                              f"sha256 {target_meta['sha256']}: retrain it (`lisa train-drafter`)")
    return model.eval(), meta


def train_drafter(codes_path: str | Path, target_path: str | Path, p: TrainDrafterParams, out_dir: str | Path,
                  report: str | Path, work_dir: str | Path, curves: Optional[str | Path] = None,
                  corpus_path: Optional[str | Path] = None) -> dict:
    """Baseline EAGLE-3 drafter (TTT, soft CE to the target) for a world's target, on its training codes (or a
    built corpus, lisa/data/corpus.py). Under torchrun: DDP over the ranks; rank 0 writes the drafter and reports."""
    from lisa.training.drafter import new_drafter, train_drafter as train

    rank = init_distributed()
    target, target_meta = load_target(target_path)
    d = load_codes(codes_path, target.config.model_type)
    tokens, cond = d["train_tokens"], d["train_cond"]
    if corpus_path is not None:
        from lisa.data.corpus import read_corpus

        c = read_corpus(corpus_path, target.config.model_type, target.config.cls_token_num)
        tokens, cond = c["tokens"], c["cond"]
    torch.manual_seed(p.seed)
    drafter = new_drafter(target)
    metrics = train(drafter, target, tokens, cond, d["test_tokens"][:512], d["test_cond"][:512], p, work_dir,
                    curves=curves, target_id=target_meta["sha256"])
    if rank != 0:
        return {"rank": rank}
    meta = save_artifact(drafter.cpu(), Path(out_dir) / DRAFTER_FILE, "drafter", drafter.config, step=p.steps,
                         seed=p.seed, made_from={"target": str(target_path), "target_sha256": target_meta["sha256"],
                                                 "codes": str(corpus_path or codes_path)},
                         extra={"metrics": metrics})
    write_json(report, metrics)
    return metrics | {"sha256": meta["sha256"]}


def laion_fixture(p: CorporaParams, out_dir: str | Path) -> dict:
    """The LAION-COCO-layout fixture from the emoji images (lisa.data.corpus.make_laion_fixture), written to a temporary
    folder and renamed into place."""
    from lisa.data.corpus import make_laion_fixture

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    info = make_laion_fixture(tmp, p.fixture_rows, p.fixture_seed, p.fixture_format)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info


def build_laion_coco(metadata: str | Path, images: str | Path, tokenizer_path: str | Path, world: WorldParams,
                     p: CorporaParams, out_dir: str | Path, report: str | Path) -> dict:
    """The laion-coco corpus (lisa.data.corpus.build_laion_coco) with the world's tokenizer and caption encoder."""
    from lisa.data.corpus import LaionFilter, build_laion_coco as build

    vq, vq_meta = load_tokenizer(tokenizer_path)
    cfg = world.gpt_config()
    if cfg.model_type == "lm":
        raise ValueError("corpora.laion_world: Lumina-mGPT (lm) drafters train on the target's own samples "
                         "(build-self-generated), not on LAION-COCO; name a LlamaGen world")
    if cfg.model_type != "t2i":
        raise ValueError(f"corpora.laion_world: a laion-coco corpus is for a text-to-image world, not {cfg.model_type}")
    encoder = CaptionEncoder(None if world.caption_encoder in (None, "minilm") else world.caption_encoder)
    files = sorted(Path(metadata).glob("*.parquet")) if Path(metadata).is_dir() else [Path(metadata)]
    flt = LaionFilter(p.min_size, p.max_punsafe, p.max_pwatermark, p.min_similarity)
    m = build(files, Path(images), vq, vq_meta["sha256"], encoder, cfg.cls_token_num, flt, Path(out_dir),
              p.shard_size)
    metrics = {"sequences": m["rows"], "bytes": m["bytes"], "counts": m["counts"], "filter": m["filter"]}
    write_json(report, metrics)
    return metrics


def build_self_generated(codes_path: str | Path, target_path: str | Path, world: WorldParams,
                         p: SelfGeneratedParams, out_dir: str | Path, report: str | Path) -> dict:
    """The self-generated corpus: the world's target samples p.n sequences, conditions = classes in turn (c2i) or
    the training captions in turn (t2i)."""
    from lisa.data.corpus import build_self_generated as build

    target, target_meta = load_target(target_path)
    if target.config.model_type == "c2i":
        cond = torch.arange(p.n) % target.config.num_classes
        labels, captions = cond.tolist(), [""] * p.n
    else:
        t = read_state_dict(codes_path)
        idx = t["train_caption_idx"].unique()[:p.n]
        idx = idx[torch.arange(p.n) % len(idx)]
        names = json.loads(Path(codes_path).with_suffix(".json").read_text())["captions"]
        cond, labels, captions = _caption_cond(t, idx), [-1] * p.n, [names[i] for i in idx.tolist()]
    sampling = world_sampling(world, p)  # the world's own values over the section's
    t0 = time.perf_counter()
    m = build(target, target_meta["sha256"], cond, labels, captions, sampling, p.seed, Path(out_dir),
              batch_size=p.batch_size)
    metrics = {"sequences": m["rows"], "bytes": m["bytes"], "sampling": m["sampling"], "target_sha256": m["target_sha256"],
               "build_s": time.perf_counter() - t0}
    write_json(report, metrics)
    return metrics


def init_distributed() -> int:
    """Under torchrun: join the process group (nccl on GPU, gloo on CPU). Returns this process's rank."""
    rank, world_size = cache.dist_env()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return rank


def cache_logits(codes_path: str | Path, target_path: str | Path, p: CacheLogitsParams, out_dir: str | Path,
                 report: str | Path, corpus_path: Optional[str | Path] = None) -> dict:
    """The target logit cache of a world's training codes (lisa/training/cache.py). Under torchrun each rank writes its
    shards (gloo or nccl process group for the final barrier); rank 0 writes the manifest and the report."""
    rank, world_size = init_distributed(), cache.dist_env()[1]
    target, target_meta = load_target(target_path)
    if corpus_path is not None:
        from lisa.data.corpus import read_corpus

        c = read_corpus(corpus_path, target.config.model_type, target.config.cls_token_num)
        all_tokens, all_cond = c["tokens"], c["cond"]
    else:
        d = load_codes(codes_path, target.config.model_type)
        all_tokens, all_cond = d["train_tokens"], d["train_cond"]
    n = len(all_tokens) if p.max_sequences is None else min(p.max_sequences, len(all_tokens))
    tokens, cond = all_tokens[:n], all_cond[:n]
    spec = cache.CacheSpec(p.K, p.shard_size, p.batch_size, p.uncond_every)
    t0 = time.perf_counter()
    cache.write_cache(target, target_meta["sha256"], tokens, cond, spec, out_dir, rank, world_size)
    elapsed = time.perf_counter() - t0
    if world_size > 1:
        dist.barrier()
    if rank != 0:
        return {"rank": rank}
    source = ({"corpus": str(corpus_path), "corpus_manifest_sha256": file_sha256(Path(corpus_path) / "manifest.json")}
              if corpus_path is not None else {"codes": str(codes_path), "codes_sha256": file_sha256(codes_path)})
    manifest = cache.write_manifest(out_dir, target_meta["sha256"], spec, n, tokens.shape[1], extra=source)
    metrics = {"sequences": n, "tokens": manifest["tokens"], "bytes": manifest["bytes"],
               "bytes_per_token": manifest["bytes_per_token"], "K": p.K, "workers": world_size,
               "write_s": elapsed, "write_tokens_per_s": manifest["tokens"] / elapsed,
               "target_sha256": target_meta["sha256"]}
    metrics |= cache.throughput(target, tokens, cond, spec)
    write_json(report, metrics)
    return metrics


def ablate_lid(codes_path: str | Path, target_path: str | Path, tokenizer_path: str | Path,
               cache_dir: str | Path, world: WorldParams, train_p: TrainDrafterParams, p: AblateLIDParams,
               sample_p: SampleParams, out_dir: str | Path, report_dir: str | Path, work_dir: str | Path) -> dict:
    """LID vs the baseline loss, same data (the logit cache), steps and seed: two drafters, then the acceptance
    length tau of each under `exact` verification on the same conditions and seeds."""
    import dataclasses

    from lisa.training.distill import LIDConfig
    from lisa.training.drafter import new_drafter, train_drafter as train
    from lisa.decoding.generate import SpecConfig, speculative_generate

    target, target_meta = load_target(target_path)
    vq, _ = load_tokenizer(tokenizer_path)
    lc = cache.open_cache(cache_dir, target_meta["sha256"])
    d = load_codes(codes_path, target.config.model_type)
    tp = dataclasses.replace(train_p, steps=p.steps)
    lid = (target_codebook(vq, target.config), LIDConfig(**dataclasses.asdict(p.lid)))
    if target.config.model_type == "c2i":
        cond = torch.tensor([c for c in sample_p.classes for _ in range(p.per_class)])
    else:
        cond = text_conditions(world, target.config, list(sample_p.prompts)).repeat_interleave(p.per_class, 0)
    sampling = world_sampling(world, p)  # the world's own values over the section's
    spec = SpecConfig("exact", p.tree, p.depth, p.top_k_draft, p.total_tokens)
    results = {}
    for name, loss in (("baseline", None), ("lid", lid)):
        torch.manual_seed(tp.seed)
        drafter = new_drafter(target)
        m = train(drafter, target, d["train_tokens"], d["train_cond"], d["test_tokens"][:512], d["test_cond"][:512],
                  tp, Path(work_dir) / name, cache=lc, lid=loss, curves=Path(report_dir) / name,
                  target_id=target_meta["sha256"])
        save_artifact(drafter, Path(out_dir) / f"{name}.safetensors", "drafter", drafter.config, step=tp.steps,
                      seed=tp.seed, made_from={"target_sha256": target_meta["sha256"], "loss": name,
                                               "cache": str(cache_dir)}, extra={"metrics": m})
        taus = []
        for i in range(len(cond)):
            _, stats = speculative_generate(target, drafter, cond[i : i + 1], sampling, spec,
                                            torch.Generator().manual_seed(p.seed * 1_000_003 + i))
            taus.append(stats["tau"])
        results[name] = m | {"tau_exact": sum(taus) / len(taus), "tau_per_condition": taus}
    metrics = {"steps": tp.steps, "conditions": len(cond), "tree": dataclasses.asdict(spec),
               "baseline_tau": results["baseline"]["tau_exact"], "lid_tau": results["lid"]["tau_exact"],
               "lid_over_baseline": results["lid"]["tau_exact"] / results["baseline"]["tau_exact"],
               "lid": dataclasses.asdict(p.lid), "runs": results, "target_sha256": target_meta["sha256"]}
    out = Path(report_dir)
    write_json(out / "metrics.json", metrics)
    lines = [f"## LID vs baseline drafter loss ({tp.steps} steps from the same logit cache; exact verification, "
             f"{spec.tree} tree depth {spec.depth}, {spec.total_tokens} nodes; T={sampling.temperature:g}, "
             f"CFG {sampling.cfg_scale:g}; {len(cond)} conditions)", "",
             "| loss | tau (exact) | held-out top-1 agreement (TTT steps) | held-out soft CE |", "|---|---|---|---|"]
    for name in ("baseline", "lid"):
        r = results[name]
        lines.append(f"| {name} | {r['tau_exact']:.3f} | "
                     f"{' / '.join(f'{a:.3f}' for a in r['heldout_top1_agreement'])} | "
                     f"{' / '.join(f'{c:.3f}' for c in r['heldout_soft_ce'])} |")
    lines += ["", f"LID / baseline tau: {metrics['lid_over_baseline']:.3f}"]
    atomic_write(out / "table.md", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    return {k: v for k, v in metrics.items() if k != "runs"}


def bench_ddp(world: str, params_path: str | Path, steps: int, out: str | Path, work: str | Path) -> dict:
    """Drafter training steps/s: 1 process (2 threads, 1 thread) against `torchrun --nproc_per_node 2` DDP (gloo,
    1 thread each), same params and global batch, run one after another on this machine. Each run is `lisa
    train-drafter` in a subprocess with its own scratch folders under `work`; timing covers training steps only."""
    import os
    import subprocess
    import sys

    bin_dir = Path(sys.executable).parent
    lisa_bin = str(bin_dir / "lisa")
    runs = [("1 process, 2 threads", [lisa_bin], 2), ("1 process, 1 thread", [lisa_bin], 1),
            ("2 processes (DDP, gloo), 1 thread each",
             [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--no-python", lisa_bin], 1)]
    rows = []
    for i, (name, launcher, threads) in enumerate(runs):
        w = Path(work) / f"run{i}"
        shutil.rmtree(w, ignore_errors=True)
        cmd = launcher + ["train-drafter", "--world", world, "--params", str(params_path), "--steps", str(steps),
                          "--out", str(w / "drafter"), "--report", str(w / "report.json"), "--work", str(w / "work"),
                          "--curves", str(w / "curves")]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        r = json.loads((w / "report.json").read_text())
        rows.append({"run": name, "processes": r["world_size"], "threads_per_process": threads,
                     "steps": steps, "steps_per_s": r["steps_per_s_this_run"]})
    for r in rows:
        r["vs_1_process_2_threads"] = r["steps_per_s"] / rows[0]["steps_per_s"]
    report = {"world": world, "rows": rows, "cpus": os.cpu_count()}
    out = Path(out)
    write_json(out.with_suffix(".json"), report)
    lines = [f"## Drafter training throughput, {world} ({steps} steps each, same global batch)", "",
             "| run | steps/s | vs 1 process, 2 threads |", "|---|---|---|"]
    lines += [f"| {r['run']} | {r['steps_per_s']:.2f} | {r['vs_1_process_2_threads']:.2f}x |" for r in rows]
    atomic_write(out.with_suffix(".md"), lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    return report


# ---------------------------------------------------------------------------------------------------------------
# LISA at decode time: calibration, quality per method, the results table


def calibrate(target_path: str | Path, tokenizer_path: str | Path, cache_dir: str | Path, p: CalibrateParams,
              out_dir: str | Path, report: str | Path) -> dict:
    """GASV's calibration of a target checkpoint from its output head, its codebook and its logit cache
    -> out_dir/calibration.{safetensors,json} (the JSON records the target's sha256)."""
    from lisa.training.calibrate import CalibrateConfig, calibrate as fit, save_calibration

    model, target_meta = load_target(target_path)
    vq, vq_meta = load_tokenizer(tokenizer_path)
    lc = cache.open_cache(cache_dir, target_meta["sha256"])
    cal = fit(model.output.weight, target_codebook(vq, model.config), lc, CalibrateConfig(**asdict(p)),
              {"target": str(target_path), "target_sha256": target_meta["sha256"], "tokenizer": str(tokenizer_path),
               "tokenizer_sha256": vq_meta["sha256"], "cache": str(cache_dir)})
    meta = save_calibration(cal, out_dir)
    metrics = {k: meta[k] for k in ("positions", "clusters_used_by_top1", "clusters_with_own_budget", "beta_global",
                                    "looseness_ref", "share_within_budget", "calibrate_s", "sha256")}
    metrics |= {"beta_min": min(meta["beta"]), "beta_max": max(meta["beta"]), "target_sha256": target_meta["sha256"],
                "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(report, metrics)
    return metrics


def needs_recalibration(target_path: str | Path, calibration_dir: str | Path) -> Optional[str]:
    """Why the calibration in calibration_dir no longer fits the target checkpoint (None if it does): compares the
    checkpoint's content hash with the one the calibration recorded (a touch changes nothing)."""
    side = Path(calibration_dir) / "calibration.json"
    if not side.is_file():
        return f"no calibration at {side}"
    made = json.loads(side.read_text()).get("made_from", {}).get("target_sha256")
    now = file_sha256(target_path)
    return None if made == now else f"{target_path} has sha256 {now[:12]}, the calibration was made for {str(made)[:12]}"


def _eval_conditions(model, codes: dict, captions_all: list[str], n: int):
    """The conditions of quality evaluation: c2i classes in turn; t2i held-out captions in turn -> (conds, labels,
    captions)."""
    if model.config.model_type == "c2i":
        labels = torch.arange(n) % model.config.num_classes
        return labels, labels, []
    idx = codes["test_caption_idx"][torch.arange(n) % len(codes["test_caption_idx"])]
    return (_caption_cond(codes, idx), codes["test_labels"][torch.arange(n) % len(codes["test_labels"])],
            [captions_all[i] for i in idx.tolist()])


def eval_method(target_path: str | Path, tokenizer_path: str | Path, codes_path: str | Path,
                reference_path: str | Path, judge_dir: str | Path, world: WorldParams, name: str, p: TableParams,
                q: QualityParams, drafter_paths: dict, calibration_path: Optional[str | Path], out_dir: str | Path,
                work_dir: str | Path) -> dict:
    """One quality cell: `p.num_samples` samples decoded with method `name` (table.cells) on the conditions of
    `evaluate`, batch i seeded (seed, i) for every method: FID / KID against the held-out reference, the judge's
    score, tau, and the measured relaxation (TV between the law each token was drawn from and the target's,
    per image position and on average) -> out_dir/<name>.{json,png}, out_dir/<name>-tv.csv."""
    from lisa.decoding.generate import SpecConfig, decoder

    m = p.cells[name].as_method(name)
    model, target_meta = load_target(target_path)
    vq, vq_meta = load_tokenizer(tokenizer_path)
    vq = image_tokenizer(vq, model.config)  # lm targets: the grammar is dropped before decoding
    judge, judge_meta = load_judge(Path(judge_dir) / JUDGE_FILE)
    ref, _, ref_meta = quality.read_reference(reference_path)
    if ref_meta.get("tokenizer_sha256") not in (None, vq_meta["sha256"]):
        raise ValueError(f"{reference_path} was made with another tokenizer than {tokenizer_path}: "
                         "rerun `lisa fid-reference`")
    drafters = method_drafters([m], drafter_paths, target_meta)
    geometry = load_geometry(model, target_meta, vq, [m], min(64, model.config.vocab_size - 1), calibration_path)
    if geometry is not None and geometry.calibration is not None:
        geometry.neighbours = geometry.calibration.neighbours
    drafter = drafters[m.drafter][0] if m.drafter in drafters else None
    spec = (SpecConfig(m.method, m.tree, m.depth, m.top_k_draft, m.total_tokens)
            if m.method not in ("vanilla", "sjd", "gsd") else None)
    decode = decoder(model, m.method, drafter, spec, m.window, geometry, dict(m.options), measure=m.method != "vanilla")
    codes = read_state_dict(codes_path)
    captions_all = json.loads(Path(codes_path).with_suffix(".json").read_text())["captions"]
    conds, labels, captions = _eval_conditions(model, codes, captions_all, p.num_samples)
    sampling = world_sampling(world, p)  # the world's own values over the section's
    recipe = json.dumps([target_meta["sha256"], vq_meta["sha256"], asdict(m),
                         {k: v for k, v in asdict(p).items() if k not in ("rows", "pareto", "cells")},
                         {k: meta["sha256"] for k, (_, meta) in drafters.items()},
                         geometry.calibration.meta["sha256"] if geometry and geometry.calibration else None]
                        + ([world.sampling] if world.sampling else []),
                        sort_keys=True)
    work = Path(work_dir) / (name + "-" + hashlib.sha256(recipe.encode()).hexdigest()[:12])
    stats_path = work / "decode.json"

    def make_tokens():
        toks, taus, tvs, t0 = [], [], [], time.perf_counter()
        batches = list(conds.split(p.batch_size))
        for i, batch in enumerate(tqdm(batches, desc=f"eval {name}", unit="batch")):
            tok, st = decode(batch, sampling, torch.Generator().manual_seed(p.seed * 1_000_003 + i))
            toks.append(tok)
            lengths = [a for row in st.get("accept_lengths", []) for a in row if a > 0]
            taus += lengths or [1] * tok.numel()
            if "tv" in st:
                tvs.append(st["tv"])
        tv = torch.cat(tvs) if tvs else torch.zeros(len(conds), model.config.block_size)
        write_json(stats_path, {"decode_s": time.perf_counter() - t0, "tau": sum(taus) / len(taus),
                                "tv_per_position": tv.nanmean(0).tolist(), "tv_mean": float(tv[:, 1:].nanmean()),
                                "threads": torch.get_num_threads()})
        return torch.cat(toks)

    tokens = quality.cached(work / "tokens.safetensors", "tokens", make_tokens)
    dstats = json.loads(stats_path.read_text())
    images = quality.decode_tokens(vq, tokens)
    feats = quality.cached(work / "features.safetensors", "features", lambda: fid.features(images, q.inception_batch))
    metrics = {"world_method": name, "method": asdict(m), "samples": len(tokens), "tau": dstats["tau"],
               "tv_mean": dstats["tv_mean"], "decode_s": dstats["decode_s"]}
    metrics |= fid.fid_kid(ref, feats, q.kid_subsets, min(q.kid_subset_size, len(tokens)), q.seed)
    score_name = "class_consistency" if judge.config.kind == "classifier" else "clip_score"
    metrics[score_name] = _judge_scores(judge, images, labels, captions)
    metrics |= {"target_sha256": target_meta["sha256"], "judge_sha256": judge_meta["sha256"],
                "drafter_sha256": {k: meta["sha256"] for k, (_, meta) in drafters.items()},
                "calibration_sha256": geometry.calibration.meta["sha256"] if geometry and geometry.calibration else None}
    out = Path(out_dir)
    write_json(out / f"{name}.json", metrics)
    tv_lines = ["position,tv"] + [f"{i},{v:.6f}" for i, v in enumerate(dstats["tv_per_position"])]
    atomic_write(out / f"{name}-tv.csv", lambda tmp: Path(tmp).write_text("\n".join(tv_lines) + "\n"))
    _save_quality_grid(images, labels, captions, model.config, world, vq, codes["test_codes"], out / f"{name}.png",
                       rows=5)
    return {k: v for k, v in metrics.items() if k != "method"}


def results_table(worlds: list[str], p: TableParams, bench_dir: str | Path, cells_dir, out_md: str | Path,
                  out_plot: str | Path) -> dict:
    """reports/table.md in the layout of the paper's main table (world x method: speedup, tau, FID, CLIP score or
    class consistency, plus KID and the measured TV relaxation) and the tau-FID Pareto plot of the `pareto`
    cells. Speedup and tau come from the world's bench-spec run (same run for every method); the quality columns
    from each eval-method cell. cells_dir: world -> folder of the cells."""
    rows_out, lines = {}, ["# LISA against the baselines", "",
                           f"Speedup and tau: `lisa bench --world W` (every method in one run, batch 1, wall clock on "
                           f"this machine). Quality: {p.num_samples} samples per cell (`lisa eval-method`), FID / KID "
                           "against the held-out images; CLIP score (t2i) or class consistency (c2i) from the world's "
                           "judge. TV: mean total variation between the distribution each token was drawn from and "
                           "the target's (0 for lossless methods). tau (quality run): acceptance length measured in "
                           "the batched quality run itself.", ""]
    for w in worlds:
        bench = json.loads((Path(bench_dir) / f"{w}.json").read_text())
        bm = {m["name"]: m for m in bench["methods"]}
        cells = {n: json.loads((Path(cells_dir(w)) / f"{n}.json").read_text()) for n in dict.fromkeys(p.rows + p.pareto)}
        score = "clip_score" if "clip_score" in next(iter(cells.values())) else "class_consistency"
        van = cells.get("vanilla")
        lines += [f"## {w}", "", f"| method | settings | speedup | tau | FID | FID vs vanilla | KID | "
                  f"{'CLIP score' if score == 'clip_score' else 'class consistency'} | TV | tau (quality run) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        rows_out[w] = {}
        for n in p.rows:
            b, c = bm[p.cells[n].bench or n], cells[n]
            rel = c["fid"] / van["fid"] - 1 if van else float("nan")
            lines.append(f"| {n} | {_describe_cell(p.cells[n])} | {b.get('speedup', float('nan')):.2f}x | "
                         f"{b['tau']:.2f} | {c['fid']:.2f} | {100 * rel:+.1f}% | {c['kid']:.4f} | {c[score]:.2f} | "
                         f"{c['tv_mean']:.3f} | {c['tau']:.2f} |")
            rows_out[w][n] = {"speedup": b.get("speedup"), "tau": b["tau"], "fid": c["fid"], "fid_vs_vanilla": rel,
                              "kid": c["kid"], score: c[score], "tv": c["tv_mean"], "tau_quality_run": c["tau"],
                              "bench_method": b["name"]}
        for n in [x for x in p.pareto if x not in p.rows]:
            c = cells[n]
            rows_out[w][n] = {"fid": c["fid"], "fid_vs_vanilla": c["fid"] / van["fid"] - 1 if van else None,
                              "kid": c["kid"], score: c[score], "tv": c["tv_mean"], "tau_quality_run": c["tau"]}
        lines.append("")
    _pareto_plot(worlds, p, cells_dir, out_plot)
    lines += [f"Pareto plot (tau against FID over the cells {', '.join(p.pareto)}): `{Path(out_plot).name}`.", ""]
    atomic_write(out_md, lambda tmp: Path(tmp).write_text("\n".join(lines)))
    write_json(Path(out_md).with_suffix(".json"), rows_out)
    return rows_out


def _describe_cell(c) -> str:
    o = c.options
    if c.method == "vanilla":
        return "-"
    if c.method in ("sjd", "gsd"):
        return f"window {c.window}"
    tree = f"{c.tree} d{c.depth} top-{c.top_k_draft} {c.total_tokens} nodes"
    if c.method == "lantern":
        tree += f", k {o.get('k', 5):g}, delta {o.get('delta', 0.1):g}"
    if c.method == "gasv":
        tree += f", kappa {o.get('kappa', 1.0):g}, lambda {o.get('lambda', 0.5):g}, k {o.get('k', 8):g}"
    return tree + (", LID drafter" if c.drafter == "lid" else "")


def _pareto_plot(worlds: list[str], p: TableParams, cells_dir, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
    for ax, w in zip(axes[0], worlds):
        names = list(dict.fromkeys(p.rows + p.pareto))
        cells = {n: json.loads((Path(cells_dir(w)) / f"{n}.json").read_text()) for n in names}
        sweep = [n for n in p.pareto]
        ax.plot([cells[n]["fid"] for n in sweep], [cells[n]["tau"] for n in sweep], "o-", color="tab:red",
                label="GASV sweep (kappa, lambda)")
        for n in names:
            c = cells[n]
            ax.scatter(c["fid"], c["tau"], s=30, color="tab:red" if n in sweep else "tab:blue", zorder=3)
            ax.annotate(n, (c["fid"], c["tau"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if "vanilla" in cells:
            ax.axvline(cells["vanilla"]["fid"] * 1.05, color="grey", ls="--", lw=1, label="vanilla FID + 5%")
        ax.set_xlabel("FID (lower is better)")
        ax.set_ylabel("tau: tokens per target forward")
        ax.set_title(w)
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
