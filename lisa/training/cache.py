"""Target logit cache: one teacher-forced pass of the target over a dataset, kept as Parquet shards, so drafter
training reads its labels instead of recomputing the target's output head.

One Parquet row per (sequence, pass, position): the target's distribution of image token `pos` given the
condition and the tokens before it. `uncond` rows come from the unconditional pass (null class / empty caption)
that a share of the sequences also get (what CFG-aware drafters train on). Columns (explicit Arrow schema,
compact types; `cache_schema`):

  seq int32, pos int16, uncond bool, token uint16 (the dataset's token at pos),
  topk_idx fixed_size_list<uint16>[K], topk_logit fixed_size_list<float16>[K] (raw logits, descending),
  lse float32 (logsumexp of all logits), entropy float16 (nats), margin float16 (top-1 minus top-2 logit)

Shard i holds sequences [i * shard_size, (i + 1) * shard_size), rows ordered by (seq, uncond, pos), computed in
fixed batches, so a shard's bytes depend only on the target, the data and the settings. A shard is written to a
temporary file and renamed, with its sha256 beside it (`sha256/shard-*.parquet`), so a killed run leaves only whole
shards; rerunning keeps a shard only if its bytes still match that hash (resumable: the result equals an
uninterrupted run's; a changed or unhashed shard is written again). identity.json records what the cache is a
function of (target, source data, settings, version): a rerun with another identity clears the folder first, so
a cache never mixes settings. A committed copy of it (data/identity/cache/<world>.json, written with the manifest) is
what consumers (calibrate, ablate-lid, ablate-arch) depend on in dvc.yaml, not the shards' bytes, which may differ
in float rounding from one CPU to another, nor the folder, which a fresh clone lacks; `open_cache` checks the two
are equal. Workers (torchrun ranks) take every world_size-th shard; rank 0 writes
manifest.json when all are there. Every shard's schema metadata and the manifest carry the target's sha256:
readers (`open_cache`) check the schema and refuse a cache made by another target.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor
from tqdm import tqdm

from lisa.checkpoint import atomic_write, file_sha256, read_json, write_json
from lisa.models.gpt import Transformer

CACHE_VERSION = "1"
MANIFEST = "manifest.json"
IDENTITY = "identity.json"


class CacheError(ValueError):
    """A logit cache that does not fit: wrong schema, missing shard, or made by another target."""


def cache_schema(K: int, target_sha256: str) -> pa.Schema:
    return pa.schema(
        [
            pa.field("seq", pa.int32(), nullable=False),
            pa.field("pos", pa.int16(), nullable=False),
            pa.field("uncond", pa.bool_(), nullable=False),
            pa.field("token", pa.uint16(), nullable=False),
            pa.field("topk_idx", pa.list_(pa.uint16(), K), nullable=False),
            pa.field("topk_logit", pa.list_(pa.float16(), K), nullable=False),
            pa.field("lse", pa.float32(), nullable=False),
            pa.field("entropy", pa.float16(), nullable=False),
            pa.field("margin", pa.float16(), nullable=False),
        ],
        metadata={"lisa.cache.version": CACHE_VERSION, "lisa.cache.K": str(K),
                  "lisa.cache.target_sha256": target_sha256},
    )


def shard_rows(first: int, last: int, uncond_every: int) -> list[tuple[int, bool]]:
    """The (sequence, unconditional) passes of a shard: every sequence conditionally, and every uncond_every-th
    (seq % uncond_every == 0) once more unconditionally; 0 = no unconditional pass."""
    rows = []
    for s in range(first, last):
        rows.append((s, False))
        if uncond_every and s % uncond_every == 0:
            rows.append((s, True))
    return rows


@torch.inference_mode()
def logit_stats(logits: Tensor, K: int) -> dict[str, Tensor]:
    """(B, T, V) logits -> top-K indices / values, logsumexp, entropy, top-1 minus top-2 margin."""
    logits = logits.float()
    lse = logits.logsumexp(-1)
    logp = logits - lse[..., None]
    entropy = -(logp.exp() * logp).sum(-1)
    top, idx = logits.topk(max(K, 2), dim=-1)
    return {"topk_idx": idx[..., :K], "topk_logit": top[..., :K], "lse": lse, "entropy": entropy,
            "margin": top[..., 0] - top[..., 1]}


def _table(rows: list[tuple[int, bool]], tokens: Tensor, stats: dict[str, Tensor], schema: pa.Schema) -> pa.Table:
    R, T = tokens.shape
    K = stats["topk_idx"].shape[-1]
    seq = np.repeat(np.array([r[0] for r in rows], dtype=np.int32), T)
    unc = np.repeat(np.array([r[1] for r in rows], dtype=bool), T)
    pos = np.tile(np.arange(T, dtype=np.int16), R)

    def fixed(x: Tensor, dtype) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1).numpy().astype(dtype)), K)

    cols = [pa.array(seq), pa.array(pos), pa.array(unc), pa.array(tokens.reshape(-1).numpy().astype(np.uint16)),
            fixed(stats["topk_idx"], np.uint16), fixed(stats["topk_logit"], np.float16),
            pa.array(stats["lse"].reshape(-1).numpy().astype(np.float32)),
            pa.array(stats["entropy"].reshape(-1).numpy().astype(np.float16)),
            pa.array(stats["margin"].reshape(-1).numpy().astype(np.float16))]
    return pa.Table.from_arrays(cols, schema=schema)


@dataclass
class CacheSpec:
    K: int = 64
    shard_size: int = 512  # sequences per shard
    batch_size: int = 64  # rows per teacher-forced forward
    uncond_every: int = 10  # every 10th sequence also gets an unconditional pass (10%)


def write_cache(target: Transformer, target_sha256: str, tokens: Tensor, cond: Tensor, spec: CacheSpec,
                out_dir: str | Path, rank: int = 0, world_size: int = 1, progress: bool = True,
                stop_after: Optional[int] = None) -> list[Path]:
    """Write this rank's shards (skipping finished ones) for sequences tokens (N, T) / cond (N, ...). Returns the
    shard paths this rank owns. stop_after: return after writing that many new shards (tests of resumption)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if int(tokens.max()) > 65535 or target.config.vocab_size > 65536:
        raise CacheError(f"vocab {target.config.vocab_size}: token ids must fit uint16")
    schema = cache_schema(spec.K, target_sha256)
    n_shards = -(-len(tokens) // spec.shard_size)
    mine = [i for i in range(n_shards) if i % world_size == rank]
    paths, written = [], 0
    target.eval()
    for i in tqdm(mine, desc=f"cache logits (rank {rank})", unit="shard", disable=not progress):
        path = out / f"shard-{i:05d}.parquet"
        paths.append(path)
        if _shard_kept(path, schema):
            continue
        rows = shard_rows(i * spec.shard_size, min((i + 1) * spec.shard_size, len(tokens)), spec.uncond_every)
        tables = []
        for b in range(0, len(rows), spec.batch_size):
            batch = rows[b : b + spec.batch_size]
            idx = torch.tensor([r[0] for r in batch])
            drop = torch.tensor([r[1] for r in batch])
            with torch.inference_mode():
                logits = target.teacher_forced(cond[idx], tokens[idx], drop).logits
            tables.append(_table(batch, tokens[idx], logit_stats(logits, spec.K), schema))
        table = pa.concat_tables(tables)
        atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd", write_statistics=False))
        atomic_write(_hash_file(path), lambda tmp: Path(tmp).write_text(file_sha256(path) + "\n"))
        written += 1
        if stop_after is not None and written >= stop_after:
            break
    return paths


def same_schema(found: pa.Schema, expected: pa.Schema) -> bool:
    """Fields and types equal (Parquet renames list children; that is ignored), and our metadata keys equal."""
    ours = {k: v for k, v in (expected.metadata or {}).items()}
    theirs = {k: v for k, v in (found.metadata or {}).items() if k in ours}
    return found.equals(expected, check_metadata=False) and theirs == ours


def _hash_file(shard: Path) -> Path:
    return shard.parent / "sha256" / shard.name


def _shard_kept(path: Path, schema: pa.Schema) -> bool:
    """A shard of an earlier run is kept if it has this cache's schema and still has the bytes it was written with."""
    h = _hash_file(path)
    return (path.is_file() and h.is_file() and _shard_ok(path, schema)
            and h.read_text().strip() == file_sha256(path))


def cache_identity(target_sha256: str, spec: CacheSpec, num_sequences: int, seq_len: int, source: dict) -> dict:
    """What a cache's content is a function of: the target, the source data (e.g. the codes' sha256), the settings."""
    return {"version": CACHE_VERSION, "target_sha256": target_sha256, "spec": asdict(spec),
            "num_sequences": num_sequences, "seq_len": seq_len, "source": source}


def prepare_cache_dir(out_dir: str | Path, identity: dict) -> Optional[str]:
    """Start or resume a cache in out_dir (rank 0, before any shard is written): a folder holding a cache of another
    identity (or of none) is cleared, so shards of other settings are never reused. Returns why it was cleared."""
    out = Path(out_dir)
    path = out / IDENTITY
    try:
        old = json.loads(path.read_text()) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        old = {"unreadable": str(path)}  # of no known settings: cleared like any other
    why = None
    if old != identity and out.is_dir() and any(out.iterdir()):
        why = (f"{out}: holds a cache of other settings ({_identity_diff(old, identity)}): cleared"
               if old is not None else f"{out}: holds files but no {IDENTITY}: cleared")
        for f in [*out.glob("shard-*"), *out.glob("sha256/shard-*"), out / MANIFEST, path]:
            f.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if old != identity:
        write_json(path, identity)
    return why


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _identity_diff(old: dict, new: dict) -> str:
    a, b = _flat(old), _flat(new)
    return ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def _shard_ok(path: Path, schema: pa.Schema) -> bool:
    try:
        return same_schema(pq.read_schema(path), schema)
    except (pa.ArrowInvalid, OSError):
        return False


def write_manifest(out_dir: str | Path, target_sha256: str, spec: CacheSpec, num_sequences: int,
                   seq_len: int, extra: Optional[dict] = None) -> dict:
    """After every shard exists: the manifest that readers check (shards, their hashes, the target's hash)."""
    out = Path(out_dir)
    n_shards = -(-num_sequences // spec.shard_size)
    schema = cache_schema(spec.K, target_sha256)
    shards = []
    for i in range(n_shards):
        path = out / f"shard-{i:05d}.parquet"
        if not _shard_kept(path, schema):
            raise CacheError(f"{path}: missing or not a shard of this cache (target {target_sha256[:12]}, K {spec.K}), "
                             f"or changed since it was written (its bytes differ from sha256/{path.name})")
        shards.append({"file": path.name, "rows": pq.ParquetFile(path).metadata.num_rows,
                       "bytes": path.stat().st_size, "sha256": file_sha256(path)})
    tokens = sum(s["rows"] for s in shards)
    manifest = {"version": CACHE_VERSION, "target_sha256": target_sha256, "K": spec.K,
                "shard_size": spec.shard_size, "batch_size": spec.batch_size, "uncond_every": spec.uncond_every,
                "num_sequences": num_sequences, "seq_len": seq_len, "tokens": tokens,
                "bytes": sum(s["bytes"] for s in shards), "schema": schema.to_string(show_schema_metadata=False),
                "shards": shards} | (extra or {})
    manifest["bytes_per_token"] = manifest["bytes"] / max(tokens, 1)
    write_json(out / MANIFEST, manifest)
    return manifest


@dataclass
class LogitCache:
    """An opened cache: (R, T[, K]) tensors over its R (sequence, pass) rows, in shard order."""
    manifest: dict
    seq: Tensor  # (R,)
    uncond: Tensor  # (R,) bool
    token: Tensor  # (R, T)
    topk_idx: Tensor  # (R, T, K) long
    topk_logit: Tensor  # (R, T, K) float32
    lse: Tensor  # (R, T)
    entropy: Tensor  # (R, T)
    margin: Tensor  # (R, T)

    def topk_probs(self) -> Tensor:
        """(R, T, K) the target's probabilities of its top-K tokens (exp(logit - lse): not renormalised)."""
        return (self.topk_logit - self.lse[..., None]).exp()


def open_cache(cache_dir: str | Path, target_sha256: Optional[str] = None,
               identity_file: Optional[Path] = None) -> LogitCache:
    """Read a cache, checking its manifest, every shard's schema and hash, (if given) the target's hash, and (if given)
    that its identity.json equals identity_file (the committed copy that cache-logits writes: the readers' dep)."""
    d = Path(cache_dir)
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise CacheError(f"{mpath}: no manifest: the cache is incomplete or not a logit cache (`lisa cache-logits`)")
    if identity_file is not None:
        if not Path(identity_file).is_file():
            raise CacheError(f"{identity_file}: no such file (`lisa cache-logits` writes it with the cache)")
        want = read_json(identity_file, CacheError)
        got = read_json(d / IDENTITY, CacheError) if (d / IDENTITY).is_file() else {}
        if want != got:
            raise CacheError(f"{d / IDENTITY} differs from {identity_file} ({_identity_diff(want, got)}): the cache "
                             "is not the one the stage depends on; rebuild it (`lisa cache-logits`)")
    m = read_json(mpath, CacheError)
    if m.get("version") != CACHE_VERSION:
        raise CacheError(f"{mpath}: cache version {m.get('version')!r}, this lisa reads {CACHE_VERSION!r}")
    if target_sha256 is not None and m["target_sha256"] != target_sha256:
        raise CacheError(f"{d}: logit cache made by target {m['target_sha256']}, but the target given has sha256 "
                         f"{target_sha256}: rebuild it (`lisa cache-logits`)")
    schema = cache_schema(m["K"], m["target_sha256"])
    tables = []
    for s in m["shards"]:
        path = d / s["file"]
        if not path.is_file():
            raise CacheError(f"{path}: shard listed in the manifest is missing")
        try:
            found = pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as e:  # a damaged footer
            raise CacheError(f"{path}: not a readable Parquet shard ({e})") from None
        if not same_schema(found, schema):
            raise CacheError(f"{path}: schema differs from the cache's:\n{found}\nexpected:\n{schema}")
        if file_sha256(path) != s["sha256"]:
            raise CacheError(f"{path}: sha256 differs from the manifest's: the shard changed after the cache was made")
        tables.append(pq.read_table(path))
    t = pa.concat_tables(tables)
    T, K = m["seq_len"], m["K"]
    R = t.num_rows // T

    def col(name, dtype=None):
        return torch.from_numpy(t.column(name).to_numpy().astype(dtype) if dtype else t.column(name).to_numpy())

    def fixed(name, dtype):
        flat = t.column(name).combine_chunks().flatten().to_numpy().astype(dtype)
        return torch.from_numpy(flat).reshape(R, T, K)

    return LogitCache(m, col("seq")[::T].clone().long(), col("uncond", bool)[::T].clone(),
                      col("token", np.int64).reshape(R, T), fixed("topk_idx", np.int64), fixed("topk_logit", np.float32),
                      col("lse", np.float32).reshape(R, T), col("entropy", np.float32).reshape(R, T),
                      col("margin", np.float32).reshape(R, T))


def dist_env() -> tuple[int, int]:
    """(rank, world_size) from torchrun's environment; (0, 1) for a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def throughput(target: Transformer, tokens: Tensor, cond: Tensor, spec: CacheSpec, batches: int = 3) -> dict:
    """Tokens/s of a bare teacher-forced forward against the same forward + the cache's statistics and Arrow
    conversion (no disk), interleaved on the first `batches` batches after one warm-up pair."""
    rows = shard_rows(0, min(len(tokens), batches * spec.batch_size), 0)
    schema = cache_schema(spec.K, "-")
    times = {"bare": 0.0, "cache": 0.0}
    n = 0
    for b in range(-spec.batch_size, len(rows), spec.batch_size):  # the first batch twice: a warm-up
        batch = rows[max(b, 0) : max(b, 0) + spec.batch_size]
        idx = torch.tensor([r[0] for r in batch])
        for kind in ("bare", "cache"):
            t0 = time.perf_counter()
            with torch.inference_mode():
                logits = target.teacher_forced(cond[idx], tokens[idx]).logits
                if kind == "cache":
                    _table(batch, tokens[idx], logit_stats(logits, spec.K), schema)
            if b >= 0:
                times[kind] += time.perf_counter() - t0
        if b >= 0:
            n += idx.numel() * tokens.shape[1]
    return {"bare_tokens_per_s": n / times["bare"], "cache_tokens_per_s": n / times["cache"],
            "cache_vs_bare": times["bare"] / times["cache"]}
