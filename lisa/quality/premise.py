"""The premise of LISA, measured on a target: its next-token distribution is flat over token ids but gathered in
codebook neighbourhoods.

On held-out (condition, tokens) pairs, teacher-forced, with CFG and temperature 1, per position:
  U = H(p) / log V (normalised entropy), the top-1 probability, and for k in `ks` the target mass inside the
  neighbourhood {top-1 code + its k nearest codes on the normalised codebook} next to the mass of the top-(k+1)
  tokens (the most any k+1 codes can hold) and of k+1 random codes (what ids alone would give).
"""
from __future__ import annotations

import torch

from lisa.decoding.sampling import cfg_logits
from lisa.decoding.verify import neighbour_table  # noqa: F401  (re-exported: the premise measures the same table)


@torch.no_grad()
def premise_stats(model, codebook: torch.Tensor, tokens: torch.Tensor, cond: torch.Tensor, cfg_scale: float,
                  ks: tuple[int, ...] = (8, 32), batch_size: int = 128, seed: int = 0) -> dict:
    V = model.config.vocab_size
    table = neighbour_table(codebook, max(ks))  # (V, K)
    gen = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = {}
    n = 0
    for i in range(0, len(tokens), batch_size):
        t, c = tokens[i : i + batch_size], cond[i : i + batch_size]
        B = len(t)
        if cfg_scale != 1.0:
            drop = torch.cat([torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool)])
            logits = cfg_logits(model.teacher_forced(torch.cat([c, c]), torch.cat([t, t]), drop).logits, cfg_scale)
        else:
            logits = model.teacher_forced(c, t).logits
        p = torch.softmax(logits.float(), dim=-1).flatten(0, 1)  # (N, V)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
        top1 = p.argmax(-1)  # (N,)
        sorted_p = p.sort(dim=-1, descending=True).values
        stats = {"U": entropy / torch.log(torch.tensor(float(V))), "top1_prob": sorted_p[:, 0]}
        for k in ks:
            hood = torch.cat([top1[:, None], table[top1, :k]], dim=1)  # (N, k+1)
            stats[f"mass_top1_plus_{k}_neighbours"] = p.gather(1, hood).sum(-1)
            stats[f"mass_top_{k + 1}_tokens"] = sorted_p[:, : k + 1].sum(-1)
            rand = torch.stack([torch.randperm(V, generator=gen)[: k + 1] for _ in range(len(p))])
            stats[f"mass_{k + 1}_random_codes"] = p.gather(1, rand).sum(-1)
        for name, v in stats.items():
            sums[name] = sums.get(name, 0.0) + v.sum().item()
        n += len(p)
    out = {name: s / n for name, s in sums.items()}
    out.update(positions=n, cfg_scale=cfg_scale, vocab_size=V)
    return out
