"""The real profile's path through the same stages, on small stand-ins in the same formats: local datasets
(an ImageFolder tree with a separate val/ tree; MS-COCO images with captions files), official-format checkpoints
imported by train-tokenizer / train-target instead of training, T5 caption features stored with their mask, and
sampling from MS-COCO captions."""
import json

import pytest
import torch

from lisa.data import datasets as data
from lisa.config import (BuildDatasetParams, DatasetParams, EncodeParams, SampleParams, TrainTargetParams,
                         TrainTokenizerParams, WorldParams)
from lisa.models.gpt import Transformer, gpt_config
from lisa.models.vq import VQModel, vq_config
from lisa.stages import WorldPaths
from lisa.stages.build import build_dataset, encode, train_target, train_tokenizer
from lisa.stages.sample import sample
from tests.helpers import make_tiny_t5

CLASSES = ["boot", "coat", "shirt"]


def fashion_images(n):
    return [r["image"] for r, _ in zip(data.fashion_split("test"), range(n))]


def image_folder(root, per_class):
    imgs = iter(fashion_images(len(CLASSES) * per_class))
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            next(imgs).resize((24, 20)).save(root / c / f"{i}.png")  # not square: centre-cropped
    return root


def coco_folder(root, n, first_id):
    root.mkdir(parents=True)
    images, anns = [], []
    for i, im in enumerate(fashion_images(n)):
        name = f"{first_id + i:012d}.jpg"
        im.save(root / name)
        images.append({"id": first_id + i, "file_name": name})
        anns += [{"image_id": first_id + i, "caption": f"a {CLASSES[i % 3]}"},
                 {"image_id": first_id + i, "caption": f"a grey {CLASSES[i % 3]} on black, number {i}"}]
    f = root.parent / f"captions_{root.name}.json"
    f.write_text(json.dumps({"images": images, "annotations": anns}))
    return root, f


def official(tmp_path, target_cfg):
    """Random models saved the way LlamaGen ships them: {"model": state_dict} .pt files."""
    torch.manual_seed(0)
    torch.save({"model": VQModel(vq_config("VQ-micro")).state_dict()}, tmp_path / "vq.pt")
    torch.save({"model": Transformer(gpt_config(**target_cfg)).state_dict()}, tmp_path / "gpt.pt")
    return str(tmp_path / "vq.pt"), str(tmp_path / "gpt.pt")


def run_stages(tmp_path, world, sample_p):
    out = tmp_path / "run"
    paths = run_paths(out)
    ds = build_dataset(world, BuildDatasetParams(), paths)
    tok = train_tokenizer(world, TrainTokenizerParams(eval_batch_size=8), paths)
    codes = encode(world, EncodeParams(), paths)
    tgt = train_target(world, TrainTargetParams(eval_batch_size=8), paths)
    smp = sample(world, sample_p, paths)
    return ds, tok, codes, tgt, smp, out


def run_paths(out, **overrides):
    return WorldPaths.of("w", out, **{**dict(dataset_dir=out / "ds", tokenizer_dir=out / "tok",
                                             tokenizer_report=out / "tok.json", tokenizer_work=out / "work",
                                             codes_dir=out / "codes", target_dir=out / "target",
                                             target_report=out / "target.json", target_work=out / "work",
                                             samples_dir=out / "samples"), **overrides})


def test_imagenet_folder_and_imported_c2i_checkpoints(tmp_path):
    train, val = image_folder(tmp_path / "train", 4), image_folder(tmp_path / "val", 2)
    target = dict(preset="GPT-micro", vocab_size=64, block_size=16, num_classes=3)
    vq_pt, gpt_pt = official(tmp_path, target)
    world = WorldParams(dataset=DatasetParams(name="imagenet", image_size=16, path=str(train), test_path=str(val)),
                        tokenizer={"preset": "VQ-micro"}, target=target, target_checkpoint=gpt_pt,
                        tokenizer_checkpoint=vq_pt)
    ds, tok, codes, tgt, smp, out = run_stages(tmp_path, world, SampleParams(classes=[0, 2], per_class=2, batch_size=4))
    assert (ds["train"], ds["test"], ds["classes"]) == (12, 6, CLASSES)
    assert tok["imported"] == vq_pt and tok["psnr_db"] > 0  # the imported tokenizer's reconstruction
    assert tgt["imported"] == gpt_pt and 0 < tgt["heldout_nll_per_token"] < 10
    assert codes["train"] == 12 and smp["images"] == 4 and (out / "samples" / "grid.png").is_file()
    assert data.class_names("imagenet", str(train)) == CLASSES
    # classes in turn: a capped split stays balanced
    capped = data.build("imagenet", 16, path=str(train), limits=(6, None), test_path=str(val))
    assert sorted(capped["train"]["label"]) == [0, 0, 1, 1, 2, 2]
    # an imported target whose grid does not fit the world's is refused with both values named
    bad = WorldParams(dataset=world.dataset, tokenizer={"preset": "VQ-micro"},
                      target={**target, "block_size": 64}, target_checkpoint=gpt_pt, tokenizer_checkpoint=vq_pt)
    with pytest.raises(ValueError, match=r"block_size': \(64, 16\)"):
        train_target(bad, TrainTargetParams(), run_paths(out, target_dir=tmp_path / "bad",
                                                         target_report=tmp_path / "b.json",
                                                         target_work=tmp_path / "work"))


def test_coco_with_t5_captions_and_imported_t2i_checkpoint(tmp_path):
    train, train_caps = coco_folder(tmp_path / "train2017", 6, 100)
    val, val_caps = coco_folder(tmp_path / "val2017", 3, 500)
    t5 = make_tiny_t5(tmp_path / "t5")
    target = dict(preset="GPT-micro", model_type="t2i", caption_dim=16, cls_token_num=16, vocab_size=64, block_size=16)
    vq_pt, gpt_pt = official(tmp_path, target)
    world = WorldParams(dataset=DatasetParams(name="coco", image_size=16, path=str(train), captions=str(train_caps),
                                              test_path=str(val), test_captions=str(val_caps)),
                        tokenizer={"preset": "VQ-micro"}, target=target, caption_encoder=str(t5),
                        target_checkpoint=gpt_pt, tokenizer_checkpoint=vq_pt, sampling={"cfg_scale": 3.0})
    p = SampleParams(prompts_file=str(val_caps), num_prompts=2, per_class=1, batch_size=2)
    ds, tok, codes, tgt, smp, out = run_stages(tmp_path, world, p)
    assert (ds["train"], ds["test"]) == (6, 3)
    from datasets import load_from_disk

    test = load_from_disk(str(out / "ds"))["test"]
    assert test["caption"][0] == "a grey boot on black, number 0"  # the longest caption of each image
    from lisa.checkpoint import read_state_dict

    feats = read_state_dict(run_paths(out).codes_file)["caption_feats"]
    assert feats.shape[1:] == (16, 17)  # 16-d T5 states + the packed mask channel
    mask = feats[..., -1] > 0.5
    assert mask[:, -1].all() and not mask[:, 0].any()  # left padded: real tokens at the end
    assert 0 < tgt["heldout_nll_per_token"] < 10 and smp["images"] == 2
    assert smp["rows"] == data.coco_prompts(val_caps, 2)
