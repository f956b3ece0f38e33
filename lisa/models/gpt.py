"""LlamaGen-compatible autoregressive image transformer (the *target* of speculative decoding).

Architecture only: Llama blocks (RMSNorm, SwiGLU, 2D RoPE over the token grid) with a condition prefix —
one class token (c2i) or `cls_token_num` caption-feature tokens through a caption MLP (t2i) — and a static KV
cache indexed by cache slots, gpt-fast style.

Matches LlamaGen's `autoregressive/models/gpt.py` math exactly, so its checkpoints give the same logits:
  * 2D RoPE: the head dim is split in two halves (row frequencies, then column frequencies), each rotated in
    adjacent (even, odd) pairs; the condition positions get an all-zero rotation table (cos = sin = 0), which
    zeroes their queries and keys — a quirk of the official code that we must reproduce.
  * RMSNorm in fp32 with eps 1e-5, then cast back; `wqkv` split as [q | k | v]; logits in fp32.
  * the null class is index `num_classes`; the unconditional caption is the learned `uncond_embedding` buffer.

Beyond LlamaGen (what speculative decoding needs):
  * `forward(x, input_pos, mask, rope_pos, taps)`: `input_pos` are cache slots to write, `rope_pos` the grid
    positions (they differ inside a draft tree, where siblings share a depth), `mask` an explicit
    (B|1, S, K) bool attention mask over cache slots for a block of new tokens (K <= cache length).
  * `taps`: hidden states after chosen blocks (EAGLE-3 fuses a low, a middle and a high layer).

`arch="chameleon"` is the Chameleon-7B / Lumina-mGPT stack (lisa/models/lumina.py imports transformers' checkpoints):
1D RoPE over sequence positions, a per-head LayerNorm of queries and keys (`qk_norm`), optionally Swin-style
post-norms (`swin_norm`), and `model_type="lm"`: the condition is the prompt's text token ids (B, C), left padded,
embedded with the same table as everything else (`text_vocab_size` rows). Our token ids are a compact vocabulary
(`vocab_size`: the image codes first, then the image grammar tokens) mapped onto the checkpoint's ids by the
`token_ids` buffer; the output head holds just those rows, and logits of ids >= `free_vocab` (the grammar) are
pushed to -1e4 so that only image codes are ever sampled (the grammar is forced: lisa.decoding.grammar).
The RoPE pairs are stored interleaved like LlamaGen's: the importer permutes the query / key rows of each head
from transformers' rotate-half layout, which leaves every attention score unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lisa.models.presets import build_config


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class GPTConfig:
    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None
    multiple_of: int = 256  # SwiGLU hidden size rounded up to this
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    token_dropout_p: float = 0.0
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0
    model_type: str = "c2i"  # "c2i" | "t2i" | "lm" (prompt token ids, chameleon)
    arch: str = "llamagen"  # "llamagen" | "chameleon"
    qk_norm: bool = False  # chameleon: LayerNorm of each head's queries and keys
    swin_norm: bool = False  # chameleon: x + norm(attn(x)) instead of x + attn(norm(x))
    intermediate_size: Optional[int] = None  # SwiGLU hidden size; None = LlamaGen's rule (ffn_hidden)
    text_vocab_size: int = 0  # lm: rows of the embedding table (the checkpoint's whole vocabulary)
    free_vocab: int = 0  # lm: ids < free_vocab may be sampled (image codes), the rest are grammar (0 = all)
    rope_length: int = 0  # chameleon: RoPE positions covered (0 = cls_token_num + block_size + 64)
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1  # > 0 adds the null class row (index num_classes) / enables CFG
    vocab_size: int = 16384
    cls_token_num: int = 1  # condition prefix length: 1 for c2i, 120 for LlamaGen t2i
    block_size: int = 256  # image tokens = grid_size ** 2

    def __post_init__(self):
        if self.model_type not in ("c2i", "t2i", "lm"):
            raise ValueError(f"GPTConfig.model_type must be 'c2i', 't2i' or 'lm', got {self.model_type!r}")
        if self.arch not in ("llamagen", "chameleon"):
            raise ValueError(f"GPTConfig.arch must be 'llamagen' or 'chameleon', got {self.arch!r}")
        if (self.model_type == "lm") != (self.arch == "chameleon"):
            raise ValueError(f"GPTConfig: model_type 'lm' goes with arch 'chameleon' (got {self.model_type!r}, "
                             f"{self.arch!r})")
        if self.model_type == "lm" and self.text_vocab_size < self.vocab_size:
            raise ValueError(f"GPTConfig.text_vocab_size={self.text_vocab_size} is smaller than "
                             f"vocab_size={self.vocab_size}")
        if self.dim % self.n_head:
            raise ValueError(f"GPTConfig.dim={self.dim} is not divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"GPTConfig.n_head={self.n_head} is not divisible by n_kv_head={self.kv_heads}")
        if (self.dim // self.n_head) % 4:
            raise ValueError(f"GPTConfig head_dim={self.dim // self.n_head} must be divisible by 4 (2D RoPE)")
        if self.arch == "llamagen" and math.isqrt(self.block_size) ** 2 != self.block_size:
            raise ValueError(f"GPTConfig.block_size={self.block_size} is not a square token grid")
        if self.model_type == "c2i" and self.cls_token_num != 1:
            raise ValueError(f"GPTConfig: c2i uses one class token, got cls_token_num={self.cls_token_num}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def grid_size(self) -> int:
        return math.isqrt(self.block_size)

    @property
    def ffn_hidden(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    @property
    def has_null_cond(self) -> bool:
        return self.model_type in ("t2i", "lm") or self.class_dropout_prob > 0

    @property
    def rope_positions(self) -> int:
        return self.rope_length or self.cls_token_num + self.block_size + 64

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        return build_config(cls, {}, **d)


# Named configs: LlamaGen's sizes, plus tiny presets for CPU work and tests.
PRESETS: dict[str, dict] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),  # 111M
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),  # 343M
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),  # 775M
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),  # 1.4B
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),  # 3.9B
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
    "GPT-tiny": dict(n_layer=8, n_head=8, dim=256, multiple_of=64),  # ~7M at vocab 1024
    "GPT-mini": dict(n_layer=6, n_head=6, dim=192, multiple_of=64),  # ~3M at vocab 1024: the built-in worlds
    "GPT-micro": dict(n_layer=2, n_head=4, dim=64, multiple_of=32),  # tests
}


def gpt_config(preset: Optional[str] = None, **overrides) -> GPTConfig:
    """A named preset with any field overridden; no preset = the dataclass defaults."""
    return build_config(GPTConfig, PRESETS, preset, **overrides)


# ---------------------------------------------------------------------------------------------------------------
# 2D rotary embedding


def rope_2d_table(grid_size: int, head_dim: int, base: float, cls_token_num: int) -> Tensor:
    """(cls_token_num + grid_size**2, head_dim // 2, 2) table of (cos, sin); zeros for the condition prefix."""
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))  # (head_dim // 4,)
    t = torch.arange(grid_size, dtype=torch.float32)
    angles = torch.outer(t, freqs)  # (G, head_dim // 4)
    grid = torch.cat(
        [angles[:, None, :].expand(-1, grid_size, -1), angles[None, :, :].expand(grid_size, -1, -1)], dim=-1
    )  # (G, G, head_dim // 2): row angles then column angles
    table = torch.stack([torch.cos(grid), torch.sin(grid)], dim=-1).flatten(0, 1)  # (G*G, head_dim // 2, 2)
    return torch.cat([torch.zeros(cls_token_num, half, 2), table])


def rope_1d_table(length: int, head_dim: int, base: float) -> Tensor:
    """(length, head_dim // 2, 2) table of (cos, sin) for 1D RoPE over positions 0..length-1 (pair j: frequency
    base ** (-2j / head_dim)), in apply_rope's adjacent-pair layout."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)


def rotate_half_permutation(head_dim: int) -> Tensor:
    """Index that reorders one head's dims from rotate-half RoPE pairs (j, j + hd/2) to adjacent pairs (2j, 2j+1)."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()


def rope_operands(rope: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of a RoPE table (B|1, S, hd // 2, 2) of (cos, sin) -> apply_rope's operands, built once per forward
    and shared by every layer: (cos, cos) and (-sin, sin) per pair, each (B|1, S, 1, hd // 2, 2)."""
    c, s = rope[..., :1], rope[..., 1:]
    return torch.cat([c, c], -1)[:, :, None], torch.cat([-s, s], -1)[:, :, None]


def apply_rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """x: (B, S, H, hd); rope: `rope_operands`. Rotates adjacent pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s), in
    fp32 like LlamaGen, as x * (c, c) + swap(x) * (-s, s): the same float operations in the same order (x1 (-s)
    is -(x1 s) exactly), in a handful of tensor ops instead of two dozen."""
    cc, ss = rope
    xs = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, S, H, hd/2, 2)
    return (xs * cc + xs.flip(-1) * ss).flatten(3).type_as(x)


# ---------------------------------------------------------------------------------------------------------------
# Blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class HeadNorm(nn.Module):
    """Chameleon's query / key norm: LayerNorm statistics over each head's dims, a weight and bias per head."""

    def __init__(self, n_head: int, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_head, head_dim))
        self.bias = nn.Parameter(torch.zeros(n_head, head_dim))

    def forward(self, x: Tensor) -> Tensor:  # (B, S, H, hd)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight + self.bias


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.dropout = nn.Dropout(cfg.ffn_dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class KVCache(nn.Module):
    """Static cache (B, H_kv, L, hd); `update` writes the new keys/values at cache slots (rollback = overwrite)."""

    def __init__(self, batch: int, length: int, n_kv_head: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (batch, n_kv_head, length, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # input_pos: (S,) slots shared by all rows, or (B, S) per row (speculative decoding: rows accept their own
        # lengths); k, v: (B, H_kv, S, hd) with B <= cache batch
        b = k.shape[0]
        if input_pos.dim() == 2:
            rows = torch.arange(b, device=k.device)[:, None]
            self.k[rows, :, input_pos] = k.transpose(1, 2)  # advanced indices first: (B, S, H_kv, hd)
            self.v[rows, :, input_pos] = v.transpose(1, 2)
        else:
            self.k[:b, :, input_pos] = k
            self.v[:b, :, input_pos] = v
        return self.k[:b], self.v[:b]

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Per row, copy the entries at slots src (B, M) to slots dst (B, M) (reads all before writing)."""
        b = src.shape[0]
        for buf in (self.k, self.v):
            idx = lambda t: t[:, None, :, None].expand(b, buf.shape[1], t.shape[1], buf.shape[3])  # noqa: E731
            buf[:b].scatter_(2, idx(dst), buf[:b].gather(2, idx(src)))


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.attn_dropout_p = cfg.attn_dropout_p
        self.resid_dropout = nn.Dropout(cfg.resid_dropout_p)
        self.kv_cache: Optional[KVCache] = None
        if cfg.qk_norm:
            self.q_norm = HeadNorm(cfg.n_head, cfg.head_dim)
            self.k_norm = HeadNorm(cfg.kv_heads, cfg.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, rope: Tensor, input_pos: Optional[Tensor], mask: Optional[Tensor]) -> Tensor:
        B, S, D = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([D, kv, kv], dim=-1)
        q, k = q.view(B, S, self.n_head, self.head_dim), k.view(B, S, self.n_kv_head, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, rope).transpose(1, 2)  # (B, H, S, hd)
        k = apply_rope(k, rope).transpose(1, 2)  # (B, Hkv, S, hd)
        v = v.view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, S, hd)
        if input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)  # (B, Hkv, L, hd)
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.attn_dropout_p if self.training else 0.0
        )  # (B, H, S, hd)
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(B, S, D)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.swin_norm = cfg.swin_norm

    def forward(self, x: Tensor, rope: Tensor, input_pos: Optional[Tensor], mask: Optional[Tensor]) -> Tensor:
        if self.swin_norm:  # Chameleon-30B style: norms after the sublayers
            h = x + self.attention_norm(self.attention(x, rope, input_pos, mask))
            return h + self.ffn_norm(self.feed_forward(h))
        h = x + self.attention(self.attention_norm(x), rope, input_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


# ---------------------------------------------------------------------------------------------------------------
# Condition embedders (LlamaGen's key names: cls_embedding.embedding_table / cls_embedding.cap_proj.fc{1,2})


class LabelEmbedder(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_classes = cfg.num_classes
        self.embedding_table = nn.Embedding(cfg.num_classes + int(cfg.class_dropout_prob > 0), cfg.dim)

    def forward(self, labels: Tensor, drop: Optional[Tensor]) -> Tensor:
        # labels: (B,) long; drop: (B,) bool -> the null class. Returns (B, 1, D).
        if drop is not None:
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels).unsqueeze(1)


class CaptionMLP(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cap_proj = CaptionMLP(cfg.caption_dim, cfg.dim)
        self.register_buffer("uncond_embedding", torch.randn(cfg.cls_token_num, cfg.caption_dim) / cfg.caption_dim**0.5)

    def forward(self, caption: Tensor, drop: Optional[Tensor]) -> Tensor:
        # caption: (B, L, caption_dim) features; drop: (B,) bool -> the learned unconditional embedding.
        if drop is not None:
            caption = torch.where(drop[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return self.cap_proj(caption)


# ---------------------------------------------------------------------------------------------------------------


def image_grammar(codebook_size: int, h: int, w: int) -> Tensor:
    """The forced-token vector (4 + h (w + 1),) of an lm target's h x w image in our ids (codes 0..K-1, then SOI = K,
    EOI = K + 1, EOL = K + 2, size token of grid g = K + 3 + g): SOI, size(h), size(w), h rows of w codes (-1:
    sampled) each followed by EOL, EOI. lisa.models.lumina.LuminaGrammar names the layout."""
    K = codebook_size
    rows = torch.full((h, w + 1), -1, dtype=torch.long)
    rows[:, w] = K + 2
    return torch.cat([torch.tensor([K, K + 3 + h, K + 3 + w]), rows.flatten(), torch.tensor([K + 1])])


def grammar_grid(block_size: int) -> int:
    """The side g of an lm target's square image: block_size = 4 + g (g + 1)."""
    g = next((g for g in range(1, 257) if 4 + g * (g + 1) >= block_size), 0)
    if 4 + g * (g + 1) != block_size:
        raise ValueError(f"GPTConfig.block_size={block_size} is not 4 + g (g + 1) for a square g x g image grammar")
    return g


def square_image_grammar(codebook_size: int, block_size: int) -> Tensor:
    """image_grammar of the square grid that block_size holds."""
    g = grammar_grid(block_size)
    return image_grammar(codebook_size, g, g)


class PromptEmbedder(nn.Module):
    """lm: the prompt is text token ids (B, C) read through the model's own embedding table (no extra weights);
    the unconditional CFG row is the same prompt with every prefix position masked out (lisa.decoding.generate)."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = [table]  # not a submodule: the weights belong to Transformer.tok_embeddings

    def forward(self, ids: Tensor, drop: Optional[Tensor]) -> Tensor:
        return self.table[0](ids)


class GPTOutput(NamedTuple):
    logits: Optional[Tensor]  # (B, S, V) fp32; None when asked for hidden taps only
    hidden: tuple[Tensor, ...]  # one (B, S, D) per requested tap, in the order asked


class Transformer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        if cfg.model_type == "lm":
            self.tok_embeddings = nn.Embedding(cfg.text_vocab_size, cfg.dim)
            self.cls_embedding = PromptEmbedder(self.tok_embeddings)
            # our id -> the checkpoint's id (image codes, then grammar tokens); persistent: saved with the weights
            self.register_buffer("token_ids", torch.arange(cfg.vocab_size))
            # the forced image grammar every decode loop applies (lisa.decoding.grammar)
            self.register_buffer("grammar", square_image_grammar(cfg.free_vocab, cfg.block_size), persistent=False)
        else:  # (registration order = init order: kept as it was, so seeded models stay the same)
            self.cls_embedding = LabelEmbedder(cfg) if cfg.model_type == "c2i" else CaptionEmbedder(cfg)
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_dropout = nn.Dropout(cfg.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.arch == "chameleon":
            rope = rope_1d_table(cfg.rope_positions, cfg.head_dim, cfg.rope_base)
        else:
            rope = rope_2d_table(cfg.grid_size, cfg.head_dim, cfg.rope_base, cfg.cls_token_num)
        self.register_buffer("rope", rope, persistent=False)  # (C + block_size, hd/2, 2)
        self.register_buffer("causal", torch.ones(0, 0, dtype=torch.bool), persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module):
        # LlamaGen: N(0, 0.02) everywhere, but a zero output head; we keep the head random so that a
        # random-weight model has non-uniform next-token distributions (benchmarks, tests).
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.config.initializer_range)

    @property
    def seq_len(self) -> int:
        """Full sequence length of one image: condition prefix + image tokens."""
        return self.config.cls_token_num + self.config.block_size

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype=None, device=None):
        """Allocate the static KV caches (rounded up to a multiple of 8 slots, like gpt-fast)."""
        length = find_multiple(max_seq_length, 8)
        dtype = dtype or self.tok_embeddings.weight.dtype
        device = device or self.tok_embeddings.weight.device
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, length, self.config.kv_heads, self.config.head_dim, dtype, device)
        self.causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))  # (L, L)

    def clear_caches(self):
        for layer in self.layers:
            layer.attention.kv_cache = None
        self.causal = torch.ones(0, 0, dtype=torch.bool, device=self.causal.device)

    @property
    def cache_length(self) -> int:
        return self.causal.shape[0]

    def split_cond(self, cond: Tensor, cond_mask: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """A condition packed with its mask -> (condition, mask): t2i features (B, C, caption_dim + 1) whose last
        channel is the mask (lisa.data.text.pack_caption); lm prompt ids (B, C) with -1 at padded positions
        (lisa.models.lumina.encode_prompts). Anything else passes through with the mask given."""
        packed = None
        if self.config.model_type == "t2i" and cond.dim() == 3 and cond.shape[-1] == self.config.caption_dim + 1:
            cond, packed = cond[..., :-1], cond[..., -1] > 0.5
        elif self.config.model_type == "lm" and bool((cond < 0).any()):
            cond, packed = cond.clamp(min=0), cond >= 0
        if packed is None:
            return cond, cond_mask
        return cond, packed if cond_mask is None else cond_mask.bool() & packed

    def image_codes(self, tokens: Tensor) -> Tensor:
        """Generated tokens (B, T) -> the VQ codes (B, h*w) a tokenizer decodes (lm: the grammar tokens removed)."""
        if self.config.model_type == "lm":
            return tokens[:, self.grammar.to(tokens.device) < 0]
        return tokens

    def embed_cond(self, cond: Tensor, drop: Optional[Tensor] = None) -> Tensor:
        """Condition prefix (B, C, D): class ids (B,) for c2i, caption features (B, C, caption_dim) for t2i.
        `drop` (B,) bool replaces a row's condition by the null class / unconditional caption (CFG)."""
        return self.cls_embedding(cond, drop)[:, : self.config.cls_token_num]

    def embed_tokens(self, idx: Tensor) -> Tensor:
        if self.config.model_type == "lm":
            idx = self.token_ids[idx]
        return self.tok_embeddings(idx)  # (B, S, D)

    def token_embedding_table(self) -> Tensor:
        """(vocab_size, D): the embedding of each of our token ids (what a drafter starts from)."""
        w = self.tok_embeddings.weight
        return w[self.token_ids] if self.config.model_type == "lm" else w

    def forward(
        self,
        x: Tensor,
        input_pos: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        rope_pos: Optional[Tensor] = None,
        taps: Sequence[int] = (),
        logits: bool = True,
    ) -> GPTOutput:
        """x: (B, S, D) embeddings (condition prefix and/or image tokens).

        input_pos: (S,) cache slots to write, or (B, S) per row (then `mask` is required); None = no cache, a plain
            causal pass over positions 0..S-1.
        mask: (B|1, S, K) bool, True = may attend, over cache slots 0..K-1 (K <= cache length); default causal.
        rope_pos: (S,) or (B, S) sequence positions for RoPE; defaults to input_pos (or 0..S-1 without cache).
        taps: block indices whose output hidden states are returned (EAGLE-3: low, mid, high).
        logits: False = stop after the highest tapped block, no output head (logits None): drafter features only.
        """
        B, S, _ = x.shape
        if rope_pos is None:
            rope_pos = input_pos if input_pos is not None else torch.arange(S, device=x.device)
        rope = self.rope[rope_pos]  # (S | B,S, hd/2, 2)
        rope = rope_operands(rope.unsqueeze(0) if rope.dim() == 3 else rope)  # (B|1, S, 1, hd/2, 2) x 2
        attn_mask = None
        if input_pos is not None:
            if self.cache_length == 0:
                raise RuntimeError("Transformer.forward: input_pos given but no KV cache; call setup_caches first")
            if mask is None:
                if input_pos.dim() == 2:
                    raise ValueError("Transformer.forward: per-row input_pos needs an explicit mask")
                attn_mask = self.causal[input_pos][None, None]  # (1, 1, S, L)
            else:
                mask = mask if mask.dim() == 3 else mask[None]
                pad = self.cache_length - mask.shape[-1]
                attn_mask = (F.pad(mask, (0, pad), value=False) if pad else mask)[:, None]  # (B|1, 1, S, L)
        elif mask is not None:
            attn_mask = (mask if mask.dim() == 3 else mask[None])[:, None]  # (B|1, 1, S, S)
        h = self.tok_dropout(x)
        hidden = {}
        depth = len(self.layers) if logits or not taps else max(taps) + 1
        for i, layer in enumerate(self.layers[:depth]):
            h = layer(h, rope, input_pos, attn_mask)
            if i in taps:
                hidden[i] = h
        out = self.output(self.norm(h)).float() if logits else None  # (B, S, V)
        if out is not None and self.config.free_vocab:
            out[..., self.config.free_vocab :] = -1e4  # grammar tokens: forced, never sampled
        return GPTOutput(out, tuple(hidden[i] for i in taps))

    def teacher_forced(self, cond: Tensor, tokens: Tensor, drop: Optional[Tensor] = None, taps: Sequence[int] = (),
                       logits: bool = True, cond_mask: Optional[Tensor] = None) -> GPTOutput:
        """Logits (B, T, V) for (condition, image tokens (B, T)) with no cache: logits[:, t] predicts tokens[:, t]
        (it sees the condition and tokens[:, :t]). Hidden taps are aligned the same way. logits=False: taps only,
        the target run up to its highest tapped block (labels come from a logit cache). cond_mask (B, C) bool:
        False at padded prefix positions (no query attends them); lm rows dropped by `drop` mask their whole
        prompt (the unconditional row). lm targets: at the image grammar's positions the logits are the forced token
        (0 there, -1e4 elsewhere), so losses and caches see what decoding emits (log-prob 0)."""
        C = self.config.cls_token_num
        cond, cond_mask = self.split_cond(cond, cond_mask)
        x = torch.cat([self.embed_cond(cond, drop), self.embed_tokens(tokens[:, :-1])], dim=1)  # (B, C+T-1, D)
        mask = None
        if cond_mask is not None or (drop is not None and self.config.model_type == "lm"):
            S = x.shape[1]
            keep = torch.ones(x.shape[0], S, dtype=torch.bool, device=x.device)
            if cond_mask is not None:
                keep[:, :C] = cond_mask.bool()
            if drop is not None and self.config.model_type == "lm":
                keep[:, :C] &= ~drop[:, None]
            causal = torch.tril(torch.ones(S, S, dtype=torch.bool, device=x.device))
            mask = (causal[None] & keep[:, None, :]) | torch.eye(S, dtype=torch.bool, device=x.device)[None]
        out = self(x, mask=mask, taps=taps, logits=logits)
        lg = out.logits[:, C - 1 :] if logits else None
        if lg is not None and self.config.model_type == "lm":  # grammar positions: the forced token, log-prob 0
            f = self.grammar[: lg.shape[1]].to(lg.device)
            pos = (f >= 0).nonzero().squeeze(1)
            lg[:, pos] = -1e4
            lg[:, pos, f[pos]] = 0.0
        return GPTOutput(lg, tuple(h[:, C - 1 :] for h in out.hidden))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def default_taps(n_layer: int) -> tuple[int, int, int]:
    """EAGLE-3's choice of tapped layers: low = 2, mid = L // 2, high = L - 3 (clamped for tiny models)."""
    clamp = lambda i: min(max(i, 0), n_layer - 1)  # noqa: E731
    return clamp(2), clamp(n_layer // 2), clamp(n_layer - 3)
