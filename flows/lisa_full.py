"""`lisa-full`: the whole DAG of dvc.yaml, in the same order, as one Prefect flow."""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from lisa.config import load_params
from tasks import stages as t


@flow(name="lisa-full", log_prints=True)
def lisa_full(params_path: str = "params.yaml", root: str = ".") -> dict:
    """Run every stage for every world of `params_path`; outputs go under `root` (data/, reports/).
    Built-in worlds (with a `dataset`) are trained, drafter included, and benchmarked (every decoding method); the
    others are imported (or randomly initialised)."""
    params_path = str(Path(root) / params_path) if not Path(params_path).is_absolute() else params_path
    worlds = load_params(params_path).worlds
    metrics = {"estimate": t.estimate(params_path)}  # GPU memory / time, logged before anything runs
    for name, world in worlds.items():
        m = metrics[name] = {}
        if world.dataset is not None:
            m["dataset"] = t.build_dataset(params_path, name, root)
            m["tokenizer"] = t.train_tokenizer(params_path, name, root)
            m["codes"] = t.encode(params_path, name, root)
            m["target"] = t.train_target(params_path, name, root)
            m["premise"] = t.premise(params_path, name, root)
            m["fid_reference"] = t.fid_reference(params_path, name, root)
            m["judge"] = t.train_judge(params_path, name, root)
            m["evaluate"] = t.evaluate(params_path, name, root)
            m["drafter"] = t.train_drafter(params_path, name, root)
            m["self_generated"] = t.build_self_generated(params_path, name, root)
            m["cache"] = t.cache_logits(params_path, name, root)
            m["ablate_lid"] = t.ablate_lid(params_path, name, root)
            m["calibrate"] = t.calibrate(params_path, name, root)
            m["bench_spec"] = t.bench_spec(params_path, name, root)
            m["cells"] = {c: t.eval_method(params_path, name, root, method=c)
                          for c in load_params(params_path).table.cells}
        else:
            m["tokenizer"] = t.init_tokenizer(params_path, name, root)
            m["target"] = t.init_target(params_path, name, root)
        m["sample"] = t.sample(params_path, name, root)
    laion_world = load_params(params_path).corpora.laion_world
    if laion_world in worlds and worlds[laion_world].dataset is not None:  # the fixture needs the emoji world
        metrics["laion_fixture"] = t.laion_fixture(params_path, root=root)
        metrics["laion_coco"] = t.build_laion_coco(params_path, root=root)
    if all(w.dataset is not None for w in worlds.values()):
        metrics["table"] = t.table(params_path, root=root)
    metrics["bench"] = t.bench(params_path, root=root)
    return metrics


if __name__ == "__main__":
    lisa_full()
