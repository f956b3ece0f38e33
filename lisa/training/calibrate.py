"""Offline calibration of GASV for one target checkpoint (LISA, inference side): what `lisa.decoding.verify.gasv` reads.

From the target's output head W (V, D) (the rows that score the image tokens) and its codebook:
  * invstd (D,): 1 / std over the V rows of each dimension of W; the whitened rows W * invstd are where the
    geometric drift is measured (s_geo in lisa/decoding/verify.py);
  * clusters: k-means (scikit-learn, k-means++ init, `clusters` clusters) on the whitened rows: cluster (V,);
  * budgets beta_c (C,): on a calibration pass over the logit cache (`lisa cache-logits`: the target's top-K
    logits on real sequences, conditional passes, up to `positions` positions), the drift of every cached
    non-top-1 token v, s_geo(v) = (l_i - l_v) / (||(w_i - w_v) * invstd|| + eps), grouped by the cluster of the
    position's top-1 i; beta_c is its `budget_quantile` quantile (clusters with fewer than `min_count` drifts
    use the quantile over all positions);
  * the looseness reference s_ref: the median over the pass of U * 2 (1 - sigmoid(margin)), U the normalised
    entropy (what f_kappa / f_lambda are centred on);
  * the neighbour table: each code's `neighbours` nearest codes on the normalised codebook (LANTERN's table).
One safetensors file + a JSON sidecar with the sha256 of the target checkpoint, the tokenizer and the cache's
target: loading it for another checkpoint (`load_calibration(..., target_sha256=...)`) is a CalibrationError
that names both.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from lisa.checkpoint import atomic_write, file_sha256, read_json, write_json
from lisa.config import CalibrateParams

CALIBRATION_FILE = "calibration.safetensors"
CALIBRATION_VERSION = "1"


class CalibrationError(ValueError):
    """A calibration that does not fit the target it is used with (or is not a calibration)."""


CalibrateConfig = CalibrateParams  # the one type of the calibration's settings: params.yaml's `calibrate` (lisa.config)


@dataclass
class Calibration:
    invstd: Tensor  # (D,)
    head: Tensor  # (V, D) whitened head rows (W * invstd); not stored: rebuilt from the target on load
    head_sq: Tensor  # (V,) their squared norms
    cluster: Tensor  # (V,) long
    beta: Tensor  # (C,)
    neighbours: Tensor  # (V, K) long
    looseness_ref: float
    meta: dict


def whiten(head: Tensor) -> tuple[Tensor, Tensor]:
    """(V, D) head rows -> (invstd (D,), whitened rows (V, D))."""
    W = head.detach().float().cpu()
    invstd = 1.0 / W.std(0).clamp(min=1e-8)
    return invstd, W * invstd


def kmeans(rows: Tensor, k: int, seed: int) -> Tensor:
    """Cluster index (V,) of each row: scikit-learn k-means (k-means++ init, 3 restarts)."""
    from sklearn.cluster import KMeans

    if not 1 <= k <= rows.shape[0]:
        raise ValueError(f"calibrate.clusters must be in [1, {rows.shape[0]}] (the vocabulary), got {k}")
    km = KMeans(n_clusters=k, n_init=3, random_state=seed).fit(rows.double().numpy())
    return torch.from_numpy(km.labels_).long()


def drift_scores(topk_idx: Tensor, topk_logit: Tensor, W: Tensor, eps: float) -> Tensor:
    """(P, K) cached top-K (indices, logits, descending) -> (P, K - 1) drift s_geo of tokens 2..K against the
    top-1 in whitened space."""
    i, v = topk_idx[:, :1], topk_idx[:, 1:]
    dist = (W[i] - W[v]).norm(dim=-1)  # (P, K - 1)
    return (topk_logit[:, :1] - topk_logit[:, 1:]).clamp(min=0) / (dist + eps)


def calibrate(head: Tensor, codebook: Tensor, cache, cfg: CalibrateConfig, made_from: dict,
              progress: bool = True) -> Calibration:
    """Fit a calibration (see the module docstring). head: (V, D) output-head rows of the image tokens; cache: an
    opened lisa.training.cache.LogitCache of the same target."""
    from lisa.decoding.verify import neighbour_table

    t0 = time.perf_counter()
    V = head.shape[0]
    if codebook.shape[0] != V:
        raise CalibrationError(f"the target scores {V} image tokens but the codebook has {codebook.shape[0]} codes")
    invstd, W = whiten(head)
    cluster = kmeans(W, cfg.clusters, cfg.seed)
    # the calibration pass: conditional rows of the cache, the first `positions` positions
    rows = ~cache.uncond
    idx = cache.topk_idx[rows].reshape(-1, cache.topk_idx.shape[-1])[: cfg.positions]
    logit = cache.topk_logit[rows].reshape(-1, cache.topk_logit.shape[-1])[: cfg.positions].float()
    ent = cache.entropy[rows].reshape(-1)[: cfg.positions].float()
    margin = cache.margin[rows].reshape(-1)[: cfg.positions].float()
    if int(idx.max()) >= V:
        raise CalibrationError(f"the logit cache holds token ids up to {int(idx.max())}, beyond the {V} image tokens")
    drift = drift_scores(idx, logit, W, cfg.eps)  # (P, K - 1)
    top_cluster = cluster[idx[:, 0]]  # (P,)
    q = cfg.budget_quantile
    sample = torch.Generator().manual_seed(cfg.seed)

    def quantile(x: Tensor) -> float:  # torch.quantile takes at most 16M values
        if x.numel() > 4_000_000:
            x = x[torch.randint(0, x.numel(), (4_000_000,), generator=sample)]
        return float(torch.quantile(x, q))

    overall = quantile(drift.flatten())
    beta = torch.full((cfg.clusters,), overall)
    counts = torch.zeros(cfg.clusters, dtype=torch.long)
    for c in range(cfg.clusters):
        d = drift[top_cluster == c].flatten()
        counts[c] = d.numel()
        if d.numel() >= cfg.min_count:
            beta[c] = quantile(d)
    loose = (ent / math.log(V)) * 2 * (1 - torch.sigmoid(margin))
    neighbours = neighbour_table(codebook, min(cfg.neighbours, V - 1)).cpu()
    within = drift <= beta[top_cluster][:, None]
    meta = {
        "version": CALIBRATION_VERSION,
        "config": asdict(cfg),
        "made_from": made_from,
        "vocab": V,
        "head_dim": int(head.shape[1]),
        "positions": int(idx.shape[0]),
        "clusters_used_by_top1": int((counts > 0).sum()),
        "clusters_with_own_budget": int((counts >= cfg.min_count).sum()),
        "cluster_sizes": torch.bincount(cluster, minlength=cfg.clusters).tolist(),
        "beta_global": overall,
        "beta": beta.tolist(),
        "looseness_ref": float(loose.median()),
        "share_within_budget": float(within.float().mean()),
        "calibrate_s": time.perf_counter() - t0,
    }
    head_w = W
    return Calibration(invstd, head_w, (head_w * head_w).sum(-1), cluster, beta, neighbours, meta["looseness_ref"],
                       meta)


def save_calibration(cal: Calibration, out_dir: str | Path) -> dict:
    """out_dir/calibration.safetensors + calibration.json (written atomically; the JSON records the file's sha256)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CALIBRATION_FILE
    tensors = {"invstd": cal.invstd.contiguous(), "cluster": cal.cluster.contiguous(), "beta": cal.beta.contiguous(),
               "neighbours": cal.neighbours.contiguous(), "looseness_ref": torch.tensor([cal.looseness_ref])}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"lisa.kind": "calibration"}))
    meta = cal.meta | {"sha256": file_sha256(path)}
    write_json(path.with_suffix(".json"), meta)
    return meta


def load_calibration(path: str | Path, head: Tensor, target_sha256: Optional[str] = None) -> Calibration:
    """Read a calibration for the target whose head rows are `head` (V, D); with target_sha256, refuse a
    calibration made for another checkpoint."""
    path = Path(path)
    side = path.with_suffix(".json")
    if not path.is_file() or not side.is_file():
        raise CalibrationError(f"{path}: no calibration there (needs {path.name} and {side.name}: `lisa calibrate`)")
    meta = read_json(side, CalibrationError)
    made = meta.get("made_from", {}).get("target_sha256")
    if target_sha256 is not None and made != target_sha256:
        raise CalibrationError(f"{path}: calibration made for target {made} ({meta['made_from'].get('target')}), but "
                               f"the target given has sha256 {target_sha256}: recalibrate (`lisa calibrate`)")
    if meta.get("sha256") and file_sha256(path) != meta["sha256"]:
        raise CalibrationError(f"{path}: sha256 differs from {side.name}: the file changed after calibration")
    t = load_file(str(path))
    invstd = t["invstd"].float()
    if head.shape[1] != invstd.shape[0] or head.shape[0] != t["cluster"].shape[0]:
        raise CalibrationError(f"{path}: calibration for a ({t['cluster'].shape[0]}, {invstd.shape[0]}) head, "
                               f"the target's is {tuple(head.shape)}")
    W = head.detach().float().cpu() * invstd
    return Calibration(invstd, W, (W * W).sum(-1), t["cluster"].long(), t["beta"].float(), t["neighbours"].long(),
                       float(t["looseness_ref"][0]), meta)
