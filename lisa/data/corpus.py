"""Drafter training corpora: built with HuggingFace `datasets` from local files, stored as Parquet shards.

Two builders, one output format (what `lisa cache-logits --corpus DIR` and the drafter training read):

* `laion-coco`: an image-caption source in LAION-COCO's layout. The metadata is LAION-COCO's public Parquet files
  (columns URL, TEXT, top_caption, all_captions, all_similarities, WIDTH, HEIGHT, similarity, hash, pwatermark,
  punsafe). The images are what img2dataset fetched from those URLs, in any of its three output formats:
  Parquet shards (columns key, url, caption, jpg, status, ...), WebDataset tar shards ({key}.jpg + {key}.json with
  the url), or a folder of {key}.jpg + {key}.json. Rows are filtered on the metadata (WIDTH and HEIGHT >=
  min_size, punsafe <= max_punsafe, pwatermark <= max_pwatermark, similarity >= min_similarity), joined to the
  fetched images on the URL (failed downloads dropped), centre-cropped and resized to the tokenizer's resolution,
  encoded to VQ codes, and the caption (top_caption, LAION-COCO's BLIP caption) encoded by the caption encoder.
* `self-generated`: the target samples N images from classes or prompts (how Lumina-mGPT's drafter data is made);
  the manifest records the sampling settings and the target's hash.

Output: `shard-NNNNN.parquet` files with an explicit Arrow schema (key, caption, label int16, codes
fixed_size_list<int16>[T]; for text-conditional worlds caption_feats fixed_size_list<float16>[C * D]) and
`manifest.json` (what was built from what, the filter counts, the tokenizer / target hash, every shard's sha256).
Shards are written atomically and a rerun skips the finished ones, so a killed build resumes.

`make_laion_fixture` writes a small source in exactly that layout from the built-in emoji images (our test
fixture; its punsafe / pwatermark / similarity values are drawn from a seeded RNG, and a share of rows are made
small, or failed downloads, so that every filter has something to remove).
"""
from __future__ import annotations

import io
import itertools
import json
import tarfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image
from tqdm import tqdm

from lisa.checkpoint import atomic_write, file_sha256, write_json
from lisa.config import LaionFilter, seed_for

LAION_COCO_COLUMNS = ("URL", "TEXT", "top_caption", "all_captions", "all_similarities", "WIDTH", "HEIGHT",
                      "similarity", "hash", "pwatermark", "punsafe")
MANIFEST = "manifest.json"


class CorpusError(ValueError):
    """A corpus source or a built corpus is missing, malformed or made for another model; the message names it."""


def corpus_schema(T: int, feat_len: Optional[int], prompt_len: Optional[int] = None) -> pa.Schema:
    fields = [pa.field("key", pa.string()), pa.field("caption", pa.string()), pa.field("label", pa.int16()),
              pa.field("codes", pa.list_(pa.int16(), T))]
    if feat_len:
        fields.append(pa.field("caption_feats", pa.list_(pa.float16(), feat_len)))
    if prompt_len:  # lm (Lumina-mGPT) targets: the prompt's token ids, -1 at padding
        fields.append(pa.field("prompt_ids", pa.list_(pa.int32(), prompt_len)))
    return pa.schema(fields)


def shard_path(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}.parquet"


def write_shards(out: Path, n: int, shard_size: int, make_shard: Callable[[int, int], pa.Table], desc: str):
    """make_shard(start, stop) -> table, for each missing shard of rows [0, n); atomic, resumable."""
    out.mkdir(parents=True, exist_ok=True)
    starts = range(0, n, shard_size)
    for i, start in enumerate(tqdm(starts, desc=desc)):
        path = shard_path(out, i)
        if path.is_file():
            continue
        table = make_shard(start, min(n, start + shard_size))
        atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def finish(out: Path, n: int, shard_size: int, info: dict) -> dict:
    shards = [shard_path(out, i) for i in range((n + shard_size - 1) // shard_size)]
    manifest = info | {"rows": n, "shards": [{"file": s.name, "sha256": file_sha256(s)} for s in shards],
                       "bytes": sum(s.stat().st_size for s in shards)}
    write_json(out / MANIFEST, manifest)
    return manifest


# ---------------------------------------------------------------------------------------------------------------
# LAION-COCO


def read_metadata(files: list[Path]):
    """LAION-COCO metadata Parquet files -> a datasets.Dataset; an error names a file that lacks a column."""
    from datasets import load_dataset

    if not files:
        raise CorpusError("laion-coco: no metadata .parquet files given")
    for f in files:
        missing = [c for c in LAION_COCO_COLUMNS if c not in pq.read_schema(f).names]
        if missing:
            raise CorpusError(f"{f}: not LAION-COCO metadata: missing columns {missing}")
    return load_dataset("parquet", data_files=[str(f) for f in files], split="train")


def read_images(source: Path) -> dict[str, bytes]:
    """img2dataset output (Parquet shards, WebDataset tars, or a folder of {key}.jpg + {key}.json) -> {url: jpg
    bytes} of the successful downloads. The format is read from what is there: tars are WebDataset, sub-folders of
    {key}.jpg the `files` format (img2dataset writes a per-shard NNNNN.parquet of metadata beside both: it is not
    the Parquet format, whose shards carry the `jpg` column)."""
    from datasets import load_dataset

    parquets, tars = sorted(source.glob("*.parquet")), sorted(source.glob("*.tar"))
    files = not tars and any(p.is_dir() and any(p.glob("*.jpg")) for p in source.iterdir())
    out = {}
    if parquets and not tars and not files:
        ds = load_dataset("parquet", data_files=[str(p) for p in parquets], split="train")
        for col in ("url", "jpg", "status"):
            if col not in ds.column_names:
                raise CorpusError(f"{source}: img2dataset Parquet shards lack column {col!r}")
        for row in ds:
            if row["status"] == "success" and row["jpg"]:
                out[row["url"]] = row["jpg"]
    elif tars:  # read with tarfile: HF's webdataset builder infers one JSON schema and trips on null fields
        for path in tars:
            with tarfile.open(path) as tar:
                blobs = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
            for name, blob in blobs.items():
                stem, ext = name.rsplit(".", 1) if "." in name else (name, "")
                if ext == "json" and f"{stem}.jpg" in blobs:
                    info = json.loads(blob)
                    if info.get("status", "success") == "success":
                        out[info["url"]] = blobs[f"{stem}.jpg"]
    elif files:
        for meta in sorted(source.rglob("*.json")):
            jpg = meta.with_suffix(".jpg")
            if jpg.is_file():
                info = json.loads(meta.read_text())
                if info.get("status", "success") == "success":
                    out[info["url"]] = jpg.read_bytes()
    if not out:
        raise CorpusError(f"{source}: no fetched images (img2dataset Parquet / WebDataset shards or a folder of "
                          f"{{key}}.jpg + {{key}}.json)")
    return out


def _decodes(jpg: bytes) -> bool:
    """Whether the image bytes decode whole (a download cut short, or not an image at all, does not)."""
    try:
        with Image.open(io.BytesIO(jpg)) as img:
            img.load()
        return True
    except (OSError, SyntaxError, ValueError):  # PIL: truncated, unidentified or malformed
        return False


def to_square(jpg: bytes, size: int) -> np.ndarray:
    """JPEG bytes -> (3, size, size) uint8: centre crop to a square, resize with antialiasing."""
    img = Image.open(io.BytesIO(jpg)).convert("RGB")
    side = min(img.size)
    left, top = (img.width - side) // 2, (img.height - side) // 2
    img = img.crop((left, top, left + side, top + side)).resize((size, size), Image.LANCZOS)
    return np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1))


def build_laion_coco(metadata: list[Path], images: Path, vq, vq_sha256: str, encoder, cls_token_num: int,
                     flt: LaionFilter, out: Path, shard_size: int = 512, batch_size: int = 256) -> dict:
    """Filter, join, encode (see the module docstring) into Parquet shards + manifest under `out`."""
    meta = read_metadata(metadata)
    counts = {"metadata_rows": len(meta)}
    keep = np.ones(len(meta), dtype=bool)
    cols = {c: np.asarray(meta[c], dtype=np.float64) for c in ("WIDTH", "HEIGHT", "punsafe", "pwatermark",
                                                               "similarity")}
    for name, ok in (("size", (cols["WIDTH"] >= flt.min_size) & (cols["HEIGHT"] >= flt.min_size)),
                     ("punsafe", cols["punsafe"] <= flt.max_punsafe),
                     ("pwatermark", cols["pwatermark"] <= flt.max_pwatermark),
                     ("similarity", cols["similarity"] >= flt.min_similarity)):
        keep &= np.nan_to_num(ok, nan=False).astype(bool)
        counts[f"after_{name}"] = int(keep.sum())
    fetched = read_images(images)
    urls, captions = meta["URL"], meta["top_caption"]
    rows = [i for i in np.flatnonzero(keep) if urls[i] in fetched]
    counts["joined_with_images"] = len(rows)
    rows = [i for i in rows if _decodes(fetched[urls[i]])]  # a truncated or broken JPEG is skipped, and counted
    counts["unreadable_images"] = counts["joined_with_images"] - len(rows)
    if not rows:
        raise CorpusError(f"laion-coco: no row of {metadata} passes the filters and has a fetched image in {images}")
    size = vq.config.image_size

    def make_shard(start: int, stop: int) -> pa.Table:
        sel = rows[start:stop]
        codes = []
        for b in range(0, len(sel), batch_size):
            x = torch.from_numpy(np.stack([to_square(fetched[urls[i]], size) for i in sel[b : b + batch_size]]))
            with torch.no_grad():
                codes.append(vq.encode(x.float() / 127.5 - 1).flatten(1).to(torch.int16))
        codes = torch.cat(codes)
        caps = [captions[i] for i in sel]
        feats = encoder.features(caps, cls_token_num).flatten(1).half()  # T5: the mask packed in (lisa.data.text)
        return table_of([str(meta["hash"][i]) for i in sel], caps, [-1] * len(sel), codes, feats)

    write_shards(out, len(rows), shard_size, make_shard, "build laion-coco")
    info = {"kind": "laion-coco", "metadata": [str(m) for m in metadata], "images": str(images),
            "filter": asdict(flt), "counts": counts, "tokenizer_sha256": vq_sha256, "image_size": size,
            "caption_encoder": str(encoder.path), "cls_token_num": cls_token_num, "caption_dim": encoder.dim,
            "caption_mask_packed": encoder.is_t5}
    return finish(out, len(rows), shard_size, info)


def table_of(keys: list[str], captions: list[str], labels: list[int], codes: torch.Tensor,
             feats: Optional[torch.Tensor]) -> pa.Table:
    T = codes.shape[1]
    arrays = [pa.array(keys, pa.string()), pa.array(captions, pa.string()), pa.array(labels, pa.int16()),
              pa.FixedSizeListArray.from_arrays(pa.array(codes.flatten().numpy(), pa.int16()), T)]
    if feats is not None and not feats.is_floating_point():  # prompt ids
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(feats.flatten().numpy(), pa.int32()),
                                                        feats.shape[1]))
        return pa.Table.from_arrays(arrays, schema=corpus_schema(T, None, feats.shape[1]))
    if feats is not None:
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(feats.flatten().numpy(), pa.float16()),
                                                        feats.shape[1]))
    return pa.Table.from_arrays(arrays, schema=corpus_schema(T, feats.shape[1] if feats is not None else None))


def make_laion_fixture(out: Path, n: Optional[int] = None, seed: int = 0, image_format: str = "parquet",
                       small_every: int = 10, failed_every: int = 20, shard_size: int = 1000,
                       truncated_every: int = 0) -> dict:
    """A LAION-COCO-layout source from the built-in emoji images (Twemoji + Noto renders at 72 px): out/metadata/
    part-00000.parquet (the LAION-COCO columns) and out/images/ in img2dataset's `image_format` (parquet,
    webdataset or files). Every small_every-th image is stored as a 24 px thumbnail (WIDTH / HEIGHT say so) and
    every failed_every-th row is a failed download; punsafe, pwatermark and similarity are seeded random draws
    (3% of rows unsafe, 5% watermarked, the similarity uniform on [0.2, 0.45]). With truncated_every, every such
    row's JPEG is cut in half (a download that stopped early, still marked a success). Beside WebDataset tars and
    `files` folders goes img2dataset's per-shard metadata Parquet (every column but the image)."""
    from lisa.data import datasets as data

    rng = np.random.default_rng(seed)
    entries = itertools.chain(data.emoji_split("train", image_size=72), data.emoji_split("test", image_size=72))
    entries = list(itertools.islice(entries, n) if n else entries)
    meta, fetched = [], []
    for i, e in enumerate(entries):
        img = e["image"] if i % small_every else e["image"].resize((24, 24), Image.LANCZOS)
        url = f"https://emoji.invalid/{e['style']}/{i:06d}.jpg"
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=95)
        caption = e["caption"]
        meta.append({"URL": url, "TEXT": f"{caption} emoji ({e['style']})", "top_caption": caption,
                     "all_captions": [caption, f"an emoji of {caption}", f"{caption} icon"],
                     "all_similarities": [float(x) for x in rng.uniform(0.2, 0.45, 3)],
                     "WIDTH": img.width, "HEIGHT": img.height, "similarity": float(rng.uniform(0.2, 0.45)),
                     "hash": int(rng.integers(-2**62, 2**62)),
                     "pwatermark": float(rng.uniform(0.8, 1.0) if rng.random() < 0.05 else rng.beta(1, 8)),
                     "punsafe": float(rng.uniform(0.5, 1.0) if rng.random() < 0.03 else rng.beta(1, 30))})
        status = "failed_to_download" if i % failed_every == failed_every - 1 else "success"
        fetched.append({"key": f"{i:09d}", "url": url, "caption": caption, "status": status,
                        "error_message": None if status == "success" else "HTTP Error 404: Not Found",
                        "width": img.width, "height": img.height, "original_width": img.width,
                        "original_height": img.height, "jpg": buf.getvalue() if status == "success" else None})
        if truncated_every and i % truncated_every == truncated_every - 1 and fetched[-1]["jpg"]:
            fetched[-1]["jpg"] = fetched[-1]["jpg"][: len(fetched[-1]["jpg"]) // 2]
    (out / "metadata").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(meta), out / "metadata" / "part-00000.parquet")
    images = out / "images"
    images.mkdir(exist_ok=True)
    for s in range(0, len(fetched), shard_size):
        rows = fetched[s : s + shard_size]
        stem = images / f"{s // shard_size:05d}"
        if image_format == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), stem.with_suffix(".parquet"))
        elif image_format in ("webdataset", "files"):
            pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "jpg"} for r in rows]),
                           stem.with_suffix(".parquet"))  # img2dataset's per-shard metadata beside the images
            members = []
            for r in rows:
                info = {k: v for k, v in r.items() if k != "jpg"}
                members.append((f"{r['key']}.json", json.dumps(info).encode()))
                if r["jpg"] is not None:
                    members.append((f"{r['key']}.jpg", r["jpg"]))
            if image_format == "files":
                stem.mkdir(exist_ok=True)
                for name, blob in members:
                    (stem / name).write_bytes(blob)
            else:
                with tarfile.open(stem.with_suffix(".tar"), "w") as tar:
                    for name, blob in members:
                        ti = tarfile.TarInfo(name)
                        ti.size = len(blob)
                        tar.addfile(ti, io.BytesIO(blob))
        else:
            raise CorpusError(f"image_format {image_format!r}: not one of parquet, webdataset, files")
    return {"images": len(meta), "small": sum(1 for m in meta if m["WIDTH"] < 72),
            "failed": sum(1 for f in fetched if f["status"] != "success"), "image_format": image_format}


# ---------------------------------------------------------------------------------------------------------------
# Self-generated


def build_self_generated(target, target_sha256: str, cond: torch.Tensor, labels: list[int], captions: list[str],
                         sampling, seed: int, out: Path, shard_size: int = 256, batch_size: int = 64) -> dict:
    """The target's own samples: one sequence per row of `cond` (class ids (N,) or caption features (N, C, D)),
    sampled with `sampling` (lisa.decoding.sampling.SamplingConfig) and a generator seeded per shard (resumable: a shard
    is the same whichever run writes it)."""
    from lisa.decoding.generate import generate

    n = len(cond)
    t2i, lm = cond.dim() == 3, cond.dim() == 2  # caption features / prompt ids (lm targets)

    def make_shard(start: int, stop: int) -> pa.Table:
        g = torch.Generator().manual_seed(seed_for(seed, start))
        codes = torch.cat([generate(target, cond[b : min(b + batch_size, stop)], sampling, g)[0]
                           for b in range(start, stop, batch_size)])
        return table_of([f"{i:08d}" for i in range(start, stop)], captions[start:stop], labels[start:stop],
                        codes.to(torch.int16), cond[start:stop].flatten(1).half() if t2i
                        else cond[start:stop].int() if lm else None)

    write_shards(out, n, shard_size, make_shard, "self-generate")
    info = {"kind": "self-generated", "target_sha256": target_sha256, "sampling": asdict(sampling), "seed": seed,
            "batch_size": batch_size, "cls_token_num": target.config.cls_token_num,
            "caption_dim": cond.shape[-1] if t2i else None, "prompt_len": cond.shape[1] if lm else None}
    return finish(out, n, shard_size, info)


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read_corpus(path: Path, model_type: str, cls_token_num: int) -> dict:
    """A built corpus -> {"tokens" (N, T) long, "cond" (N,) labels or (N, C, D) caption features, "manifest"};
    checks every shard against the manifest and the conditioning against the target."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise CorpusError(f"{path}: no {MANIFEST} (an unfinished or missing corpus build)")
    manifest = json.loads((path / MANIFEST).read_text())
    tables = []
    for s in manifest["shards"]:
        f = path / s["file"]
        if not f.is_file() or file_sha256(f) != s["sha256"]:
            raise CorpusError(f"{f}: missing or changed since the manifest was written")
        tables.append(pq.read_table(f))
    table = pa.concat_tables(tables)
    T = table.schema.field("codes").type.list_size
    tokens = torch.from_numpy(table.column("codes").combine_chunks().values.to_numpy().astype(np.int64)).view(-1, T)
    if model_type == "c2i":
        cond = torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
        if (cond < 0).any():
            raise CorpusError(f"{path}: a class-conditional target needs class labels; this corpus has captions only")
    elif model_type == "lm":
        if "prompt_ids" not in table.schema.names or manifest.get("prompt_len") != cls_token_num:
            raise CorpusError(f"{path}: an lm target takes prompt ids of {cls_token_num} tokens; this corpus has "
                              f"{manifest.get('prompt_len') or 'none'}")
        flat = table.column("prompt_ids").combine_chunks().values.to_numpy()
        cond = torch.from_numpy(flat.astype(np.int64)).view(len(table), cls_token_num)
    else:
        if "caption_feats" not in table.schema.names:
            raise CorpusError(f"{path}: a text-conditional target needs caption_feats; this corpus has none")
        if manifest.get("cls_token_num") != cls_token_num:
            raise CorpusError(f"{path}: caption features of {manifest.get('cls_token_num')} tokens, the target "
                              f"takes {cls_token_num}")
        flat = table.column("caption_feats").combine_chunks().values.to_numpy(zero_copy_only=False)
        cond = torch.from_numpy(flat.astype(np.float32)).view(len(table), cls_token_num, -1)
    return {"tokens": tokens, "cond": cond, "manifest": manifest}
