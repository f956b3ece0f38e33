"""`recalibrate`: when a world's target checkpoint changed, rebuild what depends on it, as `dvc repro` would.

Scheduled by the deployment `recalibrate/hourly` (prefect.yaml). For every world, tasks.pipeline.new_target decides
whether its target changed, by content (sha256; a touch, a copy or a re-download of the same bytes triggers
nothing), and makes the change DVC's: a new checkpoint named by `worlds.<world>.target_checkpoint` (an official .pt
or a bare .safetensors, no sidecar needed) is imported by train-target; new weights in lisa's format at
data/target/<world>/ are recorded with `dvc commit`. Then, if anything changed, the flow lisa-full runs: DVC finds
the logit cache, drafters, calibration, benchmarks, quality cells and the table stale and rebuilds exactly those,
recording them in dvc.lock. A target whose bytes disagree with its sidecar fails the run with one line that says
what to do.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.states import Failed

from flows.lisa_full import lisa_full
from lisa.config import load_params
from tasks.pipeline import new_target


@flow(name="recalibrate", log_prints=True)
def recalibrate(root: str = "."):
    """{world: "up to date" | why it was redone}, and under "rebuilt" the stages lisa-full ran."""
    status = {}
    for world in load_params(Path(root) / "params.yaml").worlds:
        found = new_target(world, root)
        if "refused" in found:
            print(f"{world}: refused: {found['refused']}")
            return Failed(message=found["refused"])
        why = found["changed"]
        status[world] = why or "up to date"
        print(f"{world}: {why}: rebuilding what depends on it" if why else
              f"{world}: target checkpoint unchanged: nothing to do")
    if any(why != "up to date" for why in status.values()):
        results = lisa_full(root=root)
        status["rebuilt"] = sorted(n for n, r in results.items() if n != "estimate" and r["outcome"] != "skipped")
    return status


if __name__ == "__main__":
    recalibrate()
