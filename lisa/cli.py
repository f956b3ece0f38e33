"""`lisa <stage>`: runs a pipeline stage through lisa.stages.run_stage (the Prefect tasks call the same function),
prints its metrics. dvc.yaml calls these commands, all but OUTSIDE_DVC; `bench-gpu`, `regime`, `estimate`, `plan`
and `profile` are tools, not stages.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Optional
from pathlib import Path

from lisa import __version__
from lisa.checkpoint import CheckpointError
from lisa.config import ConfigError, profile_text
from lisa.decoding.verify import VERIFIERS, needs
from lisa.stages import STAGES, SharedPaths, WorldPaths, run_stage
from lisa.stages.params import load_params


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
        sys.stdout.write("\nNot found (see docs/real-checkpoints.md):\n" + "".join(f"  {m}\n" for m in missing))
    return None


def drafter_archs(specs: Optional[list[str]]) -> Optional[dict]:
    """`--drafter NAME[:KEY=VALUE,...]` flags -> {name: {key: int value}} (None when none given)."""
    if not specs:
        return None
    out = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        arch = {}
        for kv in filter(None, rest.split(",")):
            key, eq, value = kv.partition("=")
            if not eq or not value.lstrip("-").isdigit():
                raise SystemExit(f"--drafter {spec!r}: {kv!r} is not KEY=INTEGER (e.g. head_rank=256)")
            arch[key] = int(value)
        if not name or name in out:
            raise SystemExit(f"--drafter {spec!r}: each drafter needs its own name")
        out[name] = arch
    return out


def cmd_replay(a):
    from pathlib import Path

    from lisa.bench.regime import shape_config
    from lisa.bench.replay import ReplayConfig, replay_bench, replay_markdown
    from lisa.checkpoint import atomic_write, write_json

    rc = ReplayConfig(**{k: v for k, v in dict(shape=a.shape, methods=a.methods, image_tokens=a.tokens,
                                                images=a.images, repeats=a.repeats, modes=a.modes, dtype=a.dtype,
                                                threads=a.threads, drafters=drafter_archs(a.drafter)).items()
                         if v is not None})
    report_path = Path(a.bench) / f"{a.world}.json"
    if not report_path.is_file():
        raise FileNotFoundError(f"{report_path}: no bench report of {a.world} (`lisa bench-spec --world {a.world}`)")
    cfg, _ = shape_config(rc.shape)
    r = replay_bench(rc, json.loads(report_path.read_text()), cfg, device=a.device)
    text = replay_markdown(r)
    print(text)
    out = Path(a.out or f"reports/regime/replay-{rc.shape}-{a.world}")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), r)
    atomic_write(out.with_suffix(".md"), lambda tmp: Path(tmp).write_text(text))
    return None


def cmd_regime(a):
    from pathlib import Path

    from lisa.bench.regime import RegimeConfig, bench_reports, regime, regime_markdown, reprice, shape_config
    from lisa.checkpoint import atomic_write, write_json

    out = Path(a.out or "reports/regime/regime")
    if a.reprice:  # the stored measurements, priced against the current bench reports
        r = reprice(json.loads(out.with_suffix(".json").read_text()), bench_reports(Path(a.bench)))
        text = regime_markdown(r)
        write_json(out.with_suffix(".json"), r)
        atomic_write(out.with_suffix(".md"), lambda tmp: Path(tmp).write_text(text))
        print(text)
        return None
    rc = RegimeConfig(**{k: v for k, v in dict(shapes=a.shapes, dtypes=a.dtypes, modes=a.modes, repeats=a.repeats,
                                                threads=a.threads, compile_budget_s=a.compile_budget,
                                                time_budget_s=a.time_budget, compile_shapes=a.compile_shapes).items()
                                    if v is not None})
    params = load_params(a.params) if Path(a.params).is_file() else None
    shapes = {s: shape_config(s, Path(a.targets), params) for s in rc.shapes}
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    r = regime(rc, shapes, bench_reports(Path(a.bench)), device=a.device, log=log)
    text = regime_markdown(r)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), r)
    atomic_write(out.with_suffix(".md"), lambda tmp: Path(tmp).write_text(text))
    return None


def _dvc_status(lock: str, out) -> str:
    """`dvc status --json` in the folder of `lock`, through DVC's command line (lisa never imports DVC), written to
    the file `out`."""
    import subprocess
    from pathlib import Path

    if not Path(lock).parent.is_dir():
        raise FileNotFoundError(f"{Path(lock).parent}: no such folder (--lock names the repository's dvc.lock)")
    dvc = Path(sys.executable).with_name("dvc")
    try:
        proc = subprocess.run([str(dvc if dvc.is_file() else "dvc"), "status", "--json"], capture_output=True,
                              text=True, cwd=Path(lock).parent)
    except FileNotFoundError as e:
        raise FileNotFoundError("dvc not found: install lisa[pipeline], or pass --status <file of `dvc status "
                                "--json`>") from e
    if proc.returncode:
        raise ValueError(f"`dvc status --json` failed: {proc.stderr.strip().splitlines()[-1:]}")
    Path(out).write_text(proc.stdout)
    return str(out)


def cmd_plan(a):
    import tempfile

    from lisa.stages.plan import main as plan

    if a.check_deps:
        from lisa.stages.deps import main as check_deps

        problems = check_deps(Path(a.lock).parent / "dvc.yaml")
        sys.stdout.write("".join(line + "\n" for line in problems))
        if problems:
            raise ValueError(f"{len(problems)} code deps of dvc.yaml disagree with what the stages import "
                             "(lisa/stages/deps.py says how they are walked)")
        print("dvc.yaml's code deps are the lisa files each stage's function imports")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        status = a.status or _dvc_status(a.lock, f"{tmp}/status.json")
        sys.stdout.write("".join(line + "\n" for line in plan(status, a.lock)))
    return None


def cmd_profile(a):
    text = profile_text(a.name)
    if not a.workspace:
        sys.stdout.write(text)
        return None
    workspace(a.name, text, a.workspace)
    return None


def _git(*args: str, cwd=".") -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise ValueError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def workspace(name: str, text: str, folder: str) -> Path:
    """A workspace of its own for profile `name`: a git worktree of this repository's HEAD at `folder` with the
    profile as its params.yaml, sharing this checkout's DVC cache. `dvc repro` there rebuilds the profile's
    pipeline and never writes this checkout's committed release artifacts."""
    root = Path(_git("rev-parse", "--show-toplevel").strip())
    dest = Path(folder).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"--workspace {folder}: exists and is not empty")
    _git("worktree", "add", "--detach", str(dest), "HEAD", cwd=root)
    (dest / "params.yaml").write_text(text)
    cache = root / ".dvc" / "cache"
    if (root / ".dvc").is_dir():  # the same content-addressed cache: nothing is stored twice
        (dest / ".dvc" / "config.local").write_text(f"[cache]\n    dir = {cache}\n")
    print(f"workspace {dest}: git worktree of {root} at HEAD, params.yaml = the {name} profile, DVC cache {cache}.\n"
          f"  cd {dest} && dvc repro     # this checkout's releases stay as they are\n"
          f"  git worktree remove --force {dest}   # when done", file=sys.stderr)
    return dest


# matrix stages: the option that names their item (dvc.yaml's stage name is <stage>@<world>-<item>)
MATRIX_ITEM = {"eval-method": "method", "ablate-arch": "drafter", "sweep": "family"}
# stages whose output folder is shared: the files (git pathspecs, in it) each run writes
WRITES = {"bench": ["vanilla.*"], "bench-spec": ["{world}.*"], "table": ["table.*", "pareto.png"],
          "eval-method": ["{method}.*", "{method}-tv.csv"], "ablate-arch": ["{drafter}.json", "{drafter}/*"],
          "named-drafter": ["{drafter}.*", "{drafter}/*"],
          "sweep": ["{family}.json"], "quality-point": ["{point}.json"]}


def release_outputs(stage: str, world, options: dict) -> list[str]:
    """What a stage run by hand would overwrite that is committed to git: the tracked files among the ones it writes
    in a shared folder (WRITES), else its default output paths (`out`, `report`, unless --out / --report name
    others) that hold tracked files, each with their count. Empty under DVC
    (`dvc repro` sets DVC_STAGE) and outside a git checkout. Paths are relative to the working directory, as
    run_stage writes them."""
    if os.environ.get("DVC_STAGE"):
        return []
    st = STAGES[stage]
    fields = [f for f, flag in ((st.out, "out"), (st.report, "report")) if f and options.get(flag) is None]
    paths = WorldPaths.of(world) if st.world else SharedPaths.of()
    names = dict(world=world, method=options.get("method"), drafter=options.get("drafter"),
                 family=options.get("family"), point=options.get("point"))
    found = []
    for target in [getattr(paths, f) for f in fields if hasattr(paths, f)]:
        specs = [str(target / w.format(**names)) for w in WRITES.get(stage, [])]
        try:
            listed = _git("ls-files", "--", *(specs or [str(target)])).split()
        except (ValueError, OSError):  # not a git checkout, or no git
            return []
        if specs:
            found += listed
        elif listed:
            n = len(listed)
            found.append(f"{target}{'/' if Path(target).is_dir() else ''} ({n} file{'s' * (n > 1)})")
    return found


# stage -> (help, its options besides --params, --world and --out)
COMMANDS = {
    "build-dataset": ("build a built-in world's dataset from offline real images -> data/datasets/<world>/ "
                      "(HuggingFace datasets)", []),
    "train-tokenizer": ("train a world's VQ tokenizer (resumable) -> data/tokenizer/<world>/tokenizer.safetensors",
                        ["dataset", "report", "work"]),
    "encode": ("VQ codes (+ caption features) of a world's dataset -> data/codes/<world>/codes.safetensors",
               ["dataset", "tokenizer"]),
    "train-target": ("train a world's target GPT on its codes (resumable) -> data/target/<world>/model.safetensors",
                     ["codes", "report", "work"]),
    "init-target": ("build a world's target: random init, or import an official LlamaGen checkpoint "
                    "-> data/target/<world>/model.safetensors", []),
    "init-tokenizer": ("build a world's VQ tokenizer: random init, or import an official vq_ds16_*.pt "
                       "-> data/tokenizer/<world>/tokenizer.safetensors", []),
    "sample": ("sample a grid, one row per class or prompt, with a decoding method (params sample.method: vanilla "
               "or a verifier; --method: also a named one, e.g. lisa-sampled) -> reports/samples/<world>/", ["target", "tokenizer", "drafter", "method", "compile"]),
    "premise": ("LISA's premise on held-out data: entropy, top-1 prob, codebook-neighbourhood mass "
                "-> reports/premise/<world>.json (--out: the JSON)", []),
    "fid-reference": ("held-out Inception features and reference FID / KID (train, VQ reconstructions, unigram) "
                      "-> data/quality/<world>/, reports/quality/<world>-reference.json", []),
    "train-judge": ("train the world's quality judge: a classifier (c2i) or a small open_clip CLIP (t2i) "
                    "-> data/judge/<world>/, reports/judge/<world>.json", []),
    "evaluate": ("vanilla CFG samples scored by FID / KID against held-out images and by the judge "
                 "-> reports/quality/<world>/", ["target"]),
    "train-drafter": ("train the baseline EAGLE-3 drafter of a world's target (TTT, resumable; under torchrun: DDP) "
                      "-> data/drafter/<world>/drafter.safetensors, reports/drafter/<world>.json, "
                      "reports/drafter/<world>/{train,heldout}.csv",
                      ["codes", "corpus", "target", "steps", "report", "work", "curves"]),
    "cache-logits": ("the target logit cache: top-K logits, logsumexp, entropy and margin per position of a "
                     "teacher-forced pass over the world's training codes, as Parquet shards (resumable; under "
                     "torchrun each rank writes its shards) -> data/cache/<world>/, reports/cache/<world>.json",
                     ["codes", "target", "report", "corpus"]),
    "bench-ddp": ("drafter training steps/s: 1 process against torchrun DDP with 2 processes, same global batch "
                  "-> reports/bench/ddp-<world>.{json,md} (--out: the path without suffix)", ["ddp-steps", "work"]),
    "laion-fixture": ("a LAION-COCO-layout source (metadata Parquet + img2dataset images) from the emoji images "
                      "-> data/corpora/laion-coco-fixture/", []),
    "build-laion-coco": ("a drafter training corpus as Parquet shards: an image-caption source in LAION-COCO's "
                         "layout filtered, joined and VQ-encoded with corpora.laion_world's tokenizer "
                         "-> data/corpora/laion-coco/, reports/corpora/laion-coco.json",
                         ["metadata", "images", "report"]),
    "build-self-generated": ("a drafter training corpus as Parquet shards: the world's target's own samples "
                             "-> data/corpora/self-generated/<world>/, reports/corpora/self-generated-<world>.json",
                             ["report"]),
    "ablate-lid": ("LID vs the baseline drafter loss: two drafters from the same logit cache, their acceptance "
                   "length under exact verification -> data/ablation/<world>/, reports/ablation/<world>/", []),
    "ablate-arch": ("a drafter architecture of params ablate_arch.drafters trained from the logit cache, its step "
                    "against the target's (eager, compiled) and tau / ms per image against vanilla under exact "
                    "-> reports/ablate-arch/<world>/<drafter>.json and curves", ["arch", "work"]),
    "named-drafter": ("a named drafter of params drafters.named (its architecture, steps, seed, loss: baseline, LID or "
                      "CFG-aware) trained from the logit cache, its held-out acceptance (top-k mass, sum_x min(p, q) "
                      "unguided and guided) and tau / ms per image against vanilla under exact; methods draft with "
                      "it by `drafter: <name>` -> data/drafters/<world>/<drafter>.safetensors, "
                      "reports/drafters/<world>/<drafter>.json and curves", ["named", "report", "work"]),
    "drafter-reference": ("the release and LID drafters measured as named-drafter measures its own (held-out "
                          "acceptance, tau / ms per image against vanilla): drafter-table's reference rows "
                          "-> reports/drafters/<world>/{release,lid}.json", []),
    "drafter-table": ("a world's named drafters side by side (held-out acceptance, tau, speedup), the seeds of an "
                      "entry pooled with 95%% t-intervals, the held-out overlap curves "
                      "-> reports/drafters/<world>.{md,json,png}", []),
    "bench": ("vanilla decode loop of a random-weight target vs its bare forwards -> reports/bench/vanilla.{json,md}",
              []),
    "bench-spec": ("every decoding method of params bench_spec (vanilla, exact tree / chain, lantern, sjd, gsd, gasv, "
                   "auto trees) on the world's target and drafters, same conditions and seeds "
                   "-> reports/bench/<world>.{json,md,png}", ["drafter"]),
    "calibrate": ("GASV's calibration of a world's target: whitening, k-means clusters of the output head, drift "
                  "budgets from the logit cache, neighbour table -> data/calibration/<world>/, "
                  "reports/calibration/<world>.json", ["target", "cache"]),
    "eval-method": ("one quality cell of the results table: samples decoded with a method of params table.cells, "
                    "FID / KID, judge score, tau and the measured TV relaxation "
                    "-> reports/quality/<world>/methods/<method>.{json,png}", ["cell", "compile"]),
    "sweep": ("the scoreboard's sweep of one family of params scoreboard.families: tau and the measured per-token TV "
              "of every point of its knob grid on the same images and seeds (resumable per point) "
              "-> reports/scoreboard/<world>/sweep/<family>.json", ["family"]),
    "quality-point": ("one image-quality point of the scoreboard (params scoreboard.points): a family at a TV budget, "
                      "Inception FID / KID / precision / recall, judge-space FD / KID and the judge's score with "
                      "bootstrap 95%% intervals -> reports/scoreboard/<world>/quality/<point>.json", ["point"]),
    "method-inputs": ("what each decoding method of a world reads besides the target (its drafter, GASV's "
                      "calibration), per table cell and scoreboard family: the files and their sha256, what "
                      "eval-method / sweep / quality-point depend on -> data/methods/<world>/{cells,families}/<key>.json",
                      []),
    "scoreboard": ("the matched-quality scoreboard of a world from its sweep and quality points: tau at each TV budget "
                   "per family, the frontier plot -> reports/scoreboard/<world>.{md,json,png}", []),
    "table": ("the results table and the tau-FID Pareto plot from bench-spec and eval-method "
              "-> reports/table.{md,json}, reports/pareto.png (--out: their folder)", []),
    "summary": ("a world's headline from the results table: vanilla's FID, the fastest lossless and LISA rows "
                "(speedup, tau, TV, FID against vanilla) -> reports/summary/<world>.json (what `dvc metrics show` "
                "lists)", []),
}

# commands of COMMANDS that are not dvc.yaml stages: run by hand (tests/test_flows.py checks the rest against
# dvc.yaml)
OUTSIDE_DVC = ("init-target", "init-tokenizer", "bench-ddp")
TOOLS = ("bench-gpu", "regime", "replay", "estimate", "plan", "profile")

# option -> (flag, add_argument keywords); `dest` is the run_stage option it sets
OPTIONS = {
    "dataset": ("--dataset", dict(dest="dataset_dir", help="dataset folder (default: data/datasets/<world>)")),
    "tokenizer": ("--tokenizer", dict(dest="tokenizer_file",
                                      help="tokenizer .safetensors (default: data/tokenizer/<world>/...)")),
    "codes": ("--codes", dict(dest="codes_file", help="codes .safetensors (default: data/codes/<world>/...)")),
    "target": ("--target", dict(dest="target_file", help="target .safetensors (default: data/target/<world>/...)")),
    "drafter": ("--drafter", dict(dest="drafter_file",
                                  help="drafter .safetensors (default: data/drafter/<world>/...)")),
    "cache": ("--cache", dict(dest="cache_dir", help="logit cache folder (default: data/cache/<world>)")),
    "curves": ("--curves", dict(dest="drafter_curves", help="curves folder (default: reports/drafter/<world>/)")),
    "report": ("--report", dict(help="metrics JSON (default: its path in dvc.yaml)")),
    "work": ("--work", dict(help="resume / scratch folder (default: under data/work/)")),
    "corpus": ("--corpus", dict(help="a built corpus (lisa build-laion-coco / build-self-generated) instead of the "
                                     "world's training codes")),
    "steps": ("--steps", dict(type=int, help="override train_drafter.steps")),
    "ddp-steps": ("--steps", dict(type=int, default=40, help="training steps per run (default 40)")),
    "method": ("--method", dict(help="vanilla (default: params sample.method); a verifier with params sample's tree, "
                                     "window and options: " + ", ".join(
                                         f"{v} ({', '.join(needs(v))})" for v in sorted(VERIFIERS))
                                     + " (the drafter: data/drafter/<world>; the calibration: data/calibration/<world>); or a "
                                       "named method of params table.cells / bench_spec.methods with all its fields "
                                       "(e.g. lisa-sampled; an LID drafter: data/ablation/<world>)")),
    "cell": ("--method", dict(required=True, help="a key of params table.cells")),
    "arch": ("--drafter", dict(dest="drafter", required=True, help="a key of params ablate_arch.drafters")),
    "named": ("--drafter", dict(dest="drafter", required=True, help="a key of params drafters.named")),
    "family": ("--family", dict(required=True, help="a key of params scoreboard.families")),
    "point": ("--point", dict(required=True, help="a key of params scoreboard.points")),
    "compile": ("--compile", dict(action="store_true", help="the target's and the drafter's forwards under "
                                  "torch.compile (static shapes; graphs compile on first use; default: params "
                                  "sample.compile / table.compile)")),
    "metadata": ("--metadata", dict(help="folder of LAION-COCO metadata .parquet (default: params corpora)")),
    "images": ("--images", dict(help="img2dataset output folder (default: params corpora)")),
}


def _add_stages(sub) -> None:
    """One command per pipeline stage (COMMANDS); its options are run_stage's options."""
    for name, (help, options) in COMMANDS.items():
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
        if STAGES[name].world:
            s.add_argument("--world", required=True, help="world name (a key of params.yaml's `worlds`)")
        s.add_argument("--out", default=None, help="where it writes (default: its path in dvc.yaml)")
        s.add_argument("--force", action="store_true", help="overwrite outputs committed to git (by hand; DVC's runs "
                       "always may)")
        for option in options:
            flag, kwargs = OPTIONS[option]
            s.add_argument(flag, **{"default": None} | kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lisa", description="LISA: locality-informed speculative decoding for AR image generation. Each command "
        f"but {', '.join(OUTSIDE_DVC + TOOLS)} is one pipeline stage of dvc.yaml, of the same name; "
        f"{', '.join(OUTSIDE_DVC)} are stages run by hand (not in dvc.yaml); {', '.join(TOOLS)} are tools.")
    parser.add_argument("--version", action="version", version=f"lisa {__version__}")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    _add_stages(sub)
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
    s = sub.add_parser("regime", help="the regime table: t(N) / t(1) for N = 1..33 and a drafter step at the worlds' "
                       "and LlamaGen B / L / XL shapes (random weights), fp32 / bf16, eager / compiled, measured side "
                       "by side on this machine, and the speedup it allows each method of the bench reports "
                       "-> reports/regime/regime.{json,md} (docs/regime.md)")
    s.add_argument("--shapes", nargs="+", default=None,
                   help="world names and GPT presets (default: fashion-c2i emoji-t2i GPT-B GPT-L GPT-XL)")
    s.add_argument("--dtypes", nargs="+", default=None, choices=["fp32", "bf16"])
    s.add_argument("--modes", nargs="+", default=None, choices=["eager", "compiled"])
    s.add_argument("--repeats", type=int, default=None, help="interleaved timed rounds (default 31; cut to fit "
                   "--time-budget per shape)")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    s.add_argument("--compile-budget", type=float, default=None, help="seconds of compilation a shape may take "
                   "(predicted from a pilot; default 300): compiled mode is skipped, with a note, where it would "
                   "not fit")
    s.add_argument("--compile-shapes", nargs="+", default=None, help="the shapes that run compiled (default: all, "
                   "within --compile-budget)")
    s.add_argument("--time-budget", type=float, default=None, help="seconds of timed rounds per shape (default 45)")
    s.add_argument("--params", default="params.yaml", help="for worlds without a checkpoint")
    s.add_argument("--targets", default="data/target", help="the worlds' targets: <targets>/<world>/model.json")
    s.add_argument("--bench", default="reports/bench", help="bench-spec reports whose methods are priced")
    s.add_argument("--device", default=None, help="default: cpu")
    s.add_argument("--out", default=None, help="report path without suffix (default reports/regime/regime)")
    s.add_argument("--reprice", action="store_true", help="time nothing: price the methods of the current bench "
                   "reports on the regimes stored in --out's JSON")
    s.set_defaults(fn=cmd_regime)
    s = sub.add_parser("replay", help="the speculative loop timed at a LlamaGen shape (random weights) with a world's "
                       "measured acceptance replayed: vanilla and tree methods of its bench report, eager and "
                       "compiled, against the bare round -> reports/regime/replay-<shape>-<world>.{json,md} "
                       "(docs/regime.md)")
    s.add_argument("--world", default="fashion-c2i", help="whose bench report (--bench) gives the acceptance")
    s.add_argument("--shape", default=None, help="a GPT preset (default GPT-B)")
    s.add_argument("--methods", nargs="+", default=None, help="tree methods of the report (default exact-sampled "
                   "lisa-sampled)")
    s.add_argument("--tokens", type=int, default=None, help="tokens decoded per image (default 64)")
    s.add_argument("--images", type=int, default=None, help="images per pass (default 2)")
    s.add_argument("--repeats", type=int, default=None, help="timed passes after one warm-up (default 3)")
    s.add_argument("--modes", nargs="+", default=None, choices=["eager", "compiled"])
    s.add_argument("--dtype", default=None, choices=["fp32", "bf16"])
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    s.add_argument("--drafter", action="append", default=None, metavar="NAME[:KEY=VALUE,...]",
                   help="a drafter architecture to time (repeatable; the first names the rows without '@'): "
                   "DrafterConfig overrides, e.g. eagle3 and cheap:ffn_dim=0,head_rank=256 (default: eagle3, the "
                   "release architecture)")
    s.add_argument("--bench", default="reports/bench", help="folder of the bench-spec reports")
    s.add_argument("--device", default=None, help="default: cpu")
    s.add_argument("--out", default=None, help="report path without suffix")
    s.set_defaults(fn=cmd_replay)
    s = sub.add_parser("plan", help="what `make run` (dvc repro) or the flow lisa-full will do: the stages it runs "
                       "and why, the committed release artifacts it reuses, the expected time (runs `dvc status "
                       "--json` in the lock's folder, or reads its output from --status)")
    s.add_argument("--status", default=None, help="a file holding the output of `dvc status --json` (default: run it)")
    s.add_argument("--lock", default="dvc.lock")
    s.add_argument("--check-deps", action="store_true",
                   help="instead: check that each dvc.yaml stage (beside --lock) lists as code deps the lisa/*.py "
                   "files its function imports, no more and no fewer; one line per problem, exit status 2 if any")
    s.set_defaults(fn=cmd_plan)
    p = sub.add_parser("profile", help="print a named params profile (micro, real) to stdout, or make it a "
                       "workspace of its own (--workspace) so that its runs never touch this checkout's releases")
    p.add_argument("name")
    p.add_argument("--workspace", default=None, help="a new folder: a git worktree of HEAD with the profile as its "
                   "params.yaml (sharing this checkout's DVC cache); run `dvc repro` there")
    p.set_defaults(fn=cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.stage in STAGES:
            options = {k: v for k, v in vars(args).items()
                       if k not in ("stage", "params", "world", "force") and v is not None}
            world = getattr(args, "world", None)
            if world is not None:
                load_params(args.params).world(world)  # a bad params file or world first: the error names it
            tracked = [] if args.force else release_outputs(args.stage, world, options)
            if tracked:
                item = MATRIX_ITEM.get(args.stage)
                where = (f"{args.stage}@{world}" + (f"-{options[item]}" if item else "")) if world else args.stage
                where = f"{args.stage}@{options['point']}" if args.stage == "quality-point" else where
                raise ValueError(f"would overwrite what git holds in {', '.join(tracked)} (the committed outputs of "
                                 f"dvc.yaml's stage {where}): `dvc repro {where}` rebuilds them when their inputs "
                                 "changed; --out writes elsewhere; --force overwrites")
            result = run_stage(args.stage, args.params, world, **options)
        else:
            result = args.fn(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"lisa {args.stage}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --out over a file, a read-only folder, a full disk: what failed and where, no traceback
        where = f" ({e.filename})" if e.filename and str(e.filename) not in str(e) else ""
        print(f"lisa {args.stage}: error: {e}{where}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps({k: v for k, v in result.items() if k != "rows"} if "rows" in result else result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
