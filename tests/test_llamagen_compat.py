"""Bit-level compatibility with the official LlamaGen code (FoundationVision/LlamaGen).

The assets under tests/assets/ were produced once by the *official* implementation
(autoregressive/models/gpt.py and generate.py @5a50452, tokenizer/tokenizer_image/vq_model.py @3786e6a; the
official code itself is not part of this repository):

* `llamagen_c2i_tiny.pt`, `llamagen_c2i_gqa_tiny.pt`, `llamagen_t2i_tiny.pt`, `vq_tiny.pt`: `{"model": state_dict}`
  exactly as official `torch.save` writes them, from tiny official models with all weights randomised (including
  the output head, which the official init zeroes, and RMSNorm / GroupNorm affine weights):
    - c2i: ModelArgs(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=64, block_size=16, num_classes=10)
    - c2i GQA: the same with n_layer=1, n_kv_head=2
    - t2i: the same as c2i but model_type='t2i', caption_dim=24, cls_token_num=120
    - VQ: VQModel(codebook_size=64, codebook_embed_dim=8, z_channels=32, codebook_show_usage=False) with its
      Encoder/Decoder built by the official classes with ch=32, ch_mult=[1, 1], num_res_blocks=1.
* `llamagen_golden.pt`: inputs and official outputs:
    - teacher-forced logits = eval-mode `forward(idx=tokens[:, :-1], cond_idx=cond, input_pos=arange(C+T-1))`
      sliced `[:, C-1:]` (checked equal to the official training path with all dropouts off);
    - greedy tokens of official `generate(..., sample_logits=False)` with cfg_scale 4 (and 1 for c2i);
    - VQ codes of `encode`, `decode_code(codes, shape=(B, 8, h, w))`, and `forward` reconstructions.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lisa.models.llamagen import import_llamagen_gpt, import_llamagen_vq
from lisa.decoding.sampling import SamplingConfig, cfg_logits, sample

ASSETS = Path(__file__).parent / "assets"
ATOL = 1e-5

# Loader arguments for the tiny checkpoints: GPT-micro = 2 layers, 4 heads, dim 64, multiple_of 32;
# a 4x4 token grid (block_size 16) = image_size 4 / downsample 1.
GPT_ASSETS = {
    "c2i": ("llamagen_c2i_tiny.pt", dict(preset="GPT-micro", image_size=4, downsample=1), "c2i_logits"),
    "gqa": ("llamagen_c2i_gqa_tiny.pt", dict(preset="GPT-micro", image_size=4, downsample=1, n_layer=1), "gqa_logits"),
    "t2i": ("llamagen_t2i_tiny.pt", dict(preset="GPT-micro", image_size=4, downsample=1), "t2i_logits"),
}
VQ_KW = dict(preset="VQ-16", encoder_ch_mult=[1, 1], decoder_ch_mult=[1, 1], z_channels=32, ch=32,
             num_res_blocks=1, image_size=16)


@pytest.fixture(scope="module")
def golden():
    return torch.load(ASSETS / "llamagen_golden.pt", map_location="cpu", weights_only=True)


def load_gpt(name):
    file, kw, _ = GPT_ASSETS[name]
    return import_llamagen_gpt(ASSETS / file, **kw)


def cond_and_tokens(golden, name):
    prefix = "t2i" if name == "t2i" else "c2i"
    return golden[f"{prefix}_cond"], golden[f"{prefix}_tokens"]


def save_official_layout(model, path):
    torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}, path)


# ---------------------------------------------------------------------------------------------------------------
# GPT


@pytest.mark.parametrize("name", ["c2i", "gqa", "t2i"])
def test_config_inferred_from_official_checkpoint(golden, name):
    cfg = load_gpt(name).config
    ref = golden["config"][name]
    for field in ("dim", "n_layer", "n_head", "multiple_of", "vocab_size", "block_size", "cls_token_num",
                  "model_type", "norm_eps", "rope_base"):
        assert getattr(cfg, field) == ref[field], field
    assert cfg.kv_heads == (ref["n_kv_head"] or ref["n_head"])
    if ref["model_type"] == "c2i":
        assert cfg.num_classes == ref["num_classes"]
    else:
        assert cfg.caption_dim == ref["caption_dim"]


@pytest.mark.parametrize("name", ["c2i", "gqa", "t2i"])
@torch.no_grad()
def test_teacher_forced_logits_match_official(golden, name):
    model = load_gpt(name)
    cond, tokens = cond_and_tokens(golden, name)
    ref = golden[GPT_ASSETS[name][2]]
    logits = model.teacher_forced(cond, tokens).logits
    assert logits.shape == ref.shape == (tokens.shape[0], tokens.shape[1], model.config.vocab_size)
    assert ref.std() > 0.5  # the golden logits are far from trivial
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


@torch.no_grad()
def greedy_generate(model, cond, n_tokens, cfg_scale):
    """Greedy decoding through our KV-cache path, laid out like official generate(): prefill the condition
    at cache slots 0..C-1, then one token per step at slot C + i; CFG batch = [cond; null]."""
    C = model.config.cls_token_num
    B = cond.shape[0]
    guided = cfg_scale != 1.0
    cond2, drop = (torch.cat([cond, cond]), torch.arange(2 * B) >= B) if guided else (cond, None)
    scfg = SamplingConfig(temperature=0.0, cfg_scale=cfg_scale)
    model.setup_caches(cond2.shape[0], C + n_tokens)
    try:
        logits = model(model.embed_cond(cond2, drop), input_pos=torch.arange(C)).logits[:, -1]
        out = []
        for i in range(n_tokens):
            tok, _ = sample(cfg_logits(logits, cfg_scale) if guided else logits, scfg)
            out.append(tok)
            if i + 1 < n_tokens:
                x = model.embed_tokens((torch.cat([tok, tok]) if guided else tok)[:, None])
                logits = model(x, input_pos=torch.tensor([C + i])).logits[:, -1]
        return torch.stack(out, dim=1)
    finally:
        model.clear_caches()


@pytest.mark.parametrize("name,cfg_scale,key", [("c2i", 4.0, "c2i_gen_cfg4_greedy"),
                                                ("c2i", 1.0, "c2i_gen_cfg1_greedy"),
                                                ("t2i", 4.0, "t2i_gen_cfg4_greedy")])
def test_greedy_cached_generation_matches_official_generate(golden, name, cfg_scale, key):
    model = load_gpt(name)
    cond, _ = cond_and_tokens(golden, name)
    ref = golden[key]
    assert torch.equal(greedy_generate(model, cond, ref.shape[1], cfg_scale), ref)


@torch.no_grad()
def test_official_greedy_tokens_are_teacher_forced_argmax(golden):
    """Official cached greedy decoding (cfg 1) = argmax of our no-cache teacher-forced logits on its own prefix."""
    model = load_gpt("c2i")
    cond = golden["c2i_cond"]
    tokens = golden["c2i_gen_cfg1_greedy"]
    tf = model.teacher_forced(cond, tokens).logits
    assert torch.equal(tf.argmax(-1), tokens)


@pytest.mark.parametrize("name", ["c2i", "gqa", "t2i"])
@torch.no_grad()
def test_state_dict_round_trip_in_official_layout(golden, name, tmp_path):
    model = load_gpt(name)
    file, kw, key = GPT_ASSETS[name]
    official = torch.load(ASSETS / file, map_location="cpu", weights_only=True)["model"]
    sd = model.state_dict()
    assert set(sd) == set(official)  # same key layout as LlamaGen
    for k in sd:
        assert sd[k].shape == official[k].shape and torch.equal(sd[k], official[k]), k
    save_official_layout(model, tmp_path / "rt.pt")
    again = import_llamagen_gpt(tmp_path / "rt.pt", **kw)
    cond, tokens = cond_and_tokens(golden, name)
    a = model.teacher_forced(cond, tokens).logits
    b = again.teacher_forced(cond, tokens).logits
    assert torch.equal(a, b)
    torch.testing.assert_close(b, golden[key], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# VQ tokenizer


@pytest.fixture(scope="module")
def vq():
    return import_llamagen_vq(ASSETS / "vq_tiny.pt", **VQ_KW)


@torch.no_grad()
def test_vq_codes_match_official(golden, vq):
    codes = vq.encode(golden["vq_images"])
    assert codes.shape == golden["vq_codes"].shape == (2, 8, 8)
    assert torch.equal(codes, golden["vq_codes"])


@torch.no_grad()
def test_vq_code_vectors_match_official(golden, vq):
    torch.testing.assert_close(vq.quantize.embed(golden["vq_codes"]), golden["vq_quant"], atol=ATOL, rtol=0)


@torch.no_grad()
def test_vq_decode_matches_official_decode_code(golden, vq):
    images = vq.decode(golden["vq_codes"])
    assert images.shape == golden["vq_decoded"].shape == (2, 3, 16, 16)
    torch.testing.assert_close(images, golden["vq_decoded"], atol=ATOL, rtol=0)
    # (B, h*w) codes, as the GPT emits them
    torch.testing.assert_close(vq.decode(golden["vq_codes"].flatten(1)), golden["vq_decoded"], atol=ATOL, rtol=0)


@torch.no_grad()
def test_vq_reconstruction_matches_official_forward(golden, vq):
    recon = vq.decode(vq.encode(golden["vq_images"]))
    torch.testing.assert_close(recon, golden["vq_reconstruction"], atol=ATOL, rtol=0)


@torch.no_grad()
def test_vq_round_trip_and_usage_buffer(golden, vq, tmp_path):
    official = torch.load(ASSETS / "vq_tiny.pt", map_location="cpu", weights_only=True)["model"]
    sd = vq.state_dict()
    assert set(sd) == set(official)
    # released LlamaGen tokenizers also carry the `quantize.codebook_used` usage counter (show_usage=True)
    save_official_layout(vq, tmp_path / "vq_rt.pt")
    blob = torch.load(tmp_path / "vq_rt.pt", weights_only=True)
    blob["model"]["quantize.codebook_used"] = torch.zeros(65536)
    torch.save(blob, tmp_path / "vq_rt.pt")
    again = import_llamagen_vq(tmp_path / "vq_rt.pt", **VQ_KW)
    assert torch.equal(again.encode(golden["vq_images"]), golden["vq_codes"])
    assert torch.equal(again.decode(golden["vq_codes"]), vq.decode(golden["vq_codes"]))
