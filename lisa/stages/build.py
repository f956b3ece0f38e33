"""Stages that build a world's tokenizer and target: `build-dataset` -> `train-tokenizer` -> `encode` ->
`train-target` for the built-in worlds; `init-tokenizer` / `init-target` (import an official checkpoint, or random
init) for a world of official checkpoints."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from lisa.checkpoint import CheckpointError, atomic_write, file_sha256, save_artifact, write_json
from lisa.config import (BuildDatasetParams, ConfigError, EncodeParams, InitTargetParams, InitTokenizerParams,
                         TrainTargetParams, TrainTokenizerParams, WorldParams)
from lisa.data import datasets as data
from lisa.data.identity import write_identity
from lisa.models.gpt import Transformer, gpt_config, grammar_grid, square_image_grammar
from lisa.models.llamagen import import_llamagen_gpt, import_llamagen_vq, load_target, load_tokenizer
from lisa.models.vq import VQModel, vq_config
from lisa.stages.common import caption_encoder, load_codes, load_images, text_conditions
from lisa.stages.paths import Stage, WorldPaths
from lisa.training.loops import evaluate_vq, heldout_nll, train_gpt, train_vq


def _checkpoint_sha(path) -> str:
    """sha256 of a checkpoint file; of a transformers directory: the hash of its files' hashes."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in sorted(x for x in path.rglob("*") if x.is_file()):
        h.update(f"{f.relative_to(path)}:{file_sha256(f)}\n".encode())
    return h.hexdigest()


def _save_initial(model, out: Path, kind: str, seed: int, checkpoint) -> dict:
    """Write an imported (checkpoint set) or randomly initialised model as a step-0 artifact."""
    made_from = ({"llamagen_checkpoint": str(checkpoint), "sha256": _checkpoint_sha(checkpoint)} if checkpoint
                 else {"init": "random"})
    meta = save_artifact(model, out, kind, model.config, step=0, seed=seed, made_from=made_from)
    return {"params": sum(x.numel() for x in model.parameters()), "sha256": meta["sha256"], "path": str(out)}


def _config_diff(want, got, keys) -> dict:
    return {k: (getattr(want, k), getattr(got, k)) for k in keys if getattr(want, k) != getattr(got, k)}


def _import_chameleon(world: WorldParams):
    from lisa.models.lumina import LuminaGrammar, import_chameleon

    want = gpt_config(**world.target)
    grammar = LuminaGrammar(codebook_size=want.free_vocab, max_grid=want.vocab_size - want.free_vocab - 4)
    model = import_chameleon(world.target_checkpoint, image_size=16 * grammar_grid(want.block_size),
                             prompt_len=want.cls_token_num, grammar=grammar)
    diff = _config_diff(want, model.config, vars(want))
    if diff:
        raise CheckpointError(f"{world.target_checkpoint}: differs from worlds.<world>.target (params, checkpoint): "
                              f"{diff}")
    return model


def _import_llamagen(world: WorldParams):
    vq = vq_config(**world.tokenizer)
    # the vocabulary comes from the file and the grid from the image size; checked against the world below
    overrides = {k: v for k, v in world.target.items() if k not in ("preset", "vocab_size", "block_size")}
    model = import_llamagen_gpt(world.target_checkpoint, world.target.get("preset"), vq.image_size, vq.downsample,
                                **overrides)
    diff = _config_diff(gpt_config(**world.target), model.config, [k for k in ("vocab_size", "block_size")
                                                           if k in world.target])  # the ones the world names
    if diff:
        raise CheckpointError(f"{world.target_checkpoint}: differs from worlds.<world>.target (params, checkpoint "
                              f"at {vq.image_size} px / downsample {vq.downsample}): {diff}")
    return model


def init_target(world: WorldParams, p: InitTargetParams, paths: WorldPaths) -> dict:
    """Target artifact for a world: imported from `world.target_checkpoint` if set (an official LlamaGen .pt, or a
    Lumina-mGPT / Chameleon transformers directory), else seeded random init."""
    from lisa.models.lumina import is_chameleon_dir

    torch.manual_seed(p.seed)
    if world.target_checkpoint and is_chameleon_dir(world.target_checkpoint):
        model = _import_chameleon(world)
    elif world.target_checkpoint:
        model = _import_llamagen(world)
    else:
        model = Transformer(gpt_config(**world.target))
    return _save_initial(model, paths.target_file, "gpt", p.seed, world.target_checkpoint)


def init_tokenizer(world: WorldParams, p: InitTokenizerParams, paths: WorldPaths) -> dict:
    """Tokenizer artifact for a world: imported from `world.tokenizer_checkpoint` if set, else random init."""
    torch.manual_seed(p.seed)
    if world.tokenizer_checkpoint and world.target.get("arch") == "chameleon":  # Lumina-mGPT: Chameleon's VQGAN
        from lisa.models.lumina import import_chameleon_vq

        grid = grammar_grid(gpt_config(**world.target).block_size)
        model = import_chameleon_vq(world.tokenizer_checkpoint, 16 * grid)
    elif world.tokenizer_checkpoint:
        overrides = {k: v for k, v in world.tokenizer.items() if k != "preset"}
        model = import_llamagen_vq(world.tokenizer_checkpoint, world.tokenizer.get("preset", "VQ-16"), **overrides)
    else:
        model = VQModel(vq_config(**world.tokenizer))
    return _save_initial(model, paths.tokenizer_file, "vq", p.seed, world.tokenizer_checkpoint)


def build_dataset(world: WorldParams, p: BuildDatasetParams, paths: WorldPaths) -> dict:
    """A built-in or local dataset (lisa/data/datasets.py) of the world's `dataset` section (name, image size; path,
    captions, test_path, test_captions of a local dataset) as a HuggingFace DatasetDict saved to paths.dataset_dir."""
    source = world.dataset
    if source is None:
        raise ConfigError(f"world {paths.world!r} has no `dataset` section: it is not a built-in world")
    local = {k: getattr(source, k) for k in ("path", "captions", "test_path", "test_captions")}
    ds = data.build(source.name, source.image_size, p.test_fraction, limits=(p.max_train, p.max_test), **local)
    for split, limit in (("train", p.max_train), ("test", p.max_test)):
        n = len(ds[split]) if limit is None else min(limit, len(ds[split]))
        # a fingerprint from the recipe, not a random one: the saved folder (and its DVC hash) is reproducible
        recipe = f"{source.name}/{source.image_size}/{p.test_fraction}/{split}/{n}"
        ds[split] = ds[split].select(range(n), new_fingerprint=hashlib.sha256(recipe.encode()).hexdigest()[:16])
    out = paths.dataset_dir
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a crash never leaves a half-written dataset behind
    if paths.dataset_identity is not None:  # the readers' dvc.yaml dep, committed (the folder is not)
        write_identity(paths.dataset_identity, dataset=out)
    return {split: len(ds[split]) for split in ds} | {"classes": ds["train"].features["label"].names}


def train_tokenizer(world: WorldParams, p: TrainTokenizerParams, paths: WorldPaths) -> dict:
    """Train the world's VQ tokenizer on its dataset; resumable (tokenizer_work/resume.pt). Held-out PSNR and usage.
    A world with a `tokenizer_checkpoint` (the real profile) imports it instead (init_tokenizer), and reports the
    imported tokenizer's held-out reconstruction."""
    train_u8, test_u8, _ = load_images(paths.dataset_dir, paths.dataset_identity)
    if world.tokenizer_checkpoint:
        info = init_tokenizer(world, InitTokenizerParams(seed=p.seed), paths)
        vq, _ = load_tokenizer(paths.tokenizer_file)
        metrics = {"imported": world.tokenizer_checkpoint, **evaluate_vq(vq, test_u8, p.eval_batch_size)}
        write_json(paths.tokenizer_report, metrics)
        return metrics | {"sha256": info["sha256"]}
    torch.manual_seed(p.seed)
    model = VQModel(vq_config(**world.tokenizer))
    metrics = train_vq(model, train_u8, test_u8, p, paths.tokenizer_work)
    meta = save_artifact(model, paths.tokenizer_file, "vq", model.config, step=p.steps, seed=p.seed,
                         made_from={"dataset": str(paths.dataset_dir)}, extra={"metrics": metrics})
    write_json(paths.tokenizer_report, metrics)
    return metrics | {"sha256": meta["sha256"]}


def _grammar_sequences(codes: torch.Tensor, cfg, tokenizer_path) -> torch.Tensor:
    """An lm target's sequences: the codes (N, K) placed inside its image grammar -> (N, T)."""
    grammar = square_image_grammar(cfg.free_vocab, cfg.block_size)
    if codes.shape[1] != int((grammar < 0).sum()):
        raise ValueError(f"{tokenizer_path} gives {codes.shape[1]} codes per image, the target's grammar "
                         f"holds {int((grammar < 0).sum())}: dataset.image_size does not fit")
    seq = grammar.expand(len(codes), -1).clone()
    seq[:, grammar < 0] = codes
    return seq


def _caption_features(world: WorldParams, cfg, captions: list[str]) -> torch.Tensor:
    """Per-token features of the captions (t2i), or an lm target's prompt ids (-1 at padding)."""
    if cfg.model_type == "lm":  # prompt ids from the checkpoint's tokenizer
        return text_conditions(world, cfg, captions)
    encoder = caption_encoder(world)
    if encoder.dim != cfg.caption_dim:
        raise ValueError(f"caption encoder {encoder.path} gives {encoder.dim}-d features, the target's "
                         f"caption_dim is {cfg.caption_dim}")
    # (U, C, D), or (U, C, D + 1) with the mask packed in for T5 (lisa.data.text.pack_caption)
    return encoder.features(captions, cfg.cls_token_num).to(torch.float16)


@torch.no_grad()
def encode(world: WorldParams, p: EncodeParams, paths: WorldPaths) -> dict:
    """VQ codes of every image, with its class, and (t2i) per-token caption features of every distinct caption."""
    vq, vq_meta = load_tokenizer(paths.tokenizer_file)
    _, _, ds = load_images(paths.dataset_dir, paths.dataset_identity)
    cfg = gpt_config(**world.target)
    tensors, captions = {}, sorted(set(ds["train"]["caption"]) | set(ds["test"]["caption"]))
    index = {c: i for i, c in enumerate(captions)}
    for split in ("train", "test"):
        images = data.images_tensor(ds[split])
        codes = torch.cat([vq.encode(data.to_model_range(b)).flatten(1) for b in
                           tqdm(images.split(p.batch_size), desc=f"encode {split}", unit="batch")])
        if cfg.model_type == "lm":  # the target's sequences: the codes inside its image grammar
            codes = _grammar_sequences(codes, cfg, paths.tokenizer_file)
        tensors[f"{split}_codes"] = codes.to(torch.int16)  # (N, T)
        tensors[f"{split}_labels"] = torch.tensor(ds[split]["label"], dtype=torch.int64)
        tensors[f"{split}_caption_idx"] = torch.tensor([index[c] for c in ds[split]["caption"]], dtype=torch.int64)
    if cfg.model_type in ("lm", "t2i"):
        tensors["caption_feats"] = _caption_features(world, cfg, captions)
    out = paths.codes_file
    atomic_write(out, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp))
    write_json(out.with_suffix(".json"), {"captions": captions, "tokenizer_sha256": vq_meta["sha256"],
                                          "sha256": file_sha256(out)})
    return {"train": len(tensors["train_codes"]), "test": len(tensors["test_codes"]), "captions": len(captions),
            "codes_used": int(torch.cat([tensors["train_codes"], tensors["test_codes"]]).unique().numel())}


def train_target(world: WorldParams, p: TrainTargetParams, paths: WorldPaths) -> dict:
    """Train the world's target GPT on its VQ codes; resumable (target_work/resume.pt). Held-out NLL per token.
    A world with a `target_checkpoint` (the real profile) imports it instead (init_target), and reports the
    imported target's held-out NLL on these codes."""
    cfg = gpt_config(**world.target)
    d = load_codes(paths.codes_file, cfg.model_type)
    if world.target_checkpoint:
        info = init_target(world, InitTargetParams(seed=p.seed), paths)
        model, _ = load_target(paths.target_file)
        metrics = {"imported": world.target_checkpoint,
                   "heldout_nll_per_token": heldout_nll(model, d["test_tokens"], d["test_cond"], p.eval_batch_size)}
        write_json(paths.target_report, metrics)
        return metrics | {"sha256": info["sha256"]}
    torch.manual_seed(p.seed)
    model = Transformer(cfg)
    metrics = train_gpt(model, d["train_tokens"], d["train_cond"], d["test_tokens"], d["test_cond"], p,
                        paths.target_work)
    meta = save_artifact(model.eval(), paths.target_file, "gpt", cfg, step=p.steps, seed=p.seed,
                         made_from={"codes": str(paths.codes_file), "codes_sha256": file_sha256(paths.codes_file)},
                         extra={"metrics": metrics})
    write_json(paths.target_report, metrics)
    return metrics | {"sha256": meta["sha256"]}


STAGES = {
    "build-dataset": Stage(lambda c: build_dataset(c.world, c.params.build_dataset, c.paths), out="dataset_dir"),
    "train-tokenizer": Stage(lambda c: train_tokenizer(c.world, c.params.train_tokenizer, c.paths),
                             out="tokenizer_dir", report="tokenizer_report", work="tokenizer_work"),
    "encode": Stage(lambda c: encode(c.world, c.params.encode, c.paths), out="codes_dir"),
    "train-target": Stage(lambda c: train_target(c.world, c.params.train_target, c.paths),
                          out="target_dir", report="target_report", work="target_work"),
    "init-tokenizer": Stage(lambda c: init_tokenizer(c.world, c.params.init_tokenizer, c.paths), out="tokenizer_dir"),
    "init-target": Stage(lambda c: init_target(c.world, c.params.init_target, c.paths), out="target_dir"),
}
