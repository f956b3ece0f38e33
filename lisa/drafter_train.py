"""Baseline EAGLE-3 drafter training (single process), with the training-time test (TTT).

Data: a world's (condition, VQ codes) pairs. The frozen target runs teacher-forced, online (no dumped features),
with 10% of rows unconditional (the null class / unconditional caption) so the drafter can draft for both halves
of a CFG batch; it gives the tapped hidden states (the drafter's input) and its next-token distributions (the
labels).

TTT: step 0 feeds pair j = (fused target features at j, token j) and predicts token j + 1. Step s >= 1 feeds pair
j = (the drafter's own output hidden of pair j - 1 at step s - 1, token j): the s-th token of a chain drafted from
the committed pair j - s. Its attention sees the committed pairs <= j - s (step 0) and its own chain: step s' at
pair j - (s - s') for 1 <= s' <= s. This is exactly what drafting does at decode time. The loss is
sum_s decay^s * soft cross-entropy(target distribution of token j + 1, drafter's), over the pairs j >= s.
Every step is one forward over the concatenation of all steps so far with that mask (simple; the single drafter
layer makes it cheap). The LISA loss (locality-informed distillation) plugs in later through `loss_fn`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from lisa.models.drafter import DrafterConfig, Eagle3Drafter
from lisa.models.gpt import Transformer
from lisa.train import load_resume, lr_at, save_resume


def init_from_target(drafter: Eagle3Drafter, target: Transformer) -> Eagle3Drafter:
    """EAGLE's start: the target's token embedding (frozen) and its LM head (trained further)."""
    with torch.no_grad():
        drafter.tok_embeddings.weight.copy_(target.tok_embeddings.weight)
        drafter.output.weight.copy_(target.output.weight)
    drafter.tok_embeddings.weight.requires_grad_(False)
    return drafter


def ttt_mask(T: int, steps: int, device=None) -> Tensor:
    """(S*T, S*T) bool over the concatenated steps: query (s, j) may attend key (s', j')."""
    s = torch.arange(steps, device=device).repeat_interleave(T)
    j = torch.arange(T, device=device).repeat(steps)
    qs, qj, ks, kj = s[:, None], j[:, None], s[None, :], j[None, :]
    committed = (ks == 0) & (kj <= qj - qs)
    own_chain = (ks >= 1) & (ks <= qs) & (kj == qj - (qs - ks))
    return committed | own_chain | ((qs == ks) & (qj == kj))  # a pair always sees itself (no empty rows)


def soft_ce(target_probs: Tensor, logits: Tensor) -> Tensor:
    """Per position -sum p log q: (..., V) x (..., V) -> (...)."""
    return -(target_probs * logits.log_softmax(-1)).sum(-1)


@dataclass
class CachedTargets:
    """The target's distributions as a logit cache holds them (lisa.cache): top-K ids / logits, logsumexp."""
    topk_idx: Tensor  # (B, T, K)
    topk_logit: Tensor  # (B, T, K)
    lse: Tensor  # (B, T)

    def __getitem__(self, key) -> "CachedTargets":
        return CachedTargets(self.topk_idx[key], self.topk_logit[key], self.lse[key])

    def argmax(self, dim: int = -1) -> Tensor:
        return self.topk_idx[..., 0]

    def probs(self) -> Tensor:
        return (self.topk_logit - self.lse[..., None]).exp()


def cached_soft_ce(target: CachedTargets, logits: Tensor) -> Tensor:
    """The baseline loss on cached labels: soft CE over the target's top-K (the tail is not cached)."""
    return -(target.probs() * logits.log_softmax(-1).gather(-1, target.topk_idx)).sum(-1)


def lid_loss_fn(codebook: Tensor, cfg, step: int) -> Callable[[CachedTargets, Tensor], Tensor]:
    """LISA's locality-informed distillation (lisa.distill) as a per-position loss for ttt_losses: each
    position's weighted CE + KD, scaled so that its mean is the LID loss of the batch."""
    from lisa.distill import lid_loss

    def fn(target: CachedTargets, logits: Tensor) -> Tensor:
        shape = logits.shape[:-1]
        out = lid_loss(logits.reshape(-1, logits.shape[-1]), target.topk_idx.reshape(-1, target.topk_idx.shape[-1]),
                       target.topk_logit.reshape(-1, target.topk_logit.shape[-1]), target.lse.reshape(-1), codebook,
                       cfg, step)
        return out.per_position.reshape(shape)

    return fn


@torch.no_grad()
def target_features(target: Transformer, cond: Tensor, tokens: Tensor, drop: Optional[Tensor], taps) -> tuple:
    out = target.teacher_forced(cond, tokens, drop, taps=taps)
    return out.hidden, out.logits.softmax(-1)  # taps (B, T, H) each; p (B, T, V): p[:, t] is token t's


def ttt_losses(drafter: Eagle3Drafter, hidden, target_p, tokens: Tensor, steps: int, C: int,
               loss_fn: Callable = soft_ce) -> list[Tensor]:
    """Mean loss of each TTT step (list of `steps` scalars), and per-step top-1 agreement in `drafter.last_acc`.
    target_p: the target's distributions (B, T, V), or CachedTargets (labels from a logit cache, with a loss_fn
    that reads them: cached_soft_ce or lid_loss_fn)."""
    B, T = tokens.shape
    dev = tokens.device
    mask = ttt_mask(T, steps, dev)
    feats = drafter.fuse(hidden)  # (B, T, H)
    rope = (C + torch.arange(T, device=dev)).repeat(steps)  # pair j embeds token j at grid position j
    toks, hids, losses, accs = [tokens], [feats], [], []
    for s in range(steps):
        L = (s + 1) * T
        out = drafter(torch.cat(toks, 1), torch.cat(hids, 1), mask=mask[:L, :L], rope_pos=rope[:L])
        logits = out.logits[:, s * T : (s + 1) * T]  # step s: pair j predicts token j + 1
        valid = torch.arange(T, device=dev) >= s  # the chain starts at committed pair j - s >= 0
        valid[-1] = False  # pair T - 1 has no next token
        p = target_p[:, 1:]  # token j + 1's distribution, for j = 0..T-2
        per = loss_fn(p, logits[:, :-1])  # (B, T-1)
        w = valid[:-1].float()
        losses.append((per * w).sum() / (w.sum() * B).clamp(min=1))
        accs.append(((logits[:, :-1].argmax(-1) == p.argmax(-1)).float() * w).sum().item() / max(w.sum().item() * B, 1))
        if s + 1 < steps:  # next step: pair j reads this step's output hidden of pair j - 1
            h = out.hidden[:, s * T : (s + 1) * T]
            toks.append(tokens)
            hids.append(torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1))
    drafter.last_acc = accs
    return losses


def train_drafter(drafter: Eagle3Drafter, target: Transformer, tokens: Tensor, cond: Tensor, test_tokens: Tensor,
                  test_cond: Tensor, cfg, work_dir: str | Path, progress: bool = True,
                  loss_fn: Callable[[Tensor, Tensor], Tensor] = soft_ce, cache=None,
                  lid: Optional[tuple] = None) -> dict:
    """Train on (tokens (N, T), cond); resumable from work_dir/resume.pt. Returns held-out TTT metrics.

    cache: a lisa.cache.LogitCache of this target over (tokens, cond): batches are drawn from its rows (its
    conditional and unconditional passes), labels are its top-K, and the target runs only up to its highest
    tapped block for the drafter's features. The loss is then the top-K soft CE (baseline), or LISA's LID with
    lid = (codebook (V, D), lisa.distill.LIDConfig)."""
    resume = Path(work_dir) / "resume.pt"
    torch.manual_seed(cfg.seed)
    target.eval().requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, extra = load_resume(resume, drafter, opt, cfg)
    elapsed, t0 = float(extra.get("elapsed_s", 0.0)), time.perf_counter()
    taps, C = tuple(drafter.config.taps), target.config.cls_token_num
    gen = torch.Generator()
    drafter.train()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc="train drafter", disable=not progress)
    for step in bar:
        gen.manual_seed(cfg.seed * 1_000_003 + step)  # batch and drops depend only on (seed, step): resumable
        if cache is None:
            idx = torch.randint(0, len(tokens), (cfg.batch_size,), generator=gen)
            drop = torch.rand(cfg.batch_size, generator=gen) < cfg.cond_drop
            batch_tokens = tokens[idx]
            hidden, p = target_features(target, cond[idx], batch_tokens, drop, taps)
            step_loss = loss_fn
        else:
            rows = torch.randint(0, len(cache.seq), (cfg.batch_size,), generator=gen)
            batch_tokens = cache.token[rows]
            with torch.no_grad():
                hidden = target.teacher_forced(cond[cache.seq[rows]], batch_tokens, cache.uncond[rows], taps=taps,
                                               logits=False).hidden
            p = CachedTargets(cache.topk_idx[rows], cache.topk_logit[rows], cache.lse[rows])
            step_loss = lid_loss_fn(lid[0], lid[1], step) if lid is not None else cached_soft_ce
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.min_lr, cfg.warmup)
        losses = ttt_losses(drafter, hidden, p, batch_tokens, cfg.ttt_steps, C, step_loss)
        loss = sum(cfg.ttt_decay**s * l for s, l in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{drafter.last_acc[0]:.2f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_resume(resume, drafter, opt, cfg, step + 1,
                        {"elapsed_s": torch.tensor(elapsed + time.perf_counter() - t0)})
    drafter.eval()
    return heldout_ttt(drafter, target, test_tokens, test_cond, cfg) | {
        "steps": cfg.steps, "train_s": elapsed + time.perf_counter() - t0}


@torch.no_grad()
def heldout_ttt(drafter: Eagle3Drafter, target: Transformer, tokens: Tensor, cond: Tensor, cfg) -> dict:
    """Held-out soft CE and top-1 agreement with the target, per TTT step (conditional rows)."""
    taps, C = tuple(drafter.config.taps), target.config.cls_token_num
    tot_l, tot_a, n = torch.zeros(cfg.ttt_steps), torch.zeros(cfg.ttt_steps), 0
    for i in range(0, len(tokens), cfg.eval_batch_size):
        t, c = tokens[i : i + cfg.eval_batch_size], cond[i : i + cfg.eval_batch_size]
        hidden, p = target_features(target, c, t, None, taps)
        losses = ttt_losses(drafter, hidden, p, t, cfg.ttt_steps, C)
        tot_l += torch.tensor([l.item() for l in losses]) * len(t)
        tot_a += torch.tensor(drafter.last_acc) * len(t)
        n += len(t)
    return {"heldout_soft_ce": (tot_l / n).tolist(), "heldout_top1_agreement": (tot_a / n).tolist()}


def new_drafter(target: Transformer, **overrides) -> Eagle3Drafter:
    return init_from_target(Eagle3Drafter(DrafterConfig.for_target(target.config, **overrides)), target)
