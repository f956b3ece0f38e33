"""Drafter architectures: EAGLE-3 fused-feature drafter (cache = full forward, tree masks) and Medusa heads."""
import pytest
import torch

from lisa.models.drafter import DrafterConfig, Eagle3Drafter, MedusaDrafter, build_drafter
from tests.helpers import micro_gpt


def eagle(**kw):
    target = micro_gpt()
    cfg = DrafterConfig.for_target(target.config, **kw)
    return target, build_drafter(cfg).eval()


def test_config_matches_target_and_roundtrips():
    target, d = eagle()
    c = d.config
    assert (c.dim, c.vocab_size, c.block_size, c.cls_token_num) == (64, 64, 16, 1) and len(c.taps) == 3
    assert DrafterConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown field"):
        DrafterConfig.from_dict({**c.to_dict(), "depth": 3})
    with pytest.raises(ValueError, match="eagle3 fuses three"):
        DrafterConfig.for_target(target.config, taps=[0, 1])


def test_fused_features_shapes():
    target, d = eagle()
    tokens = torch.randint(0, 64, (2, 16))
    out = target.teacher_forced(torch.tensor([1, 2]), tokens, taps=d.config.taps)
    fused = d.fuse(out.hidden)
    assert fused.shape == (2, 16, 64)
    o = d(tokens, fused)
    assert o.logits.shape == (2, 16, 64) and o.logits.dtype == torch.float32 and o.hidden.shape == (2, 16, 64)


def test_kv_cache_decoding_equals_full_forward():
    _, d = eagle()
    tokens, hidden = torch.randint(0, 64, (2, 10)), torch.randn(2, 10, 64)
    with torch.no_grad():
        full = d(tokens, hidden)
        d.setup_caches(2, 17)
        first = d(tokens[:, :6], hidden[:, :6], input_pos=torch.arange(6))
        steps = [d(tokens[:, i : i + 1], hidden[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(6, 10)]
    inc = torch.cat([first.logits] + [s.logits for s in steps], dim=1)
    torch.testing.assert_close(inc, full.logits, atol=1e-5, rtol=1e-5)


def test_tree_mask_equals_paths():
    """Two siblings at one depth (same RoPE position, masked from each other) = two separate chains."""
    _, d = eagle()
    tokens, hidden = torch.randint(0, 64, (1, 6)), torch.randn(1, 6, 64)
    alt_tok, alt_hid = torch.randint(0, 64, (1, 1)), torch.randn(1, 1, 64)
    with torch.no_grad():
        d.setup_caches(1, 16)
        d(tokens[:, :5], hidden[:, :5], input_pos=torch.arange(5))
        mask = torch.zeros(1, 2, 7, dtype=torch.bool)
        mask[:, :, :5] = True
        mask[0, 0, 5] = mask[0, 1, 6] = True
        tree = d(torch.cat([tokens[:, 5:], alt_tok], 1), torch.cat([hidden[:, 5:], alt_hid], 1),
                 input_pos=torch.tensor([5, 6]), mask=mask, rope_pos=torch.tensor([5, 5]))
        a = d(tokens, hidden).logits[:, -1]
        b = d(torch.cat([tokens[:, :5], alt_tok], 1), torch.cat([hidden[:, :5], alt_hid], 1)).logits[:, -1]
    torch.testing.assert_close(tree.logits[:, 0], a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree.logits[:, 1], b, atol=1e-5, rtol=1e-5)


def test_medusa_heads():
    target = micro_gpt()
    m = build_drafter(DrafterConfig.for_target(target.config, kind="medusa", medusa_heads=3))
    assert isinstance(m, MedusaDrafter)
    out = m(torch.randn(2, 5, 64))
    assert out.logits.shape == (2, 5, 3, 64)
    with pytest.raises(ValueError, match="kind"):
        Eagle3Drafter(m.config)
