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
layer makes it cheap). Labels come from the online target or from a logit cache (lisa.training.cache), with the baseline
soft CE or LISA's locality-informed distillation (lisa.training.distill).

Distributed training is torch's own: under torchrun, DDP (gloo on CPU, nccl on GPU) around the TTT loss, each rank
a share of every step's batch; gradient accumulation; bf16 autocast (`precision`); resumable checkpoints; the
loss / agreement curves as CSV for `dvc plots`.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from lisa.checkpoint import atomic_write
from lisa.config import seed_for
from lisa.decoding.sampling import cfg_logits, logits_to_probs
from lisa.models.drafter import DrafterConfig, Eagle3Drafter
from lisa.models.gpt import Transformer
from lisa.training.loops import load_resume, lr_at, read_resume, save_resume


def init_from_target(drafter: Eagle3Drafter, target: Transformer) -> Eagle3Drafter:
    """EAGLE's start: the target's token embedding (frozen) and its LM head (trained further; a drafter narrower
    than the target starts its head from scratch). A factored head (head_rank r) starts from the target head's
    best rank-r approximation (truncated SVD W ~ U_r S_r V_r^T: output = U_r S_r^1/2, head_in = S_r^1/2 V_r^T)."""
    with torch.no_grad():
        drafter.tok_embeddings.weight.copy_(target.token_embedding_table())
        W = target.output.weight  # (V, H)
        r = drafter.config.head_rank
        if r and drafter.head_in.weight.shape[1] == W.shape[1]:
            U, S, Vh = torch.linalg.svd(W.float(), full_matrices=False)
            root = S[:r].sqrt()
            drafter.output.weight.copy_(U[:, :r] * root)
            drafter.head_in.weight.copy_(root[:, None] * Vh[:r])
        elif not r and drafter.output.weight.shape == W.shape:
            drafter.output.weight.copy_(W)
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
    """The target's distributions as a logit cache holds them (lisa.training.cache): top-K ids / logits, logsumexp."""
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
    """LISA's locality-informed distillation (lisa.training.distill) as a per-position loss for ttt_losses: each
    position's weighted CE + KD, scaled so that its mean is the LID loss of the batch."""
    from lisa.training.distill import lid_loss

    def fn(target: CachedTargets, logits: Tensor) -> Tensor:
        shape = logits.shape[:-1]
        out = lid_loss(logits.reshape(-1, logits.shape[-1]), target.topk_idx.reshape(-1, target.topk_idx.shape[-1]),
                       target.topk_logit.reshape(-1, target.topk_logit.shape[-1]), target.lse.reshape(-1), codebook,
                       cfg, step)
        return out.per_position.reshape(shape)

    return fn


@dataclass
class GuidedTargets:
    """Labels of a batch of CFG pairs (rows 0..B-1 conditional, B..2B-1 their unconditional twins on the same
    tokens): each row's own distribution (top-K, as a logit cache holds it) and the guided one per pair (B, T, V)."""
    halves: CachedTargets  # (2B, T, K)
    guided: Tensor  # (B, T, V) probabilities

    def __getitem__(self, key) -> "GuidedTargets":
        return GuidedTargets(self.halves[key], self.guided[key])

    def argmax(self, dim: int = -1) -> Tensor:
        return self.halves.argmax()


def cached_targets(logits: Tensor, K: int) -> CachedTargets:
    """A target's logits (..., V) as a logit cache holds them: top-K ids and logits, logsumexp."""
    top = logits.float().topk(K, -1)
    return CachedTargets(top.indices, top.values, logits.float().logsumexp(-1))


def guided_probs(logits: Tensor, sampling) -> Tensor:
    """Logits of CFG pairs (2B, ..., V), conditional rows first -> the distribution sampling draws from (B, ..., V):
    guided at sampling.cfg_scale, then its temperature, top-k and top-p (lisa.decoding.sampling)."""
    g = cfg_logits(logits.float(), sampling.cfg_scale)
    return logits_to_probs(g, sampling.temperature, sampling.top_k, sampling.top_p)


def guided_loss_fn(halves_fn: Callable, sampling, weight: float) -> Callable[[GuidedTargets, Tensor], Tensor]:
    """A per-row loss for CFG pairs: (1 - weight) x each row's own loss (halves_fn: cached_soft_ce or LID) + weight x
    the soft CE from the target's guided distribution to the drafter's (its logits guided at sampling.cfg_scale
    and tempered, as sampled drafting draws them; unfiltered, so that every code keeps a gradient); a pair's guided
    term is counted on both of its rows, so the batch mean weighs it once per pair."""

    def fn(target: GuidedTargets, logits: Tensor) -> Tensor:
        own = halves_fn(target.halves, logits)
        g = soft_ce(target.guided, cfg_logits(logits.float(), sampling.cfg_scale) / sampling.temperature)
        return (1 - weight) * own + weight * torch.cat([g, g])

    return fn


@torch.no_grad()
def target_features(target: Transformer, cond: Tensor, tokens: Tensor, drop: Optional[Tensor], taps) -> tuple:
    out = target.teacher_forced(cond, tokens, drop, taps=taps)
    return out.hidden, out.logits.float().softmax(-1)  # taps (B, T, H) each; p (B, T, V): p[:, t] is token t's


def ttt_losses(drafter: Eagle3Drafter, hidden, target_p, tokens: Tensor, steps: int, C: int,
               loss_fn: Callable = soft_ce, incremental: bool = False) -> list[Tensor]:
    """Mean loss of each TTT step (list of `steps` scalars), and per-step top-1 agreement in `drafter.last_acc`.
    target_p: the target's distributions (B, T, V), or CachedTargets (labels from a logit cache, with a loss_fn
    that reads them: cached_soft_ce or lid_loss_fn). Step s runs the drafter over the concatenation of steps
    0..s (all (s + 1) T pairs, the earlier ones recomputed), or with `incremental` over its own T pairs only,
    their queries attending the earlier steps' keys and values (`Eagle3Drafter.forward`'s past): the same
    function and gradients up to float summation order, with a quarter of the pairs at 4 steps (4 T against 10 T)."""
    B, T = tokens.shape
    dev = tokens.device
    mask = ttt_mask(T, steps, dev)
    feats = drafter.fuse(hidden)  # (B, T, H)
    rope = (C + torch.arange(T, device=dev)).repeat(steps)  # pair j embeds token j at grid position j
    toks, hids, losses, accs, past = [tokens], [feats], [], [], []
    for s in range(steps):
        L = (s + 1) * T
        if incremental:
            out = drafter(tokens, hids[-1], mask=mask[s * T : L, :L], rope_pos=rope[s * T : L], past=past)
            logits = out.logits
        else:
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
            h = out.hidden if incremental else out.hidden[:, s * T : (s + 1) * T]
            toks.append(tokens)
            hids.append(torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1))
    drafter.last_acc = accs
    return losses


class TTTLoss(torch.nn.Module):
    """The drafter's weighted TTT loss as one module forward, so that DDP wraps it (its forward registers the
    gradient all-reduce); returns (loss, per-step losses, per-step top-1 agreement)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, C: int, incremental: bool = False):
        super().__init__()
        self.drafter, self.steps, self.decay, self.C, self.incremental = drafter, steps, decay, C, incremental

    def forward(self, hidden, target_p, tokens: Tensor, loss_fn: Callable):
        losses = ttt_losses(self.drafter, hidden, target_p, tokens, self.steps, self.C, loss_fn, self.incremental)
        return sum(self.decay**s * l for s, l in enumerate(losses)), torch.stack(losses), self.drafter.last_acc


def autocast_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """None (fp32) or torch.bfloat16: `bf16` asks for it; `auto` takes it on a GPU that supports it."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if precision not in ("auto", "fp32"):
        raise ValueError(f"train_drafter.precision: {precision!r} is not one of fp32, bf16, auto")
    return None


def train_device() -> torch.device:
    """cuda:LOCAL_RANK where a GPU is visible (torchrun sets LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


# the held-out metrics (heldout_ttt's, then heldout_overlap's), in heldout.csv's order
HELDOUT_KEYS = ("heldout_soft_ce", "heldout_top1_agreement", "heldout_topk_mass", "heldout_overlap",
                "heldout_overlap_cfg")


def curve_columns(ttt_steps: int, overlap: bool = False) -> tuple[list[str], list[str]]:
    """Columns of train.csv and heldout.csv (with `overlap`: heldout_overlap's too)."""
    per = lambda name: [f"{name}_s{s}" for s in range(ttt_steps)]
    held = ["heldout_soft_ce", "heldout_top1", "heldout_topk_mass"]
    held += ["heldout_overlap", "heldout_overlap_cfg"] if overlap else []
    return ["step", "lr", "loss"] + per("loss") + per("top1"), ["step"] + sum((per(h) for h in held), [])


def write_curves(out: Path, log: list, held: list, ttt_steps: int):
    """train.csv and heldout.csv under out (atomic), for `dvc plots`."""
    import pandas as pd

    train_cols, held_cols = curve_columns(ttt_steps, bool(held) and len(held[0]) > 1 + 3 * ttt_steps)
    for name, rows, cols in (("train.csv", log, train_cols), ("heldout.csv", held, held_cols)):
        df = pd.DataFrame(rows, columns=cols).astype({"step": int})
        atomic_write(out / name, lambda tmp: df.to_csv(tmp, index=False, float_format="%.5g"))


def train_drafter(drafter: Eagle3Drafter, target: Transformer, tokens: Tensor, cond: Tensor, test_tokens: Tensor,
                  test_cond: Tensor, cfg, work_dir: str | Path, progress: bool = True,
                  loss_fn: Callable[[Tensor, Tensor], Tensor] = soft_ce, cache=None,
                  lid: Optional[tuple] = None, curves: Optional[Path] = None, target_id: str = "",
                  guided: Optional[tuple] = None, overlap: Optional[object] = None) -> dict:
    """Train on (tokens (N, T), cond); resumable from work_dir/resume.pt (only by a run against the same target:
    `target_id`, e.g. its sha256, is kept in the resume file). Returns held-out TTT metrics.

    cache: a lisa.training.cache.LogitCache of this target over (tokens, cond): batches are drawn from its rows (its
    conditional and unconditional passes), labels are its top-K, and the target runs only up to its highest
    tapped block for the drafter's features. The loss is then the top-K soft CE (baseline), or LISA's LID with
    lid = (codebook (V, D), lisa.training.distill.LIDConfig).

    guided = (sampling, weight), with a cache: CFG-aware distillation. Each micro-batch takes half its drawn cache
    rows' sequences, each as a conditional row and its unconditional twin on the same tokens; the target runs
    whole on them (its own top-K replaces the cache's labels: the same labels on the conditional rows) and the
    loss is `guided_loss_fn` (the rows' own loss, baseline or LID, and the guided soft CE, mixed by weight).
    overlap: a SamplingConfig: heldout.csv and the result also carry `heldout_overlap` (sum_x min(p, q), the
    acceptance of one sampled draft under exact) per TTT step, unguided and guided (`heldout_overlap_cfg`).

    Distributed: under torchrun (an initialised process group) the drafter is wrapped in DDP; every rank draws the
    same global batch of cfg.batch_size rows from (seed, step) and takes its 1/world share, split further into
    cfg.grad_accum micro-batches (gradients synchronised on the last one only). So 2 ranks, or 1 process with
    grad_accum 2, compute the same step as 1 process (up to float summation order; LID's batch quantile and
    normalisation are per micro-batch). Rank 0 writes the resume checkpoint and the curves.

    curves: a directory for `train.csv` (per step: lr, loss, per-TTT-step loss and top-1 agreement, averaged
    over ranks) and `heldout.csv` (every cfg.eval_every steps: held-out agreement and the target mass the
    drafter's top-k covers, the acceptance rate of a node with k drafted children under `exact`)."""
    import torch.distributed as dist

    resume = Path(work_dir) / "resume.pt"
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = train_device()
    amp = autocast_dtype(cfg.precision, device)
    micro = cfg.batch_size // (world * cfg.grad_accum)
    if micro * world * cfg.grad_accum != cfg.batch_size:
        raise ValueError(f"train_drafter.batch_size {cfg.batch_size} is not divisible by {world} ranks x "
                         f"grad_accum {cfg.grad_accum}")
    torch.manual_seed(cfg.seed)
    target.to(device).eval().requires_grad_(False)
    drafter.to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    key = torch.frombuffer(bytearray(target_id.encode() or b"-"), dtype=torch.uint8)
    if rank == 0 and (state := read_resume(resume)) is not None:
        old = state.get("target_id", key)
        if not torch.equal(old, key):
            print(f"{resume}: a checkpoint of a run against another target: starting from step 0")
            resume.unlink()
    if world > 1:
        dist.barrier()
    step, extra = load_resume(resume, drafter, opt, cfg)
    extra.pop("target_id", None)
    elapsed, t0 = float(extra.get("elapsed_s", 0.0)), time.perf_counter()
    train_cols, held_cols = curve_columns(cfg.ttt_steps, overlap is not None)
    log = extra.get("curve", torch.zeros(0, len(train_cols))).tolist()
    held = extra.get("heldout_curve", torch.zeros(0, len(held_cols))).tolist()
    taps, C = tuple(drafter.config.taps), target.config.cls_token_num
    module = TTTLoss(drafter, cfg.ttt_steps, cfg.ttt_decay, C, cfg.ttt == "incremental")
    codebook = lid[0].to(device) if lid is not None else None
    if guided is not None and (cache is None or micro < 2):
        raise ValueError("guided distillation needs a logit cache and micro-batches of at least 2 rows")
    model = torch.nn.parallel.DistributedDataParallel(module) if world > 1 else module
    gen = torch.Generator()
    drafter.train()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc="train drafter",
               disable=not progress or rank != 0)
    first, step_s = step, 0.0  # time in training steps only (no evaluation, no checkpoints): steps/s
    for step in bar:
        t_step = time.perf_counter()
        gen.manual_seed(seed_for(cfg.seed, step))  # batch and drops depend only on (seed, step): resumable
        if cache is None:
            idx = torch.randint(0, len(tokens), (cfg.batch_size,), generator=gen)
            drop = torch.rand(cfg.batch_size, generator=gen) < cfg.cond_drop
        else:
            idx = torch.randint(0, len(cache.seq), (cfg.batch_size,), generator=gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.min_lr, cfg.warmup)
        opt.zero_grad(set_to_none=True)
        stats = torch.zeros(1 + 2 * cfg.ttt_steps)
        for m in range(cfg.grad_accum):
            share = slice((rank * cfg.grad_accum + m) * micro, (rank * cfg.grad_accum + m + 1) * micro)
            rows = idx[share]
            with torch.no_grad(), torch.autocast(device.type, amp, enabled=amp is not None):
                if guided is not None:  # CFG pairs: each drawn sequence conditional, then unconditional
                    half = rows[: len(rows) // 2]
                    t, c = cache.token[half].to(device), cond[cache.seq[half]].to(device)
                    batch_tokens = torch.cat([t, t])
                    drop = torch.arange(2 * len(half), device=device) >= len(half)
                    out = target.teacher_forced(torch.cat([c, c]), batch_tokens, drop, taps=taps)
                    hidden = out.hidden
                    p = GuidedTargets(cached_targets(out.logits, cache.topk_idx.shape[-1]),
                                      guided_probs(out.logits, guided[0]))
                    own = lid_loss_fn(codebook, lid[1], step) if lid is not None else cached_soft_ce
                    step_loss = guided_loss_fn(own, guided[0], guided[1])
                elif cache is None:
                    batch_tokens = tokens[rows].to(device)
                    hidden, p = target_features(target, cond[rows].to(device), batch_tokens, drop[share].to(device),
                                                taps)
                    step_loss = loss_fn
                else:
                    batch_tokens = cache.token[rows].to(device)
                    hidden = target.teacher_forced(cond[cache.seq[rows]].to(device), batch_tokens,
                                                   cache.uncond[rows].to(device), taps=taps, logits=False).hidden
                    p = CachedTargets(cache.topk_idx[rows].to(device), cache.topk_logit[rows].to(device),
                                      cache.lse[rows].to(device))
                    step_loss = lid_loss_fn(codebook, lid[1], step) if lid is not None else cached_soft_ce
            sync = m + 1 == cfg.grad_accum or world == 1
            with (contextlib.nullcontext() if sync else model.no_sync()), \
                    torch.autocast(device.type, amp, enabled=amp is not None):
                loss, per_step, acc = model(hidden, p, batch_tokens, step_loss)
            (loss / cfg.grad_accum).backward()
            stats += torch.cat([loss.detach().float().cpu()[None], per_step.detach().float().cpu(),
                                torch.tensor(acc)]) / cfg.grad_accum
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        if world > 1:  # the curves show the global batch
            dist.all_reduce(stats)
            stats /= world
        step_s += time.perf_counter() - t_step
        log.append([step + 1, opt.param_groups[0]["lr"]] + stats.tolist())
        bar.set_postfix(loss=f"{stats[0]:.3f}", acc0=f"{stats[1 + cfg.ttt_steps]:.2f}")
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and rank == 0:
            drafter.eval()
            h = heldout_ttt(drafter, target, test_tokens[: cfg.eval_sequences], test_cond[: cfg.eval_sequences], cfg)
            if overlap is not None:
                h |= heldout_overlap(drafter, target, test_tokens[: cfg.eval_sequences],
                                     test_cond[: cfg.eval_sequences], cfg, overlap)
            drafter.train()
            held.append([step + 1] + sum((h[k] for k in HELDOUT_KEYS[: (len(held_cols) - 1) // cfg.ttt_steps]), []))
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            if rank == 0:
                save_resume(resume, drafter, opt, cfg, step + 1,
                            {"elapsed_s": torch.tensor(elapsed + time.perf_counter() - t0), "target_id": key,
                             "curve": torch.tensor(log, dtype=torch.float64),
                             "heldout_curve": torch.tensor(held, dtype=torch.float64)})
            if world > 1:
                dist.barrier()
    drafter.eval()
    out = {"steps": cfg.steps, "train_s": elapsed + time.perf_counter() - t0, "world_size": world,
           "steps_per_s_this_run": (cfg.steps - first) / step_s if step_s > 0 else None,
           "grad_accum": cfg.grad_accum, "precision": str(amp or torch.float32).replace("torch.", ""),
           "device": str(device)}
    if rank != 0:
        return out
    if curves is not None:
        write_curves(Path(curves), log, held, cfg.ttt_steps)
    final = heldout_ttt(drafter, target, test_tokens, test_cond, cfg)
    if overlap is not None:
        final |= heldout_overlap(drafter, target, test_tokens, test_cond, cfg, overlap)
    return final | out


@torch.no_grad()
def heldout_ttt(drafter: Eagle3Drafter, target: Transformer, tokens: Tensor, cond: Tensor, cfg) -> dict:
    """Held-out soft CE, top-1 agreement with the target, and the target mass on the drafter's top eval_topk
    tokens (the acceptance rate of a node with eval_topk drafted children under `exact`'s sequential rule), per
    TTT step (conditional rows, no CFG)."""
    taps, C = tuple(drafter.config.taps), target.config.cls_token_num
    device = next(drafter.parameters()).device
    S = cfg.ttt_steps
    tot_l, tot_a, tot_m, n = torch.zeros(S), torch.zeros(S), torch.zeros(S), 0
    for i in range(0, len(tokens), cfg.eval_batch_size):
        t, c = tokens[i : i + cfg.eval_batch_size].to(device), cond[i : i + cfg.eval_batch_size].to(device)
        hidden, p = target_features(target, c, t, None, taps)
        mass = []

        def loss_and_mass(target_p, logits):  # called once per TTT step s, in order
            s = len(mass)
            top = logits[:, s:].topk(cfg.eval_topk, -1).indices
            mass.append(target_p[:, s:].gather(-1, top).sum(-1).mean().item())
            return soft_ce(target_p, logits)

        losses = ttt_losses(drafter, hidden, p, t, S, C, loss_and_mass, cfg.ttt == "incremental")
        tot_l += torch.tensor([l.item() for l in losses]) * len(t)
        tot_a += torch.tensor(drafter.last_acc) * len(t)
        tot_m += torch.tensor(mass) * len(t)
        n += len(t)
    return {"heldout_soft_ce": (tot_l / n).tolist(), "heldout_top1_agreement": (tot_a / n).tolist(),
            "heldout_topk_mass": (tot_m / n).tolist()}


@torch.no_grad()
def heldout_overlap(drafter: Eagle3Drafter, target: Transformer, tokens: Tensor, cond: Tensor, cfg,
                    sampling) -> dict:
    """Held-out sum_x min(p, q) per TTT step: the acceptance of one sampled draft under exact verification, with p
    and q the target's and the drafter's distributions as `sampling` draws them (temperature, top-k, top-p):
    `heldout_overlap` on the conditional rows alone, `heldout_overlap_cfg` guided at sampling.cfg_scale (each
    sequence's conditional row and its unconditional twin, both drafted as decoding drafts them)."""
    taps, C = tuple(drafter.config.taps), target.config.cls_token_num
    device = next(drafter.parameters()).device
    S = cfg.ttt_steps
    probs = lambda lg: logits_to_probs(lg.float(), sampling.temperature, sampling.top_k, sampling.top_p)  # noqa: E731
    tot, tot_g, n = torch.zeros(S), torch.zeros(S), 0
    for i in range(0, len(tokens), cfg.eval_batch_size):
        t, c = tokens[i : i + cfg.eval_batch_size].to(device), cond[i : i + cfg.eval_batch_size].to(device)
        B = len(t)
        drop = torch.arange(2 * B, device=device) >= B
        out = target.teacher_forced(torch.cat([c, c]), torch.cat([t, t]), drop, taps=taps)
        p, p_g = probs(out.logits[:B]), guided_probs(out.logits, sampling)
        step = []

        def overlaps(_, logits):  # called once per TTT step s, in order: logits (2B, T-1, V)
            s = len(step)
            q, q_g = probs(logits[:B]), guided_probs(logits, sampling)
            step.append((torch.minimum(p[:, 1:][:, s:], q[:, s:]).sum(-1).mean().item(),
                         torch.minimum(p_g[:, 1:][:, s:], q_g[:, s:]).sum(-1).mean().item()))
            return logits.new_zeros(logits.shape[:-1])

        ttt_losses(drafter, out.hidden, out.logits, torch.cat([t, t]), S, C, overlaps, cfg.ttt == "incremental")
        tot += torch.tensor([a for a, _ in step]) * B
        tot_g += torch.tensor([b for _, b in step]) * B
        n += B
    return {"heldout_overlap": (tot / n).tolist(), "heldout_overlap_cfg": (tot_g / n).tolist()}


def new_drafter(target: Transformer, **overrides) -> Eagle3Drafter:
    return init_from_target(Eagle3Drafter(DrafterConfig.for_target(target.config, **overrides)), target)
