"""Strict construction of the model config dataclasses from a named preset plus field overrides."""
from __future__ import annotations

from dataclasses import fields
from typing import Optional, TypeVar

C = TypeVar("C")


def build_config(cls: type[C], presets: dict[str, dict], preset: Optional[str] = None, **overrides) -> C:
    """`cls` from `presets[preset]` updated with `overrides`; an unknown preset or field is a ValueError."""
    base = {}
    if preset is not None:
        if preset not in presets:
            raise ValueError(f"unknown {cls.__name__} preset {preset!r}; known: {sorted(presets)}")
        base = dict(presets[preset])
    d = {**base, **overrides}
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
    return cls(**d)
