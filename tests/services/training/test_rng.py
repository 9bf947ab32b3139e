"""The counter-based draws are a contract: the same (seed, counter, index) gives the same
number in every release, so a resumed or re-sharded run samples what the first run did."""

from __future__ import annotations

import torch

from services.training.rng import derive_seed, gumbel, uniform

SEEDS = torch.tensor([0, 1, 2**32 - 1])


def test_uniform_draws_are_the_published_numbers() -> None:
    expected = [
        [0.2875876274192706, 0.5676490020705387, 0.7722895495826378, 0.9263385514495894],
        [0.9992427084362134, 0.9886297468328848, 0.24701314291451126, 0.004079684498719871],
        [0.04913392418529838, 0.70378112338949, 0.8317895351210609, 0.20081737206783146],
    ]
    assert uniform(SEEDS, 3, 4).tolist() == expected


def test_gumbel_draws_with_one_counter_per_row_are_the_published_numbers() -> None:
    expected = [
        [0.8835451809101824, 0.918709515027127, -0.2626133250026186],
        [0.9462540332187539, -0.31098659135064444, -0.01541476227996908],
        [2.7190419809481003, 0.620688883110247, 2.1774711497333397],
    ]
    assert gumbel(SEEDS, torch.tensor([0, 7, 123456]), 3).tolist() == expected


def test_a_draw_leaves_its_seeds_and_counters_as_they_were() -> None:
    seeds = SEEDS.clone()
    counters = torch.tensor([0, 7, 123456])
    gumbel(seeds, counters, 5)
    assert torch.equal(seeds, SEEDS)
    assert counters.tolist() == [0, 7, 123456]


def test_a_row_draws_the_same_numbers_whatever_shares_its_batch() -> None:
    alone = uniform(SEEDS[1:2], 9, 16)
    together = uniform(SEEDS, 9, 16)[1:2]
    assert torch.equal(alone, together)
    assert derive_seed(1, 2) != derive_seed(2, 1)
