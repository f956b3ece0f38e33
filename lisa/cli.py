"""`lisa <stage>`: reads its params.yaml section, calls the stage function in lisa.stages, prints the metrics.

dvc.yaml calls these commands with explicit paths; the Prefect tasks call the same stage functions directly.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from lisa import __version__
from lisa.checkpoint import CheckpointError
from lisa.config import ConfigError, load_params, profile_text


def cmd_init_target(a):
    from lisa.stages import init_target, layout

    p = load_params(a.params)
    return init_target(p.world(a.world), p.init_target, a.out or layout(a.world)["target"])


def cmd_init_tokenizer(a):
    from lisa.stages import init_tokenizer, layout

    p = load_params(a.params)
    return init_tokenizer(p.world(a.world), p.init_tokenizer, a.out or layout(a.world)["tokenizer"])


def cmd_build_dataset(a):
    from lisa.stages import build_dataset, layout

    p = load_params(a.params)
    w = p.world(a.world)
    if w.dataset is None:
        raise ConfigError(f"world {a.world!r} has no `dataset` section: it is not a built-in world")
    return build_dataset(w.dataset.name, w.dataset.image_size, p.build_dataset, a.out or layout(a.world)["dataset"],
                         w.dataset)


def cmd_train_tokenizer(a):
    from lisa.stages import layout, train_tokenizer

    p = load_params(a.params)
    where = layout(a.world)
    return train_tokenizer(a.dataset or where["dataset"], p.world(a.world), p.train_tokenizer,
                           a.out or where["tokenizer"], a.report or where["tokenizer_report"],
                           a.work or where["tokenizer_work"])


def cmd_encode(a):
    from lisa.stages import TOKENIZER_FILE, encode, layout

    p = load_params(a.params)
    where = layout(a.world)
    return encode(a.dataset or where["dataset"], a.tokenizer or where["tokenizer"] / TOKENIZER_FILE,
                  p.world(a.world), p.encode, a.out or where["codes"])


def cmd_train_target(a):
    from lisa.stages import CODES_FILE, layout, train_target

    p = load_params(a.params)
    where = layout(a.world)
    return train_target(a.codes or where["codes"] / CODES_FILE, p.world(a.world), p.train_target,
                        a.out or where["target"], a.report or where["target_report"],
                        a.work or where["target_work"])


def cmd_sample(a):
    from lisa.stages import CALIBRATION_FILE, DRAFTER_FILE, TARGET_FILE, TOKENIZER_FILE, layout, sample

    p = load_params(a.params)
    where = layout(a.world)
    target = a.target or where["target"] / TARGET_FILE
    tokenizer = a.tokenizer or where["tokenizer"] / TOKENIZER_FILE
    params = p.sample
    if a.method:
        import dataclasses

        params = dataclasses.replace(params, method=a.method)
    drafter = a.drafter or where["drafter"] / DRAFTER_FILE
    return sample(target, tokenizer, p.world(a.world), params, a.out or where["samples"], drafter,
                  where["calibration"] / CALIBRATION_FILE)


def cmd_premise(a):
    from lisa.stages import CODES_FILE, TARGET_FILE, TOKENIZER_FILE, layout, premise

    p = load_params(a.params)
    p.world(a.world)
    where = layout(a.world)
    return premise(where["target"] / TARGET_FILE, where["tokenizer"] / TOKENIZER_FILE, where["codes"] / CODES_FILE,
                   p.premise, a.out or where["premise_report"])


def cmd_fid_reference(a):
    from lisa.stages import CODES_FILE, TOKENIZER_FILE, fid_reference, layout

    p = load_params(a.params)
    where = layout(a.world)
    return fid_reference(where["dataset"], where["tokenizer"] / TOKENIZER_FILE, where["codes"] / CODES_FILE,
                         p.world(a.world), p.quality, a.out or where["quality"], where["reference_report"],
                         where["quality_work"])


def cmd_train_judge(a):
    from lisa.stages import layout, train_judge

    p = load_params(a.params)
    where = layout(a.world)
    return train_judge(where["dataset"], p.world(a.world), p.train_judge, a.out or where["judge"],
                       where["judge_report"], where["judge_work"])


def cmd_evaluate(a):
    from lisa.stages import CODES_FILE, REFERENCE_FILE, TARGET_FILE, TOKENIZER_FILE, evaluate, layout

    p = load_params(a.params)
    where = layout(a.world)
    return evaluate(a.target or where["target"] / TARGET_FILE, where["tokenizer"] / TOKENIZER_FILE,
                    where["codes"] / CODES_FILE, where["quality"] / REFERENCE_FILE, where["judge"],
                    p.world(a.world), p.evaluate, p.quality, a.out or where["evaluate"], where["quality_work"])


def cmd_train_drafter(a):
    from lisa.stages import CODES_FILE, TARGET_FILE, layout, train_drafter

    p = load_params(a.params)
    p.world(a.world)
    where = layout(a.world)
    tp = p.train_drafter
    if a.steps is not None:
        tp = dataclasses.replace(tp, steps=a.steps)
    return train_drafter(a.codes or where["codes"] / CODES_FILE, a.target or where["target"] / TARGET_FILE, tp,
                         a.out or where["drafter"], a.report or where["drafter_report"],
                         a.work or where["drafter_work"], a.curves or where["drafter_curves"], a.corpus)


def cmd_cache_logits(a):
    from lisa.stages import CODES_FILE, TARGET_FILE, cache_logits, layout

    p = load_params(a.params)
    p.world(a.world)
    where = layout(a.world)
    return cache_logits(a.codes or where["codes"] / CODES_FILE, a.target or where["target"] / TARGET_FILE,
                        p.cache_logits, a.out or where["cache"], a.report or where["cache_report"], a.corpus)


def cmd_bench_ddp(a):
    from lisa.stages import bench_ddp, layout

    load_params(a.params).world(a.world)
    return bench_ddp(a.world, a.params, a.steps, a.out or layout(a.world)["bench"] / f"ddp-{a.world}",
                     a.work or f"data/work/bench-ddp/{a.world}")


def cmd_laion_fixture(a):
    from lisa.stages import corpora_layout, laion_fixture

    p = load_params(a.params)
    return laion_fixture(p.corpora, a.out or corpora_layout()["fixture"])


def cmd_build_corpus(a):
    from lisa.stages import (CODES_FILE, TARGET_FILE, TOKENIZER_FILE, build_laion_coco, build_self_generated,
                             corpora_layout, layout)

    p = load_params(a.params)
    c = corpora_layout()
    if a.kind == "laion-coco":
        world = p.corpora.laion_world
        where = layout(world)
        return build_laion_coco(a.metadata or p.corpora.laion_metadata, a.images or p.corpora.laion_images,
                                where["tokenizer"] / TOKENIZER_FILE, p.world(world), p.corpora,
                                a.out or c["laion"], a.report or c["laion_report"])
    if a.world is None:
        raise ValueError("build-corpus self-generated needs --world")
    where = layout(a.world)
    return build_self_generated(where["codes"] / CODES_FILE, where["target"] / TARGET_FILE, p.world(a.world),
                                p.corpora.self_generated, a.out or c["self"](a.world),
                                a.report or c["self_report"](a.world))


def cmd_ablate_lid(a):
    from lisa.stages import CODES_FILE, TARGET_FILE, TOKENIZER_FILE, ablate_lid, layout

    p = load_params(a.params)
    where = layout(a.world)
    return ablate_lid(where["codes"] / CODES_FILE, where["target"] / TARGET_FILE, where["tokenizer"] / TOKENIZER_FILE,
                      where["cache"], p.world(a.world), p.train_drafter, p.ablate_lid, p.sample,
                      a.out or where["ablation"], where["ablation_report"], where["ablation_work"])


def cmd_bench(a):
    from lisa.stages import CALIBRATION_FILE, DRAFTER_FILE, TARGET_FILE, TOKENIZER_FILE, bench, bench_spec, layout

    p = load_params(a.params)
    if a.world is None:
        return bench(p.bench, a.out or layout("-")["bench"])
    where = layout(a.world)
    return bench_spec(where["target"] / TARGET_FILE, where["tokenizer"] / TOKENIZER_FILE,
                      a.drafter or where["drafter"] / DRAFTER_FILE, p.world(a.world), p.sample, p.bench_spec,
                      a.out or where["bench"], a.world, where["lid_drafter"],
                      where["calibration"] / CALIBRATION_FILE)


def cmd_calibrate(a):
    from lisa.stages import TARGET_FILE, TOKENIZER_FILE, calibrate, layout

    p = load_params(a.params)
    p.world(a.world)
    where = layout(a.world)
    return calibrate(a.target or where["target"] / TARGET_FILE, where["tokenizer"] / TOKENIZER_FILE,
                     a.cache or where["cache"], p.calibrate, a.out or where["calibration"], where["calibration_report"])


def cmd_eval_method(a):
    from lisa.stages import (CALIBRATION_FILE, CODES_FILE, DRAFTER_FILE, REFERENCE_FILE, TARGET_FILE, TOKENIZER_FILE,
                             eval_method, layout)

    p = load_params(a.params)
    if a.method not in p.table.cells:
        raise ValueError(f"--method {a.method!r}: not a key of params table.cells {sorted(p.table.cells)}")
    where = layout(a.world)
    return eval_method(where["target"] / TARGET_FILE, where["tokenizer"] / TOKENIZER_FILE, where["codes"] / CODES_FILE,
                       where["quality"] / REFERENCE_FILE, where["judge"], p.world(a.world), a.method, p.table,
                       p.quality, {"release": where["drafter"] / DRAFTER_FILE, "lid": where["lid_drafter"]},
                       where["calibration"] / CALIBRATION_FILE, a.out or where["cells"], where["cells_work"])


def cmd_table(a):
    from lisa.stages import layout, results_table

    p = load_params(a.params)
    out = a.out or "reports"
    from pathlib import Path

    return results_table(list(p.worlds), p.table, layout("-")["bench"], lambda w: layout(w)["cells"],
                         Path(out) / "table.md", Path(out) / "pareto.png")


def cmd_bench_gpu(a):
    from pathlib import Path

    from lisa.checkpoint import atomic_write, write_json
    from lisa.bench.gpu import GPUBenchConfig, gpu_bench, gpu_markdown

    cfg = GPUBenchConfig(preset=a.preset, image_tokens=a.tokens, vocab_size=a.vocab, batch_size=a.batch,
                         dtype=a.dtype, compile=a.compile, repeats=a.repeats)
    r = gpu_bench(cfg, device=a.device)
    text = gpu_markdown(r)
    print(text)
    out = Path(a.out or "reports/bench/gpu")
    write_json(out.with_suffix(".json"), r | {"methods": [{k: v for k, v in m.items() if k != "ms_per_image_all"}
                                                         for m in r["methods"]]})
    atomic_write(out.with_suffix(".md"), lambda tmp: Path(tmp).write_text(text))
    return None


def cmd_estimate(a):
    from lisa.bench.estimate import estimate_markdown, missing_checkpoints

    p = load_params(a.params)
    sys.stdout.write(estimate_markdown(p, a.gpu, a.tau))
    missing = missing_checkpoints(p)
    if missing:
        sys.stdout.write("\nNot found (see README, 'Use your own checkpoints'):\n" + "".join(f"  {m}\n" for m in missing))
    return None


def cmd_profile(a):
    sys.stdout.write(profile_text(a.name))
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lisa", description="LISA: locality-informed speculative decoding for "
                                     "AR image generation. Each command is one pipeline stage (see dvc.yaml).")
    parser.add_argument("--version", action="version", version=f"lisa {__version__}")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")

    def stage(name, fn, help, world=True):
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
        if world:
            s.add_argument("--world", required=True, help="world name (a key of params.yaml's `worlds`)")
        s.add_argument("--out", default=None, help="output folder (default: the layout of dvc.yaml)")
        s.set_defaults(fn=fn)
        return s

    stage("build-dataset", cmd_build_dataset, "build a built-in world's dataset from offline real images "
          "-> data/datasets/<world>/ (HuggingFace datasets)")
    s = stage("train-tokenizer", cmd_train_tokenizer, "train a world's VQ tokenizer (resumable) "
              "-> data/tokenizer/<world>/tokenizer.safetensors")
    s.add_argument("--dataset", default=None, help="dataset folder (default: data/datasets/<world>)")
    s.add_argument("--report", default=None, help="metrics JSON (default: reports/tokenizer/<world>.json)")
    s.add_argument("--work", default=None, help="resume folder (default: data/work/tokenizer/<world>)")
    s = stage("encode", cmd_encode, "VQ codes (+ caption features) of a world's dataset "
              "-> data/codes/<world>/codes.safetensors")
    s.add_argument("--dataset", default=None, help="dataset folder (default: data/datasets/<world>)")
    s.add_argument("--tokenizer", default=None, help="tokenizer .safetensors (default: data/tokenizer/<world>/...)")
    s = stage("train-target", cmd_train_target, "train a world's target GPT on its codes (resumable) "
              "-> data/target/<world>/model.safetensors")
    s.add_argument("--codes", default=None, help="codes .safetensors (default: data/codes/<world>/...)")
    s.add_argument("--report", default=None, help="metrics JSON (default: reports/target/<world>.json)")
    s.add_argument("--work", default=None, help="resume folder (default: data/work/target/<world>)")
    stage("init-target", cmd_init_target, "build a world's target: random init, or import an official "
          "LlamaGen checkpoint -> data/target/<world>/model.safetensors")
    stage("init-tokenizer", cmd_init_tokenizer, "build a world's VQ tokenizer: random init, or import an "
          "official vq_ds16_*.pt -> data/tokenizer/<world>/tokenizer.safetensors")
    s = stage("sample", cmd_sample, "vanilla sampling: a grid, one row per class or prompt -> reports/samples/<world>/")
    s.add_argument("--target", default=None, help="target .safetensors (default: data/target/<world>/...)")
    s.add_argument("--tokenizer", default=None, help="tokenizer .safetensors (default: data/tokenizer/<world>/...)")
    s.add_argument("--method", default=None, help="vanilla (default: params sample.method), or a verifier: "
                   "greedy, exact, lantern, gasv (with a drafter; gasv reads data/calibration/<world>), sjd, gsd")
    s.add_argument("--drafter", default=None, help="drafter .safetensors (default: data/drafter/<world>/...)")
    stage("premise", cmd_premise, "LISA's premise on held-out data: entropy, top-1 prob, codebook-neighbourhood "
          "mass -> reports/premise/<world>.json")
    stage("fid-reference", cmd_fid_reference, "held-out Inception features and reference FID / KID (train, VQ "
          "reconstructions, unigram) -> data/quality/<world>/, reports/quality/<world>-reference.json")
    stage("train-judge", cmd_train_judge, "train the world's quality judge: a classifier (c2i) or a small "
          "open_clip CLIP (t2i) -> data/judge/<world>/, reports/judge/<world>.json")
    s = stage("evaluate", cmd_evaluate, "CFG samples scored by FID / KID against held-out images and by the "
              "judge -> reports/quality/<world>/")
    s.add_argument("--target", default=None, help="target .safetensors (default: data/target/<world>/...)")
    s = stage("train-drafter", cmd_train_drafter, "train the baseline EAGLE-3 drafter of a world's target (TTT, "
              "resumable; under torchrun: DDP) -> data/drafter/<world>/drafter.safetensors, "
              "reports/drafter/<world>.json, reports/drafter/<world>/{train,heldout}.csv")
    s.add_argument("--codes", default=None, help="codes .safetensors (default: data/codes/<world>/...)")
    s.add_argument("--corpus", default=None, help="train on a built corpus (lisa build-corpus) instead of the codes")
    s.add_argument("--target", default=None, help="target .safetensors (default: data/target/<world>/...)")
    s.add_argument("--steps", type=int, default=None, help="override train_drafter.steps")
    s.add_argument("--report", default=None, help="metrics JSON (default: reports/drafter/<world>.json)")
    s.add_argument("--work", default=None, help="resume folder (default: data/work/drafter/<world>)")
    s.add_argument("--curves", default=None, help="curves folder (default: reports/drafter/<world>/)")
    s = stage("cache-logits", cmd_cache_logits, "the target logit cache: top-K logits, logsumexp, entropy and "
              "margin per position of a teacher-forced pass over the world's training codes, as Parquet shards "
              "(resumable; under torchrun each rank writes its shards) -> data/cache/<world>/, reports/cache/<world>.json")
    s.add_argument("--codes", default=None, help="codes .safetensors (default: data/codes/<world>/...)")
    s.add_argument("--target", default=None, help="target .safetensors (default: data/target/<world>/...)")
    s.add_argument("--report", default=None, help="metrics JSON (default: reports/cache/<world>.json)")
    s.add_argument("--corpus", default=None, help="cache a built corpus (lisa build-corpus) instead of the codes")
    s = stage("bench-ddp", cmd_bench_ddp, "drafter training steps/s: 1 process against torchrun DDP with 2 "
              "processes, same global batch -> reports/bench/ddp-<world>.{json,md}")
    s.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    s.add_argument("--work", default=None, help="scratch folder (default: data/work/bench-ddp/<world>)")
    stage("laion-fixture", cmd_laion_fixture, "a LAION-COCO-layout source (metadata Parquet + img2dataset images) "
          "from the emoji images -> data/corpora/laion-coco-fixture/", world=False)
    s = stage("build-corpus", cmd_build_corpus, "a drafter training corpus as Parquet shards: laion-coco (filter, "
              "join, VQ-encode an image-caption source in LAION-COCO's layout) or self-generated (the target's "
              "own samples) -> data/corpora/...", world=False)
    s.add_argument("kind", choices=["laion-coco", "self-generated"])
    s.add_argument("--world", default=None, help="self-generated: the world whose target samples")
    s.add_argument("--metadata", default=None, help="laion-coco: folder of metadata .parquet (default: params)")
    s.add_argument("--images", default=None, help="laion-coco: img2dataset output folder (default: params)")
    s.add_argument("--report", default=None, help="metrics JSON")
    stage("ablate-lid", cmd_ablate_lid, "LID vs the baseline drafter loss: two drafters from the same logit cache, "
          "their acceptance length under exact verification -> data/ablation/<world>/, reports/ablation/<world>/")
    s = stage("bench", cmd_bench, "decode speed. With --world: every method of params bench_spec (vanilla, "
              "exact tree / chain, lantern, sjd, gsd, auto trees) on the world's target and drafter, same "
              "conditions and seeds -> reports/bench/<world>.{json,md,png}; without: vanilla loop of a "
              "random-weight target vs its bare forwards -> reports/bench/vanilla.{json,md}", world=False)
    s.add_argument("--world", default=None, help="world name: the speculative benchmark of its target")
    s.add_argument("--drafter", default=None, help="drafter .safetensors (default: data/drafter/<world>/...)")
    s = stage("calibrate", cmd_calibrate, "GASV's calibration of a world's target: whitening, k-means clusters of "
              "the output head, drift budgets from the logit cache, neighbour table -> data/calibration/<world>/, "
              "reports/calibration/<world>.json")
    s.add_argument("--target", default=None, help="target .safetensors (default: data/target/<world>/...)")
    s.add_argument("--cache", default=None, help="logit cache folder (default: data/cache/<world>)")
    s = stage("eval-method", cmd_eval_method, "one quality cell of the results table: samples decoded with a method "
              "of params table.cells, FID / KID, judge score, tau and the measured TV relaxation "
              "-> reports/quality/<world>/methods/<method>.{json,png}")
    s.add_argument("--method", required=True, help="a key of params table.cells")
    stage("table", cmd_table, "the results table and the tau-FID Pareto plot from bench-spec and eval-method "
          "-> reports/table.{md,json}, reports/pareto.png", world=False)
    s = sub.add_parser("bench-gpu", help="GPU benchmark: a GPT-XL-sized random target and a matching EAGLE-3 "
                       "drafter, vanilla vs speculative, CUDA-synchronised, bf16, optional torch.compile; prints one "
                       "table -> reports/bench/gpu.{json,md}")
    s.add_argument("--preset", default="GPT-XL")
    s.add_argument("--tokens", type=int, default=256, help="image tokens (256 = 256 px)")
    s.add_argument("--vocab", type=int, default=16384)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    s.add_argument("--compile", action="store_true", help="torch.compile the forwards (compilation in the warm-up)")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    s.add_argument("--out", default=None, help="report path without suffix (default reports/bench/gpu)")
    s.set_defaults(fn=cmd_bench_gpu)
    s = sub.add_parser("estimate", help="GPU memory and time of every world's stages, from the params alone "
                       "(nothing is loaded), and the checkpoint paths that are missing")
    s.add_argument("--params", default="params.yaml")
    s.add_argument("--gpu", default="H200", help="H200 | H100 | A100-80G | A100-40G | L40S | RTX4090")
    s.add_argument("--tau", type=float, default=2.5, help="acceptance length assumed for speculative decoding")
    s.set_defaults(fn=cmd_estimate)
    p = sub.add_parser("profile", help="print a named params profile (micro, real) to stdout")
    p.add_argument("name")
    p.set_defaults(fn=cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.fn(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"lisa {args.stage}: error: {e}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps({k: v for k, v in result.items() if k != "rows"} if "rows" in result else result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
