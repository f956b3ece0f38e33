"""Checkpoint I/O: our artifacts (safetensors + JSON sidecar) and official LlamaGen `.pt` checkpoints.

Our format: `<name>.safetensors` holds the weights, `<name>.json` the lineage: `kind`, `config`, `step`, `seed`,
`sha256` (content hash of the weights file), and `made_from` (hashes of the artifacts it was derived from).
Nothing is unpickled: official `.pt` files are read with `torch.load(weights_only=True)`.
Every failure names the file and the offending keys or shapes.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

# Wrappers under which training scripts store weights (LlamaGen: "model"; DDP/DeepSpeed: "module"; Lightning ...).
WRAPPER_KEYS = ("model", "module", "state_dict")
# Prefixes left by DDP / torch.compile around every key.
STRIP_PREFIXES = ("module.", "_orig_mod.")


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not fit the model it is loaded into."""


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]):
    """Run write(tmp_path) then rename over `path`, so a crash never leaves a half-written file."""
    atomic_write_all({path: write})


def atomic_write_all(writes: dict[str | os.PathLike, Callable[[str], None]]):
    """Several files that make one output (a grid, its tokens and its metrics): each written to a temporary beside
    it, then all renamed into place one after the other (in the order given: put the metrics last), so a crash while
    writing leaves the old set whole. A temporary is `.<name>.<random>.tmp`: .gitignore and .dvcignore skip it, and
    the next write of the same file removes one that a killed run left behind."""
    temps, umask = [], os.umask(0)
    os.umask(umask)
    try:
        for path, write in writes.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):  # a killed run's leftover
                stale.unlink(missing_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            temps.append((tmp, path))
            write(tmp)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual permissions of a new file
        for tmp, path in temps:
            os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)


def json_writer(obj: Any) -> Callable[[str], None]:
    """A writer of obj as indented JSON, for atomic_write / atomic_write_all."""
    def w(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")

    return w


def write_json(path: str | os.PathLike, obj: Any):
    atomic_write(path, json_writer(obj))


# ---------------------------------------------------------------------------------------------------------------
# Reading raw state dicts


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a `.safetensors` file, or of a torch `.pt`/`.pth`/`.bin` (weights_only) with the weights at the
    top level or under one of WRAPPER_KEYS. Errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # zip errors, unpickling refusals, EOF: all mean "not a usable checkpoint"
        raise CheckpointError(f"{path}: cannot be read as a torch checkpoint (truncated, corrupt, or not "
                              f"weights-only loadable): {type(e).__name__}: {e}") from e
    if isinstance(obj, dict):
        for key in WRAPPER_KEYS:
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        top = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path}: no state dict found (looked at the top level and under {WRAPPER_KEYS}); "
                              f"top-level entries: {top}")
    out = {}
    for k, v in obj.items():
        for p in STRIP_PREFIXES:
            k = k[len(p):] if k.startswith(p) else k
        out[k] = v
    return out


def check_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], path, ignore: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError naming missing / unexpected keys and shape mismatches between `sd` and `model`."""
    expected = model.state_dict()
    keys = {k for k in sd if not any(k.startswith(i) or i in k for i in ignore)}
    missing = sorted(set(expected) - keys)
    unexpected = sorted(keys - set(expected))
    shapes = [f"{k}: file {tuple(sd[k].shape)} vs model {tuple(expected[k].shape)}"
              for k in sorted(keys & set(expected)) if sd[k].shape != expected[k].shape]
    bad = nonfinite(sd, keys)
    if missing or unexpected or shapes or bad:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_clip(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_clip(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches ({len(shapes)}): {_clip(shapes)}")
        if bad:
            parts.append(f"NaN or inf values in {len(bad)} tensors: {_clip(bad)}")
        raise CheckpointError(f"{path} does not fit {type(model).__name__}: " + "; ".join(parts))


def nonfinite(tensors: dict[str, torch.Tensor], keys=None) -> list[str]:
    """The names of the floating tensors (of `keys`, default all) that hold a NaN or an inf."""
    return sorted(k for k in (tensors if keys is None else keys)
                  if tensors[k].is_floating_point() and not bool(torch.isfinite(tensors[k]).all()))


def _clip(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... (+{len(items) - n})" if len(items) > n else "")


def load_into(model: nn.Module, sd: dict[str, torch.Tensor], path, ignore: tuple[str, ...] = ()) -> nn.Module:
    check_state_dict(model, sd, path, ignore)
    expected = model.state_dict()
    model.load_state_dict({k: v for k, v in sd.items() if k in expected}, strict=True)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Our artifacts: safetensors + JSON sidecar


def sidecar_path(weights: str | os.PathLike) -> Path:
    return Path(weights).with_suffix(".json")


def save_artifact(model: nn.Module, path: str | os.PathLike, kind: str, config, step: int = 0,
                  seed: Optional[int] = None, made_from: Optional[dict] = None, extra: Optional[dict] = None,
                  store_dtype: Optional[torch.dtype] = None) -> dict:
    """Write `path` (.safetensors) and its JSON sidecar atomically; returns the sidecar dict. `store_dtype`
    (e.g. torch.float16) stores floating tensors smaller; loading casts them back into the model's dtype."""
    path = Path(path)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    bad = nonfinite(tensors)
    if bad:  # a diverged run: nothing is written, the last good checkpoint stays
        raise CheckpointError(f"{path}: not saved: the {kind} has NaN or inf weights in {len(bad)} tensors "
                              f"({_clip(bad, 4)}); training diverged (lower the learning rate?)")
    if store_dtype is not None:
        tensors = {k: v.to(store_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp))
    meta = {
        "kind": kind,
        "config": asdict(config) if hasattr(config, "__dataclass_fields__") else dict(config),
        "step": int(step),
        "seed": seed,
        "sha256": file_sha256(path),
        "made_from": made_from or {},
        **({"stored_dtype": str(store_dtype).removeprefix("torch.")} if store_dtype is not None else {}),
        **(extra or {}),
    }
    write_json(sidecar_path(path), meta)
    return meta


def read_json(path: str | os.PathLike, error: type[Exception] = ValueError):
    """The content of JSON file `path`; a file that is not JSON raises `error` with a line that names it."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None


def read_sidecar(path: str | os.PathLike, kind: Optional[str] = None, verify_hash: bool = True) -> dict:
    path = Path(path)
    side = sidecar_path(path)
    if not side.is_file():
        raise CheckpointError(f"{path}: its sidecar {side} is missing (it carries the config and lineage)")
    meta = read_json(side, CheckpointError)
    for key in ("kind", "config", "sha256"):
        if key not in meta:
            raise CheckpointError(f"{side}: missing key {key!r}")
    if kind is not None and meta["kind"] != kind:
        raise CheckpointError(f"{path}: is a {meta['kind']!r} artifact, expected {kind!r}")
    if verify_hash and path.is_file():
        actual = file_sha256(path)
        if actual != meta["sha256"]:
            raise CheckpointError(f"{path}: content hash {actual[:12]} does not match its sidecar "
                                  f"{side} ({meta['sha256'][:12]}): the weights changed or are truncated")
    return meta


def load_artifact(path: str | os.PathLike, kind: str, build: Callable[[dict], nn.Module]) -> tuple[nn.Module, dict]:
    """Read sidecar (checks kind and hash), build the model from its config, load the weights strictly."""
    meta = read_sidecar(path, kind)
    try:
        model = build(meta["config"])
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a config of the wrong shape or types
        raise CheckpointError(f"{sidecar_path(Path(path))}: its `config` does not build a {kind} "
                              f"({type(e).__name__}: {e})") from None
    load_into(model, read_state_dict(path), path)
    return model, meta
