"""Vanilla autoregressive decoding of a LlamaGen-style target, in gpt-fast's shape: prefill, then one-token steps.

CFG runs the conditional and unconditional rows in one batch (conditional first) sharing one KV cache; guidance is
applied to the logits before temperature / top-k / top-p (lisa.sampling). Reproducible through an explicit
torch.Generator. The speculative loop (drafting, verification) builds on the same `prefill` / `decode_one_token`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from lisa.models.gpt import Transformer
from lisa.sampling import SamplingConfig, cfg_logits, sample


def prefix_embeddings(model: Transformer, cond: Tensor, use_cfg: bool) -> Tensor:
    """Condition prefix (B', C, D), B' = 2B with CFG: conditional rows first, then their unconditional twins."""
    if not use_cfg:
        return model.embed_cond(cond)
    B = cond.shape[0]
    drop = torch.cat([torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool)]).to(cond.device)
    return model.embed_cond(torch.cat([cond, cond]), drop)


def prefix_key_mask(model: Transformer, cond_mask: Optional[Tensor], use_cfg: bool) -> Optional[Tensor]:
    """(B', L) bool over cache slots: False at padded caption positions (LlamaGen's emb_masks), True elsewhere."""
    if cond_mask is None:
        return None
    cond_mask = torch.cat([cond_mask, cond_mask]) if use_cfg else cond_mask
    keep = torch.ones(cond_mask.shape[0], model.cache_length, dtype=torch.bool, device=cond_mask.device)
    keep[:, : cond_mask.shape[1]] = cond_mask.bool()
    return keep


def step_mask(model: Transformer, input_pos: Tensor, key_mask: Optional[Tensor]) -> Optional[Tensor]:
    """Causal mask for the slots `input_pos` (S,), restricted by key_mask (B', L); a token always sees itself."""
    if key_mask is None:
        return None
    mask = model.causal[input_pos][None] & key_mask[:, None, :]  # (B', S, L)
    return mask | torch.nn.functional.one_hot(input_pos, model.cache_length).bool()[None]


def guided(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    return cfg_logits(logits, sampling.cfg_scale) if sampling.use_cfg else logits


def prefill(model: Transformer, prefix: Tensor, sampling: SamplingConfig, generator: Optional[torch.Generator],
            key_mask: Optional[Tensor] = None) -> Tensor:
    """Run the condition prefix (B', C, D) through the model and sample the first image token (B,)."""
    input_pos = torch.arange(prefix.shape[1], device=prefix.device)  # (C,)
    logits = model(prefix, input_pos, mask=step_mask(model, input_pos, key_mask)).logits[:, -1]  # (B', V)
    return sample(guided(logits, sampling), sampling, generator)[0]


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, sampling: SamplingConfig,
                     generator: Optional[torch.Generator], key_mask: Optional[Tensor] = None) -> Tensor:
    """token (B,) at slot input_pos (1,) -> next token (B,)."""
    x = model.embed_tokens(torch.cat([token, token]) if sampling.use_cfg else token)[:, None]  # (B', 1, D)
    logits = model(x, input_pos, mask=step_mask(model, input_pos, key_mask)).logits[:, -1]  # (B', V)
    return sample(guided(logits, sampling), sampling, generator)[0]


@torch.no_grad()
def generate(model: Transformer, cond: Tensor, sampling: SamplingConfig, generator: Optional[torch.Generator] = None,
             num_tokens: Optional[int] = None, cond_mask: Optional[Tensor] = None,
             step_fn: Optional[Callable] = None) -> tuple[Tensor, dict]:
    """Sample image tokens (B, T) for `cond` (class ids (B,) or caption features (B, C, Dc)).

    cond_mask: (B, C) bool for t2i caption padding (True = real token). step_fn: a compiled
    decode_one_token, if wanted. Returns (tokens, {"forwards": target forward passes}).
    """
    cfg = model.config
    T = num_tokens or cfg.block_size
    if sampling.use_cfg and not cfg.has_null_cond:
        raise ValueError("cfg_scale != 1 needs a null class: this c2i model was built with class_dropout_prob=0")
    B, C = cond.shape[0], cfg.cls_token_num
    model.setup_caches((2 if sampling.use_cfg else 1) * B, C + T)
    key_mask = prefix_key_mask(model, cond_mask, sampling.use_cfg)
    step = step_fn or decode_one_token

    tokens = torch.empty(B, T, dtype=torch.long, device=cond.device)
    tokens[:, 0] = prefill(model, prefix_embeddings(model, cond, sampling.use_cfg), sampling, generator, key_mask)
    for t in range(1, T):
        input_pos = torch.tensor([C + t - 1], device=cond.device)  # slot of the token being fed
        tokens[:, t] = step(model, tokens[:, t - 1], input_pos, sampling, generator, key_mask)
    return tokens, {"forwards": T}
