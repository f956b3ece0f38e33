"""The premise measurement: neighbour tables and the neighbourhood-vs-top-k masses."""
import math

import torch

from lisa.quality.premise import neighbour_table, premise_stats
from tests.helpers import micro_gpt


def test_neighbour_table_on_a_circle():
    angles = torch.arange(12) * (2 * math.pi / 12)
    codebook = torch.stack([angles.cos(), angles.sin()], -1) * 3  # scale does not matter (cosine)
    table = neighbour_table(codebook, 2)
    assert set(table[0].tolist()) == {1, 11} and set(table[5].tolist()) == {4, 6}


def test_premise_stats_bounds():
    model = micro_gpt()
    codebook = torch.randn(64, 8)
    tokens, cond = torch.randint(0, 64, (6, 16)), torch.randint(0, 10, (6,))
    s = premise_stats(model, codebook, tokens, cond, cfg_scale=2.0, ks=(4,))
    assert s["positions"] == 96 and 0 < s["U"] <= 1 and 0 < s["top1_prob"] <= 1
    assert s["mass_top1_plus_4_neighbours"] <= s["mass_top_5_tokens"] + 1e-6
    assert s["mass_5_random_codes"] <= s["mass_top_5_tokens"] + 1e-6
