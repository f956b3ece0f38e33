"""Training loops for the built-in world: the VQ tokenizer (and, next, the target GPT), nanoGPT-style.

One readable loop per model; checkpoints every `checkpoint_every` steps to `<work_dir>/resume.pt` (model,
optimizer, step, RNG states; written atomically, read with weights_only=True), so a killed run resumes where it
stopped and ends with the same weights as an uninterrupted one. Progress bars through tqdm.

Tokenizer: reconstruction loss (MSE + L1) plus the VQ codebook and commitment losses on the L2-normalised
latents (LlamaGen's VQ objective without the perceptual and GAN terms, which need downloaded networks), and
dead-code restarts: every `restart_every` steps the codes used fewer than `restart_min_usage` times since the last
restart are moved onto random encoder outputs of the current batch, so the whole codebook stays in use.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lisa.checkpoint import atomic_write
from lisa.config import TrainTargetParams, TrainTokenizerParams, seed_for
from lisa.models.vq import VQModel


def lr_at(step: int, steps: int, lr: float, min_lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to min_lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def fingerprint(model, cfg) -> torch.Tensor:
    """A run's identity (model config + training params) as bytes: a resume file of another run is ignored."""
    text = json.dumps({"model": asdict(model.config), "train": asdict(cfg)}, sort_keys=True, default=str)
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def save_resume(path: Path, model, opt, cfg, step: int, extra: dict):
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": torch.tensor(step),
             "rng": torch.get_rng_state(), "fingerprint": fingerprint(model, cfg), **extra}
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def read_resume(path: Path) -> dict | None:
    """The state in resume file `path`, or None when there is none. A file that cannot be read (truncated by a kill
    or a full disk, not a checkpoint at all) is set aside as <name>.corrupt with a warning that names it, so the run
    starts over instead of failing on it every time."""
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises RuntimeError, EOFError, UnpicklingError... on a damaged file
        aside = path.with_name(path.name + ".corrupt")
        path.replace(aside)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"warning: {path}: unreadable resume file ({why}); set aside as {aside.name}, starting from step 0")
        return None


def load_resume(path: Path, model, opt, cfg) -> tuple[int, dict]:
    """Restore a run from path if it is a checkpoint of this very run (same fingerprint); else start at 0 (an
    unreadable file is set aside: read_resume)."""
    state = read_resume(path)
    if state is None:
        return 0, {}
    if not torch.equal(state.get("fingerprint", torch.empty(0, dtype=torch.uint8)), fingerprint(model, cfg)):
        print(f"{path}: a checkpoint of a different run (config changed): starting from step 0")
        return 0, {}
    state.pop("fingerprint")
    model.load_state_dict(state.pop("model"))
    opt.load_state_dict(state.pop("optimizer"))
    torch.set_rng_state(state.pop("rng"))
    return int(state.pop("step")), state


def vq_losses(model: VQModel, x: torch.Tensor, cfg: TrainTokenizerParams) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """x: (B, 3, H, W) in [-1, 1] -> (loss, logs, codes (B, h, w))."""
    z = F.normalize(model.encode_latents(x), dim=1)  # (B, d, h, w) on the sphere
    codes = model.quantize.lookup(z)  # (B, h, w), fp32
    zq = model.quantize.embed(codes)  # (B, d, h, w) normalised code vectors
    codebook_loss = F.mse_loss(zq, z.detach())
    commit_loss = F.mse_loss(z, zq.detach())
    zq = z + (zq - z).detach()  # straight-through
    recon = model.decode_latents(zq)
    rec_loss = F.mse_loss(recon, x) + cfg.l1_weight * F.l1_loss(recon, x)
    loss = rec_loss + codebook_loss + cfg.commit_beta * commit_loss
    return loss, {"rec": rec_loss.item(), "codebook": codebook_loss.item()}, codes


@torch.no_grad()
def restart_dead_codes(model: VQModel, usage: torch.Tensor, z: torch.Tensor, min_usage: int, gen) -> int:
    """Move codes with usage < min_usage onto random latents z (N, d) of the current batch. Returns how many."""
    dead = (usage < min_usage).nonzero().squeeze(1)
    if len(dead) == 0:
        return 0
    pick = torch.randint(0, z.shape[0], (len(dead),), generator=gen)
    new = F.normalize(z[pick] + 0.01 * torch.randn(len(dead), z.shape[1], generator=gen), dim=1)
    model.quantize.embedding.weight.data[dead] = new
    return len(dead)


@torch.no_grad()
def evaluate_vq(model: VQModel, images_u8: torch.Tensor, batch_size: int) -> dict:
    """Held-out PSNR (on [0, 1] pixels) and codebook usage."""
    model.eval()
    mse_sum, n, used = 0.0, 0, torch.zeros(model.config.codebook_size, dtype=torch.bool)
    for batch in images_u8.split(batch_size):
        x = batch.float() / 127.5 - 1
        codes = model.encode(x)
        used[codes.flatten()] = True
        recon = model.decode(codes).clamp(-1, 1)
        mse_sum += ((recon - x) / 2).pow(2).mean(dim=(1, 2, 3)).sum().item()
        n += len(x)
    model.train()
    mse = mse_sum / n
    return {"psnr_db": 10 * math.log10(1.0 / max(mse, 1e-12)), "codebook_usage": used.float().mean().item(),
            "codes_used": int(used.sum())}


def train_vq(model: VQModel, train_u8: torch.Tensor, test_u8: torch.Tensor, cfg: TrainTokenizerParams,
             work_dir: str | Path, progress: bool = True) -> dict:
    """Train `model` on uint8 images (N, 3, H, W); resumes from work_dir/resume.pt. Returns held-out metrics."""
    work_dir = Path(work_dir)
    resume = work_dir / "resume.pt"
    torch.manual_seed(cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    step, extra = load_resume(resume, model, opt, cfg)
    usage = extra.get("usage", torch.zeros(model.config.codebook_size))
    elapsed, t0 = float(extra.get("elapsed_s", 0.0)), time.perf_counter()  # training time over all resumptions
    gen = torch.Generator().manual_seed(cfg.seed + step)  # data order depends only on (seed, step): resumable
    model.train()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc="train tokenizer", disable=not progress)
    restarts = 0
    for step in bar:
        gen.manual_seed(seed_for(cfg.seed, step))
        idx = torch.randint(0, len(train_u8), (cfg.batch_size,), generator=gen)
        x = train_u8[idx].float() / 127.5 - 1
        x = torch.where(torch.rand(len(x), 1, 1, 1, generator=gen) < 0.5, x, x.flip(-1))  # horizontal flips
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.min_lr, cfg.warmup)
        loss, logs, codes = vq_losses(model, x, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        usage += torch.bincount(codes.flatten(), minlength=len(usage)).float()
        if (step + 1) % cfg.restart_every == 0 and step + 1 < cfg.steps * 0.9:
            with torch.no_grad():
                z = F.normalize(model.encode_latents(x), dim=1).permute(0, 2, 3, 1).reshape(-1, model.config.codebook_embed_dim)
            restarts = restart_dead_codes(model, usage, z, cfg.restart_min_usage, gen)
            usage.zero_()
        bar.set_postfix(rec=f"{logs['rec']:.4f}", dead_restarted=restarts)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_resume(resume, model, opt, cfg, step + 1,
                        {"usage": usage, "elapsed_s": torch.tensor(elapsed + time.perf_counter() - t0)})
    model.eval()
    train_s = elapsed + time.perf_counter() - t0
    return evaluate_vq(model, test_u8, cfg.eval_batch_size) | {"train_s": train_s}


# ---------------------------------------------------------------------------------------------------------------
# Target GPT


def gpt_batch_loss(model, tokens: torch.Tensor, cond: torch.Tensor, drop: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of image tokens (B, T) given cond."""
    logits = model.teacher_forced(cond, tokens, drop).logits  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@torch.no_grad()
def heldout_nll(model, tokens: torch.Tensor, cond: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(tokens), batch_size):
        t, c = tokens[i : i + batch_size], cond[i : i + batch_size]
        total += gpt_batch_loss(model, t, c, None).item() * len(t)
        n += len(t)
    return total / n


def train_gpt(model, tokens: torch.Tensor, cond: torch.Tensor, test_tokens: torch.Tensor, test_cond: torch.Tensor,
              cfg: TrainTargetParams, work_dir: str | Path, progress: bool = True) -> dict:
    """Train the target on (tokens (N, T) long, cond (N,) class ids or (N, C, Dc) caption features);
    resumes from work_dir/resume.pt. Returns the held-out NLL per token."""
    work_dir = Path(work_dir)
    resume = work_dir / "resume.pt"
    torch.manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    step, extra = load_resume(resume, model, opt, cfg)
    elapsed, t0 = float(extra.get("elapsed_s", 0.0)), time.perf_counter()  # training time over all resumptions
    gen = torch.Generator()
    model.train()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc="train target", disable=not progress)
    for step in bar:
        gen.manual_seed(seed_for(cfg.seed, step))  # batch and drops depend only on (seed, step): resumable
        idx = torch.randint(0, len(tokens), (cfg.batch_size,), generator=gen)
        drop = torch.rand(cfg.batch_size, generator=gen) < cfg.cond_drop
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.min_lr, cfg.warmup)
        loss = gpt_batch_loss(model, tokens[idx], cond[idx], drop)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        bar.set_postfix(nll=f"{loss.item():.3f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_resume(resume, model, opt, cfg, step + 1, {"elapsed_s": torch.tensor(elapsed + time.perf_counter() - t0)})
    train_s = elapsed + time.perf_counter() - t0
    return {"heldout_nll_per_token": heldout_nll(model, test_tokens, test_cond, cfg.eval_batch_size),
            "steps": cfg.steps, "train_s": train_s}
