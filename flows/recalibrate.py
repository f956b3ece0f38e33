"""`recalibrate`: redo GASV's calibration, and the evaluation that depends on it, when a target checkpoint changed.

Scheduled by the deployment `recalibrate/hourly` (prefect.yaml). For every world it compares the content hash
(sha256) of data/target/<world>/model.safetensors with the one its calibration recorded; a world whose checkpoint
bytes are unchanged is skipped (a touch, a copy or a re-download of the same file triggers nothing). For a changed
one it rebuilds, in order: the logit cache (it is the target's), the drafters when they were trained against
another target (train-drafter, ablate-lid's LID drafter), the calibration, the speculative benchmark, every
quality cell of the results table, and then the table itself. The same chain as `dvc repro` after the checkpoint
changes, so the DVC locks can be brought up to date with `dvc commit` afterwards.
"""
from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from lisa.checkpoint import file_sha256
from lisa.config import load_params
from lisa.stages import WorldPaths
from tasks import stages as t


def _drafter_target(path: Path) -> str | None:
    side = path.with_suffix(".json")
    return json.loads(side.read_text()).get("made_from", {}).get("target_sha256") if side.is_file() else None


@flow(name="recalibrate", log_prints=True)
def recalibrate(params_path: str = "params.yaml", root: str = ".") -> dict:
    """Returns {world: "up to date" | the reason it was redone}; see the module docstring."""
    params_path = str(Path(root) / params_path) if not Path(params_path).is_absolute() else params_path
    p = load_params(params_path)
    status, redone = {}, []
    for name, world in p.worlds.items():
        why = t.needs_recalibration(name, root)
        if why is None:
            print(f"{name}: target checkpoint unchanged since its calibration: nothing to do")
            status[name] = "up to date"
            continue
        print(f"{name}: {why}: recalibrating and re-evaluating")
        paths = WorldPaths.of(name, root)
        target_sha = file_sha256(paths.target_file)
        t.cache_logits(params_path, name, root)
        if world.dataset is not None:
            if _drafter_target(paths.drafter_file) != target_sha:
                t.train_drafter(params_path, name, root)
            if _drafter_target(paths.lid_drafter_file) != target_sha:
                t.ablate_lid(params_path, name, root)
        t.calibrate(params_path, name, root)
        if world.dataset is not None:
            t.bench_spec(params_path, name, root)
            for cell in p.table.cells:
                t.eval_method(params_path, name, root, method=cell)
        status[name] = why
        redone.append(name)
    if redone and all(w.dataset is not None for w in p.worlds.values()):
        t.table(params_path, root=root)
    return status


if __name__ == "__main__":
    recalibrate()
