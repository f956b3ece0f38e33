"""`lisa-full`: the whole DAG of dvc.yaml, in the same order, as one Prefect flow."""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from lisa.config import load_params
from tasks import stages as t


@flow(name="lisa-full", log_prints=True)
def lisa_full(params_path: str = "params.yaml", root: str = ".") -> dict:
    """Run every stage for every world of `params_path`; outputs go under `root` (data/, reports/)."""
    params_path = str(Path(root) / params_path) if not Path(params_path).is_absolute() else params_path
    worlds = list(load_params(params_path).worlds)
    metrics = {}
    for world in worlds:
        tokenizer = t.init_tokenizer.submit(params_path, world, root)
        target = t.init_target.submit(params_path, world, root)
        sample = t.sample.submit(params_path, world, root, wait_for=[tokenizer, target])
        metrics[world] = {"tokenizer": tokenizer.result(), "target": target.result(), "sample": sample.result()}
    metrics["bench"] = t.bench(params_path, root)
    return metrics


if __name__ == "__main__":
    lisa_full()
