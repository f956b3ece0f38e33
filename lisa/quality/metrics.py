"""Sample quality of a world's target: FID / KID against held-out images, and the world's judge.

Reference sets (stage `fid-reference`, once per tokenizer and dataset), each of up to `max_images` images:
  * held-out: real test images, a seeded subset; their Inception features are kept (reference.safetensors) and
    every later FID / KID is measured against them;
  * train: real training images: held-out vs train is the floor any generator can reach at this sample size;
  * reconstructions: the held-out images through the VQ tokenizer (encode, decode): the floor of this tokenizer;
  * unigram: images whose tokens are drawn independently from the training codes' frequency at each position,
    the baseline a target must clearly beat.
`evaluate` samples `num_samples` CFG images from the target (classes in turn, or held-out captions in turn),
measures FID / KID against the held-out features and scores them with the judge (lisa/quality/judges.py).
Long feature extractions are cached per set under a work folder, so a killed stage resumes where it stopped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from lisa.quality import fid
from lisa.checkpoint import atomic_write, read_state_dict
from lisa.config import seed_for
from lisa.decoding.generate import generate
from lisa.decoding.sampling import SamplingConfig


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1] -> uint8, the way a PNG would store them."""
    return ((images.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


@torch.inference_mode()
def decode_tokens(vq, tokens: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """(N, T) codes -> (N, 3, H, W) uint8 images."""
    return torch.cat([to_uint8(vq.decode(t.long())) for t in tokens.split(batch_size)])


def unigram_tokens(train_codes: torch.Tensor, vocab_size: int, n: int, seed: int) -> torch.Tensor:
    """(n, T) tokens, each drawn independently from the training codes' frequencies at its position."""
    T = train_codes.shape[1]
    counts = torch.zeros(T, vocab_size)
    counts.scatter_add_(1, train_codes.long().T.contiguous(), torch.ones(T, len(train_codes)))
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(counts / counts.sum(1, keepdim=True), n, replacement=True, generator=gen).T.contiguous()


def subset(n_total: int, n: int, seed: int) -> torch.Tensor:
    """A seeded, sorted subset of min(n, n_total) indices."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n_total, generator=gen)[: min(n, n_total)].sort().values


def cached(path: Path, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make() once: the result is stored atomically at path, and a rerun (after a kill) reads it back."""
    if path.is_file():
        return read_state_dict(path)[key]
    value = make()
    atomic_write(path, lambda tmp: save_file({key: value.contiguous()}, tmp))
    return value


def generate_samples(model, conds: torch.Tensor, sampling: SamplingConfig, batch_size: int, seed: int,
                     progress: bool = True) -> torch.Tensor:
    """Vanilla samples for each condition, batch by batch; batch i uses generator seed (seed, i)."""
    out = []
    for i, batch in enumerate(tqdm(conds.split(batch_size), desc="sample", unit="batch", disable=not progress)):
        tokens, _ = generate(model, batch, sampling, torch.Generator().manual_seed(seed_for(seed, i)))
        out.append(tokens)
    return torch.cat(out)


def write_reference(out: Path, feats: torch.Tensor, indices: torch.Tensor, meta: dict) -> None:
    atomic_write(out, lambda tmp: save_file({"features": feats.contiguous(), "indices": indices.contiguous()}, tmp))
    atomic_write(out.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))


def read_reference(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    path = Path(path)
    t = read_state_dict(path)
    if "features" not in t or t["features"].dim() != 2 or t["features"].shape[1] != 2048:
        raise ValueError(f"{path}: not a reference-features file (expected 'features' (N, 2048))")
    side = path.with_suffix(".json")
    meta = json.loads(side.read_text()) if side.is_file() else {}
    return t["features"], t["indices"], meta
