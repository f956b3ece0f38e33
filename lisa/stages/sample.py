"""Stages that sample a world's target: `sample` (a grid, with any decoding method) and `premise` (LISA's premise
measured on held-out codes)."""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
from tqdm import tqdm

from lisa.checkpoint import atomic_write_all, json_writer, write_json
from lisa.config import AutoTreeParams, Params, PremiseParams, SampleParams, WorldParams
from lisa.data import datasets as data
from lisa.data.images import grid_image
from lisa.decoding.methods import auto_tree, method_decoder, resolve_auto
from lisa.decoding.sampling import SamplingConfig, sampling_config
from lisa.decoding.verify import VERIFIERS, drafts_tree
from lisa.models.llamagen import load_target, load_tokenizer
from lisa.quality.premise import premise_stats
from lisa.stages.common import (check_pair, class_names, load_codes, method_resources, target_codebook,
                                text_conditions)
from lisa.stages.paths import Stage, WorldPaths


def _grid_rows(world: WorldParams, cfg, p: SampleParams, target_path) -> tuple[list[str], torch.Tensor]:
    """The grid's rows (class ids or prompts) and the conditions of its images, `per_class` per row."""
    if cfg.model_type == "c2i":
        bad = [c for c in p.classes if not 0 <= c < cfg.num_classes]
        if bad:
            raise ValueError(f"sample.classes {bad} out of range for {cfg.num_classes} classes ({target_path})")
        return [str(c) for c in p.classes], torch.tensor([c for c in p.classes for _ in range(p.per_class)])
    rows = data.coco_prompts(p.prompts_file, p.num_prompts) if p.prompts_file else list(p.prompts)
    if not rows:
        raise ValueError(f"{target_path} is text-conditional: sample.prompts (or prompts_file) must give captions")
    # (N, C, D); T5 (LlamaGen-T2I): 120 left-padded positions with their mask packed in; lm: prompt ids
    return rows, text_conditions(world, cfg, rows).repeat_interleave(p.per_class, dim=0)


def sample(world: WorldParams, p: SampleParams, paths: WorldPaths) -> dict:
    """Sampling, `per_class` images per grid row: one row per class (c2i) or per prompt (t2i), decoded with
    `p.method`: vanilla, or a verifier (greedy / exact / lantern / gasv read the drafter, gasv the calibration)
    -> samples_dir/{grid.png, tokens.pt, metrics.json}."""
    model, target_meta = load_target(paths.target_file)
    vq, vq_meta = load_tokenizer(paths.tokenizer_file)
    check_pair(paths.target_file, target_meta, paths.tokenizer_file, vq_meta)
    cfg = model.config
    if (cfg.free_vocab or cfg.vocab_size) != vq.config.codebook_size:
        raise ValueError(f"{paths.target_file} samples {cfg.free_vocab or cfg.vocab_size} codes but "
                         f"{paths.tokenizer_file} has codebook_size {vq.config.codebook_size}")
    rows, cond = _grid_rows(world, cfg, p, paths.target_file)
    sampling = sampling_config(world, p)
    gen = torch.Generator().manual_seed(p.seed)
    tokens, images, taus, decode_s, auto = [], [], [], 0.0, {}
    t0 = time.perf_counter()
    decode = _decoder(model, vq, target_meta, p, paths, calib=cond[: p.batch_size], auto=auto)
    for batch in tqdm(cond.split(p.batch_size), desc=f"sample ({p.method})", unit="batch"):
        tok, stats = decode(batch, sampling, gen)
        taus.append(stats.get("tau", 1.0))
        t1 = time.perf_counter()
        with torch.inference_mode():
            images.append(vq.decode(model.image_codes(tok)))
        decode_s += time.perf_counter() - t1
        tokens.append(tok)
    total_s = time.perf_counter() - t0
    out = paths.samples_dir
    names = class_names(world) if cfg.model_type == "c2i" else None
    grid = grid_image(torch.cat(images), nrow=p.per_class,
                      labels=[f"{r} {names[int(r)]}" for r in rows] if names else rows)
    tokens = torch.cat(tokens)
    metrics = {"images": len(cond), "rows": rows, "decode_loop_s": total_s - decode_s, "vq_decode_s": decode_s,
               "s_per_image": (total_s - decode_s) / len(cond), "method": p.method, "tau": sum(taus) / len(taus),
               **({"auto_tree": auto} if auto else {}), **({"compiled": True} if p.compile else {}),
               "target_sha256": target_meta["sha256"], "tokenizer_sha256": vq_meta["sha256"]}
    # one output: grid, tokens and metrics renamed into place together (a crash leaves the old three); tokens
    # through a file object: torch.save names the archive after a path it is given (here a random temp name)
    atomic_write_all({out / "grid.png": lambda tmp: grid.save(tmp, format="PNG"),
                      out / "tokens.pt": lambda tmp: _save_pt({"rows": rows, "tokens": tokens}, tmp),
                      out / "metrics.json": json_writer(metrics)})
    return metrics


def _save_pt(obj, path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)


def _decoder(model, vq, target_meta: dict, p: SampleParams, paths: WorldPaths, calib=None,
             auto: Optional[dict] = None):
    """(cond, sampling, generator) -> (tokens, stats) for the method p (lisa.decoding.methods.method_decoder) with
    the drafter and geometry it reads, its neighbour table `p.neighbours` wide. With p.tree "auto", the cost model
    picks depth and total_tokens from decoding the conditions `calib` on this machine (recorded in `auto`)."""
    res = method_resources([p], model, target_meta, vq, paths, p.neighbours)
    if p.tree == "auto" and drafts_tree(p.method):
        sampling = SamplingConfig(p.temperature, p.top_k, p.top_p, p.cfg_scale)  # as before: not the world's
        choice = auto_tree(model, res.modules[p.drafter], [{"label": "calibration", "cond": calib}], p, sampling,
                           p.seed, res.geometry, AutoTreeParams(calib_conditions=1))
        p = resolve_auto(p, choice)
        if auto is not None:
            auto.update(draft=choice.draft, branching=choice.branching, depth=choice.depth,
                        total_tokens=choice.total_tokens, why=choice.why)
    return method_decoder(p, model, res.modules, res.geometry, compile=p.compile)


def premise(p: PremiseParams, paths: WorldPaths) -> dict:
    """LISA's premise on held-out data: flat over ids (U, top-1 prob) yet gathered in codebook neighbourhoods."""
    model, target_meta = load_target(paths.target_file)
    vq, _ = load_tokenizer(paths.tokenizer_file)
    d = load_codes(paths.codes_file, model.config.model_type)
    n = min(p.max_sequences, len(d["test_tokens"]))
    stats = premise_stats(model, target_codebook(vq, model.config), d["test_tokens"][:n], d["test_cond"][:n],
                          p.cfg_scale, tuple(p.neighbours), seed=p.seed)
    stats["target_sha256"] = target_meta["sha256"]
    write_json(paths.premise_report, stats)
    return stats


def sample_params(params: Params, method: Optional[str] = None, compile: Optional[bool] = None) -> SampleParams:
    """params.sample with the method `method` (the CLI's --method) and compile set: vanilla or a verifier (with
    sample's own tree / window and options), or a named method (Params.named_method: table.cells, bench_spec.methods)
    with all its fields."""
    p = params.sample
    if method in ("vanilla", *VERIFIERS):
        p = dataclasses.replace(p, method=method)
    elif method:
        m = params.named_method(method)
        p = dataclasses.replace(p, **{f.name: getattr(m, f.name) for f in dataclasses.fields(m)})
    return dataclasses.replace(p, compile=True) if compile else p


STAGES = {
    "sample": Stage(lambda c, method=None, compile=None: sample(c.world, sample_params(c.params, method, compile),
                                                               c.paths),
                    out="samples_dir"),
    "premise": Stage(lambda c: premise(c.params.premise, c.paths), out="premise_report"),
}
