"""Locality-informed distillation (LID): LISA's drafter loss (../shared/docs/LISA.md, training side).

Per position (b, t), with the target's cached top-K (lisa.training.cache: ids, logits, logsumexp) and the drafter's logits:

1. Locality-aware selection. The target's top-Kc tokens, weighted by their probabilities (renormalised over the
   Kc), give the centroid c of their L2-normalised codebook embeddings (c normalised too). The neighbourhood N =
   codes within cosine distance r of c (1 - cos(e_v, c) <= r). alpha = the target's mass inside N (over the
   cached top-K; the tail beyond it is not known and counts as outside). a = 1 if the drafter's top-1 is in N.
   Mismatch s = alpha * (1 - a). Selected: s > 0 and s >= the `quantile` of s over the batch (dynamic threshold).
2. Progressive soft gate. g = exp(-KL(p~t || p~s)) over the joint top-K set J = the target's top-Kj (cached) and
   the drafter's top-Kj, both distributions softened by tau_s and renormalised on J. A drafter token outside the
   cached top-K gets the smallest cached logit (an upper bound on its true logit). Weight:
       w = w_base                                 (unselected: smooth gradients everywhere)
       w = w_base + w_sel * g ** veto(step)       (selected)
   veto(step) ramps linearly from 0 to 1 over `veto_steps`: early on every selected position gets the full boost;
   later the boost is vetoed where the drafter is far from the target (small g), so capacity goes to the
   positions it can learn. (The paper names a scheduled veto factor; this schedule is our choice.)
   The gate is computed without gradient (a weight, not a target).
3. Loss = lambda_ce * L_CE + lambda_kd * L_KD, weighted means over positions:
       L_CE = sum w * (-sum_{v in S} p~t(v) log p_s(v)) / sum w, S = the target's kernel set: the fewest top tokens
              holding `kernel_p` of its probability (within the cached top-K), p~t renormalised on S;
       L_KD = tau_s^2 * sum w * KL(p~t || p~s on J) / sum w.
Every constant is a field of LIDConfig (lisa.config; params.yaml `ablate_lid.lid`). The baseline EAGLE-3 loss (soft CE to the full target
distribution) stays in lisa.training.drafter.soft_ce.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lisa.config import LIDConfig


@dataclass
class LIDTerms:
    loss: Tensor
    ce: Tensor
    kd: Tensor
    selected: Tensor  # (N,) bool
    gate: Tensor  # (N,)
    weight: Tensor  # (N,)
    alpha: Tensor  # (N,)
    in_hood: Tensor  # (N,) bool: the drafter's top-1 inside the neighbourhood
    per_position: Tensor  # (N,) weighted CE + KD of each position, scaled so that its mean is `loss`


def neighbourhood(topk_idx: Tensor, topk_p: Tensor, codebook_n: Tensor, top_kc: int, radius: float) -> Tensor:
    """(N, V) bool: codes within cosine distance `radius` of the probability-weighted centroid of the target's
    top_kc codes. topk_idx / topk_p (N, K) in descending order; codebook_n (V, D) L2-normalised."""
    w = topk_p[:, :top_kc] / topk_p[:, :top_kc].sum(-1, keepdim=True).clamp(min=1e-12)
    c = F.normalize((w[..., None] * codebook_n[topk_idx[:, :top_kc]]).sum(1), dim=-1)  # (N, D)
    return (1 - c @ codebook_n.T) <= radius


def veto_exponent(step: int, cfg: LIDConfig) -> float:
    return min(1.0, step / cfg.veto_steps) if cfg.veto_steps > 0 else 1.0


def lid_loss(drafter_logits: Tensor, topk_idx: Tensor, topk_logit: Tensor, lse: Tensor, codebook: Tensor,
             cfg: LIDConfig, step: int = 0) -> LIDTerms:
    """drafter_logits (N, V); the target's cached top-K ids / logits (N, K) (descending) and logsumexp (N,);
    codebook (V, D) embeddings (normalised here). Returns the loss and its parts (see the module docstring)."""
    N, V = drafter_logits.shape
    logp_s = drafter_logits.float().log_softmax(-1)
    topk_p = (topk_logit.float() - lse.float()[:, None]).exp()  # the target's probabilities of its top-K
    with torch.no_grad():
        e = F.normalize(codebook.float(), dim=-1)
        hood = neighbourhood(topk_idx, topk_p, e, cfg.top_kc, cfg.radius)  # (N, V)
        alpha = (topk_p * hood.gather(1, topk_idx)).sum(-1)
        in_hood = hood.gather(1, logp_s.argmax(-1, keepdim=True)).squeeze(1)
        s = alpha * (~in_hood).float()
        thresh = torch.quantile(s, cfg.quantile) if N else s.new_zeros(())
        selected = (s > 0) & (s >= thresh)
        # joint top-K set: the target's top-Kj and the drafter's top-Kj
        s_top = logp_s.topk(cfg.joint_k, dim=-1).indices  # (N, Kj)
        joint = torch.cat([topk_idx[:, : cfg.joint_k], s_top], 1)  # (N, 2Kj), duplicates masked below
        dup = (joint[:, :, None] == joint[:, None, :]).tril(-1).any(-1)  # a later copy of an earlier id
        # the target's logit of each joint id: cached, else the smallest cached logit (an upper bound)
        hit = joint[:, :, None] == topk_idx[:, None, :]  # (N, 2Kj, K)
        t_logit = torch.where(hit.any(-1), (topk_logit.float()[:, None, :] * hit).sum(-1),
                              topk_logit.float().min(-1, keepdim=True).values)
    t_j = (t_logit / cfg.tau_s).masked_fill(dup, -float("inf")).log_softmax(-1)
    s_j = (drafter_logits.float().gather(1, joint) / cfg.tau_s).masked_fill(dup, -float("inf")).log_softmax(-1)
    kl = (t_j.exp() * (t_j - s_j)).masked_fill(dup, 0.0).sum(-1)  # (N,)
    with torch.no_grad():
        gate = torch.exp(-kl)
        weight = torch.full_like(gate, cfg.w_base) + selected.float() * cfg.w_sel * gate ** veto_exponent(step, cfg)
        # kernel set: the fewest top tokens holding kernel_p of the target's mass
        cum = topk_p.cumsum(-1)
        kernel = (cum - topk_p) < cfg.kernel_p * topk_p.sum(-1, keepdim=True).clamp(max=1.0)
        p_kernel = topk_p * kernel
        p_kernel = p_kernel / p_kernel.sum(-1, keepdim=True).clamp(min=1e-12)
    ce = -(p_kernel * logp_s.gather(1, topk_idx)).sum(-1)  # (N,)
    wsum = weight.sum().clamp(min=1e-12)
    l_ce = (weight * ce).sum() / wsum
    l_kd = cfg.tau_s**2 * (weight * kl).sum() / wsum
    per = weight / weight.mean().clamp(min=1e-12) * (cfg.lambda_ce * ce + cfg.lambda_kd * cfg.tau_s**2 * kl)
    return LIDTerms(cfg.lambda_ce * l_ce + cfg.lambda_kd * l_kd, l_ce, l_kd, selected, gate, weight, alpha, in_hood,
                    per)
