"""One Prefect task per pipeline stage. Each reads its params.yaml section and calls the lisa.stages function
that `lisa <stage>` (and so dvc.yaml) calls."""
from __future__ import annotations

from pathlib import Path

from prefect import task

from lisa import stages
from lisa.config import load_params


@task(name="init-tokenizer")
def init_tokenizer(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    return stages.init_tokenizer(p.world(world), p.init_tokenizer, stages.layout(world, root)["tokenizer"])


@task(name="init-target")
def init_target(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    return stages.init_target(p.world(world), p.init_target, stages.layout(world, root)["target"])


@task(name="sample")
def sample(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.sample(Path(where["target"]) / stages.TARGET_FILE, Path(where["tokenizer"]) / stages.TOKENIZER_FILE,
                         p.sample, where["samples"])


@task(name="bench")
def bench(params_path: str, root: str = ".") -> dict:
    return stages.bench(load_params(params_path).bench, stages.layout("-", root)["bench"])
