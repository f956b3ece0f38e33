"""LlamaGen-compatible VQ image tokenizer (VQ-16: conv encoder/decoder, an 8-d L2-normalised codebook).

The same stack with `level_attn=False` and a 256-d unnormalised codebook is Chameleon's VQGAN (Lumina-mGPT's
image tokenizer, taming-transformers layout): lisa.models.lumina.import_chameleon_vq maps its keys onto these.

Architecture only, with LlamaGen's module and key names (`encoder.conv_blocks.{i}.res.{j}...`, `quantize.embedding`,
`quant_conv`, `post_quant_conv`) so that `vq_ds16_{c2i,t2i}.pt` loads as is. Images are (B, 3, H, W) in [-1, 1];
codes are (B, h, w) long with h = H / 2**(len(ch_mult) - 1). The code lookup is nearest neighbour on the
normalised codebook and always runs in fp32 (bf16 autocast would pick wrong codes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lisa.models.presets import build_config


@dataclass
class VQConfig:
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    encoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    decoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    z_channels: int = 256
    ch: int = 128
    num_res_blocks: int = 2
    norm_groups: int = 32
    in_channels: int = 3
    dropout_p: float = 0.0
    image_size: int = 256  # default input size; the model itself is fully convolutional
    level_attn: bool = True  # attention in the lowest-resolution level (LlamaGen); Chameleon's VQGAN: mid block only

    def __post_init__(self):
        for name in ("encoder_ch_mult", "decoder_ch_mult"):
            chans = [self.ch * m for m in getattr(self, name)] + [self.z_channels]
            bad = [c for c in chans if c % self.norm_groups]
            if bad:
                raise ValueError(f"VQConfig.{name}: channels {bad} not divisible by norm_groups={self.norm_groups}")

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)

    @property
    def grid_size(self) -> int:
        return self.image_size // self.downsample

    @classmethod
    def from_dict(cls, d: dict) -> "VQConfig":
        return build_config(cls, {}, **d)


VQ_PRESETS: dict[str, dict] = {
    "VQ-16": dict(encoder_ch_mult=[1, 1, 2, 2, 4], decoder_ch_mult=[1, 1, 2, 2, 4]),  # LlamaGen vq_ds16_*
    "VQ-8": dict(encoder_ch_mult=[1, 2, 2, 4], decoder_ch_mult=[1, 2, 2, 4]),
    # 32x32 images -> 8x8 codes: the built-in worlds
    "VQ-tiny": dict(codebook_size=1024, ch=16, encoder_ch_mult=[1, 2, 4], decoder_ch_mult=[1, 2, 4],
                    z_channels=32, num_res_blocks=1, norm_groups=8, image_size=32),  # 0.8M, ~0.75 s/step of 64 on 2 CPUs
    "VQ-micro": dict(codebook_size=64, ch=16, encoder_ch_mult=[1, 1, 2], decoder_ch_mult=[1, 1, 2], z_channels=16,
                     num_res_blocks=1, norm_groups=8, image_size=16),
}


def vq_config(preset: Optional[str] = None, **overrides) -> VQConfig:
    """A named preset with any field overridden; no preset = the dataclass defaults."""
    return build_config(VQConfig, VQ_PRESETS, preset, **overrides)


def swish(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, groups: int, dropout: float):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in, eps=1e-6)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, c_out, eps=1e-6)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        if c_in != c_out:
            self.nin_shortcut = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    """Single-head spatial self-attention over the h*w positions."""

    def __init__(self, c: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.q, self.k, self.v = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = (m(h).reshape(B, C, H * W).transpose(1, 2) for m in (self.q, self.k, self.v))  # (B, HW, C)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, HW, C), scale 1/sqrt(C)
        return x + self.proj_out(y.transpose(1, 2).reshape(B, C, H, W))


class Downsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # asymmetric padding, as in taming / LlamaGen


class Upsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _level(c_in: int, c_out: int, n_res: int, attn: bool, cfg: VQConfig) -> tuple[nn.Module, int]:
    level = nn.Module()
    level.res = nn.ModuleList()
    level.attn = nn.ModuleList()
    for _ in range(n_res):
        level.res.append(ResnetBlock(c_in, c_out, cfg.norm_groups, cfg.dropout_p))
        c_in = c_out
        if attn:
            level.attn.append(AttnBlock(c_in, cfg.norm_groups))
    return level, c_in


def _mid(c: int, cfg: VQConfig) -> nn.ModuleList:
    g, p = cfg.norm_groups, cfg.dropout_p
    return nn.ModuleList([ResnetBlock(c, c, g, p), AttnBlock(c, g), ResnetBlock(c, c, g, p)])


def _run_level(level: nn.Module, h: Tensor) -> Tensor:
    for i, res in enumerate(level.res):
        h = res(h)
        if len(level.attn):
            h = level.attn[i](h)
    return h


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        mult = cfg.encoder_ch_mult
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        c = cfg.ch
        for i, m in enumerate(mult):
            level, c = _level(c, cfg.ch * m, cfg.num_res_blocks, cfg.level_attn and i == len(mult) - 1, cfg)
            if i != len(mult) - 1:
                level.downsample = Downsample(c)
            self.conv_blocks.append(level)
        self.mid = _mid(c, cfg)
        self.norm_out = nn.GroupNorm(cfg.norm_groups, c, eps=1e-6)
        self.conv_out = nn.Conv2d(c, cfg.z_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = _run_level(level, h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        mult = cfg.decoder_ch_mult
        c = cfg.ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, c, 3, padding=1)
        self.mid = _mid(c, cfg)
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(len(mult))):
            level, c = _level(c, cfg.ch * mult[i], cfg.num_res_blocks + 1, cfg.level_attn and i == len(mult) - 1,
                              cfg)
            if i != 0:
                level.upsample = Upsample(c)
            self.conv_blocks.append(level)
        self.norm_out = nn.GroupNorm(cfg.norm_groups, c, eps=1e-6)
        self.conv_out = nn.Conv2d(c, cfg.in_channels, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for level in self.conv_blocks:
            h = _run_level(level, h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.l2_norm = cfg.codebook_l2_norm
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_embed_dim)
        nn.init.uniform_(self.embedding.weight, -1.0 / cfg.codebook_size, 1.0 / cfg.codebook_size)
        if self.l2_norm:
            self.embedding.weight.data = F.normalize(self.embedding.weight.data, dim=-1)

    def codebook(self) -> Tensor:
        """(K, d) code vectors as used at lookup (normalised when codebook_l2_norm)."""
        w = self.embedding.weight.float()
        return F.normalize(w, dim=-1) if self.l2_norm else w

    def lookup(self, z: Tensor) -> Tensor:
        """z: (B, d, h, w) latents -> (B, h, w) nearest codes, in fp32."""
        with torch.autocast(z.device.type, enabled=False):
            zf = z.float().permute(0, 2, 3, 1)  # (B, h, w, d)
            zf = F.normalize(zf, dim=-1) if self.l2_norm else zf
            e = self.codebook()  # (K, d)
            d = zf.pow(2).sum(-1, keepdim=True) + e.pow(2).sum(-1) - 2 * zf @ e.T  # (B, h, w, K)
            return d.argmin(-1)

    def embed(self, codes: Tensor) -> Tensor:
        """codes (B, h, w) -> (B, d, h, w) code vectors."""
        return self.codebook()[codes].permute(0, 3, 1, 2).contiguous()


class VQModel(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.z_channels, 1)

    def encode_latents(self, images: Tensor) -> Tensor:
        return self.quant_conv(self.encoder(images))  # (B, d, h, w)

    def encode(self, images: Tensor) -> Tensor:
        """images (B, 3, H, W) in [-1, 1] -> codes (B, h, w) long."""
        return self.quantize.lookup(self.encode_latents(images))

    def decode_latents(self, zq: Tensor) -> Tensor:
        return self.decoder(self.post_quant_conv(zq))

    def decode(self, codes: Tensor) -> Tensor:
        """codes (B, h, w), or (B, h*w) for a square grid -> images (B, 3, H, W), roughly in [-1, 1]."""
        if codes.dim() == 2:
            g = int(round(codes.shape[1] ** 0.5))
            if g * g != codes.shape[1]:
                raise ValueError(f"VQModel.decode: {codes.shape[1]} codes do not form a square grid")
            codes = codes.view(codes.shape[0], g, g)
        return self.decode_latents(self.quantize.embed(codes.long()))

    def codebook(self) -> Tensor:
        return self.quantize.codebook()
