"""Vanilla decoding: it samples what teacher forcing says, with and without CFG, batched, reproducibly."""
import torch

from lisa.decoding.generate import generate
from lisa.decoding.sampling import SamplingConfig, cfg_logits
from tests.helpers import micro_gpt, micro_t2i


def test_greedy_generate_matches_teacher_forcing_with_cfg():
    model = micro_gpt()
    cond = torch.tensor([1, 4, 7])
    sampling = SamplingConfig(temperature=0, cfg_scale=3.0)
    tokens, stats = generate(model, cond, sampling)
    assert tokens.shape == (3, 16) and stats["forwards"] == 16
    drop = torch.cat([torch.zeros(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)])
    logits = model.teacher_forced(torch.cat([cond, cond]), torch.cat([tokens, tokens]), drop).logits
    assert torch.equal(cfg_logits(logits, 3.0).argmax(-1), tokens)


def test_batched_rows_equal_single_rows():
    model = micro_gpt()
    sampling = SamplingConfig(temperature=0, cfg_scale=2.0)
    batch, _ = generate(model, torch.tensor([2, 5]), sampling)
    for i, c in enumerate([2, 5]):
        single, _ = generate(model, torch.tensor([c]), sampling)
        assert torch.equal(batch[i], single[0])


def test_same_seed_same_images_and_top_k_respected():
    model = micro_gpt()
    sampling = SamplingConfig(temperature=1.0, top_k=3, cfg_scale=4.0)
    a, _ = generate(model, torch.tensor([0, 1]), sampling, torch.Generator().manual_seed(1))
    b, _ = generate(model, torch.tensor([0, 1]), sampling, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    drop = torch.tensor([False, False, True, True])
    logits = cfg_logits(model.teacher_forced(torch.tensor([0, 1, 0, 1]), torch.cat([a, a]), drop).logits, 4.0)
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == a[..., None]).any(-1).all()


def test_t2i_caption_padding_mask():
    """Padded caption positions are invisible: the result equals the same caption without the padding."""
    model = micro_t2i()
    feats = torch.randn(1, 5, 24)
    mask = torch.tensor([[False, False, True, True, True]])
    sampling = SamplingConfig(temperature=0, cfg_scale=1.0)
    a, _ = generate(model, feats, sampling, cond_mask=mask)
    garbage = feats.clone()
    garbage[:, :2] = torch.randn(1, 2, 24) * 10
    b, _ = generate(model, garbage, sampling, cond_mask=mask)
    assert torch.equal(a, b)
    c, _ = generate(model, garbage, sampling)
    assert not torch.equal(a, c)
