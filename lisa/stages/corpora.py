"""Drafter training corpora (lisa/data/corpus.py): `laion-fixture` (a LAION-COCO-layout source from the emoji images),
`build-laion-coco` (filter, join and encode a LAION-COCO source) and `build-self-generated` (a world's own samples)."""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from lisa.checkpoint import read_state_dict, write_json
from lisa.config import CorporaParams, SelfGeneratedParams, WorldParams
from lisa.data.identity import check_identity, write_identity
from lisa.decoding.sampling import sampling_config
from lisa.models.gpt import gpt_config
from lisa.models.llamagen import load_target, load_tokenizer
from lisa.stages.common import caption_cond, caption_encoder
from lisa.stages.paths import Call, SharedPaths, Stage, WorldPaths


def laion_fixture(p: CorporaParams, shared: SharedPaths) -> dict:
    """The LAION-COCO-layout fixture from the emoji images (lisa.data.corpus.make_laion_fixture), written to a
    temporary folder and renamed into place."""
    from lisa.data.corpus import make_laion_fixture

    out = shared.fixture_dir
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    info = make_laion_fixture(tmp, p.fixture_rows, p.fixture_seed, p.fixture_format)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    if shared.fixture_identity is not None:  # build-laion-coco's dvc.yaml dep, committed (the folder is not)
        write_identity(shared.fixture_identity, metadata=out / "metadata", images=out / "images")
    return info


def build_laion_coco(world: WorldParams, p: CorporaParams, paths: WorldPaths, shared: SharedPaths,
                     identity: Optional[Path]) -> dict:
    """The laion-coco corpus (lisa.data.corpus.build_laion_coco) of `p.laion_metadata` / `p.laion_images`, with the
    tokenizer and caption encoder of the world `p.laion_world` (`world`, `paths`). A source whose files differ from
    `identity` (lisa/data/identity.py) is refused; None: not checked."""
    from lisa.data.corpus import build_laion_coco as build

    if identity is not None:
        check_identity(identity, metadata=p.laion_metadata, images=p.laion_images)
    vq, vq_meta = load_tokenizer(paths.tokenizer_file)
    cfg = gpt_config(**world.target)
    if cfg.model_type == "lm":
        raise ValueError("corpora.laion_world: Lumina-mGPT (lm) drafters train on the target's own samples "
                         "(build-self-generated), not on LAION-COCO; name a LlamaGen world")
    if cfg.model_type != "t2i":
        raise ValueError(f"corpora.laion_world: a laion-coco corpus is for a text-to-image world, not {cfg.model_type}")
    metadata = Path(p.laion_metadata)
    files = sorted(metadata.glob("*.parquet")) if metadata.is_dir() else [metadata]
    flt = p.laion_filter()
    m = build(files, Path(p.laion_images), vq, vq_meta["sha256"], caption_encoder(world), cfg.cls_token_num, flt,
              shared.laion_dir, p.shard_size)
    metrics = {"sequences": m["rows"], "bytes": m["bytes"], "counts": m["counts"], "filter": m["filter"]}
    write_json(shared.laion_report, metrics)
    return metrics


def build_self_generated(world: WorldParams, p: SelfGeneratedParams, paths: WorldPaths) -> dict:
    """The self-generated corpus: the world's target samples p.n sequences, conditions = classes in turn (c2i) or
    the training captions in turn (t2i)."""
    from lisa.data.corpus import build_self_generated as build

    target, target_meta = load_target(paths.target_file)
    if target.config.model_type == "c2i":
        cond = torch.arange(p.n) % target.config.num_classes
        labels, captions = cond.tolist(), [""] * p.n
    else:
        t = read_state_dict(paths.codes_file)
        idx = t["train_caption_idx"].unique()[:p.n]
        idx = idx[torch.arange(p.n) % len(idx)]
        names = json.loads(paths.codes_file.with_suffix(".json").read_text())["captions"]
        cond, labels, captions = caption_cond(t, idx), [-1] * p.n, [names[i] for i in idx.tolist()]
    sampling = sampling_config(world, p)  # the world's own values over the section's
    t0 = time.perf_counter()
    m = build(target, target_meta["sha256"], cond, labels, captions, sampling, p.seed, paths.self_generated_dir,
              batch_size=p.batch_size)
    metrics = {"sequences": m["rows"], "bytes": m["bytes"], "sampling": m["sampling"],
               "target_sha256": m["target_sha256"], "build_s": time.perf_counter() - t0}
    write_json(paths.self_generated_report, metrics)
    return metrics


def _laion_coco(c: Call, metadata: Optional[str] = None, images: Optional[str] = None) -> dict:
    """build-laion-coco of the params' source, which must match its identity file `corpora.laion_identity` (the
    stage's dvc.yaml dep), or of `metadata` / `images` (not checked); paths relative to the root."""
    p = c.params.corpora
    rooted = lambda path: Path(path) if Path(path).is_absolute() else c.shared.root / path  # noqa: E731
    identity = rooted(p.laion_identity) if metadata is None and images is None else None
    p = dataclasses.replace(p, laion_metadata=str(rooted(metadata or p.laion_metadata)),
                            laion_images=str(rooted(images or p.laion_images)))
    return build_laion_coco(c.params.world(p.laion_world), p, WorldPaths.of(p.laion_world, c.shared.root), c.shared,
                            identity)


STAGES = {
    "laion-fixture": Stage(lambda c: laion_fixture(c.params.corpora, c.shared), out="fixture_dir", world=False),
    "build-laion-coco": Stage(_laion_coco, out="laion_dir", report="laion_report", world=False),
    "build-self-generated": Stage(lambda c: build_self_generated(c.world, c.params.corpora.self_generated, c.paths),
                                  out="self_generated_dir", report="self_generated_report"),
}
