"""The Prefect task runner of the flows, chosen by settings (environment variables), not by code.

  LISA_TASK_RUNNER   threads (default): a thread pool in the flow's process; each stage is its own `dvc repro`
                     process, so threads are enough on one machine
                     dask: prefect-dask's DaskTaskRunner
  LISA_WORKERS       how many stages run at once (default 2): threads, or the workers of a local Dask cluster
  LISA_DASK_ADDRESS  a running Dask scheduler (tcp://host:8786) to use instead of a local cluster

A deployment sets them in prefect.yaml (`job_variables: env:`); `lisa_full.with_options(task_runner=...)` overrides
them in code, as the tests do.
"""
from __future__ import annotations

import os


def task_runner(kind: str | None = None, workers: int | None = None, address: str | None = None):
    """The task runner the settings name; arguments override the environment."""
    kind = kind or os.environ.get("LISA_TASK_RUNNER", "threads")
    workers = workers or int(os.environ.get("LISA_WORKERS", "2"))
    address = address or os.environ.get("LISA_DASK_ADDRESS") or None
    if kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    if kind == "dask":
        from prefect_dask import DaskTaskRunner  # optional: pip install 'lisa[dask]'

        if address:
            return DaskTaskRunner(address=address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True})
    raise ValueError(f"LISA_TASK_RUNNER={kind!r}: use threads or dask")
