"""What every decode loop of lisa.decoding.generate shares: the compiled forwards, the condition prefix and its key
mask, the target's distributions under CFG and the sampling filters, the preamble (`start`) and `prefill`, the
statistics (`DecodeStats`, `Clock`), the speculative loops' commit (`Emitted`), the tree forward over [root, nodes]
and the cache moves of the accepted nodes."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, TypedDict

import torch
from torch import Tensor

from lisa.decoding.grammar import Grammar
from lisa.decoding.sampling import SamplingConfig, cfg_logits, logits_to_probs, sample_from
from lisa.decoding.tree import Shape
from lisa.models.gpt import GPTOutput, Transformer


def compiled(model: Optional[torch.nn.Module]) -> Optional[torch.nn.Module]:
    """`model` with its forward under torch.compile (inductor, dynamic=False: one graph per input shape, as gpt-fast
    compiles its decode step), made once per model and reused by every decoder of it. Everything but the forward
    call (caches, embeddings, config) is the model's own: torch's OptimizedModule delegates attribute access. The
    decode loops call each forward with a handful of shapes (prefill, one step or one tree / window, the drafter's
    level widths and one commit width), so the recompile limit is raised to hold them all."""
    if model is None:
        return None
    if "_lisa_compiled" not in model.__dict__:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # kept outside the module's registry (object.__setattr__): not a submodule, not in the state dict
        object.__setattr__(model, "_lisa_compiled", torch.compile(model, dynamic=False))
    return model.__dict__["_lisa_compiled"]


def prefix_embeddings(model: Transformer, cond: Tensor, use_cfg: bool) -> Tensor:
    """Condition prefix (B', C, D), B' = 2B with CFG: conditional rows first, then their unconditional twins."""
    if not use_cfg:
        return model.embed_cond(cond)
    B = cond.shape[0]
    drop = torch.cat([torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool)]).to(cond.device)
    return model.embed_cond(torch.cat([cond, cond]), drop)


def prefix_key_mask(model: Transformer, cond_mask: Optional[Tensor], use_cfg: bool,
                    cond: Optional[Tensor] = None) -> Optional[Tensor]:
    """(B', L) bool over cache slots: False at padded caption positions (LlamaGen's emb_masks), True elsewhere.
    lm targets (Lumina-mGPT): the unconditional CFG rows mask their whole prompt, so that they start at the
    start-of-image token as in Lumina-mGPT's own guidance."""
    lm_uncond = model.config.model_type == "lm" and use_cfg
    if cond_mask is None and not lm_uncond:
        return None
    if cond_mask is None:
        cond_mask = torch.ones(cond.shape[0], model.config.cls_token_num, dtype=torch.bool, device=cond.device)
    uncond = torch.zeros_like(cond_mask.bool()) if lm_uncond else cond_mask
    cond_mask = torch.cat([cond_mask, uncond]) if use_cfg else cond_mask
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


def target_probs(logits: Tensor, sampling: SamplingConfig) -> tuple[Tensor, Tensor]:
    """Target logits (B', ..., V) -> (guided logits, the distribution p vanilla sampling draws from), (B, ..., V)."""
    g = guided(logits, sampling)
    return g, logits_to_probs(g, sampling.temperature, sampling.top_k, sampling.top_p)


def target_dists(logits: Tensor, sampling: SamplingConfig, grammar: Grammar, pos: Tensor) -> tuple[Tensor, Tensor]:
    """A tree or window forward's logits (B', S, V) -> (guided logits, p with the grammar applied at the sequence
    positions pos (B, S)), each (B, S, V): what verification reads."""
    g, p = target_probs(logits, sampling)
    return g, grammar.probs(p, pos)


def draw(p: Tensor, sampling: SamplingConfig, generator: Optional[torch.Generator]) -> Tensor:
    """One token per row of p (..., V): the argmax when sampling is greedy, else a draw (no host sync)."""
    return p.argmax(-1) if sampling.greedy else sample_from(p, generator)


class DecodeStats(TypedDict, total=False):
    """What every decode loop returns beside the tokens."""
    forwards: int  # target forward passes, the prefill included
    rounds: int  # draft-verify rounds (speculative loops)
    tau: float  # tokens emitted per target forward after the prefill, bonus token included
    accept_lengths: list[list[int]]  # (B, rounds): tokens each row kept per round, 0 once it was finished
    tv: Tensor  # (B, T) TV between each token's law and the target's p there (measure=True; 0 at the prefill token)


def pooled_tau(stats: Iterable[DecodeStats]) -> float:
    """tau over several decodes: their rows' live rounds pooled (the mean accept length, bonus token included), as
    the benchmarks report it; DecodeStats.tau is one decode's."""
    lengths = [a for s in stats for row in s["accept_lengths"] for a in row if a > 0]
    return sum(lengths) / len(lengths)


class Clock:
    """Wall time of each part of a decode loop's rounds (lisa.bench.speed's per-round breakdown): the loop calls
    `tick(part)` after each part, which charges the time since the previous tick to it (CUDA-synchronised). A loop
    given no clock ticks a no-op: the timed passes pay nothing for the breakdown."""

    PARTS = ("prefill", "draft", "target", "verify", "move", "commit", "rest")

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device(device or "cpu")
        self.seconds = {part: 0.0 for part in self.PARTS}
        self.rounds = 0
        self._t = time.perf_counter()

    def tick(self, part: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[part] += now - self._t
        self._t = now
        self.rounds += part == "rest"


def _no_tick(part: str) -> None:
    return None


@dataclass
class Batch:
    """What a decode call resolves once, before its loop: the condition (B, ...), the key mask over cache slots
    (GB, L) (None: all visible), CFG (GB = 2B rows per forward: conditional rows first), the grammar, and the sizes:
    T image tokens after a prefix of C slots; max_pos, the target's last RoPE position."""
    cond: Tensor
    key_mask: Optional[Tensor]
    grammar: Grammar
    use_cfg: bool
    T: int
    C: int
    max_pos: int

    @property
    def B(self) -> int:
        return self.cond.shape[0]

    @property
    def GB(self) -> int:
        return (2 if self.use_cfg else 1) * self.B

    def dup(self, x: Tensor) -> Tensor:
        """(B, ...) -> (GB, ...): the unconditional rows repeat the conditional ones."""
        return _dup(x, self.use_cfg)


def start(model: Transformer, cond: Tensor, sampling: SamplingConfig, num_tokens: Optional[int],
          cond_mask: Optional[Tensor], forced: Optional[Tensor], extra_slots: int = 0) -> Batch:
    """The preamble every loop shares: unpack a packed condition (it carries its mask), check CFG, resolve the
    grammar, size the KV cache (GB rows, C + T + extra_slots slots) and mask the padded prefix."""
    cond, cond_mask = model.split_cond(cond, cond_mask)
    cfg = model.config
    if sampling.use_cfg and not cfg.has_null_cond:
        raise ValueError("cfg_scale != 1 needs a null class: this c2i model was built with class_dropout_prob=0")
    b = Batch(cond, None, Grammar.of(model, forced), sampling.use_cfg, num_tokens or cfg.block_size,
              cfg.cls_token_num, model.rope.shape[0] - 1)
    model.setup_caches(b.GB, b.C + b.T + extra_slots)
    b.key_mask = prefix_key_mask(model, cond_mask, b.use_cfg, cond)
    return b


def prefill(model: Transformer, b: Batch, sampling: SamplingConfig, generator: Optional[torch.Generator],
            taps=()) -> tuple[Tensor, GPTOutput]:
    """Run the condition prefix through the model: the first image token (B,) (the grammar's where forced) and
    the forward's output (its hidden taps feed a drafter)."""
    prefix = prefix_embeddings(model, b.cond, b.use_cfg)  # (GB, C, D)
    pos = torch.arange(b.C, device=prefix.device)  # (C,)
    out = model(prefix, pos, mask=step_mask(model, pos, b.key_mask), taps=taps)
    _, p0 = target_probs(out.logits[:, -1], sampling)  # (B, V)
    p0 = b.grammar.probs(p0[:, None], torch.zeros(b.B, 1, dtype=torch.long, device=p0.device))[:, 0]
    return draw(p0, sampling, generator), out

def _dup(x: Tensor, use_cfg: bool) -> Tensor:
    return torch.cat([x, x]) if use_cfg else x


@dataclass
class Emitted:
    """The image tokens of a batch as a speculative loop's rounds commit them (each row accepts its own length),
    and the statistics of those rounds."""
    tokens: Tensor  # (B, T + 1) long; column T is a junk slot that takes the writes past a row's end
    n: Tensor  # (B,) tokens emitted per row
    tv: Optional[Tensor]  # (B, T + 1) measured TV of each emitted token (measure=True), 0 at the prefill token
    accepted: list = field(default_factory=list)  # per round: (B,) tokens each row kept, 0 once finished
    forwards: int = 1  # target forwards: the prefill

    @classmethod
    def first(cls, token: Tensor, T: int, measure: bool) -> "Emitted":
        """Start from the prefill's token (B,)."""
        B, dev = token.shape[0], token.device
        tokens = torch.zeros(B, T + 1, dtype=torch.long, device=dev)
        tokens[:, 0] = token
        tv = torch.zeros(B, T + 1, device=dev) if measure else None
        return cls(tokens, torch.ones(B, dtype=torch.long, device=dev), tv)

    @property
    def T(self) -> int:
        return self.tokens.shape[1] - 1

    def live(self) -> Tensor:
        return self.n < self.T  # (B,)

    def unfinished(self) -> bool:
        return bool(self.live().any())  # host sync, once per round: the loop's exit test

    def last(self) -> Tensor:
        """(B,) each row's last emitted token (the next round's root)."""
        return self.tokens.gather(1, (self.n - 1)[:, None]).squeeze(1)

    def commit(self, new: Tensor, m: Tensor, live: Tensor, tv: Optional[Tensor] = None) -> None:
        """Emit new[:, :m + 1] (new: (B, K)) at positions n .. n + m of the live rows, as far as T, with the TV
        measured at them (tv: (B, >= m + 1)); record what each row kept and advance n."""
        self.tokens.scatter_(1, self._slots(m, live, new.shape[1]), new)
        if self.tv is not None:
            self.tv.scatter_(1, self._slots(m, live, tv.shape[1]), tv)
        self.accepted.append(torch.where(live, torch.minimum(m + 1, self.T - self.n), torch.zeros_like(m)))
        self.n = torch.where(live, (self.n + m + 1).clamp(max=self.T), self.n)

    def _slots(self, m: Tensor, live: Tensor, K: int) -> Tensor:
        """(B, K) the position of each row's i-th new token, or the junk column T where it is not written."""
        i = torch.arange(K, device=m.device)[None]  # (1, K)
        pos = self.n[:, None] + i  # (B, K)
        return torch.where(live[:, None] & (i <= m[:, None]) & (pos < self.T), pos, self.T)

    def result(self) -> tuple[Tensor, DecodeStats]:
        """(tokens (B, T), stats); the host syncs here happen once per call."""
        acc = torch.stack(self.accepted) if self.accepted else torch.zeros(0, self.n.shape[0], dtype=torch.long)
        kept = acc[acc > 0]  # (rounds, B) -> the lengths of the rounds rows were live in
        stats = DecodeStats(forwards=self.forwards, rounds=len(self.accepted),
                            tau=float(kept.float().mean()) if kept.numel() else 0.0, accept_lengths=acc.T.tolist())
        if self.tv is not None:
            stats["tv"] = self.tv[:, : self.T].contiguous()
        return self.tokens[:, : self.T].contiguous(), stats


def emitted_tokens(drafted: Tensor, m: Tensor, next_token: Tensor) -> Tensor:
    """(B, K + 1): the drafted tokens (B, K) of a round, the first m (B,) of them accepted, then the correction /
    bonus token next_token (B,) at column m (columns past m are never emitted)."""
    return torch.cat([drafted, next_token[:, None]], 1).scatter(1, m[:, None], next_token[:, None])

def move_accepted(target: Transformer, path: Tensor, m: Tensor, base: Tensor, use_cfg: bool) -> None:
    """Move the target's cache entries of the accepted nodes (path (B, M), the first m (B,) valid) from their tree
    slots to their sequence slots right after the root at base (B,); padding moves the junk slot onto itself."""
    M = path.shape[1]
    if not M:
        return
    junk = target.cache_length - 1
    valid = torch.arange(M, device=path.device)[None] < m[:, None]  # (B, M)
    src = torch.where(valid, base[:, None] + 1 + path.clamp(min=0), junk)  # (B, M)
    dst = torch.where(valid, base[:, None] + 1 + torch.arange(M, device=path.device), junk)  # (B, M)
    src, dst = _dup(src, use_cfg), _dup(dst, use_cfg)
    k0 = target.layers[0].attention.kv_cache.k  # (GB', H_kv, L, hd), the same shape in every layer
    GB, (_, H, _, hd) = src.shape[0], k0.shape
    src_i, dst_i = (t[:, None, :, None].expand(GB, H, M, hd) for t in (src, dst))  # (GB, H_kv, M, hd)
    for layer in target.layers:  # KVCache.move, with the index expanded once for every layer
        cache = layer.attention.kv_cache
        for buf in (cache.k, cache.v):
            buf[:GB].scatter_(2, dst_i, buf[:GB].gather(2, src_i))

def tree_forward(target: Transformer, root: Tensor, tree, base: Tensor, key_mask: Optional[Tensor], use_cfg: bool,
                 taps=()):
    """One target forward over [root, tree nodes] per row: the root at slot base (B,), node i at base + 1 + i;
    each query sees the committed slots < base (and the caption key mask), the root, and its ancestors."""
    B, N = tree.tokens.shape
    dev = root.device
    Lt = target.cache_length
    slots = base[:, None] + torch.arange(N + 1, device=dev)  # (B, S)
    mask = (torch.arange(Lt, device=dev)[None, None, :] < base[:, None, None]).expand(B, N + 1, Lt).clone()
    window, depth = (_window(tree.shape) if tree.shape is not None else
                     _window_of(tree.ancestor_mask(), tree.depth))  # (B|1, N + 1, N + 1) over slots base .. base + N
    mask.scatter_(2, slots[:, None, :].expand(B, N + 1, N + 1), window.expand(B, N + 1, N + 1))
    rope = (base[:, None] + depth).clamp(max=target.rope.shape[0] - 1)
    x = target.embed_tokens(_dup(torch.cat([root[:, None], tree.tokens], 1), use_cfg))
    mask = _dup(mask, use_cfg)
    if key_mask is not None:  # per row: the unconditional rows of an lm target mask their whole prompt
        mask &= key_mask[:, None, :]
    return target(x, _dup(slots, use_cfg), mask=mask, rope_pos=_dup(rope, use_cfg), taps=taps)


def _window_of(ancestors: Tensor, depth: Tensor) -> tuple[Tensor, Tensor]:
    """A tree forward's attention window over [root, nodes] from the nodes' ancestor mask (B, N, N) and depths
    (B, N): everyone sees the root, a node its ancestors and itself; and the depths with the root's 0 first."""
    B, N = depth.shape
    window = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=depth.device)
    window[:, :, 0] = True
    window[:, 1:, 1:] = ancestors
    return window, torch.cat([torch.zeros_like(depth[:, :1]), depth], 1)


@functools.lru_cache(maxsize=64)
def _window(shape: Shape) -> tuple[Tensor, Tensor]:
    """`_window_of` a fixed shape, built once: (1, N + 1, N + 1), (1, N + 1)."""
    return _window_of(shape.ancestors[None], shape.depth[None])
