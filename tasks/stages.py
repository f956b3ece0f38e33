"""One Prefect task per pipeline stage, named after it: each calls lisa.stages.run_stage, the function `lisa <stage>`
(and so dvc.yaml) calls, with the same params file, world and root. Tasks pass paths and metrics, never models.
They run a stage unconditionally, for a flow of your own; `lisa-full` runs dvc.yaml's stages through DVC instead
(tasks.pipeline.repro), so that what is up to date is skipped and dvc.lock records what ran."""
from __future__ import annotations

from prefect import task

from lisa.config import load_params
from tasks.logs import name_task_logs
from lisa.stages import run_stage


def stage_task(name: str):
    """The Prefect task of stage `name`: (params_path, world=None, root=".", **options) -> its metrics."""

    @task(name=name)
    def run(params_path: str, world: str | None = None, root: str = ".", **options) -> dict:
        return run_stage(name, params_path, world, root, **options)

    return run


build_dataset = stage_task("build-dataset")
train_tokenizer = stage_task("train-tokenizer")
encode = stage_task("encode")
train_target = stage_task("train-target")
init_tokenizer = stage_task("init-tokenizer")
init_target = stage_task("init-target")
sample = stage_task("sample")
premise = stage_task("premise")
fid_reference = stage_task("fid-reference")
train_judge = stage_task("train-judge")
evaluate = stage_task("evaluate")
train_drafter = stage_task("train-drafter")
cache_logits = stage_task("cache-logits")
ablate_lid = stage_task("ablate-lid")
ablate_arch = stage_task("ablate-arch")
named_drafter = stage_task("named-drafter")
drafter_reference = stage_task("drafter-reference")
drafter_table = stage_task("drafter-table")
calibrate = stage_task("calibrate")
bench_ddp = stage_task("bench-ddp")
laion_fixture = stage_task("laion-fixture")
build_laion_coco = stage_task("build-laion-coco")
build_self_generated = stage_task("build-self-generated")
bench = stage_task("bench")
bench_spec = stage_task("bench-spec")
method_inputs = stage_task("method-inputs")
eval_method = stage_task("eval-method")
table = stage_task("table")
summary = stage_task("summary")
sweep = stage_task("sweep")
quality_point = stage_task("quality-point")
scoreboard = stage_task("scoreboard")


@task(name="estimate", task_run_name="estimate")
def estimate(params_path: str, gpu: str = "H200") -> str:
    """GPU memory and time of the run, from the params alone: logged before any stage starts."""
    name_task_logs()
    from lisa.bench.estimate import estimate_markdown, missing_checkpoints

    p = load_params(params_path)
    text = estimate_markdown(p, gpu)
    missing = missing_checkpoints(p)
    if missing:
        text += "\nNot found: " + "; ".join(missing) + "\n"
    print(text)
    return text
