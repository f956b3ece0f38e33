"""The cost model behind tree "auto": acceptance predicted from a full tree's trace, forward costs, the choice."""
import pytest
import torch

from lisa.decoding import costmodel
from lisa.decoding.generate import SpecConfig, speculative_generate
from lisa.models.drafter import DrafterConfig, build_drafter
from lisa.decoding.sampling import SamplingConfig
from tests.helpers import micro_gpt


def test_interpolation_and_loop_fit():
    table = {1: 1.0, 3: 2.0, 5: 6.0}
    assert costmodel._interp(table, 2) == pytest.approx(1.5)
    assert costmodel._interp(table, 4) == pytest.approx(4.0)
    assert costmodel._interp(table, 7) == pytest.approx(10.0)  # linear past the largest size
    a, b = costmodel.fit_loop([(4, 1.0 + 0.25 * 4), (16, 1.0 + 0.25 * 16), (85, 1.0 + 0.25 * 85)])
    assert a == pytest.approx(1.0) and b == pytest.approx(0.25)


def test_acceptance_profile_counts_ranks_within_depth():
    # root -> a (d1, -0.1), b (d1, -0.5); a -> c (d2, -0.3), d (d2, -0.9); c -> e (d3, -0.35)
    scores = torch.tensor([[-0.1, -0.5, -0.3, -0.9, -0.35]])
    depth = torch.tensor([[1, 1, 2, 2, 3]])
    path = torch.tensor([[0, 2, 4]])  # a, c, e accepted
    trace = [{"scores": scores, "depth": depth, "path": path, "m": torch.tensor([3]),
              "live": torch.tensor([True])}]
    prof = costmodel.acceptance_profile(trace, max_depth=3)
    # depth <= 3 ranks: a 1, c 2, e 3, b 4, d 5 -> the path needs 1, 2, 3 nodes
    assert prof.needs[0][2] == [1, 2, 3]
    assert prof.tau(3, 3) == 4.0 and prof.tau(3, 2) == 3.0 and prof.tau(3, 1) == 2.0
    assert prof.tau(1, 5) == 2.0  # depth 1 keeps only a
    assert prof.tau(2, 2) == 3.0


def test_predicted_acceptance_is_exact_for_greedy_first_rounds():
    """Greedy: the first round of a small tree accepts exactly what the full tree's trace predicts for it."""
    torch.manual_seed(0)
    target = micro_gpt(vocab_size=8)
    drafter = build_drafter(DrafterConfig.for_target(target.config)).eval()
    cond = torch.arange(10)
    greedy = SamplingConfig(temperature=0.0, cfg_scale=2.0)
    k, D = 3, 3
    trace = []
    speculative_generate(target, drafter, cond, greedy, SpecConfig("greedy", "dynamic", D, k, k + (D - 1) * k * k),
                         trace=trace)
    first = costmodel.acceptance_profile(trace[:1], D)
    assert len(first.needs) == 10
    checked = 0
    for depth, n in [(1, 2), (2, 3), (2, 6), (3, 4), (3, 9)]:
        small = []
        speculative_generate(target, drafter, cond, greedy, SpecConfig("greedy", "dynamic", depth, k, n), trace=small)
        actual = small[0]["m"].float()
        assert torch.equal(first.accepted(depth, n), actual), (depth, n)
        checked += int((actual > 0).sum())
    assert checked > 0  # some drafts were accepted, so the ranks mattered


def _costs(target_ms: dict, vanilla_ms: float) -> costmodel.Costs:
    return costmodel.Costs(rows=2, target_s={s: t / 1000 for s, t in target_ms.items()},
                           drafter_s={1: 0.0002, 4: 0.0003, 8: 0.0004}, vanilla_step_s=vanilla_ms / 1000)


def _profile() -> costmodel.AcceptanceProfile:
    """Rounds where a bigger tree keeps accepting more: node i of the path needs rank 2 ** i."""
    prof = costmodel.AcceptanceProfile(max_depth=4)
    for m in range(5):
        prof.needs.append([[2**i for i in range(min(m, d))] for d in range(1, 5)])
    return prof


def test_choice_follows_the_hardware():
    sizes = [1, 2, 4, 8, 16, 32]
    flat = _costs({1: 1.0, 2: 1.0, 3: 1.0, 5: 1.0, 9: 1.0, 17: 1.0, 33: 1.05}, 1.1)  # a GPU: flat up to 64
    steep = _costs({1: 1.0, 2: 1.3, 3: 1.6, 5: 2.2, 9: 3.4, 17: 5.8, 33: 10.6}, 1.1)  # a CPU: grows with N
    gpu = costmodel.choose(_profile(), flat, 4, sizes)
    cpu = costmodel.choose(_profile(), steep, 4, sizes)
    assert gpu.total_tokens > cpu.total_tokens and gpu.depth >= cpu.depth
    assert gpu.speedup == max(g["speedup"] for g in gpu.grid)
    assert f"depth {cpu.depth}, {cpu.total_tokens} nodes" in cpu.why and "predicted" in cpu.why


def test_bare_forward_timers_run():
    target = micro_gpt()
    drafter = build_drafter(DrafterConfig.for_target(target.config)).eval()
    costs = costmodel.measure_costs(target, drafter, rows=2, sizes=[2, 4], top_k=2, context=4, reps=1)
    assert set(costs.target_s) == {1, 2, 3, 5} and all(t > 0 for t in costs.target_s.values())
    assert all(t > 0 for t in costs.drafter_s.values())
    assert costs.round(2, 4, 2) > costs.target(5)


def test_predicted_acceptance_matches_exact_sampling_in_distribution():
    """`exact` at temperature 1: the first-round accepted length of a small tree has the mean the full tree's
    trace predicts (siblings are tried in score order, so the small tree's tests are a prefix of the full's)."""
    torch.manual_seed(2)
    target = micro_gpt(vocab_size=6)
    drafter = build_drafter(DrafterConfig.for_target(target.config)).eval()
    B = 4000
    cond = torch.full((B,), 3)
    s = SamplingConfig(temperature=1.0, cfg_scale=2.0)
    k, D = 2, 3
    full = []
    speculative_generate(target, drafter, cond, s, SpecConfig("exact", "dynamic", D, k, k + (D - 1) * k * k),
                         torch.Generator().manual_seed(0), num_tokens=2, trace=full)
    prof = costmodel.acceptance_profile(full[:1], D)
    for depth, n in [(1, 1), (2, 3), (3, 4)]:
        small = []
        speculative_generate(target, drafter, cond, s, SpecConfig("exact", "dynamic", depth, k, n),
                             torch.Generator().manual_seed(1), num_tokens=2, trace=small)
        pred, actual = prof.accepted(depth, n), small[0]["m"].float()
        se = ((pred.var() + actual.var()) / B).sqrt()
        assert actual.mean() > 0.05 and abs(float(pred.mean() - actual.mean())) < 4 * float(se), (depth, n)


@pytest.mark.parametrize("siblings", ["wor", "iid"])
def test_sampled_profile_matches_smaller_sampled_trees_in_distribution(siblings):
    """Sampled trees (c, 1^(d-1)): the first-round accepted length has the mean the widest tree's trace predicts
    (the first c draws are a draw of c, the chain's first d - 1 drafts a chain of d - 1)."""
    torch.manual_seed(2)
    target = micro_gpt(vocab_size=6)
    drafter = build_drafter(DrafterConfig.for_target(target.config)).eval()
    B = 4000
    cond = torch.full((B,), 3)
    s = SamplingConfig(temperature=1.0, cfg_scale=2.0)
    C, D = 3, 3
    full = []
    speculative_generate(target, drafter, cond, s, SpecConfig("exact", "dynamic", draft="sample", siblings=siblings,
                                                              branching=(C,) + (1,) * (D - 1)),
                         torch.Generator().manual_seed(0), num_tokens=2, trace=full)
    prof = costmodel.sampled_profile(full[:1], C, D)
    assert len(prof.rounds) == B
    for c, d in [(1, 1), (1, 3), (2, 2), (3, 1)]:
        small = []
        speculative_generate(target, drafter, cond, s, SpecConfig("exact", "dynamic", draft="sample",
                                                                  siblings=siblings, branching=(c,) + (1,) * (d - 1)),
                             torch.Generator().manual_seed(1), num_tokens=2, trace=small)
        pred, actual = prof.accepted(c, d), small[0]["m"].float()
        se = ((pred.var() + actual.var()) / B).sqrt()
        assert actual.mean() > 0.05 and abs(float(pred.mean() - actual.mean())) < 4 * float(se), (c, d)


def test_choice_weighs_sampled_against_topk_drafts():
    """With a sampled profile that accepts more per node, the choice is a sampled tree, and `why` names both."""
    sizes = [1, 2, 4, 8, 16]
    steep = _costs({1: 1.0, 2: 1.3, 3: 1.6, 5: 2.2, 9: 3.4, 17: 5.8, 33: 10.6}, 1.1)
    sampled = costmodel.SampledProfile(width=3, max_depth=4)
    sampled.rounds = [(0, 4)] * 8 + [(1, 2), (-1, 0)]  # most rounds accept the first draw's whole chain
    c = costmodel.choose(_profile(), steep, 4, sizes, sampled)
    assert c.draft == "sample" and c.branching[0] == 1 and len(c.branching) == c.depth
    assert "sampled tree" in c.why and "best top-k draft" in c.why
    assert c.speedup == max(g["speedup"] for g in c.grid)
    only = costmodel.choose(None, steep, 4, sizes, sampled)
    assert all(g["draft"] == "sample" for g in only.grid)
