"""`lisa-full`: the DAG of dvc.yaml as one Prefect flow, with `dvc repro`'s idea of what is up to date.

The task graph is read from dvc.yaml through DVC (tasks.pipeline.read_dag): a stage added there, or a world or table
cell added to params.yaml, appears here with no edit. Each task is `dvc repro --single-item <stage>`, submitted once
its upstream stages are done: DVC skips it when it is up to date, and records in dvc.lock what it ran, so after a
flow run `dvc status` is clean and `dvc repro` runs nothing, as after `dvc repro` itself. Independent stages (worlds,
table cells) run concurrently on the task runner that the settings name (flows.runners). Every stage's metrics,
markdown reports and images become Prefect artifacts (`prefect artifact ls`), keyed by stage and file.
"""
from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from flows.runners import task_runner
from tasks.pipeline import dvc, read_dag, repro, select
from tasks.stages import estimate


@flow(name="lisa-full", log_prints=True, task_runner=task_runner())
def lisa_full(root: str = ".", stages: list[str] | None = None) -> dict:
    """Bring the stages of root/dvc.yaml (or `stages` and what they need: addresses such as calibrate@fashion-c2i,
    or families such as eval-method) up to date. Returns {stage: {"outcome": ran | skipped | restored, "metrics":
    {path: JSON}}} and, under "estimate", `lisa estimate` of the profile (logged before anything runs)."""
    root = str(Path(root).resolve())  # the same path on every worker: a Dask worker elsewhere has its checkout there
    results = {"estimate": estimate(str(Path(root) / "params.yaml"))}
    dag = read_dag(root)
    dag = select(dag, stages) if stages else dag
    stale = set(json.loads(dvc(["status", "--json"], root).stdout or "{}"))
    futures = {}
    for name, st in dag.items():  # upstream before downstream
        up = [futures[u] for u in st.upstream if u in futures]
        futures[name] = repro.submit(name, root, st.metrics, stale=name in stale, upstream=up, cmd=st.cmd,
                                      reports=st.reports)
    failed = []
    for name, future in futures.items():
        try:
            results[name] = future.result()
        except Exception as e:  # a failed stage, or one whose upstream failed: report them all
            failed.append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    if failed:
        raise RuntimeError("stages that failed or did not run:\n  " + "\n  ".join(failed))
    ran = sorted(n for n, r in results.items() if n != "estimate" and r["outcome"] != "skipped")
    print(f"lisa-full: {len(ran)} of {len(dag)} stages ran: {', '.join(ran) or 'none'}")
    return results


if __name__ == "__main__":
    lisa_full()
