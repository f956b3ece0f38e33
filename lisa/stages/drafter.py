"""Stages of LISA's drafting side: `train-drafter` (the baseline EAGLE-3 drafter), `cache-logits` (the target's logit
cache), `ablate-lid` (LID against the baseline loss), `ablate-arch` (a drafter architecture against its cost),
`named-drafter` (a drafter of params drafters.named, which decoding methods can draft with), `drafter-table` (a
world's named drafters side by side), `calibrate` (GASV's calibration of the target) and `bench-ddp` (drafter training
throughput under DDP)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lisa.checkpoint import atomic_write_all, file_sha256, json_writer, save_artifact, write_json
from lisa.config import (AblateArchParams, AblateLIDParams, ArchEntry, CacheLogitsParams, CalibrateParams, DrafterArch,
                         DraftersParams, LIDConfig, SampleParams, TrainDrafterParams, WorldParams, seed_for)
from lisa.decoding.methods import tree_spec
from lisa.decoding.sampling import sampling_config
from lisa.models.llamagen import load_target, load_tokenizer
from lisa.stages.common import load_codes, target_codebook, text_conditions
from lisa.stages.paths import Stage, WorldPaths
from lisa.stages.render import ablation_markdown, ddp_markdown, lines_writer, write_lines
from lisa.training import cache
from lisa.training.distributed import init_distributed


def _read_corpus(target, corpus_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, cond) of a built corpus (lisa/data/corpus.py) for the target."""
    from lisa.data.corpus import read_corpus

    c = read_corpus(corpus_path, target.config.model_type, target.config.cls_token_num)
    return c["tokens"], c["cond"]


def train_drafter(p: TrainDrafterParams, paths: WorldPaths, corpus: Optional[str | Path] = None) -> dict:
    """Baseline EAGLE-3 drafter (TTT, soft CE to the target) for a world's target, on its training codes (or a
    built corpus). Under torchrun: DDP over the ranks; rank 0 writes the drafter and reports."""
    from lisa.training.drafter import new_drafter, train_drafter as train

    rank = init_distributed()
    target, target_meta = load_target(paths.target_file)
    d = load_codes(paths.codes_file, target.config.model_type)
    tokens, cond = (d["train_tokens"], d["train_cond"]) if corpus is None else _read_corpus(target, corpus)
    torch.manual_seed(p.seed)
    drafter = new_drafter(target, **p.overrides())
    metrics = train(drafter, target, tokens, cond, d["test_tokens"][:512], d["test_cond"][:512], p, paths.drafter_work,
                    curves=paths.drafter_curves, target_id=target_meta["sha256"])
    if rank != 0:
        return {"rank": rank}
    meta = save_artifact(drafter.cpu(), paths.drafter_file, "drafter", drafter.config, step=p.steps, seed=p.seed,
                         made_from={"target": str(paths.target_file), "target_sha256": target_meta["sha256"],
                                    "codes": str(corpus or paths.codes_file)},
                         extra={"metrics": metrics})
    write_json(paths.drafter_report, metrics)
    return metrics | {"sha256": meta["sha256"]}


def cache_logits(p: CacheLogitsParams, paths: WorldPaths, corpus: Optional[str | Path] = None) -> dict:
    """The target logit cache of a world's training codes (lisa/training/cache.py). Under torchrun each rank writes its
    shards (gloo or nccl process group for the final barrier); rank 0 writes the manifest and the report."""
    rank, world_size = init_distributed(), cache.dist_env()[1]
    target, target_meta = load_target(paths.target_file)
    if corpus is None:
        d = load_codes(paths.codes_file, target.config.model_type)
        all_tokens, all_cond = d["train_tokens"], d["train_cond"]
    else:
        all_tokens, all_cond = _read_corpus(target, corpus)
    n = len(all_tokens) if p.max_sequences is None else min(p.max_sequences, len(all_tokens))
    tokens, cond = all_tokens[:n], all_cond[:n]
    spec = cache.CacheSpec(p.K, p.shard_size, p.batch_size, p.uncond_every)
    source = ({"corpus": str(corpus), "corpus_manifest_sha256": file_sha256(Path(corpus) / "manifest.json")}
              if corpus is not None else
              {"codes": str(paths.codes_file), "codes_sha256": file_sha256(paths.codes_file)})
    identity = cache.cache_identity(target_meta["sha256"], spec, n, tokens.shape[1],
                                    {k: v for k, v in source.items() if k.endswith("sha256")})  # content, not paths
    if rank == 0 and (why := cache.prepare_cache_dir(paths.cache_dir, identity)):
        print(why)
    if world_size > 1:
        dist.barrier()  # no rank writes a shard before rank 0 has cleared a cache of other settings
    t0 = time.perf_counter()
    cache.write_cache(target, target_meta["sha256"], tokens, cond, spec, paths.cache_dir, rank, world_size)
    elapsed = time.perf_counter() - t0
    if world_size > 1:
        dist.barrier()
    if rank != 0:
        return {"rank": rank}
    manifest = cache.write_manifest(paths.cache_dir, target_meta["sha256"], spec, n, tokens.shape[1], extra=source)
    if paths.cache_identity is not None:  # the consumers' dvc.yaml dep, committed (the cache is not)
        write_json(paths.cache_identity, identity)
    metrics = {"sequences": n, "tokens": manifest["tokens"], "bytes": manifest["bytes"],
               "bytes_per_token": manifest["bytes_per_token"], "K": p.K, "workers": world_size,
               "write_s": elapsed, "write_tokens_per_s": manifest["tokens"] / elapsed,
               "target_sha256": target_meta["sha256"]}
    metrics |= cache.throughput(target, tokens, cond, spec)
    write_json(paths.cache_report, metrics)
    return metrics


def _tau_exact(target, drafter, cond: torch.Tensor, sampling, spec, seed: int) -> list[float]:
    """The acceptance length of each condition under exact verification, condition i seeded (seed, i)."""
    from lisa.decoding.generate import speculative_generate

    taus = []
    for i in range(len(cond)):
        _, stats = speculative_generate(target, drafter, cond[i : i + 1], sampling, spec,
                                        torch.Generator().manual_seed(seed_for(seed, i)))
        taus.append(stats["tau"])
    return taus


def ablate_lid(world: WorldParams, train_p: TrainDrafterParams, p: AblateLIDParams, sample_p: SampleParams,
               paths: WorldPaths) -> dict:
    """LID vs the baseline loss, same data (the logit cache), steps and seed: two drafters, then the acceptance
    length tau of each under `exact` verification on the same conditions and seeds."""
    from lisa.training.drafter import new_drafter, train_drafter as train

    target, target_meta = load_target(paths.target_file)
    vq, _ = load_tokenizer(paths.tokenizer_file)
    lc = cache.open_cache(paths.cache_dir, target_meta["sha256"], paths.cache_identity)
    d = load_codes(paths.codes_file, target.config.model_type)
    tp = dataclasses.replace(train_p, steps=p.steps)
    lid = (target_codebook(vq, target.config), p.lid)
    cond = _conditions(world, target, sample_p, p.per_class)
    sampling = sampling_config(world, p)  # the world's own values over the section's
    spec = tree_spec(p, "exact")
    results = {}
    for name, loss in (("baseline", None), ("lid", lid)):
        torch.manual_seed(tp.seed)
        drafter = new_drafter(target, **tp.overrides())
        m = train(drafter, target, d["train_tokens"], d["train_cond"], d["test_tokens"][:512], d["test_cond"][:512],
                  tp, paths.ablation_work / name, cache=lc, lid=loss, curves=paths.ablation_report / name,
                  target_id=target_meta["sha256"])
        save_artifact(drafter, paths.ablation_dir / f"{name}.safetensors", "drafter", drafter.config, step=tp.steps,
                      seed=tp.seed, made_from={"target_sha256": target_meta["sha256"], "loss": name,
                                               "cache": str(paths.cache_dir)}, extra={"metrics": m})
        taus = _tau_exact(target, drafter, cond, sampling, spec, p.seed)
        results[name] = m | {"tau_exact": sum(taus) / len(taus), "tau_per_condition": taus}
    metrics = {"steps": tp.steps, "conditions": len(cond), "tree": dataclasses.asdict(spec),
               "baseline_tau": results["baseline"]["tau_exact"], "lid_tau": results["lid"]["tau_exact"],
               "lid_over_baseline": results["lid"]["tau_exact"] / results["baseline"]["tau_exact"],
               "lid": dataclasses.asdict(p.lid), "runs": results, "target_sha256": target_meta["sha256"]}
    write_json(paths.ablation_report / "metrics.json", metrics)
    write_lines(paths.ablation_report / "table.md",
                ablation_markdown(results, spec, sampling, tp.steps, len(cond), metrics["lid_over_baseline"]))
    return {k: v for k, v in metrics.items() if k != "runs"}


def _conditions(world: WorldParams, target, sample_p: SampleParams, per_class: int) -> torch.Tensor:
    """sample.classes (c2i) or sample.prompts (t2i), each repeated per_class times."""
    if target.config.model_type == "c2i":
        return torch.tensor([c for c in sample_p.classes for _ in range(per_class)])
    return text_conditions(world, target.config, list(sample_p.prompts)).repeat_interleave(per_class, 0)


def _against_vanilla(target, drafter, cond: torch.Tensor, sampling, spec, seed: int) -> tuple[float, dict]:
    """tau under `exact` on the tree `spec`, and the seconds of vanilla and of it over the conditions (one image
    each, condition i seeded (seed, i), the two interleaved with the order alternating: a slow spell lands on
    both; eager, after an untimed warm-up)."""
    from lisa.decoding.methods import decoder

    vanilla, speculative = decoder(target), decoder(target, "exact", drafter, spec)
    gen = lambda i: torch.Generator().manual_seed(seed_for(seed, i))  # noqa: E731
    vanilla(cond[:1], sampling, gen(0)), speculative(cond[:1], sampling, gen(0))  # warm-up, untimed
    seconds, tokens, forwards = {"vanilla": 0.0, "exact": 0.0}, 0, 0
    for i in range(len(cond)):
        for name in (("vanilla", "exact") if i % 2 == 0 else ("exact", "vanilla")):
            t0 = time.perf_counter()
            out, stats = (vanilla if name == "vanilla" else speculative)(cond[i : i + 1], sampling, gen(i))
            seconds[name] += time.perf_counter() - t0
            if name == "exact":
                tokens, forwards = tokens + out.shape[1] - 1, forwards + stats["forwards"] - 1
    return tokens / max(forwards, 1), seconds


def _cache_inputs(paths: WorldPaths) -> tuple:
    """(target, its sidecar, its logit cache, the world's codes): what a drafter trained from the cache reads."""
    target, target_meta = load_target(paths.target_file)
    lc = cache.open_cache(paths.cache_dir, target_meta["sha256"], paths.cache_identity)
    return target, target_meta, lc, load_codes(paths.codes_file, target.config.model_type)


def _entry_params(train_p: TrainDrafterParams, entry: ArchEntry, steps: int) -> TrainDrafterParams:
    """train_drafter's settings with an entry's architecture, TTT form, steps (`steps` where it sets none) and, a
    named drafter's, seed."""
    arch = {f.name: getattr(entry, f.name) for f in dataclasses.fields(DrafterArch)}
    seed = getattr(entry, "seed", None)
    return dataclasses.replace(train_p, steps=entry.steps or steps, ttt=entry.ttt or train_p.ttt,
                               seed=train_p.seed if seed is None else seed, **arch)


def ablate_arch(world: WorldParams, train_p: TrainDrafterParams, p: AblateArchParams, sample_p: SampleParams,
                paths: WorldPaths, drafter: str) -> dict:
    """One drafter architecture of ablate_arch.drafters, trained as ablate-lid's baseline (the logit cache,
    train_drafter's settings but the architecture and the steps, the entry's or else the section's), then what a
    round pays for it and what it drafts: its step against the target's one-token step (eager and compiled,
    interleaved), its held-out acceptance, and tau and ms per image against vanilla under `exact` on the tree
    (conditions of sample.classes / sample.prompts, vanilla and speculative interleaved per condition, eager)
    -> arch_report/<drafter>.json and its curves."""
    from lisa.bench.regime import step_costs
    from lisa.training.drafter import new_drafter, train_drafter as train

    if drafter not in p.drafters:
        raise ValueError(f"ablate-arch: no drafter {drafter!r} in ablate_arch.drafters {sorted(p.drafters)}")
    arch = p.drafters[drafter]
    target, target_meta, lc, d = _cache_inputs(paths)
    tp = _entry_params(train_p, arch, p.steps)
    torch.manual_seed(tp.seed)
    model = new_drafter(target, **tp.overrides())
    m = train(model, target, d["train_tokens"], d["train_cond"], d["test_tokens"][:512], d["test_cond"][:512], tp,
              paths.arch_work / drafter, cache=lc, curves=paths.arch_report / drafter, target_id=target_meta["sha256"])
    model.eval()
    trainable = sum(x.numel() for x in model.parameters() if x.requires_grad)
    sampling, spec = sampling_config(world, p), tree_spec(p, "exact")
    rows = 2 if sampling.use_cfg else 1  # a forward's rows for one image
    costs = step_costs(target, model, rows, sorted({1, max(p.branching or [p.top_k_draft])}), p.rounds)

    cond = _conditions(world, target, sample_p, p.per_class)
    tau, seconds = _against_vanilla(target, model, cond, sampling, spec, p.seed)
    train_speed = {k: m[k] for k in ("train_s", "steps_per_s_this_run")}
    metrics = {"drafter": drafter, "architecture": dataclasses.asdict(arch), "config": model.config.to_dict(),
               "trainable_params": trainable, "steps": tp.steps, "train": train_speed,
               "heldout": {k: m[k] for k in ("heldout_soft_ce", "heldout_top1_agreement", "heldout_topk_mass")},
               "step_cost": costs, "rows": rows, "tree": dataclasses.asdict(spec), "conditions": len(cond),
               "tau": tau,
               "ms_per_image": {k: 1000 * v / len(cond) for k, v in seconds.items()},
               "speedup_eager": seconds["vanilla"] / seconds["exact"], "target_sha256": target_meta["sha256"]}
    write_json(paths.arch_report / f"{drafter}.json", metrics)
    return {k: v for k, v in metrics.items() if k not in ("config", "heldout", "step_cost")}


def plateau_rise(curve: list[list[float]], column: int, share: float = 0.2) -> Optional[float]:
    """How much a held-out curve (rows [step, ...]) rose over its last `share` of steps, relative to its end: (end -
    value at the last point at or before (1 - share) of the last step) / end; None if no point lies there."""
    before = [r for r in curve if r[0] <= (1 - share) * curve[-1][0]] if curve else []
    if not before:
        return None
    start = before[-1]
    return (curve[-1][column] - start[column]) / curve[-1][column] if curve[-1][column] else None


def named_drafter(world: WorldParams, train_p: TrainDrafterParams, p: DraftersParams, lid: LIDConfig,
                  sample_p: SampleParams, paths: WorldPaths, drafter: str) -> dict:
    """A named drafter (drafters.named) trained for a world from its logit cache: train_drafter's settings with the
    entry's architecture, steps, TTT form, seed and loss (baseline top-K soft CE or LID with ablate_lid.lid; its
    `guided` share: CFG-aware distillation at the world's cfg_scale) -> named_dir/<drafter>.safetensors; then its
    held-out acceptance per TTT step (the target mass on its top-k; sum_x min(p, q) unguided and guided, as the
    world samples) with the plateau rule's rise over the last 20% of steps, and tau and ms per image against
    vanilla under `exact` on the section's tree -> named_report/<drafter>.json and its curves."""
    from lisa.training.drafter import new_drafter, train_drafter as train

    if drafter not in p.named:
        raise ValueError(f"named-drafter: no drafter {drafter!r} in drafters.named {sorted(p.named)}")
    entry = p.named[drafter]
    target, target_meta, lc, d = _cache_inputs(paths)
    tp = _entry_params(train_p, entry, train_p.steps)
    sampling = sampling_config(world, p)
    loss = None
    if entry.loss == "lid":
        vq, _ = load_tokenizer(paths.tokenizer_file)
        loss = (target_codebook(vq, target.config), lid)
    torch.manual_seed(tp.seed)
    model = new_drafter(target, **tp.overrides())
    curves = paths.named_report / drafter
    m = train(model, target, d["train_tokens"], d["train_cond"], d["test_tokens"][:512], d["test_cond"][:512], tp,
              paths.named_work / drafter, cache=lc, lid=loss, curves=curves, target_id=target_meta["sha256"],
              guided=(sampling, entry.guided) if entry.guided > 0 else None, overlap=sampling)
    model.eval()
    save_artifact(model, paths.drafter_of(drafter), "drafter", model.config, step=tp.steps, seed=tp.seed,
                  made_from={"target_sha256": target_meta["sha256"], "named": drafter, "loss": entry.loss,
                             "guided": entry.guided, "cache": str(paths.cache_dir)}, extra={"metrics": m})
    metrics = _measured(world, target, target_meta, model, m, p, sample_p, drafter, paths.world,
                        dataclasses.asdict(entry), tp.steps, tp.seed,
                        {k: m[k] for k in ("train_s", "steps_per_s_this_run")}, _rises(curves / "heldout.csv"))
    write_json(paths.named_report / f"{drafter}.json", metrics)
    return {k: v for k, v in metrics.items() if k not in ("config", "entry", "heldout")}


HELDOUT = ("heldout_soft_ce", "heldout_top1_agreement", "heldout_topk_mass", "heldout_overlap", "heldout_overlap_cfg")


def _rises(heldout_csv: Path) -> dict:
    """plateau_rise of each acceptance curve a heldout.csv holds (TTT step 0)."""
    held = pd_read(heldout_csv)
    return {col: plateau_rise(held[["step", col]].values.tolist(), 1)
            for col in ("heldout_topk_mass_s0", "heldout_overlap_s0", "heldout_overlap_cfg_s0") if col in held}


def _measured(world: WorldParams, target, target_meta: dict, model, heldout: dict, p: DraftersParams,
              sample_p: SampleParams, drafter: str, world_name: str, entry: dict, steps, seed, train: dict,
              rise: dict) -> dict:
    """A drafter's report (named-drafter's and drafter-reference's): what it is and how it was trained, its
    trainable parameters (all but the token embedding, the target's, frozen in training) and held-out metrics, then
    tau and ms per image against vanilla under `exact` on the section's tree."""
    sampling, spec = sampling_config(world, p), tree_spec(p, "exact")
    cond = _conditions(world, target, sample_p, p.per_class)
    tau, seconds = _against_vanilla(target, model, cond, sampling, spec, p.seed)
    n_trained = sum(x.numel() for n, x in model.named_parameters() if not n.startswith("tok_embeddings."))
    return {"drafter": drafter, "world": world_name, "entry": entry, "config": model.config.to_dict(), "steps": steps,
            "seed": seed, "trainable_params": n_trained,
            "train": train, "heldout": {k: heldout[k] for k in HELDOUT}, "rise_last_20pct": rise,
            "cfg_scale": sampling.cfg_scale if sampling.use_cfg else 1.0, "tree": dataclasses.asdict(spec),
            "conditions": len(cond), "tau": tau, "ms_per_image": {k: 1000 * v / len(cond) for k, v in seconds.items()},
            "speedup_eager": seconds["vanilla"] / seconds["exact"], "target_sha256": target_meta["sha256"]}


def drafter_reference(world: WorldParams, train_p: TrainDrafterParams, p: DraftersParams, sample_p: SampleParams,
                      paths: WorldPaths) -> dict:
    """The release drafter and ablate-lid's LID drafter measured as named-drafter measures its own: held-out
    acceptance on the same 512 test sequences (top-k mass; sum_x min(p, q) unguided and at the world's CFG), tau
    and ms per image against vanilla on the same conditions and seeds -> named_report/{release,lid}.json, the
    reference rows of drafter-table."""
    from lisa.models.llamagen import load_drafter
    from lisa.training.drafter import heldout_overlap, heldout_ttt

    target, target_meta = load_target(paths.target_file)
    d = load_codes(paths.codes_file, target.config.model_type)
    test_tokens, test_cond = d["test_tokens"][:512], d["test_cond"][:512]
    sampling = sampling_config(world, p)
    out = {}
    for name, curves, loss in (("release", paths.drafter_curves, "baseline"),
                               ("lid", paths.ablation_report / "lid", "lid")):
        model, meta = load_drafter(paths.drafter_of(name), target_meta)
        held = heldout_ttt(model, target, test_tokens, test_cond, train_p)
        held |= heldout_overlap(model, target, test_tokens, test_cond, train_p, sampling)
        trained = meta.get("metrics", {})
        out[name] = _measured(world, target, target_meta, model, held, p, sample_p, name, paths.world,
                              {"loss": loss, "guided": 0.0, "reference": True}, meta.get("step"), meta.get("seed"),
                              {k: trained.get(k) for k in ("train_s", "steps_per_s_this_run")},
                              _rises(curves / "heldout.csv"))
        write_json(paths.named_report / f"{name}.json", out[name])
    return {name: {k: r[k] for k in ("tau", "speedup_eager")} for name, r in out.items()}


def seed_groups(p: DraftersParams, world: str) -> dict[str, list[str]]:
    """The world's runs grouped by their named drafter's entry without its seed: {group label: [drafter names]}, the
    label the first name of the group with its `-s<seed>` suffix (if any) dropped."""
    groups: dict[str, list[str]] = {}
    for run in p.runs.values():
        if run.world != world:
            continue
        key = json.dumps(dataclasses.asdict(p.named[run.drafter]) | {"seed": None}, sort_keys=True)
        groups.setdefault(key, []).append(run.drafter)
    return {names[0].rsplit("-s", 1)[0] if names[0].rsplit("-s", 1)[-1].isdigit() else names[0]: names
            for names in groups.values()}


REFERENCE = ("release", "lid")  # drafter-reference's rows: the drafters that train-drafter and ablate-lid make


def drafter_table(p: DraftersParams, paths: WorldPaths) -> dict:
    """The world's drafters side by side, the release and LID drafters (drafter-reference) first, then the named
    ones (their named-drafter reports): architecture, loss, seed, training
    minutes, held-out acceptance (top-k mass, sum_x min(p, q) unguided and guided) at the first TTT step, the
    curves' rise over their last 20% of steps, tau and speedup against vanilla; the seeds of one entry pooled (mean
    and 95% t-interval over seeds); the held-out guided-overlap curves -> named_report.{md,json,png}."""
    from scipy import stats

    from lisa.stages.render import drafter_table_markdown, drafter_curves_figure

    runs = {}
    for name in REFERENCE + tuple(run.drafter for run in p.runs.values() if run.world == paths.world):
        f = paths.named_report / f"{name}.json"
        if not f.is_file():
            how = "drafter-reference" if name in REFERENCE else f"named-drafter --drafter {name}"
            raise FileNotFoundError(f"{f}: no report of drafter {name!r} (`lisa {how} --world {paths.world}`)")
        runs[name] = json.loads(f.read_text())
    metrics = {"tau": lambda r: r["tau"], "speedup_eager": lambda r: r["speedup_eager"],
               "topk_mass_s0": lambda r: r["heldout"]["heldout_topk_mass"][0],
               "overlap_s0": lambda r: r["heldout"]["heldout_overlap"][0],
               "overlap_cfg_s0": lambda r: r["heldout"]["heldout_overlap_cfg"][0]}
    groups = {}
    for label, names in seed_groups(p, paths.world).items():
        g = {"drafters": names, "seeds": [runs[n]["seed"] for n in names]}
        for key, get in metrics.items():
            x = torch.tensor([get(runs[n]) for n in names], dtype=torch.float64)
            half = (float(stats.t.ppf(0.975, len(x) - 1) * x.std() / len(x) ** 0.5) if len(x) > 1 else None)
            g[key] = {"mean": x.mean().item(), "ci95": half}
        groups[label] = g
    curves = {n: pd_read(paths.named_report / n / "heldout.csv") for n in runs if n not in REFERENCE}
    report = {"world": paths.world, "runs": runs, "groups": groups}
    out = paths.named_report
    atomic_write_all({out.with_suffix(".json"): json_writer(report),
                      out.with_suffix(".md"): lines_writer(drafter_table_markdown(paths.world, runs, groups)),
                      out.with_suffix(".png"): drafter_curves_figure(paths.world, curves)})
    return {label: {k: v for k, v in g.items() if k in ("drafters", "tau")} for label, g in groups.items()}


def pd_read(path: Path):
    import pandas as pd

    return pd.read_csv(path)


def calibrate(p: CalibrateParams, paths: WorldPaths) -> dict:
    """GASV's calibration of a target checkpoint from its output head, its codebook and its logit cache
    -> calibration_dir/calibration.{safetensors,json} (the JSON records the target's sha256)."""
    from lisa.training.calibrate import calibrate as fit, save_calibration

    model, target_meta = load_target(paths.target_file)
    vq, vq_meta = load_tokenizer(paths.tokenizer_file)
    lc = cache.open_cache(paths.cache_dir, target_meta["sha256"], paths.cache_identity)
    cal = fit(model.output.weight, target_codebook(vq, model.config), lc, p,
              {"target": str(paths.target_file), "target_sha256": target_meta["sha256"],
               "tokenizer": str(paths.tokenizer_file), "tokenizer_sha256": vq_meta["sha256"],
               "cache": str(paths.cache_dir)})
    meta = save_calibration(cal, paths.calibration_dir)
    metrics = {k: meta[k] for k in ("positions", "clusters_used_by_top1", "clusters_with_own_budget", "beta_global",
                                    "looseness_ref", "share_within_budget", "calibrate_s", "sha256")}
    metrics |= {"beta_min": min(meta["beta"]), "beta_max": max(meta["beta"]), "target_sha256": target_meta["sha256"],
                "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(paths.calibration_report, metrics)
    return metrics


def needs_recalibration(target_path: str | Path, calibration_dir: str | Path) -> Optional[str]:
    """Why the calibration in calibration_dir no longer fits the target checkpoint (None if it does): compares the
    checkpoint's content hash with the one the calibration recorded (a touch changes nothing)."""
    side = Path(calibration_dir) / "calibration.json"
    if not side.is_file():
        return f"no calibration at {side}"
    made = json.loads(side.read_text()).get("made_from", {}).get("target_sha256")
    now = file_sha256(target_path)
    return None if made == now else (f"{target_path} has sha256 {now[:12]}, the calibration was made for "
                                     f"{str(made)[:12]}")


def bench_ddp(params_path: Path, paths: WorldPaths, steps: int = 40) -> dict:
    """Drafter training steps/s: 1 process (2 threads, 1 thread) against `torchrun --nproc_per_node 2` DDP (gloo,
    1 thread each), same params and global batch, run one after another on this machine. Each run is `lisa
    train-drafter` in a subprocess with its own scratch folders under bench_ddp_work; timing covers training steps
    only -> bench_ddp_report.{json,md}."""
    bin_dir = Path(sys.executable).parent
    lisa_bin = str(bin_dir / "lisa")
    runs = [("1 process, 2 threads", [lisa_bin], 2), ("1 process, 1 thread", [lisa_bin], 1),
            ("2 processes (DDP, gloo), 1 thread each",
             [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--no-python", lisa_bin], 1)]
    rows = []
    for i, (name, launcher, threads) in enumerate(runs):
        w = paths.bench_ddp_work / f"run{i}"
        shutil.rmtree(w, ignore_errors=True)
        cmd = launcher + ["train-drafter", "--world", paths.world, "--params", str(params_path), "--steps", str(steps),
                          "--out", str(w / "drafter"), "--report", str(w / "report.json"), "--work", str(w / "work"),
                          "--curves", str(w / "curves")]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        r = json.loads((w / "report.json").read_text())
        rows.append({"run": name, "processes": r["world_size"], "threads_per_process": threads,
                     "steps": steps, "steps_per_s": r["steps_per_s_this_run"]})
    for r in rows:
        r["vs_1_process_2_threads"] = r["steps_per_s"] / rows[0]["steps_per_s"]
    report = {"world": paths.world, "rows": rows, "cpus": os.cpu_count()}
    out = paths.bench_ddp_report
    write_json(out.with_suffix(".json"), report)
    write_lines(out.with_suffix(".md"), ddp_markdown(paths.world, steps, rows))
    return report


def _train_drafter_params(p: TrainDrafterParams, steps: Optional[int]) -> TrainDrafterParams:
    return dataclasses.replace(p, steps=steps) if steps is not None else p


STAGES = {
    "train-drafter": Stage(lambda c, steps=None, corpus=None: train_drafter(
        _train_drafter_params(c.params.train_drafter, steps), c.paths, corpus),
        out="drafter_dir", report="drafter_report", work="drafter_work"),
    "cache-logits": Stage(lambda c, corpus=None: cache_logits(c.params.cache_logits, c.paths, corpus),
                          out="cache_dir", report="cache_report"),
    "ablate-lid": Stage(lambda c: ablate_lid(c.world, c.params.train_drafter, c.params.ablate_lid, c.params.sample,
                                             c.paths), out="ablation_dir"),
    "ablate-arch": Stage(lambda c, drafter="eagle3": ablate_arch(c.world, c.params.train_drafter, c.params.ablate_arch,
                                                                c.params.sample, c.paths, drafter),
                         out="arch_report", work="arch_work"),
    "named-drafter": Stage(lambda c, drafter: named_drafter(c.world, c.params.train_drafter, c.params.drafters,
                                                            c.params.ablate_lid.lid, c.params.sample, c.paths,
                                                            drafter),
                           out="named_dir", report="named_report", work="named_work"),
    "drafter-reference": Stage(lambda c: drafter_reference(c.world, c.params.train_drafter, c.params.drafters,
                                                           c.params.sample, c.paths), out="named_report"),
    "drafter-table": Stage(lambda c: drafter_table(c.params.drafters, c.paths), out="named_report"),
    "calibrate": Stage(lambda c: calibrate(c.params.calibrate, c.paths), out="calibration_dir",
                       report="calibration_report"),
    "bench-ddp": Stage(lambda c, steps=40: bench_ddp(c.params_path, c.paths, steps), out="bench_ddp_report",
                       work="bench_ddp_work"),
}
