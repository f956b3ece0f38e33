"""Where the stages read and write, one frozen dataclass per world and one for the outputs of no world, and what one
stage call receives. dvc.yaml spells out the same paths as the stages' deps and outs."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

from lisa.config import Params, WorldParams


def _build(cls, folders: dict[str, Path], files: dict[str, tuple[str, str]], overrides: dict[str, Any],
           identities: Optional[dict[str, str]] = None):
    """cls(**folders, **files) with `overrides` replacing fields; a replaced folder moves the files in it
    (`files`: field -> (its folder's field, file name)) unless the file is replaced too, and drops its identity file
    (`identities`: field -> its folder's field; lisa/data/identity.py) unless that is replaced too or the replacement
    is the same folder (dvc.yaml names the default folders explicitly): a folder named by hand elsewhere is not the
    one the pipeline's identity file describes."""
    unknown = set(overrides) - {f.name for f in fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__}: no fields {sorted(unknown)}")
    moved = {d for d in overrides if d in folders and overrides[d] is not None
             and Path(overrides[d]).resolve() != Path(folders[d]).resolve()}
    folders = folders | {k: None for k, d in (identities or {}).items() if d in moved and k not in overrides}
    folders = folders | {k: Path(v) if v is not None else None for k, v in overrides.items() if k not in files}
    return cls(**folders, **{k: Path(overrides[k]) if k in overrides else folders[d] / name
                             for k, (d, name) in files.items()})


@dataclass(frozen=True)
class WorldPaths:
    """The files and folders of one world's stages."""
    world: str  # its name
    dataset_dir: Path
    dataset_identity: Optional[Path]  # its files' sha256 (lisa/data/identity.py), committed; None: unchecked
    codes_dir: Path
    tokenizer_dir: Path
    tokenizer_work: Path
    tokenizer_report: Path
    target_dir: Path
    target_work: Path
    target_report: Path
    samples_dir: Path
    premise_report: Path
    quality_dir: Path
    quality_work: Path
    reference_report: Path
    judge_dir: Path
    judge_work: Path
    judge_report: Path
    evaluate_dir: Path
    drafter_dir: Path
    drafter_work: Path
    drafter_report: Path
    drafter_curves: Path
    cache_dir: Path
    cache_identity: Optional[Path]  # a committed copy of the cache's identity.json; None: unchecked
    cache_report: Path
    ablation_dir: Path
    ablation_work: Path
    ablation_report: Path  # a folder: metrics.json, table.md, the curves of both drafters
    arch_work: Path
    arch_report: Path  # a folder: <drafter>.json and <drafter>/{train,heldout}.csv per architecture of ablate-arch
    named_dir: Path  # the named drafters: <name>.safetensors each (drafters.named)
    named_work: Path
    named_report: Path  # a folder: <name>.json and <name>/{train,heldout}.csv per named drafter
    calibration_dir: Path
    calibration_report: Path
    bench_dir: Path  # bench-spec writes <world>.{json,md,png} here
    bench_ddp_report: Path  # without suffix: .json and .md
    bench_ddp_work: Path
    cells_dir: Path
    cells_work: Path
    inputs_dir: Path  # method-inputs: what each table cell / scoreboard family reads, {cells,families}/<key>.json
    summary_file: Path  # the world's headline metrics (reports/summary/<world>.json)
    sweep_dir: Path  # the scoreboard's sweep: <family>.json per family
    sweep_work: Path
    points_dir: Path  # the scoreboard's quality points: <point>.json each
    points_work: Path
    scoreboard_report: Path  # without suffix: .md, .json, .png
    self_generated_dir: Path
    self_generated_report: Path
    codes_file: Path
    tokenizer_file: Path
    target_file: Path
    reference_file: Path
    judge_file: Path
    drafter_file: Path
    lid_drafter_file: Path
    calibration_file: Path

    def drafter_of(self, name: str) -> Path:
        """The file of the drafter a decoding method names (DecodeMethod.drafter): release, lid or a named one."""
        fixed = {"release": self.drafter_file, "lid": self.lid_drafter_file}
        return fixed[name] if name in fixed else self.named_dir / f"{name}.safetensors"

    @staticmethod
    def drafter_maker(name: str) -> str:
        """The command that makes the drafter a decoding method names (the hint of a missing-drafter error)."""
        fixed = {"release": "lisa train-drafter", "lid": "lisa ablate-lid"}
        return fixed.get(name, f"lisa named-drafter --drafter {name}")

    @classmethod
    def of(cls, world: str, root: str | Path = ".", **overrides) -> WorldPaths:
        """The paths of `world` under `root`; `overrides` replace fields (a folder with the files in it)."""
        r, w = Path(root), world
        data, reports, work = r / "data", r / "reports", r / "data" / "work"
        folders = dict(
            world=w, dataset_dir=data / "datasets" / w, dataset_identity=data / "identity" / "datasets" / f"{w}.json",
            codes_dir=data / "codes" / w,
            tokenizer_dir=data / "tokenizer" / w, tokenizer_work=work / "tokenizer" / w,
            tokenizer_report=reports / "tokenizer" / f"{w}.json",
            target_dir=data / "target" / w, target_work=work / "target" / w,
            target_report=reports / "target" / f"{w}.json",
            samples_dir=reports / "samples" / w, premise_report=reports / "premise" / f"{w}.json",
            quality_dir=data / "quality" / w, quality_work=work / "quality" / w,
            reference_report=reports / "quality" / f"{w}-reference.json",
            judge_dir=data / "judge" / w, judge_work=work / "judge" / w, judge_report=reports / "judge" / f"{w}.json",
            evaluate_dir=reports / "quality" / w,
            drafter_dir=data / "drafter" / w, drafter_work=work / "drafter" / w,
            drafter_report=reports / "drafter" / f"{w}.json", drafter_curves=reports / "drafter" / w,
            cache_dir=data / "cache" / w, cache_identity=data / "identity" / "cache" / f"{w}.json",
            cache_report=reports / "cache" / f"{w}.json",
            ablation_dir=data / "ablation" / w, ablation_work=work / "ablation" / w,
            ablation_report=reports / "ablation" / w,
            arch_work=work / "ablate-arch" / w, arch_report=reports / "ablate-arch" / w,
            named_dir=data / "drafters" / w, named_work=work / "drafters" / w, named_report=reports / "drafters" / w,
            calibration_dir=data / "calibration" / w, calibration_report=reports / "calibration" / f"{w}.json",
            bench_dir=reports / "bench", bench_ddp_report=reports / "bench" / f"ddp-{w}",
            bench_ddp_work=work / "bench-ddp" / w,
            cells_dir=reports / "quality" / w / "methods", cells_work=work / "quality" / w / "methods",
            inputs_dir=data / "methods" / w,
            summary_file=reports / "summary" / f"{w}.json",
            sweep_dir=reports / "scoreboard" / w / "sweep", sweep_work=work / "scoreboard" / w / "sweep",
            points_dir=reports / "scoreboard" / w / "quality", points_work=work / "scoreboard" / w / "quality",
            scoreboard_report=reports / "scoreboard" / w,
            self_generated_dir=data / "corpora" / "self-generated" / w,
            self_generated_report=reports / "corpora" / f"self-generated-{w}.json")
        files = dict(codes_file=("codes_dir", "codes.safetensors"),
                     tokenizer_file=("tokenizer_dir", "tokenizer.safetensors"),
                     target_file=("target_dir", "model.safetensors"),
                     reference_file=("quality_dir", "reference.safetensors"),
                     judge_file=("judge_dir", "judge.safetensors"),
                     drafter_file=("drafter_dir", "drafter.safetensors"),
                     lid_drafter_file=("ablation_dir", "lid.safetensors"),
                     calibration_file=("calibration_dir", "calibration.safetensors"))
        return _build(cls, folders, files, overrides,
                      identities=dict(dataset_identity="dataset_dir", cache_identity="cache_dir"))


@dataclass(frozen=True)
class SharedPaths:
    """The outputs of the stages of no world: the vanilla benchmark, the LAION-COCO corpora, the results table."""
    root: Path
    bench_dir: Path  # vanilla.{json,md}; bench-spec's <world>.json, read by the table
    fixture_dir: Path
    fixture_identity: Optional[Path]  # the fixture's files and sha256, committed (params corpora.laion_identity)
    laion_dir: Path
    laion_report: Path
    reports_dir: Path
    table_file: Path  # and table.json beside it
    pareto_file: Path

    @classmethod
    def of(cls, root: str | Path = ".", **overrides) -> SharedPaths:
        """The shared paths under `root`; `overrides` replace fields (a folder with the files in it)."""
        r = Path(root)
        corpora = r / "data" / "corpora"
        folders = dict(root=r, bench_dir=r / "reports" / "bench", fixture_dir=corpora / "laion-coco-fixture",
                       fixture_identity=r / "data" / "identity" / "corpora" / "laion-coco-fixture.json",
                       laion_dir=corpora / "laion-coco", laion_report=r / "reports" / "corpora" / "laion-coco.json",
                       reports_dir=r / "reports")
        files = dict(table_file=("reports_dir", "table.md"), pareto_file=("reports_dir", "pareto.png"))
        return _build(cls, folders, files, overrides, identities=dict(fixture_identity="fixture_dir"))


@dataclass(frozen=True)
class Call:
    """What a stage is called with: the params (and their file), its world's params and paths (None for a stage
    of no world), and the shared paths."""
    params: Params
    params_path: Path
    world: Optional[WorldParams]
    paths: Optional[WorldPaths]
    shared: SharedPaths


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: `run(call, **options)` calls its function; `lisa <stage> --out / --report / --work` replace
    the paths fields named here."""
    run: Callable[..., dict]
    out: str
    report: str = ""
    work: str = ""
    world: bool = True  # called per world (`--world`)
