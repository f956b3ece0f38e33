"""Quality stages: `fid-reference` (held-out Inception features, reference FID / KID), `train-judge` (the world's
classifier or CLIP), `evaluate` (vanilla CFG samples scored) and `eval-method` (one cell of the results table: a
decoding method's samples scored, its tau and measured relaxation)."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from lisa.checkpoint import atomic_write_all, json_writer, read_state_dict, save_artifact, write_json
from lisa.config import EvaluateParams, QualityParams, TableParams, TrainJudgeParams, WorldParams, seed_for
from lisa.data import datasets as data
from lisa.decoding.loop import pooled_tau
from lisa.decoding.methods import method_decoder
from lisa.decoding.sampling import sampling_config
from lisa.decoding.verify import drafts_tree
from lisa.models.gpt import gpt_config
from lisa.models.llamagen import load_target, load_tokenizer
from lisa.quality import fid, judges
from lisa.quality import metrics as quality
from lisa.stages.common import (check_pair, class_names, eval_conditions, image_tokenizer, judge_scores, load_images,
                                method_resources)
from lisa.stages.inputs import check_inputs
from lisa.stages.paths import Stage, WorldPaths
from lisa.stages.render import lines_writer, quality_grid


def _recipe_hash(parts: list) -> str:
    """12 hex digits naming a cached set: only a run of the same recipe reuses it."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def fid_reference(world: WorldParams, p: QualityParams, paths: WorldPaths) -> dict:
    """Held-out Inception features (kept for `evaluate`) and the reference FID / KID: held-out vs train (the
    floor), vs VQ reconstructions, vs a unigram baseline. Resumable per set (quality_work)."""
    train_u8, test_u8, _ = load_images(paths.dataset_dir, paths.dataset_identity)
    vq, vq_meta = load_tokenizer(paths.tokenizer_file)
    cfg = gpt_config(**world.target)
    vq = image_tokenizer(vq, cfg)  # lm targets: the grammar is dropped before decoding
    codes = read_state_dict(paths.codes_file)
    # cached sets are only reused by a run of the same tokenizer, dataset and settings
    work = paths.quality_work / _recipe_hash([vq_meta["sha256"], str(paths.dataset_dir), len(train_u8), len(test_u8),
                                              p.max_images, p.seed])
    ref_idx = quality.subset(len(test_u8), p.max_images, p.seed)
    train_idx = quality.subset(len(train_u8), p.max_images, p.seed + 1)

    def feats(name, images):
        return quality.cached(work / f"{name}.safetensors", "features",
                              lambda: fid.features(images(), p.inception_batch))

    ref = feats("heldout", lambda: test_u8[ref_idx])
    sets = {
        "train": lambda: train_u8[train_idx],
        "reconstruction": lambda: quality.decode_tokens(vq, codes["test_codes"][ref_idx]),
        "unigram": lambda: quality.decode_tokens(vq, quality.unigram_tokens(
            codes["train_codes"], cfg.vocab_size if cfg.model_type == "lm" else vq.config.codebook_size,
            p.max_images, p.seed)),
    }
    metrics = {name: fid.fid_kid(ref, feats(name, images), p.kid_subsets, p.kid_subset_size, p.seed)
               for name, images in sets.items()}
    meta = {"dataset": str(paths.dataset_dir), "heldout_images": len(ref_idx), "tokenizer_sha256": vq_meta["sha256"],
            "extractor": fid.EXTRACTOR}
    quality.write_reference(paths.reference_file, ref, ref_idx, meta)
    write_json(paths.reference_report, meta | {"vs_heldout": metrics})
    return metrics


def train_judge(world: WorldParams, p: TrainJudgeParams, paths: WorldPaths) -> dict:
    """Train the world's judge on its real training images: a classifier (c2i) or a small CLIP (t2i)."""
    train_u8, test_u8, ds = load_images(paths.dataset_dir, paths.dataset_identity)
    classes = ds["train"].features["label"].names
    kind = "classifier" if gpt_config(**world.target).model_type == "c2i" else "clip"
    config = judges.JudgeConfig(kind, image_size=train_u8.shape[-1], num_classes=len(classes), width=p.width,
                                layers=p.layers, patch_size=p.patch_size, classifier_width=p.classifier_width,
                                embed_dim=p.embed_dim, context_length=p.context_length)
    torch.manual_seed(p.seed)
    model = judges.build(config)
    labels = {s: torch.tensor(ds[s]["label"]) for s in ("train", "test")}
    captions = {s: list(ds[s]["caption"]) for s in ("train", "test")}
    metrics = judges.train_judge(model, data.to_model_range(train_u8), labels["train"], captions["train"], p,
                                 paths.judge_work)
    with torch.no_grad():  # the judge is stored in fp16 (the CLIP's BPE embedding is most of it): measure that one
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.half().float())
    test_x = data.to_model_range(test_u8)
    if kind == "classifier":
        metrics["heldout_accuracy"] = judges.class_consistency(model, test_x, labels["test"])
    else:
        metrics["heldout_retrieval"] = judges.retrieval(model, test_x, captions["test"])
        metrics["heldout_clip_score"] = judges.clip_scores(model, test_x, captions["test"]).mean().item()
        gen = torch.Generator().manual_seed(p.seed)
        shuffled = [captions["test"][i] for i in torch.randperm(len(test_u8), generator=gen).tolist()]
        metrics["heldout_clip_score_mismatched"] = judges.clip_scores(model, test_x, shuffled).mean().item()
    meta = save_artifact(model, paths.judge_file, "judge", config, step=p.steps, seed=p.seed,
                         made_from={"dataset": str(paths.dataset_dir)}, extra={"metrics": metrics, "classes": classes},
                         store_dtype=torch.float16)
    write_json(paths.judge_report, metrics | {"kind": kind})
    return metrics | {"sha256": meta["sha256"]}


@dataclass
class _Scored:
    """What the quality stages score against: the target, its image tokenizer, the judge, the held-out reference and
    the evaluation conditions."""
    model: object
    target_meta: dict
    vq: object
    vq_meta: dict
    judge: object
    judge_meta: dict
    ref: torch.Tensor
    codes: dict
    conds: torch.Tensor
    labels: torch.Tensor
    captions: list[str]


def _scored(paths: WorldPaths, n: int) -> _Scored:
    """Load what `evaluate` and `eval-method` score against; the reference must be of this tokenizer."""
    model, target_meta = load_target(paths.target_file)
    vq, vq_meta = load_tokenizer(paths.tokenizer_file)
    check_pair(paths.target_file, target_meta, paths.tokenizer_file, vq_meta)
    vq = image_tokenizer(vq, model.config)  # lm targets: the grammar is dropped before decoding
    judge, judge_meta = judges.load_judge(paths.judge_file)
    ref, _, ref_meta = quality.read_reference(paths.reference_file)
    if ref_meta.get("tokenizer_sha256") not in (None, vq_meta["sha256"]):
        raise ValueError(f"{paths.reference_file} was made with another tokenizer than {paths.tokenizer_file}: "
                         "rerun `lisa fid-reference`")
    codes = read_state_dict(paths.codes_file)
    captions_all = json.loads(paths.codes_file.with_suffix(".json").read_text())["captions"]
    conds, labels, captions = eval_conditions(model.config, codes, captions_all, n)
    return _Scored(model, target_meta, vq, vq_meta, judge, judge_meta, ref, codes, conds, labels, captions)


def _score(s: _Scored, tokens: torch.Tensor, work: Path, q: QualityParams, kid_subset_size: int):
    """(images, metrics): FID / KID of the tokens' images against the reference, and the judge's score."""
    images = quality.decode_tokens(s.vq, tokens)
    feats = quality.cached(work / "features.safetensors", "features", lambda: fid.features(images, q.inception_batch))
    metrics = fid.fid_kid(s.ref, feats, q.kid_subsets, kid_subset_size, q.seed)
    name, score = judge_scores(s.judge, images, s.labels, s.captions)
    return images, metrics | {name: score}


def evaluate(world: WorldParams, p: EvaluateParams, q: QualityParams, paths: WorldPaths) -> dict:
    """`num_samples` vanilla CFG samples (classes in turn, or held-out captions in turn): FID / KID against the
    held-out reference features, and the judge's score, next to the judge's score of real held-out images."""
    s = _scored(paths, p.num_samples)
    sampling = sampling_config(world, p)  # the world's own values over the section's
    work = paths.quality_work / ("samples-" + _recipe_hash([s.target_meta["sha256"], s.vq_meta["sha256"], asdict(p)]
                                                           + ([world.sampling] if world.sampling else [])))
    timing = work / "tokens.json"  # the sampling time of the cached tokens, kept with them

    def make_tokens():
        t0 = time.perf_counter()
        tokens = quality.generate_samples(s.model, s.conds, sampling, p.batch_size, p.seed)
        write_json(timing, {"sample_s": time.perf_counter() - t0, "threads": torch.get_num_threads()})
        return tokens

    tokens = quality.cached(work / "tokens.safetensors", "tokens", make_tokens)
    sample_s = json.loads(timing.read_text())["sample_s"] if timing.is_file() else None
    images, scores = _score(s, tokens, work, q, q.kid_subset_size)
    metrics = {"samples": p.num_samples, "sampling": asdict(p), "sample_s": sample_s} | scores
    real = ("class_consistency", 100 * s.judge_meta["metrics"]["heldout_accuracy"]) \
        if s.judge.config.kind == "classifier" else ("clip_score", s.judge_meta["metrics"]["heldout_clip_score"])
    metrics[f"{real[0]}_real_heldout"] = real[1]
    metrics |= {"target_sha256": s.target_meta["sha256"], "judge_sha256": s.judge_meta["sha256"]}
    out = paths.evaluate_dir
    grid = quality_grid(images, s.labels, s.captions, s.model.config, class_names(world), s.vq, s.codes["test_codes"])
    atomic_write_all({out / "samples.png": lambda tmp: grid.save(tmp, format="PNG"),  # one output, committed together
                      out / "tokens.safetensors": lambda tmp: save_file({"tokens": tokens.to(torch.int16)}, tmp),
                      out / "metrics.json": json_writer(metrics)})
    return metrics


def _method_decoder(s: _Scored, m, p: TableParams, paths: WorldPaths, manifest: Path):
    """(decode, resources) of a decoding method (a table cell's, a scoreboard point's) on the target, measuring the
    TV of a verifier's tokens; its neighbour table `quality_neighbours` wide; p.compile: the forwards under
    torch.compile. manifest: the method's method-inputs manifest, which what is loaded must match
    (lisa.stages.inputs.check_inputs)."""
    res = method_resources([m], s.model, s.target_meta, s.vq, paths, quality_neighbours(s.model.config))
    check_inputs(manifest, res.drafter_sha.get(m.drafter) if drafts_tree(m.method) else None, res.calibration_sha)
    decode = method_decoder(m, s.model, res.modules, res.geometry, measure=m.method != "vanilla", compile=p.compile)
    return decode, res


def quality_neighbours(cfg) -> int:
    """The neighbour table's width in the quality stages (eval-method, sweep, quality-point): 64 codes, fewer in a
    smaller vocabulary (sample and bench-spec take theirs from params: sample.neighbours, bench_spec.neighbours)."""
    return min(64, cfg.vocab_size - 1)


def decode_conditions(decode, conds: torch.Tensor, sampling, batch_size: int, seed: int, desc: str,
                      T: int) -> tuple[torch.Tensor, dict]:
    """(tokens (n, T), stats) of `decode` over the conditions in batches, batch i seeded (seed, i): tau pooled over
    every round of every row, the measured TV per image position and its mean past the first token, the time."""
    toks, stats, tvs, t0 = [], [], [], time.perf_counter()
    for i, batch in enumerate(tqdm(list(conds.split(batch_size)), desc=desc, unit="batch")):
        tok, st = decode(batch, sampling, torch.Generator().manual_seed(seed_for(seed, i)))
        toks.append(tok)
        stats.append(st)
        if "tv" in st:
            tvs.append(st["tv"])
    tv = torch.cat(tvs) if tvs else torch.zeros(len(conds), T)
    tau = pooled_tau(stats) if all("accept_lengths" in st for st in stats) else 1.0  # vanilla: one token a forward
    return torch.cat(toks), {"decode_s": time.perf_counter() - t0, "tau": tau,
                             "tv_per_position": tv.nanmean(0).tolist(), "tv_mean": float(tv[:, 1:].nanmean()),
                             "threads": torch.get_num_threads()}


def _decode_cell(decode, s: _Scored, name: str, sampling, p: TableParams, stats_path: Path) -> torch.Tensor:
    """The cell's tokens, batch i seeded (seed, i); tau, the TV per position and the time go to stats_path."""
    tokens, stats = decode_conditions(decode, s.conds, sampling, p.batch_size, p.seed, f"eval {name}",
                                      s.model.config.block_size)
    write_json(stats_path, stats)
    return tokens


def eval_method(world: WorldParams, name: str, p: TableParams, q: QualityParams, paths: WorldPaths) -> dict:
    """One quality cell: `p.num_samples` samples decoded with method `name` (table.cells) on the conditions of
    `evaluate`, batch i seeded (seed, i) for every method: FID / KID against the held-out reference, the judge's
    score, tau, and the measured relaxation (TV between the law each token was drawn from and the target's,
    per image position and on average) -> cells_dir/<name>.{json,png}, cells_dir/<name>-tv.csv."""
    if name not in p.cells:
        raise ValueError(f"--method {name!r}: not a key of params table.cells {sorted(p.cells)}")
    m = p.cells[name].as_method(name)
    s = _scored(paths, p.num_samples)
    decode, res = _method_decoder(s, m, p, paths, paths.inputs_dir / "cells" / f"{name}.json")
    sampling = sampling_config(world, p)  # the world's own values over the section's
    drafter_sha = res.drafter_sha
    recipe = [s.target_meta["sha256"], s.vq_meta["sha256"], asdict(m),
              # compile enters the recipe only when set (its tokens may differ in the last bits of a logit)
              {k: v for k, v in asdict(p).items() if k not in ("rows", "pareto", "cells") and (k != "compile" or v)},
              drafter_sha,
              res.calibration_sha] + ([world.sampling] if world.sampling else [])
    work = paths.cells_work / (name + "-" + _recipe_hash(recipe))
    stats_path = work / "decode.json"
    tokens = quality.cached(work / "tokens.safetensors", "tokens",
                            lambda: _decode_cell(decode, s, name, sampling, p, stats_path))
    dstats = json.loads(stats_path.read_text())
    images, scores = _score(s, tokens, work, q, min(q.kid_subset_size, len(tokens)))
    metrics = {"world_method": name, "method": asdict(m), "samples": len(tokens), "tau": dstats["tau"],
               "tv_mean": dstats["tv_mean"], "decode_s": dstats["decode_s"]} | scores
    metrics |= {"target_sha256": s.target_meta["sha256"], "judge_sha256": s.judge_meta["sha256"],
                "drafter_sha256": drafter_sha, "calibration_sha256": res.calibration_sha}
    out = paths.cells_dir
    grid = quality_grid(images, s.labels, s.captions, s.model.config, class_names(world), s.vq, s.codes["test_codes"],
                        rows=5)
    tv = ["position,tv"] + [f"{i},{v:.6f}" for i, v in enumerate(dstats["tv_per_position"])]
    atomic_write_all({out / f"{name}.png": lambda tmp: grid.save(tmp, format="PNG"),  # the cell, committed together
                      out / f"{name}-tv.csv": lines_writer(tv), out / f"{name}.json": json_writer(metrics)})
    return {k: v for k, v in metrics.items() if k != "method"}


STAGES = {
    "fid-reference": Stage(lambda c: fid_reference(c.world, c.params.quality, c.paths), out="quality_dir"),
    "train-judge": Stage(lambda c: train_judge(c.world, c.params.train_judge, c.paths), out="judge_dir"),
    "evaluate": Stage(lambda c: evaluate(c.world, c.params.evaluate, c.params.quality, c.paths), out="evaluate_dir"),
    "eval-method": Stage(lambda c, method, compile=None: eval_method(
        c.world, method, replace(c.params.table, compile=True) if compile else c.params.table,
        c.params.quality, c.paths),
                         out="cells_dir"),
}
