"""The lines a flow run stores in Prefect (`prefect flow-run logs`, the UI's log tab) name their task.

Prefect's API log handler stores a record's bare message, and `prefect flow-run logs` prints every line as the flow
run's, so 60 tasks' "Finished in state Completed()" could not be told apart. `name_task_logs` gives that handler
Prefect's own formatter with a task-run format: a task's lines read `<task run name> | <message>` (the repro task's
run is named after its stage, e.g. `train-target@fashion-c2i | Finished in state Completed()`). Each task calls it
first, in the process that runs it (a Dask worker too), after whatever configured Prefect's logging."""
from __future__ import annotations

import logging

TASK_RUN_FORMAT = "%(task_run_name)s | %(message)s"


def name_task_logs() -> None:
    """Install the task-naming formatter on the API log handlers of Prefect's run loggers (idempotent)."""
    from prefect.logging.formatters import PrefectFormatter
    from prefect.logging.handlers import APILogHandler

    formatter = PrefectFormatter(format="%(message)s", flow_run_fmt="%(message)s", task_run_fmt=TASK_RUN_FORMAT)
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.extra"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, APILogHandler):
                handler.setFormatter(formatter)
