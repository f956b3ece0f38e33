"""One Prefect task per pipeline stage. Each reads its params.yaml section and calls the lisa.stages function
that `lisa <stage>` (and so dvc.yaml) calls, with the same paths (lisa.stages.layout)."""
from __future__ import annotations

from pathlib import Path

from prefect import task

from lisa import stages
from lisa.config import load_params


@task(name="build-dataset")
def build_dataset(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    w = p.world(world)
    return stages.build_dataset(w.dataset.name, w.dataset.image_size, p.build_dataset,
                                stages.layout(world, root)["dataset"], w.dataset)


@task(name="train-tokenizer")
def train_tokenizer(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.train_tokenizer(where["dataset"], p.world(world), p.train_tokenizer, where["tokenizer"],
                                  where["tokenizer_report"], where["tokenizer_work"])


@task(name="encode")
def encode(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.encode(where["dataset"], where["tokenizer"] / stages.TOKENIZER_FILE, p.world(world), p.encode,
                         where["codes"])


@task(name="train-target")
def train_target(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.train_target(where["codes"] / stages.CODES_FILE, p.world(world), p.train_target, where["target"],
                               where["target_report"], where["target_work"])


@task(name="init-tokenizer")
def init_tokenizer(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    return stages.init_tokenizer(p.world(world), p.init_tokenizer, stages.layout(world, root)["tokenizer"])


@task(name="init-target")
def init_target(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    return stages.init_target(p.world(world), p.init_target, stages.layout(world, root)["target"])


@task(name="sample")
def sample(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.sample(where["target"] / stages.TARGET_FILE, where["tokenizer"] / stages.TOKENIZER_FILE,
                         p.world(world), p.sample, where["samples"])


@task(name="premise")
def premise(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.premise(where["target"] / stages.TARGET_FILE, where["tokenizer"] / stages.TOKENIZER_FILE,
                          where["codes"] / stages.CODES_FILE, p.premise, where["premise_report"])


@task(name="fid-reference")
def fid_reference(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.fid_reference(where["dataset"], where["tokenizer"] / stages.TOKENIZER_FILE,
                                where["codes"] / stages.CODES_FILE, p.world(world), p.quality, where["quality"],
                                where["reference_report"], where["quality_work"])


@task(name="train-judge")
def train_judge(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.train_judge(where["dataset"], p.world(world), p.train_judge, where["judge"],
                              where["judge_report"], where["judge_work"])


@task(name="evaluate")
def evaluate(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.evaluate(where["target"] / stages.TARGET_FILE, where["tokenizer"] / stages.TOKENIZER_FILE,
                           where["codes"] / stages.CODES_FILE, where["quality"] / stages.REFERENCE_FILE,
                           where["judge"], p.world(world), p.evaluate, p.quality, where["evaluate"],
                           where["quality_work"])


@task(name="train-drafter")
def train_drafter(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.train_drafter(where["codes"] / stages.CODES_FILE, where["target"] / stages.TARGET_FILE,
                                p.train_drafter, where["drafter"], where["drafter_report"], where["drafter_work"],
                                where["drafter_curves"])


@task(name="bench")
def bench(params_path: str, root: str = ".") -> dict:
    return stages.bench(load_params(params_path).bench, stages.layout("-", root)["bench"])


@task(name="cache-logits")
def cache_logits(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.cache_logits(where["codes"] / stages.CODES_FILE, where["target"] / stages.TARGET_FILE,
                               p.cache_logits, where["cache"], where["cache_report"])


@task(name="laion-fixture")
def laion_fixture(params_path: str, root: str = ".") -> dict:
    return stages.laion_fixture(load_params(params_path).corpora, stages.corpora_layout(root)["fixture"])


@task(name="build-laion-coco")
def build_laion_coco(params_path: str, root: str = ".") -> dict:
    p = load_params(params_path)
    c, where = stages.corpora_layout(root), stages.layout(p.corpora.laion_world, root)
    rooted = lambda path: Path(path) if Path(path).is_absolute() else Path(root) / path
    return stages.build_laion_coco(rooted(p.corpora.laion_metadata), rooted(p.corpora.laion_images),
                                   where["tokenizer"] / stages.TOKENIZER_FILE, p.world(p.corpora.laion_world),
                                   p.corpora, c["laion"], c["laion_report"])


@task(name="build-self-generated")
def build_self_generated(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    c, where = stages.corpora_layout(root), stages.layout(world, root)
    return stages.build_self_generated(where["codes"] / stages.CODES_FILE, where["target"] / stages.TARGET_FILE,
                                       p.world(world), p.corpora.self_generated, c["self"](world),
                                       c["self_report"](world))


@task(name="ablate-lid")
def ablate_lid(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.ablate_lid(where["codes"] / stages.CODES_FILE, where["target"] / stages.TARGET_FILE,
                             where["tokenizer"] / stages.TOKENIZER_FILE, where["cache"], p.world(world),
                             p.train_drafter, p.ablate_lid, p.sample, where["ablation"], where["ablation_report"],
                             where["ablation_work"])


@task(name="bench-spec")
def bench_spec(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.bench_spec(where["target"] / stages.TARGET_FILE, where["tokenizer"] / stages.TOKENIZER_FILE,
                             where["drafter"] / stages.DRAFTER_FILE, p.world(world), p.sample, p.bench_spec,
                             where["bench"], world, where["lid_drafter"], where["calibration"] / stages.CALIBRATION_FILE)


@task(name="calibrate")
def calibrate(params_path: str, world: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.calibrate(where["target"] / stages.TARGET_FILE, where["tokenizer"] / stages.TOKENIZER_FILE,
                            where["cache"], p.calibrate, where["calibration"], where["calibration_report"])


@task(name="needs-recalibration")
def needs_recalibration(world: str, root: str = ".") -> str | None:
    where = stages.layout(world, root)
    return stages.needs_recalibration(where["target"] / stages.TARGET_FILE, where["calibration"])


@task(name="eval-method")
def eval_method(params_path: str, world: str, method: str, root: str = ".") -> dict:
    p = load_params(params_path)
    where = stages.layout(world, root)
    return stages.eval_method(where["target"] / stages.TARGET_FILE, where["tokenizer"] / stages.TOKENIZER_FILE,
                              where["codes"] / stages.CODES_FILE, where["quality"] / stages.REFERENCE_FILE,
                              where["judge"], p.world(world), method, p.table, p.quality,
                              {"release": where["drafter"] / stages.DRAFTER_FILE, "lid": where["lid_drafter"]},
                              where["calibration"] / stages.CALIBRATION_FILE, where["cells"], where["cells_work"])


@task(name="table")
def table(params_path: str, root: str = ".") -> dict:
    p = load_params(params_path)
    return stages.results_table(list(p.worlds), p.table, stages.layout("-", root)["bench"],
                                lambda w: stages.layout(w, root)["cells"], Path(root) / "reports" / "table.md",
                                Path(root) / "reports" / "pareto.png")


@task(name="estimate")
def estimate(params_path: str, gpu: str = "H200") -> str:
    """GPU memory and time of the run, from the params alone: logged before any stage starts."""
    from lisa.bench.estimate import estimate_markdown, missing_checkpoints

    p = load_params(params_path)
    text = estimate_markdown(p, gpu)
    missing = missing_checkpoints(p)
    if missing:
        text += "\nNot found: " + "; ".join(missing) + "\n"
    print(text)
    return text
