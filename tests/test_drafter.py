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


@pytest.mark.parametrize("kw", [dict(width=32, n_head=2), dict(ffn_dim=0), dict(width=32, n_head=2, ffn_dim=16),
                                dict(ffn_dim=0, head_rank=8), dict(width=32, n_head=2, head_rank=4)])
def test_cheaper_drafters_decode_like_their_full_forward(kw):
    """A narrower residual stream (width D < H) and a smaller or absent SwiGLU: fused features and hidden states
    are D wide, the embedding stays the target's (H), cache decoding equals the full forward."""
    target, d = eagle(**kw)
    D = kw.get("width") or 64
    tokens = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        hidden = d.fuse(target.teacher_forced(torch.tensor([1, 2]), tokens, taps=d.config.taps).hidden)
        assert hidden.shape == (2, 10, D) and d.tok_embeddings.weight.shape == (64, 64)
        full = d(tokens, hidden)
        assert full.hidden.shape == (2, 10, D) and full.logits.shape == (2, 10, 64)
        d.setup_caches(2, 17)
        first = d(tokens[:, :6], hidden[:, :6], input_pos=torch.arange(6))
        steps = [d(tokens[:, i : i + 1], hidden[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(6, 10)]
    inc = torch.cat([first.logits] + [s.logits for s in steps], dim=1)
    torch.testing.assert_close(inc, full.logits, atol=1e-5, rtol=1e-5)
    assert hasattr(d, "feed_forward") == (kw.get("ffn_dim") != 0)
    if "ffn_dim" in kw and kw["ffn_dim"]:
        assert d.feed_forward.w1.weight.shape == (kw["ffn_dim"], D)
    assert DrafterConfig.from_dict(d.config.to_dict()) == d.config


def test_default_drafter_is_eagle3_and_cheaper_ones_are_smaller():
    """width 0 / ffn_dim None build the EAGLE-3 layer the release drafters were trained with (same tensors, same
    initialisation order); narrower ones have fewer parameters and refuse bad sizes."""
    from lisa.training.drafter import new_drafter

    target = micro_gpt()
    torch.manual_seed(0)
    a = new_drafter(target)
    torch.manual_seed(0)
    b = new_drafter(target, width=0, ffn_dim=None)
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert [n for n, _ in a.named_parameters()] == [
        "tok_embeddings.weight", "fc.weight", "embed_norm.weight", "hidden_norm.weight", "attention.wqkv.weight",
        "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w3.weight",
        "feed_forward.w2.weight", "norm.weight", "output.weight"]
    assert torch.equal(a.output.weight, target.output.weight)  # EAGLE's start: the target's head
    narrow = new_drafter(target, width=32, n_head=2, ffn_dim=0)
    count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert count(narrow) < count(a) / 2 and not narrow.tok_embeddings.weight.requires_grad
    for bad, match in ((dict(width=-1), "width"), (dict(ffn_dim=-2), "ffn_dim"), (dict(width=30, n_head=4), "n_head")):
        with pytest.raises(ValueError, match=match):
            DrafterConfig.for_target(target.config, **bad)


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


def test_factored_head_starts_from_the_targets_truncated_svd():
    """head_rank r: the head is D -> r -> V; from a target of the drafter's width it starts at the target head's
    best rank-r approximation (at r = H - 1 of a rank-deficient head: the head itself), and refuses r outside
    1..min(D, V) - 1; a checkpoint's config round-trips and old configs (no head_rank) load as full heads."""
    from lisa.training.drafter import new_drafter

    target = micro_gpt()
    W = target.output.weight.detach()
    for r in (4, 16):
        d = new_drafter(target, head_rank=r)
        assert d.head_in.weight.shape == (r, 64) and d.output.weight.shape == (64, r)
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        best = (U[:, :r] * S[:r]) @ Vh[:r]
        torch.testing.assert_close(d.output.weight @ d.head_in.weight, best, atol=1e-5, rtol=1e-4)
        x = torch.randn(3, 64)
        torch.testing.assert_close(d.output(d.head_in(x)), x @ best.T, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # a head of rank 10 is reproduced exactly at any r >= 10
        target.output.weight.copy_(torch.randn(64, 10) @ torch.randn(10, 64) / 8)
    d = new_drafter(target, head_rank=12)
    torch.testing.assert_close(d.output.weight @ d.head_in.weight, target.output.weight, atol=1e-5, rtol=1e-4)
    full = sum(p.numel() for p in new_drafter(target).parameters())
    assert sum(p.numel() for p in new_drafter(target, head_rank=8).parameters()) == full - 64 * 64 + 2 * 64 * 8
    for bad in (-1, 64, 100):
        with pytest.raises(ValueError, match="head_rank"):
            DrafterConfig.for_target(target.config, head_rank=bad)
    old = {k: v for k, v in d.config.to_dict().items() if k != "head_rank"}
    assert DrafterConfig.from_dict(old).head_rank == 0
    assert DrafterConfig.from_dict(d.config.to_dict()) == d.config
