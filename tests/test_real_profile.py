"""The `real` profile (paper settings on downloaded checkpoints): it parses, `lisa estimate` sizes every world from
the config alone and lists the missing checkpoints, MS-COCO prompts are the longest caption per image, and a
world's own sampling settings override the section's."""
import json

import pytest

from lisa.data import datasets as data
from lisa.cli import main
from lisa.config import SampleParams, WorldParams, load_params, profile_text
from lisa.decoding.sampling import sampling_config
from lisa.models.gpt import gpt_config
from lisa.bench.estimate import estimate_world


def test_real_profile_parses_and_estimates(tmp_path, capsys):
    path = tmp_path / "real.yaml"
    path.write_text(profile_text("real"))
    p = load_params(path)
    assert set(p.worlds) == {"llamagen-t2i", "llamagen-c2i-384", "lumina-mgpt-768"}
    lumina = gpt_config(**p.worlds["lumina-mgpt-768"].target)
    assert (lumina.block_size, lumina.vocab_size, lumina.free_vocab) == (2356, 8260, 8192)  # 48 x 48 + grammar
    t2i = p.worlds["llamagen-t2i"]
    assert gpt_config(**t2i.target).cls_token_num == 120 and t2i.sampling["cfg_scale"] == 7.5
    assert gpt_config(**p.worlds["llamagen-c2i-384"].target).block_size == 576
    e = estimate_world("llamagen-t2i", t2i, p)
    assert 0.7e9 < e.target_params < 0.8e9  # GPT-XL: 775M
    assert e.decode_gib > 2 * e.target_params / 2**30  # bf16 weights + caches
    assert e.spec_s_per_image < e.vanilla_s_per_image
    assert main(["estimate", "--params", str(path), "--gpu", "A100-80G"]) == 0
    out = capsys.readouterr().out
    assert "| llamagen-c2i-384 | 0.77B" in out and "| lumina-mgpt-768 | 6.78B" in out
    assert "worlds.llamagen-t2i.target_checkpoint: checkpoints/llamagen/t2i_XL_stage1_256.pt" in out
    assert "worlds.llamagen-c2i-384.dataset.test_path: data/imagenet/val" in out


def test_coco_prompts_longest_caption_per_image(tmp_path):
    f = tmp_path / "captions_val2017.json"
    f.write_text(json.dumps({"annotations": [
        {"image_id": 9, "caption": "A cat."}, {"image_id": 9, "caption": "A  grey cat on a mat."},
        {"image_id": 2, "caption": "Two dogs running"}, {"image_id": 2, "caption": "Dogs"}]}))
    assert data.coco_prompts(f) == ["Two dogs running", "A grey cat on a mat."]
    assert data.coco_prompts(f, 1) == ["Two dogs running"]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json: not an MS-COCO captions file"):
        data.coco_prompts(tmp_path / "bad.json")


def test_world_sampling_overrides_section():
    w = WorldParams(target={"preset": "GPT-micro"}, tokenizer={"preset": "VQ-micro"},
                    sampling={"cfg_scale": 3.0, "top_k": 2000})
    s = sampling_config(w, SampleParams(temperature=0.5, cfg_scale=7.0))
    assert (s.cfg_scale, s.top_k, s.temperature) == (3.0, 2000, 0.5)
    with pytest.raises(ValueError, match="unknown keys"):
        sampling_config(WorldParams(target={}, tokenizer={}, sampling={"cfg": 1.0}), SampleParams())
