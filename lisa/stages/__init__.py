"""Pipeline stages: one function each, params sections and paths in, files and a metrics dict out.

`run_stage` is the one way in: the CLI (`lisa <stage>`, which dvc.yaml calls) and the Prefect tasks (tasks/) both
call it, so both run the same function on the same arguments. The built-in worlds run `build-dataset` ->
`train-tokenizer` -> `encode` -> `train-target` -> `sample`; a world of official checkpoints uses `init-tokenizer` /
`init-target` (import, or random init) instead of the two training stages. `bench` measures vanilla decode speed
against the bare forwards. Then: logit caching, drafter training, GASV calibration, the speculative benchmark
(`bench-spec`), quality per method (`eval-method`) and the results table (`table`).
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Optional

from lisa.config import ConfigError
from lisa.stages import bench, build, corpora, drafter, inputs, quality, report, sample, scoreboard
from lisa.stages.params import load_params
from lisa.stages.paths import Call, SharedPaths, Stage, WorldPaths

STAGES: dict[str, Stage] = (build.STAGES | sample.STAGES | quality.STAGES | drafter.STAGES | corpora.STAGES
                            | bench.STAGES | report.STAGES | scoreboard.STAGES | inputs.STAGES)


def _split(options: dict, cls) -> tuple[dict, dict]:
    """(the options that are fields of `cls`, the rest)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names}


def run_stage(name: str, params_path: str | Path = "params.yaml", world: Optional[str] = None,
              root: str | Path = ".", **options) -> dict:
    """Run stage `name` on the params file, for `world` (the stages of a world), its outputs under `root`.
    `options`: `out` / `report` / `work` (the stage's output folder, report, scratch folder), any WorldPaths /
    SharedPaths field (e.g. target_file, codes_file), and the stage's own options (sample: method; train-drafter:
    steps, corpus; eval-method: method ...)."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {sorted(STAGES)}")
    stage, p = STAGES[name], load_params(params_path)
    if stage.world and world is None:
        raise ConfigError(f"stage {name!r} runs per world: name one (--world)")
    options = {getattr(stage, k) if k in ("out", "report", "work") else k: v for k, v in options.items()}
    if "" in options:
        raise ValueError(f"stage {name!r} has no --report / --work")
    world_options, options = _split(options, WorldPaths) if stage.world else ({}, options)
    shared_options, options = _split(options, SharedPaths)
    call = Call(params=p, params_path=Path(params_path), world=p.world(world) if stage.world else None,
                paths=WorldPaths.of(world, root, **world_options) if stage.world else None,
                shared=SharedPaths.of(root, **shared_options))
    return stage.run(call, **options)


__all__ = ["STAGES", "Call", "SharedPaths", "Stage", "WorldPaths", "run_stage"]
