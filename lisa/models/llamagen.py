"""Loading targets, tokenizers and drafters: our safetensors artifacts, and official LlamaGen checkpoints.

Official `c2i_*.pt` / `t2i_*.pt` files carry no config: the architecture is inferred from tensor shapes
(dim, layers, vocabulary, condition type, classes, caption width, kv heads) and the rest comes from the caller
(the preset name for the head count, the image size for the token grid). Everything is cross-checked, and a
mismatch names the file and the keys or shapes.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch.nn as nn

from lisa.checkpoint import CheckpointError, load_artifact, load_into, read_state_dict
from lisa.models.drafter import build_drafter
from lisa.models.gpt import PRESETS, GPTConfig, Transformer, gpt_config
from lisa.models.vq import VQConfig, VQModel, vq_config

# Non-weight entries that LlamaGen checkpoints may hold: KV caches saved after setup_caches, the RoPE table,
# the VQ usage counter.
IGNORED_GPT_KEYS = ("kv_cache.", "freqs_cis", "causal_mask")
IGNORED_VQ_KEYS = ("quantize.codebook_used",)


def load_target(path: str | Path) -> tuple[Transformer, dict]:
    """Our target artifact (`model.safetensors` + `model.json`) -> (model in eval mode, sidecar)."""
    model, meta = load_artifact(path, "gpt", lambda c: Transformer(GPTConfig.from_dict(c)))
    return model.eval(), meta


def load_tokenizer(path: str | Path) -> tuple[VQModel, dict]:
    """Our tokenizer artifact (`tokenizer.safetensors` + `tokenizer.json`) -> (model in eval mode, sidecar)."""
    model, meta = load_artifact(path, "vq", lambda c: VQModel(VQConfig.from_dict(c)))
    return model.eval(), meta


def load_drafter(path: str | Path, target_meta: Optional[dict] = None) -> tuple[nn.Module, dict]:
    """A drafter artifact; with `target_meta` (the target's sidecar), refuse one trained against another target."""
    model, meta = load_artifact(path, "drafter", build_drafter)
    trained_on = meta.get("made_from", {}).get("target_sha256")
    if target_meta is not None and trained_on != target_meta["sha256"]:
        made = meta.get("made_from", {})  # named-drafter's record their name; ablate-lid's their loss
        how = (f"named-drafter --drafter {made['named']}" if "named" in made else
               "ablate-lid" if "loss" in made else "train-drafter")
        raise CheckpointError(f"{path}: drafter trained against target {trained_on}, but the target given has "
                              f"sha256 {target_meta['sha256']}: retrain it (`lisa {how} --world W`)")
    return model.eval(), meta


def llamagen_gpt_config(sd: dict, path, preset: Optional[str] = None, image_size: int = 256,
                        downsample: int = 16, **overrides) -> GPTConfig:
    """Infer a GPTConfig from an official LlamaGen state dict (see module docstring)."""
    def need(key):
        if key not in sd:
            raise CheckpointError(f"{path}: key {key!r} missing: not a LlamaGen GPT checkpoint "
                                  f"(first keys: {sorted(sd)[:6]})")
        return sd[key]

    vocab_size, dim = need("tok_embeddings.weight").shape
    n_layer = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k))), default=-1)
    if "cls_embedding.embedding_table.weight" in sd:
        rows = sd["cls_embedding.embedding_table.weight"].shape[0]
        # LlamaGen's table ends with the null class row (ImageNet models: 1001 rows) unless trained without drop.
        has_null = overrides.get("class_dropout_prob", 0.1) > 0
        inferred = dict(model_type="c2i", cls_token_num=1, num_classes=rows - 1 if has_null else rows)
    elif "cls_embedding.cap_proj.fc1.weight" in sd:
        uncond = need("cls_embedding.uncond_embedding")
        inferred = dict(model_type="t2i", cls_token_num=uncond.shape[0], caption_dim=uncond.shape[1])
    else:
        raise CheckpointError(f"{path}: neither cls_embedding.embedding_table (c2i) nor cls_embedding.cap_proj (t2i) "
                              f"found: not a LlamaGen GPT checkpoint")
    if preset is None:
        by_dim = [name for name, p in PRESETS.items() if p["dim"] == dim and p["n_layer"] == n_layer]
        if not by_dim:
            raise CheckpointError(f"{path}: dim {dim} / {n_layer} layers match no preset; pass preset= or n_head=")
        preset = by_dim[0]
    grid = image_size // downsample
    cfg = gpt_config(preset, vocab_size=vocab_size, block_size=grid * grid, **{**inferred, **overrides})
    if (cfg.dim, cfg.n_layer) != (dim, n_layer):
        raise CheckpointError(f"{path}: has dim {dim} and {n_layer} layers but preset {preset!r} has "
                              f"dim {cfg.dim} and {cfg.n_layer} layers")
    q_rows = need("layers.0.attention.wqkv.weight").shape[0]
    kv_heads = (q_rows - dim) // 2 // cfg.head_dim
    if kv_heads != cfg.kv_heads:
        cfg = gpt_config(preset, vocab_size=vocab_size, block_size=grid * grid, n_kv_head=kv_heads,
                         **{**inferred, **overrides})
    return cfg


def import_llamagen_gpt(path: str | Path, preset: Optional[str] = None, image_size: int = 256,
                        downsample: int = 16, **overrides) -> Transformer:
    """Load an official LlamaGen `c2i_*.pt` / `t2i_*.pt` (weights under "model", "module", "state_dict" or raw).

    `preset` (e.g. "GPT-XL") fixes the head count; it is found from dim and depth when omitted.
    `image_size / downsample` gives the token grid: c2i_XL_384.pt -> image_size=384 (24x24 tokens).
    """
    sd = read_state_dict(path)
    cfg = llamagen_gpt_config(sd, path, preset, image_size, downsample, **overrides)
    return load_into(Transformer(cfg), sd, path, ignore=IGNORED_GPT_KEYS).eval()


def import_llamagen_vq(path: str | Path, preset: str = "VQ-16", **overrides) -> VQModel:
    """Load an official `vq_ds16_{c2i,t2i}.pt` (codebook size and dim inferred from the file)."""
    sd = read_state_dict(path)
    if "quantize.embedding.weight" not in sd:
        raise CheckpointError(f"{path}: key 'quantize.embedding.weight' missing: not a LlamaGen VQ checkpoint "
                              f"(first keys: {sorted(sd)[:6]})")
    k, d = sd["quantize.embedding.weight"].shape
    cfg = vq_config(preset, **{"codebook_size": k, "codebook_embed_dim": d, **overrides})
    return load_into(VQModel(cfg), sd, path, ignore=IGNORED_VQ_KEYS).eval()
