"""The image grammar a decode loop applies (Lumina-mGPT's start-of-image, size and end-of-line tokens; LlamaGen's
targets have none), resolved once per call from the model or the caller's `forced` vector.

Forced tokens are never sampled: at a forced position every distribution, the target's and the drafter's, is
one-hot on the forced token, so drafters draft it with certainty, every verifier accepts it (or emits it as the
correction) and the emitted sequence has it exactly in place. The layout itself (which position holds which
token) is lisa.models.gpt.image_grammar's; the model stores it as its `grammar` buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


def force_tokens(dist: Tensor, pos: Tensor, forced: Optional[Tensor], log: bool = False, free_vocab: int = 0) -> Tensor:
    """`forced` (T,) holds a token id at each image position that must be emitted as is, -1 elsewhere. At sequence
    positions `pos` (B, S) that are forced, dist (B, S, V) becomes that token: one-hot probabilities, or (log=True)
    log-probabilities 0 there and -1e4 elsewhere (finite, so draft-tree ranking stays strict). free_vocab > 0 (lm
    targets): at the free positions ids >= free_vocab (the grammar tokens) get probability 0 (log: -1e4), so a
    drafter never proposes one where a code belongs (a relaxed verifier could accept it)."""
    if forced is None:
        return dist
    T = forced.shape[0]
    f = torch.where(pos < T, forced[pos.clamp(0, T - 1)], -1)  # (B, S) forced id, -1 = free
    on = f >= 0  # (B, S)
    if free_vocab:
        grammar_id = torch.arange(dist.shape[-1], device=dist.device) >= free_vocab  # (V,)
        dist = dist.masked_fill(~on[..., None] & grammar_id, -1e4 if log else 0.0)
    hot = torch.zeros_like(dist, dtype=torch.bool).scatter_(-1, f.clamp(min=0)[..., None], True)  # (B, S, V)
    value = torch.where(hot, 0.0, -1e4).to(dist.dtype) if log else hot.to(dist.dtype)
    return torch.where(on[..., None], value, dist)


@dataclass(frozen=True)
class Grammar:
    """forced: (T,) the token each image position must hold, -1 = free (None: no grammar). free_vocab: ids >= it
    are grammar tokens, never drafted at free positions (0 = none)."""
    forced: Optional[Tensor] = None
    free_vocab: int = 0

    @classmethod
    def of(cls, model, forced: Optional[Tensor] = None) -> "Grammar":
        """The caller's `forced` vector, else the model's own grammar (lm targets), with its free vocabulary."""
        forced = forced if forced is not None else getattr(model, "grammar", None)
        return cls(forced, model.config.free_vocab)

    def probs(self, p: Tensor, pos: Tensor) -> Tensor:
        """Target probabilities p (B, S, V) at positions pos (B, S), forced where the grammar says (the target's
        logits already hold its grammar ids at -1e4)."""
        return force_tokens(p, pos, self.forced)

    def log_probs(self, logp: Tensor, pos: Tensor) -> Tensor:
        """Drafter log-probabilities logp (B, S, V) at pos (B, S): forced, and grammar ids barred where free."""
        return force_tokens(logp, pos, self.forced, log=True, free_vocab=self.free_vocab)

    def host(self, T: int) -> list[int]:
        """The forced ids of positions 0..T-1 as Python ints (-1 = free): one host sync, for a loop that then
        overrides sampled tokens without syncing."""
        if self.forced is None:
            return [-1] * T
        return self.forced[:T].tolist() + [-1] * max(0, T - self.forced.shape[0])
