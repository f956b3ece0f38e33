"""Judges of sample quality, trained on a world's real images (no downloaded weights exist offline).

* c2i worlds: a small CNN classifier; class consistency = how often it assigns a sample the class it was
  generated for (its accuracy on held-out real images is the ceiling, 1 / classes the floor).
* t2i worlds: a small CLIP built and trained with open_clip (a ViT on 4x4 patches and a text transformer with
  open_clip's own BPE tokenizer) on the (image, caption) pairs; CLIP score = 100 * max(cos(image, caption), 0),
  averaged, as in torchmetrics' CLIPScore. Real held-out pairs give its ceiling, mismatched pairs its floor.
Both are trained with the nanoGPT-style loop of lisa/training/loops.py (resumable from work_dir/resume.pt).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lisa.checkpoint import load_artifact
from lisa.config import TrainJudgeParams, seed_for
from lisa.models.presets import build_config
from lisa.training.loops import load_resume, lr_at, save_resume


@dataclass
class JudgeConfig:
    kind: str  # "classifier" | "clip"
    image_size: int = 32
    num_classes: int = 10  # classifier
    width: int = 128  # clip: both towers
    layers: int = 3  # clip
    patch_size: int = 8  # clip: ViT patches
    classifier_width: int = 64  # classifier: channels of the last conv block
    embed_dim: int = 128  # clip
    context_length: int = 32  # clip

    @classmethod
    def from_dict(cls, d: dict) -> "JudgeConfig":
        return build_config(cls, {}, **d)  # an unknown field is a ValueError naming it


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random shifts of up to 2 pixels (replicate padding): cheap augmentation for both judges."""
    pad = F.pad(x, (2, 2, 2, 2), mode="replicate")
    dx, dy = torch.randint(0, 5, (2,), generator=gen).tolist()
    return pad[..., dy : dy + x.shape[-2], dx : dx + x.shape[-1]]


class Classifier(nn.Module):
    """Images in [-1, 1] (B, 3, H, W) -> class logits (B, C). Three conv blocks, global average pool."""

    def __init__(self, config: JudgeConfig):
        super().__init__()
        self.config = config
        w = config.classifier_width

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        self.features = nn.Sequential(block(3, w // 4), nn.MaxPool2d(2), block(w // 4, w // 2), nn.MaxPool2d(2),
                                      block(w // 2, w), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(w, config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Clip(nn.Module):
    """open_clip's CLIP at toy size. encode_image / encode_text give L2-normalised embeddings."""

    def __init__(self, config: JudgeConfig):
        super().__init__()
        import open_clip

        self.config = config
        w = config.width
        vision = open_clip.CLIPVisionCfg(layers=config.layers, width=w, head_width=32,
                                         patch_size=config.patch_size,
                                         image_size=config.image_size)
        text = open_clip.CLIPTextCfg(context_length=config.context_length, width=w, heads=max(1, w // 32),
                                     layers=config.layers)
        self.clip = open_clip.CLIP(config.embed_dim, vision, text)
        # open_clip's BPE tokenizer (its vocabulary ships inside the package)
        self._tokenize = open_clip.get_tokenizer("ViT-B-32", context_length=config.context_length)
        self._tokens: dict[str, torch.Tensor] = {}

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        new = [c for c in dict.fromkeys(captions) if c not in self._tokens]
        if new:
            self._tokens.update(zip(new, self._tokenize(new)))
        return torch.stack([self._tokens[c] for c in captions])

    def encode_image(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.clip.encode_image(x), dim=-1)

    def encode_text(self, captions: list[str]) -> torch.Tensor:
        return F.normalize(self.clip.encode_text(self.tokenize(captions)), dim=-1)

    def forward(self, x: torch.Tensor, captions: list[str]) -> torch.Tensor:
        """Contrastive loss of a batch of (image, caption) pairs; duplicate captions are not counted as negatives."""
        img, txt = self.encode_image(x), self.encode_text(captions)
        logits = self.clip.logit_scale.exp() * img @ txt.T
        same = torch.tensor([[a == b for b in captions] for a in captions])
        target = same.float() / same.sum(1, keepdim=True)
        return 0.5 * (torch.sum(-target * logits.log_softmax(1), 1).mean()
                      + torch.sum(-target * logits.log_softmax(0), 0).mean())


def build(config: JudgeConfig | dict) -> nn.Module:
    config = JudgeConfig.from_dict(config) if isinstance(config, dict) else config
    if config.kind == "classifier":
        return Classifier(config)
    if config.kind == "clip":
        return Clip(config)
    raise ValueError(f"unknown judge kind {config.kind!r} (classifier | clip)")


def load_judge(path: str | Path) -> tuple[nn.Module, dict]:
    """A judge artifact (`judge.safetensors` + `judge.json`) -> (model in eval mode, sidecar)."""
    model, meta = load_artifact(path, "judge", build)
    return model.eval(), meta


def _batches(n: int, batch_size: int):
    return (slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size))


def train_judge(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, captions: list[str],
                cfg: TrainJudgeParams, work_dir: str | Path, progress: bool = True) -> dict:
    """images (N, 3, H, W) in [-1, 1]; labels (N,) for a classifier, captions (N) for a CLIP. Resumable."""
    resume = Path(work_dir) / "resume.pt"
    torch.manual_seed(cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    step, extra = load_resume(resume, model, opt, cfg)
    elapsed, t0 = float(extra.get("elapsed_s", 0.0)), time.perf_counter()
    gen = torch.Generator()
    model.train()
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc=f"train {model.config.kind}",
               disable=not progress)
    for step in bar:
        gen.manual_seed(seed_for(cfg.seed, step))  # the batch depends only on (seed, step): resumable
        idx = torch.randint(0, len(images), (cfg.batch_size,), generator=gen)
        x = _augment(images[idx], gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.min_lr, cfg.warmup)
        if model.config.kind == "classifier":
            loss = F.cross_entropy(model(x), labels[idx])
        else:
            loss = model(x, [captions[i] for i in idx.tolist()])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_resume(resume, model, opt, cfg, step + 1,
                        {"elapsed_s": torch.tensor(elapsed + time.perf_counter() - t0)})
    model.eval()
    return {"steps": cfg.steps, "train_s": elapsed + time.perf_counter() - t0}


@torch.no_grad()
def class_consistency(model: Classifier, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 256) -> float:
    """Share of images (in [-1, 1]) the classifier assigns to their label."""
    model.eval()
    hits = sum((model(images[s]).argmax(-1) == labels[s]).sum().item() for s in _batches(len(images), batch_size))
    return hits / len(images)


@torch.no_grad()
def clip_scores(model: Clip, images: torch.Tensor, captions: list[str], batch_size: int = 256) -> torch.Tensor:
    """Per-pair CLIP score 100 * max(cos, 0) of images (in [-1, 1]) with their captions."""
    model.eval()
    out = [100 * (model.encode_image(images[s]) * model.encode_text(captions[s])).sum(-1).clamp(min=0)
           for s in _batches(len(images), batch_size)]
    return torch.cat(out)


@torch.no_grad()
def retrieval(model: Clip, images: torch.Tensor, captions: list[str], ks=(1, 5)) -> dict:
    """Image -> caption retrieval among the distinct captions of a split: top-k accuracy."""
    model.eval()
    distinct = sorted(set(captions))
    txt = torch.cat([model.encode_text(distinct[s]) for s in _batches(len(distinct), 256)])
    img = torch.cat([model.encode_image(images[s]) for s in _batches(len(images), 256)])
    truth = torch.tensor([distinct.index(c) for c in captions])
    ranks = (img @ txt.T).argsort(-1, descending=True)
    return {f"top{k}": (ranks[:, :k] == truth[:, None]).any(-1).float().mean().item() for k in ks} | {
        "captions": len(distinct)}


@torch.no_grad()
def image_features(model: nn.Module, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """The judge's view of images (in [-1, 1]): the classifier's pooled features before its head, or CLIP's
    normalised image embedding (B, d): the feature space of the scoreboard's judge-space FD / KID."""
    model.eval()
    encode = model.features if isinstance(model, Classifier) else model.encode_image
    return torch.cat([encode(images[s]) for s in _batches(len(images), batch_size)])


@torch.no_grad()
def per_image_scores(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, captions: list[str],
                     batch_size: int = 256) -> tuple[str, torch.Tensor]:
    """(name, per-image score (B,)) whose mean is the judge's score: class consistency (100 x correct) or the CLIP
    score."""
    model.eval()
    if isinstance(model, Classifier):
        hits = torch.cat([model(images[s]).argmax(-1) == labels[s] for s in _batches(len(images), batch_size)])
        return "class_consistency", 100.0 * hits.double()
    return "clip_score", clip_scores(model, images, captions, batch_size).double()
