"""Image quality of a generated set against a reference, with bootstrap 95% intervals (the scoreboard's quality points,
lisa/stages/scoreboard.py).

Each metric is a function of the generated set given the fixed reference, so one resample of the generated images
(with replacement, the same indices for every metric: paired) gives one value of each; the interval is the 2.5 and
97.5 percentiles over `bootstrap` resamples, shifted by the resamples' bias (their mean minus the full-set value: duplicated
images lower a resample's spread, which raises FD and KID and lowers recall). Per feature space (Inception pool3, the world's judge):

- Frechet distance of Gaussian fits: |mu_g - mu_r|^2 + tr S_g + tr S_r - 2 tr (S_r^1/2 S_g S_r^1/2)^1/2, the last
  trace the nuclear norm of X_g S_r^1/2 / sqrt(n - 1) (X_g the centred generated features), so a resample costs one
  n x d SVD instead of a d x d matrix square root; on the full set it is torch-fidelity's FID (tests/test_compare.py).
- KID: the unbiased MMD^2 with torch-fidelity's cubic polynomial kernel over the full sets (one "subset" of every
  image: torch-fidelity's KID with kid_subsets=1 at equal set sizes), a resample read off precomputed kernel matrices.
- Precision / recall (Kynkaanniemi et al. 2019): a generated image is precise if it lies within the k-th nearest
  neighbour radius of some reference image; a reference image is recalled if it lies within some generated image's
  radius (torch-fidelity's rule and distances). Resamples keep each generated image's radius from the full set.
  With d > n (Inception), a resample's FD comes from n x n Gram matrices computed once (`_Space._frechet_gram`).
- The judge's score, the mean of a per-image score (class consistency: 100 x correct; CLIP score).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch_fidelity.metric_prc import calc_cdist_full


@dataclass
class Reference:
    """What every resample is compared with in one feature space, computed once: the reference features (m, d),
    their mean, covariance trace and covariance square root, and the reference kernel sum of the KID."""
    feats: Tensor
    mu: Tensor
    trace: float
    sqrt_cov: Tensor
    kernel_rr: float  # sum over i != j of k(r_i, r_j) / (m (m - 1))

    @classmethod
    def of(cls, feats: Tensor) -> "Reference":
        r = feats.double()
        mu = r.mean(0)
        cov = torch.cov(r.T)
        w, v = torch.linalg.eigh(cov)
        sqrt_cov = (v * w.clamp(min=0).sqrt()) @ v.T
        m = len(r)
        k = _kernel(r, r)
        return cls(r, mu, float(cov.trace()), sqrt_cov, float((k.sum() - k.diagonal().sum()) / (m * (m - 1))))


def _kernel(a: Tensor, b: Tensor) -> Tensor:
    """torch-fidelity's KID kernel: (a . b / d + 1)^3."""
    return (a @ b.T / a.shape[1] + 1) ** 3


def frechet(ref: Reference, gen: Tensor) -> float:
    """Frechet distance between Gaussian fits of the reference and of gen (n, d)."""
    g = gen.double()
    mu = g.mean(0)
    xc = (g - mu) / (len(g) - 1) ** 0.5
    cross = torch.linalg.svdvals(xc @ ref.sqrt_cov).sum()  # tr (S_r^1/2 S_g S_r^1/2)^1/2
    return float((mu - ref.mu).pow(2).sum() + xc.pow(2).sum() + ref.trace - 2 * cross)


class _Space:
    """One feature space's metrics for any resample of the generated set (indices into gen)."""

    def __init__(self, ref: Reference, gen: Tensor, nearest_k: Optional[int]):
        self.ref, self.gen = ref, gen.double()
        n, d = self.gen.shape
        if d > n:  # resamples read the cross term off one n x n Gram matrix (module docstring)
            a = self.gen @ ref.sqrt_cov
            self.gram_cross, self.gram = a @ a.T, self.gen @ self.gen.T
        self.k_gg = _kernel(self.gen, self.gen)
        self.k_gr_rows = _kernel(self.gen, ref.feats).mean(1)  # (n,) each generated image's mean kernel to the reference
        self.nearest_k = nearest_k
        if nearest_k:
            d_gr = calc_cdist_full(gen.float(), ref.feats.float(), 10000)  # (n, m)
            r_ref = calc_cdist_full(ref.feats.float(), ref.feats.float(), 10000).kthvalue(nearest_k + 1).values
            r_gen = calc_cdist_full(gen.float(), gen.float(), 10000).kthvalue(nearest_k + 1).values
            self.precise = (d_gr <= r_ref[None, :]).any(1)  # (n,)
            self.covers = d_gr <= r_gen[:, None]  # (n, m): generated image i's ball holds reference image j

    def _frechet_gram(self, idx: Tensor) -> float:
        """frechet() of the resample gen[idx] through the Gram matrices: with H the centring matrix, the cross term
        is sum sqrt(eig(H A_I A_I^T H)) / sqrt(n - 1), A = gen S_r^1/2, and tr S_g = tr(H G_I H) / (n - 1)."""
        n = len(idx)

        def centred(m: Tensor) -> Tensor:
            m = m[idx][:, idx]
            return m - m.mean(0, keepdim=True) - m.mean(1, keepdim=True) + m.mean()

        cross = torch.linalg.eigvalsh(centred(self.gram_cross)).clamp(min=0).sqrt().sum() / (n - 1) ** 0.5
        trace = centred(self.gram).trace() / (n - 1)
        mu = self.gen[idx].mean(0)
        return float((mu - self.ref.mu).pow(2).sum() + trace + self.ref.trace - 2 * cross)

    def __call__(self, idx: Tensor) -> dict:
        g = self.gen[idx]
        n = len(idx)
        k = self.k_gg[idx][:, idx]
        kid = (k.sum() - k.diagonal().sum()) / (n * (n - 1)) + self.ref.kernel_rr - 2 * self.k_gr_rows[idx].mean()
        out = {"fd": frechet(self.ref, g) if not hasattr(self, "gram") else self._frechet_gram(idx), "kid": float(kid)}
        if self.nearest_k:
            out["precision"] = float(self.precise[idx].double().mean())
            out["recall"] = float(self.covers[idx].any(0).double().mean())
        return out


def image_metrics(ref_inception: Tensor, gen_inception: Tensor, ref_judge: Tensor, gen_judge: Tensor,
                  judge_scores: Tensor, score_name: str, bootstrap: int = 200, nearest_k: int = 3,
                  seed: int = 0) -> dict:
    """{metric: {"value", "lo", "hi"}} of a generated set: Inception FD (fid) / KID (kid) / precision / recall, the
    judge-space FD (judge_fd) / KID (judge_kid), and the judge's mean per-image score (score_name); value on the
    full set, lo / hi the bias-corrected bootstrap 95% interval over `bootstrap` resamples of the generated images
    (seeded)."""
    spaces = {"": _Space(Reference.of(ref_inception), gen_inception, nearest_k),
              "judge_": _Space(Reference.of(ref_judge), gen_judge, None)}
    scores = judge_scores.double()

    def one(idx: Tensor) -> dict:
        out = {score_name: float(scores[idx].mean())}
        for prefix, space in spaces.items():
            out |= {prefix + ("fid" if k == "fd" and not prefix else k): v for k, v in space(idx).items()}
        return out

    n = len(gen_inception)
    full = one(torch.arange(n))
    gen = torch.Generator().manual_seed(seed)
    draws = [one(torch.randint(0, n, (n,), generator=gen)) for _ in range(bootstrap)]
    out = {}
    for key, value in full.items():
        vals = torch.tensor([d[key] for d in draws], dtype=torch.float64)
        lo, hi = torch.quantile(vals, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        shift = float(vals.mean()) - value  # a resample's duplicates bias FD / KID up and recall down: undone
        out[key] = {"value": value, "lo": lo - shift, "hi": hi - shift, "bootstrap_bias": shift}
    return out


def overlaps(a: dict, b: dict) -> bool:
    """Whether two intervals ({"lo", "hi"}) overlap."""
    return a["lo"] <= b["hi"] and b["lo"] <= a["hi"]
