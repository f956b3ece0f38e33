"""What several stages share: a world's sampling settings and text conditions, the target's codebook geometry, the
images and codes of a world, the drafters and geometry the decoding methods read."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lisa.checkpoint import read_state_dict
from lisa.config import WorldParams
from lisa.data import datasets as data
from lisa.data.identity import check_identity
from lisa.data.text import CaptionEncoder
from lisa.decoding.methods import geometry_reads, method_geometry
from lisa.decoding.verify import drafts_tree
from lisa.models.gpt import grammar_grid, square_image_grammar
from lisa.models.llamagen import load_drafter
from lisa.quality import judges
from lisa.stages.paths import WorldPaths


def check_pair(target_file, target_meta: dict, tokenizer_file, vq_meta: dict) -> None:
    """Refuse a target with a tokenizer other than the one whose codes it was trained on: the target's sidecar names
    its training codes (made_from: codes, codes_sha256), whose sidecar names their tokenizer's sha256. A lineage
    that cannot be followed (an imported checkpoint, codes no longer on disk) is not checked; sizes are, by the
    caller."""
    made = target_meta.get("made_from") or {}
    codes, codes_sha = made.get("codes"), made.get("codes_sha256")
    if not codes or not codes_sha:
        return
    up = Path(target_file).resolve().parents  # a root's data/target/<world>/model.safetensors: codes are root-relative
    for side in [Path(codes).with_suffix(".json")] + ([up[3] / Path(codes).with_suffix(".json")] if len(up) > 3 else []):
        if side.is_file():
            meta = json.loads(side.read_text())
            if meta.get("sha256") != codes_sha or not meta.get("tokenizer_sha256"):
                return  # other codes than those it was trained on: nothing to compare
            if meta["tokenizer_sha256"] != vq_meta.get("sha256"):
                raise ValueError(f"{target_file} was trained on the codes of tokenizer {meta['tokenizer_sha256'][:12]} "
                                 f"({codes}), but {tokenizer_file} is tokenizer {str(vq_meta.get('sha256'))[:12]}: "
                                 "a target decodes only with the tokenizer of its training codes (--tokenizer)")
            return


def caption_encoder(world: WorldParams) -> CaptionEncoder:
    """The world's caption encoder: MiniLM (the default) or a local model directory (T5)."""
    return CaptionEncoder(None if world.caption_encoder in (None, "minilm") else world.caption_encoder)


def text_encoder(world: WorldParams, cfg):
    """captions -> conditions of a text-conditional target, its encoder loaded once: caption-encoder features (T5:
    packed with their mask) for t2i; for lm targets (Lumina-mGPT) the prompt ids of the checkpoint's own tokenizer,
    -1 at padding."""
    if cfg.model_type == "lm":
        from lisa.models.lumina import prompt_encoder

        if not world.target_checkpoint:
            raise ValueError("an lm (Lumina-mGPT) world needs target_checkpoint: its tokenizer encodes the prompts")
        encode = prompt_encoder(world.target_checkpoint, cfg.cls_token_num, 16 * grammar_grid(cfg.block_size))

        def prompts(captions):
            ids, mask = encode(captions)
            return torch.where(mask, ids, -1)

        return prompts
    encoder = caption_encoder(world)
    return lambda captions: encoder.features(captions, cfg.cls_token_num)


def text_conditions(world: WorldParams, cfg, captions: list[str]) -> torch.Tensor:
    """text_encoder(world, cfg)(captions), for one call."""
    return text_encoder(world, cfg)(captions)


def class_names(world: WorldParams) -> Optional[list[str]]:
    """The class names of a world's dataset (None without one)."""
    return data.class_names(world.dataset.name, world.dataset.path) if world.dataset else None


def caption_cond(t: dict, idx: torch.Tensor) -> torch.Tensor:
    """Conditions of the captions `idx` from a codes file: features as fp32, or an lm target's prompt ids (long)."""
    x = t["caption_feats"][idx]
    return x.float() if x.is_floating_point() else x.long()


def target_codebook(vq, cfg) -> torch.Tensor:
    """The geometry of the target's vocabulary: the VQ codebook, extended for an lm target's grammar ids
    (lisa.models.lumina.geometry_codebook)."""
    if cfg.model_type == "lm":
        from lisa.models.lumina import geometry_codebook

        return geometry_codebook(vq.codebook(), cfg.vocab_size)
    return vq.codebook()


class GrammarVQ:
    """A tokenizer that decodes an lm target's token sequences: the grammar tokens are dropped first."""

    def __init__(self, vq, cfg):
        self.vq, self.free = vq, square_image_grammar(cfg.free_vocab, cfg.block_size) < 0

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vq.decode(tokens[:, self.free.to(tokens.device)])

    def __getattr__(self, name):
        return getattr(self.vq, name)


def image_tokenizer(vq, cfg):
    """What decodes the target's token sequences to images: the VQ model, or GrammarVQ for lm targets."""
    return GrammarVQ(vq, cfg) if cfg.model_type == "lm" else vq


def load_images(dataset_dir: str | Path, identity_file: Optional[Path]) -> tuple[torch.Tensor, torch.Tensor, object]:
    """A built dataset -> (train images, test images) as uint8 tensors, and the DatasetDict. A dataset whose files
    differ from identity_file (build-dataset writes it; the stages' dvc.yaml dep) is refused; None: not checked."""
    from datasets import load_from_disk

    if not (Path(dataset_dir) / "dataset_dict.json").is_file():
        raise FileNotFoundError(f"{dataset_dir}: no dataset_dict.json (run `lisa build-dataset` first)")
    if identity_file is not None:
        check_identity(identity_file, dataset=dataset_dir)
    ds = load_from_disk(str(dataset_dir))
    return data.images_tensor(ds["train"]), data.images_tensor(ds["test"]), ds


def load_codes(codes_path: str | Path, model_type: str) -> dict[str, torch.Tensor]:
    """codes.safetensors -> {"train_tokens", "train_cond", "test_tokens", "test_cond"} for the target's type."""
    t = read_state_dict(codes_path)
    out = {}
    for split in ("train", "test"):
        out[f"{split}_tokens"] = t[f"{split}_codes"].long()
        out[f"{split}_cond"] = (t[f"{split}_labels"] if model_type == "c2i" else
                                caption_cond(t, t[f"{split}_caption_idx"]))
    return out


def eval_conditions(cfg, codes: dict, captions_all: list[str], n: int):
    """The conditions of quality evaluation: c2i classes in turn; t2i held-out captions in turn -> (conds, labels,
    captions)."""
    if cfg.model_type == "c2i":
        labels = torch.arange(n) % cfg.num_classes
        return labels, labels, []
    idx = codes["test_caption_idx"][torch.arange(n) % len(codes["test_caption_idx"])]
    return (caption_cond(codes, idx), codes["test_labels"][torch.arange(n) % len(codes["test_labels"])],
            [captions_all[i] for i in idx.tolist()])


def judge_scores(judge, images_u8: torch.Tensor, labels: torch.Tensor, captions: list[str]) -> tuple[str, float]:
    """(score name, score) of uint8 images for their labels / captions: class consistency (%) or mean CLIP score."""
    x = data.to_model_range(images_u8)
    if judge.config.kind == "classifier":
        return "class_consistency", 100 * judges.class_consistency(judge, x, labels)
    return "clip_score", judges.clip_scores(judge, x, captions).mean().item()


@dataclass
class MethodResources:
    """What decoding methods read beside the target (lisa.decoding.methods): the drafters they use, loaded from the
    world's files ({name: (drafter, sidecar)}: release, lid or named), and the codebook geometry (None if no
    verifier reads it)."""
    drafters: dict
    geometry: object

    @property
    def modules(self) -> dict:
        """{name: drafter}: what lisa.decoding.methods.method_decoder picks the method's drafter from."""
        return {k: d for k, (d, _) in self.drafters.items()}

    @property
    def drafter_sha(self) -> dict:
        return {k: meta["sha256"] for k, (_, meta) in self.drafters.items()}

    @property
    def calibration_sha(self) -> Optional[str]:
        return calibration_sha(self.geometry)


def method_resources(methods, target, target_meta: dict, vq, paths: WorldPaths, neighbours: int) -> MethodResources:
    """The drafters and geometry `methods` read, from the world's files, checked against the target: the release
    drafter (data/drafter/<world>), the LID one (data/ablation/<world>) or a named one (data/drafters/<world>) per
    tree method (DecodeMethod.drafter),
    the codebook, a neighbour table at least `neighbours` wide (lisa.decoding.methods.method_geometry; each stage
    passes its own width), and for gasv the calibration of this very target (lisa.training.calibrate; another
    checkpoint's is a CalibrationError). What a verifier reads is its registry entry's (Verifier.reads)."""
    from lisa.training.calibrate import load_calibration

    out = {}
    for which in sorted({m.drafter for m in methods if drafts_tree(m.method)}):
        path = paths.drafter_of(which)
        if not Path(path).is_file():
            users = [getattr(m, "name", m.method) for m in methods if m.drafter == which and drafts_tree(m.method)]
            raise FileNotFoundError(f"methods {users} need the {which} drafter: {path} not found "
                                    f"(`{paths.drafter_maker(which)}`)")
        out[which] = load_drafter(path, target_meta)
    reads, calibration = geometry_reads(methods), None
    if "calibration" in reads:
        if paths.calibration_file is None:
            raise FileNotFoundError("gasv needs a calibration (`lisa calibrate`)")
        calibration = load_calibration(paths.calibration_file, target.output.weight, target_meta["sha256"])
    codebook = target_codebook(vq, target.config) if reads else None
    return MethodResources(out, method_geometry(methods, codebook, neighbours, calibration))


def calibration_sha(geometry) -> Optional[str]:
    """The sha256 of the calibration a geometry carries (None without one)."""
    return geometry.calibration.meta["sha256"] if geometry is not None and geometry.calibration is not None else None
