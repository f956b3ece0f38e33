"""params.yaml -> typed dataclasses, strictly: an unknown or mistyped key is an error naming the key and section.

One section per pipeline stage (`build_dataset`, `train_tokenizer`, `encode`, `train_target`, `init_target`,
`init_tokenizer`, `sample`, `premise`, the training and quality stages, `bench`, `bench_spec`) plus `worlds`:
each world is one target family with its tokenizer (the stages loop over worlds). Named profiles (`micro` for
CI, `real`; the default is params.yaml) live in lisa/profiles/. Validation uses pydantic dataclasses with extra
keys forbidden. A decoding method is one type, `DecodeMethod`; every sampling section inherits the top-level
`sampling` values it does not set (`inherit_sampling`).
The section types live in lisa/sections.py (all importable from here); this module assembles them into `Params`,
checks what spans sections at load (`parse_params`) and reads the profiles.
The params are plain data and a leaf: neither module imports lisa.decoding, lisa.models or torch. The types the code
shares with params.yaml are defined here once and imported by the code (the sampling rule, the draft tree, LIDConfig,
LaionFilter, CalibrateParams); what only the code can check (verifier names and options, model presets and world sizes) is checked
at load by lisa.stages.params, which run_stage and the CLI load through. `seed_for` is the one seed rule.
"""
from __future__ import annotations

import copy
import dataclasses
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

# the section types, importable from here
from lisa.sections import (AblateArchParams, AblateLIDParams, ArchEntry, AutoTreeParams, BenchMethod, BenchParams,
                           BenchSpecParams, BuildDatasetParams, CacheLogitsParams, CalibrateParams, CorporaParams,
                           Count, Count0, DatasetParams, DecodeMethod, DraftTree, DrafterArch, DrafterRun,
                           DraftersParams, EncodeParams, EvaluateParams, InitTargetParams, InitTokenizerParams,
                           LIDConfig, LaionFilter, LaunchParams, NamedDrafter, PremiseParams, QualityParams,
                           QualityPoint, SAMPLING_KEYS, STRICT, SampleParams, Sampling, SamplingParams,
                           ScoreboardParams, SelfGeneratedParams, Share, SweepFamily, TableCell,
                           TableParams, ThroughputParams, TrainDrafterParams, TrainJudgeParams, TrainParams,
                           TrainTargetParams, TrainTokenizerParams, WorldParams)  # noqa: F401


class ConfigError(ValueError):
    """params.yaml (or a profile) does not fit the schema; the message names the file, section and key."""


def seed_for(seed: int, i: int) -> int:
    """The seed of the i-th generator drawn from a params `seed` (a batch, a training step, a shard, a timed run):
    every torch.Generator of the pipeline is seeded with this rule."""
    return seed * 1_000_003 + i


@dataclass(config=STRICT)
class Params:
    worlds: dict[str, WorldParams]
    sampling: Sampling = Field(default_factory=Sampling)  # what every sampling section inherits (inherit_sampling)
    build_dataset: BuildDatasetParams = Field(default_factory=BuildDatasetParams)
    train_tokenizer: TrainTokenizerParams = Field(default_factory=TrainTokenizerParams)
    encode: EncodeParams = Field(default_factory=EncodeParams)
    train_target: TrainTargetParams = Field(default_factory=TrainTargetParams)
    init_target: InitTargetParams = Field(default_factory=InitTargetParams)
    init_tokenizer: InitTokenizerParams = Field(default_factory=InitTokenizerParams)
    sample: SampleParams = Field(default_factory=SampleParams)
    premise: PremiseParams = Field(default_factory=PremiseParams)
    train_judge: TrainJudgeParams = Field(default_factory=TrainJudgeParams)
    train_drafter: TrainDrafterParams = Field(default_factory=TrainDrafterParams)
    cache_logits: CacheLogitsParams = Field(default_factory=CacheLogitsParams)
    ablate_lid: AblateLIDParams = Field(default_factory=AblateLIDParams)
    ablate_arch: AblateArchParams = Field(default_factory=AblateArchParams)
    drafters: DraftersParams = Field(default_factory=DraftersParams)
    corpora: CorporaParams = Field(default_factory=CorporaParams)
    quality: QualityParams = Field(default_factory=QualityParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    bench: BenchParams = Field(default_factory=BenchParams)
    bench_spec: BenchSpecParams = Field(default_factory=BenchSpecParams)
    calibrate: CalibrateParams = Field(default_factory=CalibrateParams)
    table: TableParams = Field(default_factory=TableParams)
    scoreboard: ScoreboardParams = Field(default_factory=ScoreboardParams)
    launch: LaunchParams = Field(default_factory=LaunchParams)

    def world(self, name: str) -> WorldParams:
        if name not in self.worlds:
            raise ConfigError(f"unknown world {name!r}; params.yaml defines {sorted(self.worlds)}")
        return self.worlds[name]

    def named_method(self, name: str) -> DecodeMethod:
        """The decoding method a name stands for: a key of table.cells (the table's rows: lisa-a, lisa-sampled,
        ...) or a name of bench_spec.methods, in that order."""
        fields = [f.name for f in dataclasses.fields(DecodeMethod)]
        if name in self.table.cells:
            m = self.table.cells[name]
        elif name in (named := {m.name: m for m in self.bench_spec.methods}):
            m = named[name]
        else:
            raise ConfigError(f"method {name!r}: not 'vanilla', a verifier, a key of table.cells "
                              f"{sorted(self.table.cells)} nor a name of bench_spec.methods {sorted(named)}")
        return DecodeMethod(**{f: getattr(m, f) for f in fields} | {"options": dict(m.options)})


def _describe(err: dict, source: str) -> str:
    loc = [str(p) for p in err["loc"]]
    section = ".".join(loc[:-1]) or "<top level>"
    key = loc[-1] if loc else "?"
    if err["type"] == "unexpected_keyword_argument":
        return f"{source}: unknown key {key!r} in section {section!r}"
    if err["type"] == "missing_argument" or err["type"] == "missing":
        return f"{source}: missing key {key!r} in section {section!r}"
    return f"{source}: bad value for {key!r} in section {section!r}: {err['msg']} (got {err.get('input')!r})"


def sampling_sections(cls: type = None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The key paths of the sections of `cls` (default Params) that sample (SamplingParams), nested ones included."""
    cls = cls or Params
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            out += [path + (f.name,)] if issubclass(t, SamplingParams) else sampling_sections(t, path + (f.name,))
    return out


def inherit_sampling(raw: dict) -> dict:
    """A copy of raw params whose sampling sections (sampling_sections) hold every top-level `sampling` value they
    do not set themselves (a section left out inherits them all)."""
    top = raw.get("sampling") or {}
    top = {k: v for k, v in top.items() if k in SAMPLING_KEYS} if isinstance(top, dict) else {}
    out = copy.deepcopy(raw)
    for path in sampling_sections():
        node = out
        for key in path:
            node = node.setdefault(key, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):
            for k, v in top.items():
                node.setdefault(k, v)
    return out


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    try:
        params = TypeAdapter(Params).validate_python(inherit_sampling(raw))
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err, source) for err in e.errors())) from None
    for name in params.table.cells:
        if "." in name or "@" in name:
            raise ConfigError(f"{source}: section 'table': cell key {name!r}: no '.' or '@' (DVC stage and param "
                              "names); name the bench method in the cell's `bench` field instead")
    for name in params.table.rows + params.table.pareto:
        if name not in params.table.cells:
            raise ConfigError(f"{source}: section 'table': {name!r} is listed but not defined in table.cells")
    bench_names = {m.name: m for m in params.bench_spec.methods}
    for name in params.table.rows:
        b = params.table.cells[name].bench or name
        if b not in bench_names:
            raise ConfigError(f"{source}: section 'table': row {name!r} is timed as {b!r}, which is not in "
                              "bench_spec.methods (its speedup and tau come from there)")
        if params.table.cells[name].as_method(b) != bench_names[b]:
            raise ConfigError(f"{source}: section 'table': cells.{name} differs from bench_spec.methods' {b!r}: "
                              "a row's quality and speed must come from the same method")
    sb = params.scoreboard
    for name in list(sb.families) + list(sb.points):
        if "." in name or "@" in name:
            raise ConfigError(f"{source}: section 'scoreboard': key {name!r}: no '.' or '@' (DVC stage names)")
    for name, fam in sb.families.items():
        for key, values in fam.grid.items():
            if not values:
                raise ConfigError(f"{source}: section 'scoreboard.families.{name}.grid': {key!r} has no values")
        try:
            fam.points()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{source}: section 'scoreboard.families.{name}': {e}") from None
    for name, pt in sb.points.items():
        if pt.world not in params.worlds:
            raise ConfigError(f"{source}: section 'scoreboard.points.{name}': world {pt.world!r} is not in worlds "
                              f"{sorted(params.worlds)}")
        if pt.family not in sb.families:
            raise ConfigError(f"{source}: section 'scoreboard.points.{name}': family {pt.family!r} is not in "
                              f"scoreboard.families {sorted(sb.families)}")
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_params(raw, str(path))


def profile_text(name: str) -> str:
    """The YAML text of a named profile shipped in lisa/profiles/ (micro, toy)."""
    files = resources.files("lisa") / "profiles"
    names = sorted(p.name.removesuffix(".yaml") for p in files.iterdir() if p.name.endswith(".yaml"))
    if name not in names:
        raise ConfigError(f"unknown profile {name!r}; known: {names}")
    return (files / f"{name}.yaml").read_text()
