"""Drafters for speculative decoding of a target (lisa/models/gpt.py). Architecture only.

EAGLE-3 (`Eagle3Drafter`): the target's hidden states from a low, a middle and a high layer (its `taps`) are
concatenated and fused 3H -> D (`fuse`); one decoder layer then reads [RMSNorm(token embedding),
RMSNorm(hidden)] (H + D wide: its attention projects H + D -> heads, its residual stream is D wide and starts from
the hidden state), and its own LM head predicts the next token. D is the target's H (EAGLE-3) unless `width`
narrows it; `ffn_dim` sizes the layer's SwiGLU (0: none); `head_rank` r factors the LM head D -> r -> V (`head_in`
then `output`: D r + r V weights instead of D V; at LlamaGen-B's D = 768, V = 16384, r = 256 reads 4.4M weights
a step instead of 12.6M, where the full head is half of what a drafting step reads). All three make a drafting
step cheaper against the target's one-token step (`lisa ablate-arch` measures the ratio and what it costs in
acceptance). Alignment: at sequence position s the drafter gets
the target's hidden state at s (which predicted token s + 1) and the embedding of token s + 1, and predicts token
s + 2. Each step's output hidden state (before the final norm) is what the next drafting step reads in place of
the target's fused features (training-time test unrolls exactly this). Its KV cache, RoPE table and mask
conventions are the target's: cache slots, explicit (B|1, S, K) masks for draft trees, RoPE positions apart.

Medusa (`MedusaDrafter`, for the ablation in LISA.md): K heads on the target's last hidden state; head k (a
SiLU residual block and an LM head) predicts token s + 2 + k from the hidden state at s. No cache, no recurrence.
"""
from __future__ import annotations

from dataclasses import asdict, field
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic.dataclasses import dataclass
from torch import Tensor

from lisa.config import STRICT, DrafterArch
from lisa.models.gpt import (GPTConfig, KVCache, RMSNorm, apply_rope, default_taps, find_multiple, rope_1d_table,
                             rope_2d_table, rope_operands)
from lisa.models.presets import build_config


@dataclass(config=STRICT)
class DrafterConfig(DrafterArch):
    """A drafter as the model reads it: the params' architecture (lisa.config.DrafterArch: width, ffn_dim, n_head,
    head_rank, their types and defaults) resolved against a target (`for_target`: n_head the target's unless set),
    plus what the target fixes."""
    n_head: int = 12  # resolved (DrafterArch's None = the target's)
    kind: str = "eagle3"  # "eagle3" | "medusa"
    dim: int = 768  # the target's hidden size H
    n_kv_head: Optional[int] = None
    vocab_size: int = 16384
    taps: list[int] = field(default_factory=lambda: [2, 6, 9])  # target layers fused (eagle3)
    cls_token_num: int = 1
    block_size: int = 256
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    medusa_heads: int = 4  # medusa
    rope: str = "2d"  # "2d": LlamaGen's grid RoPE; "1d": over sequence positions (chameleon targets)
    rope_length: int = 0  # 1d: positions covered

    def __post_init__(self):
        if self.kind not in ("eagle3", "medusa"):
            raise ValueError(f"DrafterConfig.kind must be 'eagle3' or 'medusa', got {self.kind!r}")
        top = min(self.model_dim, self.vocab_size) - 1
        if not 0 <= self.head_rank <= top:
            raise ValueError(f"DrafterConfig.head_rank must be 0 (a full head) or 1..{top} (below the width "
                             f"{self.model_dim} and the vocabulary {self.vocab_size}), got {self.head_rank}")
        if self.model_dim % self.n_head:
            raise ValueError(f"DrafterConfig: width {self.model_dim} not divisible by n_head {self.n_head}")
        if self.rope not in ("2d", "1d"):
            raise ValueError(f"DrafterConfig.rope must be '2d' or '1d', got {self.rope!r}")
        if self.kind == "eagle3" and len(self.taps) != 3:
            raise ValueError(f"DrafterConfig: eagle3 fuses three target layers, got taps={self.taps}")
        self.taps = [int(t) for t in self.taps]

    @property
    def model_dim(self) -> int:
        """D, the width of the drafter's residual stream and hidden state (the target's H unless `width` is set)."""
        return self.width or self.dim

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def grid_size(self) -> int:
        return int(round(self.block_size**0.5))

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.model_dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    @classmethod
    def for_target(cls, target: GPTConfig, kind: str = "eagle3", **overrides) -> "DrafterConfig":
        """The drafter that matches a target: same width, heads, vocabulary, prefix and grid."""
        base = dict(kind=kind, dim=target.dim, n_head=target.n_head, n_kv_head=target.n_kv_head,
                    vocab_size=target.vocab_size, taps=list(default_taps(target.n_layer)),
                    cls_token_num=target.cls_token_num, block_size=target.block_size,
                    multiple_of=target.multiple_of, ffn_dim_multiplier=target.ffn_dim_multiplier,
                    rope_base=target.rope_base, norm_eps=target.norm_eps)
        if target.arch == "chameleon":
            base |= dict(rope="1d", rope_length=target.rope_positions)
        return cls(**{**base, **overrides})

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        return build_config(cls, {}, **d)  # an unknown field is a ValueError naming it

    def to_dict(self) -> dict:
        return asdict(self)


class DraftOutput(NamedTuple):
    logits: Tensor  # (B, S, V) fp32 (medusa: (B, S, K, V))
    hidden: Tensor  # (B, S, D): fed back as the next step's hidden (eagle3)


class DraftAttention(nn.Module):
    """Attention whose input is H + D wide ([norm(embedding), norm(hidden)]) and whose output is D wide."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        D = cfg.model_dim
        self.wqkv = nn.Linear(cfg.dim + D, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(D, D, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: Tensor, rope: Tensor, input_pos: Optional[Tensor], mask: Optional[Tensor],
                past: Optional[list] = None) -> Tensor:
        B, S, _ = x.shape
        q_dim, kv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([q_dim, kv, kv], dim=-1)
        q = apply_rope(q.view(B, S, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(B, S, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        if input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        elif past is not None:  # training-time test, step by step: the earlier steps' keys / values, with their graph
            past.append((k, v))
            k, v = torch.cat([pk for pk, _ in past], 2), torch.cat([pv for _, pv in past], 2)
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(y.transpose(1, 2).reshape(B, S, q_dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if cfg.kind != "eagle3":
            raise ValueError(f"Eagle3Drafter needs kind='eagle3', got {cfg.kind!r}")
        self.config = cfg
        D = cfg.model_dim
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)  # initialised from the target's, frozen
        self.fc = nn.Linear(3 * cfg.dim, D, bias=False)
        self.embed_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hidden_norm = RMSNorm(D, cfg.norm_eps)
        self.attention = DraftAttention(cfg)
        if cfg.ffn_hidden:
            self.ffn_norm = RMSNorm(D, cfg.norm_eps)
            self.feed_forward = SwiGLU(D, cfg.ffn_hidden)
        self.norm = RMSNorm(D, cfg.norm_eps)
        if cfg.head_rank:  # the head factored: D -> r -> V (from the target's head's top-r SVD when D = H)
            self.head_in = nn.Linear(D, cfg.head_rank, bias=False)
        self.output = nn.Linear(cfg.head_rank or D, cfg.vocab_size, bias=False)  # from the target's head when D = H
        if cfg.rope == "1d":
            rope = rope_1d_table(cfg.rope_length, cfg.head_dim, cfg.rope_base)
        else:
            rope = rope_2d_table(cfg.grid_size, cfg.head_dim, cfg.rope_base, cfg.cls_token_num)
        self.register_buffer("rope", rope, persistent=False)
        self.register_buffer("causal", torch.ones(0, 0, dtype=torch.bool), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype=None, device=None):
        length = find_multiple(max_seq_length, 8)
        dtype = dtype or self.fc.weight.dtype
        device = device or self.fc.weight.device
        c = self.config
        self.attention.kv_cache = KVCache(max_batch_size, length, c.kv_heads, c.head_dim, dtype, device)
        self.causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))

    def clear_caches(self):
        self.attention.kv_cache = None
        self.causal = torch.ones(0, 0, dtype=torch.bool, device=self.causal.device)

    @property
    def cache_length(self) -> int:
        return self.causal.shape[0]

    def fuse(self, taps: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
        """The target's tapped hidden states (3 x (B, S, H)) -> (B, S, D)."""
        return self.fc(torch.cat(list(taps), dim=-1))

    def forward(self, tokens: Tensor, hidden: Tensor, input_pos: Optional[Tensor] = None,
                mask: Optional[Tensor] = None, rope_pos: Optional[Tensor] = None,
                past: Optional[list] = None) -> DraftOutput:
        """tokens (B, S): the token after each hidden state; hidden (B, S, D): fused target features or the
        drafter's own previous hidden. input_pos / mask / rope_pos as in Transformer.forward. past (no cache, for
        training): a list of the (key, value) tensors of earlier calls, which this call's queries also attend
        (mask (B|1, S, earlier + S) covers them, in order) and to which it appends its own."""
        B, S = tokens.shape
        if rope_pos is None:
            rope_pos = input_pos if input_pos is not None else torch.arange(S, device=tokens.device)
        rope = self.rope[rope_pos]
        rope = rope_operands(rope.unsqueeze(0) if rope.dim() == 3 else rope)
        attn_mask = None
        if input_pos is not None:
            if self.cache_length == 0:
                raise RuntimeError("Eagle3Drafter.forward: input_pos given but no KV cache; call setup_caches")
            if mask is None:
                attn_mask = self.causal[input_pos][None, None]
            else:
                mask = mask if mask.dim() == 3 else mask[None]
                pad = self.cache_length - mask.shape[-1]
                attn_mask = (F.pad(mask, (0, pad), value=False) if pad else mask)[:, None]
        elif mask is not None:
            attn_mask = (mask if mask.dim() == 3 else mask[None])[:, None]
        x = torch.cat([self.embed_norm(self.tok_embeddings(tokens)), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.attention(x, rope, input_pos, attn_mask, past)
        if self.config.ffn_hidden:
            h = h + self.feed_forward(self.ffn_norm(h))
        x = self.norm(h)
        return DraftOutput(self.output(self.head_in(x) if self.config.head_rank else x).float(), h)


class MedusaHead(nn.Module):
    def __init__(self, dim: int, vocab_size: int):
        super().__init__()
        self.block = nn.Linear(dim, dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        nn.init.zeros_(self.block.weight)  # starts as the identity: each head begins as the target's hidden
        nn.init.zeros_(self.block.bias)

    def forward(self, h: Tensor) -> Tensor:
        return self.output(h + F.silu(self.block(h)))


class MedusaDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if cfg.kind != "medusa":
            raise ValueError(f"MedusaDrafter needs kind='medusa', got {cfg.kind!r}")
        self.config = cfg
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.heads = nn.ModuleList(MedusaHead(cfg.dim, cfg.vocab_size) for _ in range(cfg.medusa_heads))

    def forward(self, hidden: Tensor) -> DraftOutput:
        """hidden (B, S, H): the target's last hidden state -> logits (B, S, K, V): head k predicts s + 2 + k."""
        h = self.norm(hidden)
        return DraftOutput(torch.stack([head(h) for head in self.heads], dim=2).float(), hidden)


def build_drafter(cfg: DrafterConfig | dict) -> nn.Module:
    cfg = DrafterConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
    return Eagle3Drafter(cfg) if cfg.kind == "eagle3" else MedusaDrafter(cfg)
