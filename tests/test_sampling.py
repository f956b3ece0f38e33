"""CFG arithmetic, temperature / top-k / top-p, seeded reproducibility, and the sampler's exactness."""
import pytest
import torch

from lisa.decoding.sampling import (SamplingConfig, cfg_logits, filter_logits, logits_to_probs, sample, sample_from,
                                    sample_inverse, inverse_cdf)


def test_cfg_arithmetic_cond_first():
    cond, uncond = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.5, 0.5, 4.0]])
    out = cfg_logits(torch.cat([cond, uncond]), 3.0)
    torch.testing.assert_close(out, uncond + 3.0 * (cond - uncond))
    torch.testing.assert_close(cfg_logits(torch.cat([cond, uncond]), 1.0), cond)


def test_guidance_before_temperature_and_top_k():
    """LlamaGen's order: guide the logits, then temperature, then top-k (not guide the probabilities)."""
    cond, uncond = torch.tensor([[2.0, 1.0, 0.0, -1.0]]), torch.tensor([[0.0, 1.5, 0.0, 0.0]])
    guided = cfg_logits(torch.cat([cond, uncond]), 2.0)  # [4, 0.5, 0, -2]
    probs = logits_to_probs(guided, temperature=0.5, top_k=2)
    expect = torch.softmax(torch.tensor([4.0, 0.5]) / 0.5, -1)
    torch.testing.assert_close(probs[0, :2], expect)
    assert probs[0, 2:].sum() == 0


def test_top_k_keeps_ties_and_top_p_keeps_crossing_token():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [[True, True, True, False, False]]  # the tie at the k-th value stays
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(filter_logits(p.log(), top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 crosses it: kept
    kept = torch.isfinite(filter_logits(p.log(), top_p=0.1))
    assert kept.tolist() == [[True, False, False, False]]  # the top-1 always survives


def test_greedy_and_one_hot():
    logits = torch.randn(4, 50)
    tokens, probs = sample(logits, SamplingConfig(temperature=0))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(4))


def test_same_seed_same_samples():
    logits = torch.randn(8, 100)
    cfg = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9)
    a = sample(logits, cfg, torch.Generator().manual_seed(5))[0]
    b = sample(logits, cfg, torch.Generator().manual_seed(5))[0]
    c = sample(logits, cfg, torch.Generator().manual_seed(6))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sampler_is_exact_chi_square():
    """The exponential race draws exactly from probs: chi-square over 200k draws (p-value floor 1e-4)."""
    from scipy import stats as scipy_stats
    probs = torch.softmax(torch.randn(12) * 1.5, -1)
    n = 200_000
    draws = sample_from(probs.expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=12).double()
    expected = probs.double() / probs.double().sum() * n
    _, pvalue = scipy_stats.chisquare(counts.numpy(), expected.numpy())
    assert pvalue > 1e-4


@pytest.mark.parametrize("scale", [1.0, 3.7])
def test_inverse_cdf_sampler_is_exact_chi_square(scale):
    """sample_inverse draws exactly from probs, normalised or not (scale), and never a token of probability 0:
    chi-square over 200k draws, with zeros inside and at both ends of the row."""
    from scipy import stats as scipy_stats
    probs = torch.softmax(torch.randn(12) * 1.5, -1)
    probs[[0, 5, 11]] = 0.0
    n = 200_000
    draws = sample_inverse(scale * probs.expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=12).double()
    assert counts[[0, 5, 11]].sum() == 0
    keep = probs > 0
    expected = probs.double()[keep] / probs.double().sum() * n
    _, pvalue = scipy_stats.chisquare(counts[keep].numpy(), expected.numpy())
    assert pvalue > 1e-4


def test_inverse_cdf_at_the_ends_of_the_unit_interval():
    """u = 0 takes the first token with mass, the largest float32 below 1 the last one, never the zero-mass tokens
    around them (an uncapped search lands past the row's end there)."""
    probs = torch.tensor([[0.0, 0.25, 0.5, 0.25, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.3, 0.7, 0.0]])
    below_one = torch.tensor(1.0).nextafter(torch.tensor(0.0))
    for scale in (1.0, 1 / 3, 7.0):
        assert inverse_cdf(scale * probs, torch.zeros(2)).tolist() == [1, 2]
        assert inverse_cdf(scale * probs, below_one.expand(2)).tolist() == [3, 4]
        c = (scale * probs).cumsum(-1)
        assert (torch.searchsorted(c, c[:, -1:], right=True) == 6).all()  # at the total itself: past the end


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
