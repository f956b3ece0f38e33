"""params.yaml as the stages run it: lisa.config's schema (plain data, strict), then what only the code can check,
at load rather than an hour into a run: each decoding method against the verifier registry (its name and options,
lisa.decoding.verify), each world's target and tokenizer against the model presets and each other
(lisa.models.gpt, lisa.models.vq), and bench's random target. run_stage and the CLI load params through here."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

from lisa.config import ConfigError, DecodeMethod, Params, SweepFamily, load_params as load_schema
from lisa.config import parse_params as parse_schema
from lisa.decoding.verify import VERIFIERS, verifier_options
from lisa.models.gpt import gpt_config
from lisa.models.vq import vq_config


def methods(node: Any, loc: tuple[str, ...] = ()) -> Iterator[tuple[str, DecodeMethod]]:
    """(section path, method) of every decoding method in params: the sections that are one (sample, ablate_lid's
    tree is not: a DraftTree), bench_spec.methods, table.cells, and the scoreboard families with each grid point."""
    if isinstance(node, DecodeMethod):
        yield ".".join(loc), node
    if isinstance(node, SweepFamily):
        for label, m in node.points():
            yield ".".join(loc + (label,)), m
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from methods(getattr(node, f.name), loc + (f.name,))
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from methods(value, loc + (str(key),))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from methods(value, loc + (str(i),))


def check_params(params: Params, source: str = "params.yaml") -> Params:
    """params, or a ConfigError naming the file, section and key of what the code rejects."""
    for name, world in params.worlds.items():
        built = {}
        for section, build, kw in (("target", gpt_config, world.target), ("tokenizer", vq_config, world.tokenizer)):
            try:
                built[section] = build(**kw)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{source}: section 'worlds.{name}.{section}': {e}") from None
        g, v = built["target"], built["tokenizer"]
        small = {k: getattr(g, k) for k in ("n_layer", "n_head", "dim", "vocab_size", "block_size") if getattr(g, k) < 1}
        if small:
            raise ConfigError(f"{source}: section 'worlds.{name}.target': sizes must be >= 1, got {small}")
        if params.cache_logits.K > g.vocab_size:
            raise ConfigError(f"{source}: section 'cache_logits': K {params.cache_logits.K} is above world {name!r}'s "
                              f"vocabulary ({g.vocab_size} codes)")
        if world.target_checkpoint is None and g.block_size != v.grid_size**2:
            raise ConfigError(f"{source}: world {name!r}: target block_size {g.block_size} != tokenizer grid "
                              f"{v.grid_size}x{v.grid_size} (image_size {v.image_size} / downsample {v.downsample})")
        if world.target_checkpoint is None and g.vocab_size != v.codebook_size:
            raise ConfigError(f"{source}: world {name!r}: target vocab_size {g.vocab_size} != tokenizer "
                              f"codebook_size {v.codebook_size}")
    known = {"release", "lid", *params.drafters.named}
    if taken := {"release", "lid"} & set(params.drafters.named):
        raise ConfigError(f"{source}: section 'drafters.named': {sorted(taken)} name the drafters of train-drafter "
                          f"and ablate-lid: choose another name")
    for key, run in params.drafters.runs.items():
        where = f"{source}: section 'drafters.runs.{key}'"
        if run.world not in params.worlds:
            raise ConfigError(f"{where}: unknown world {run.world!r}; params defines {sorted(params.worlds)}")
        if run.drafter not in params.drafters.named:
            raise ConfigError(f"{where}: no drafter {run.drafter!r} in drafters.named "
                              f"{sorted(params.drafters.named)}")
        if key != f"{run.world}-{run.drafter}":  # the stage's name says what it trains
            raise ConfigError(f"{where}: the key must be <world>-<drafter>: {run.world}-{run.drafter}")
    for loc, m in methods(params):
        if m.drafter not in known:
            raise ConfigError(f"{source}: bad value for 'drafter' in section {loc!r}: {m.drafter!r} is not release, "
                              f"lid nor a key of drafters.named {sorted(params.drafters.named)}")
        if m.method != "vanilla" and m.method not in VERIFIERS:
            raise ConfigError(f"{source}: bad value for 'method' in section {loc!r}: decoding method {m.method!r}: "
                              f"not 'vanilla' nor a verifier {sorted(VERIFIERS)}")
        if m.method != "vanilla":
            try:
                verifier_options(m.method, m.options)
            except ValueError as e:
                raise ConfigError(f"{source}: bad value for 'options' in section {loc!r}: {e}") from None
    try:
        gpt_config(**params.bench.target)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: section 'bench.target': {e}") from None
    return params


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    """lisa.config.parse_params, then `check_params`."""
    return check_params(parse_schema(raw, source), source)


def load_params(path: str | Path = "params.yaml") -> Params:
    """lisa.config.load_params, then `check_params`."""
    return check_params(load_schema(path), str(Path(path)))
