"""prefill_accel.scheduling: the engine-agnostic parts of the scheduler policies (pure Python)."""

import pytest

from prefill_accel.scheduling import StepTimeModel, aged_remaining, attention_pairs, water_level


def test_water_level_shares_tokens_and_seconds_max_min_fairly():
    assert water_level([100, 5000, 5000], 2100) == 1000  # the short one whole, the rest split
    assert water_level([100, 200], 1000) == 200  # enough for everyone: nobody is capped
    assert water_level([], 512) == 512
    level = water_level([0.001, 0.050, 0.020], 0.012)
    assert level == pytest.approx(0.0055)
    assert sum(min(d, level) for d in [0.001, 0.050, 0.020]) == pytest.approx(0.012)


def test_attention_pairs_of_a_chunk_after_a_prefix():
    assert attention_pairs(0, 4) == 10  # causal triangle 1 + 2 + 3 + 4
    assert attention_pairs(100, 1) == 101  # a decode reads its context and itself


def test_max_chunk_inverts_the_chunk_cost():
    model = StepTimeModel(token_scale=2048, pair_scale=2048 * 131072)
    for step in range(30):
        tokens, pairs = 512 + 16 * (step % 7), attention_pairs(1024 * step, 512 + 16 * (step % 7))
        model.observe(tokens, pairs, 0.002 + 20e-6 * tokens + 1e-9 * pairs)
    for context in (0, 4096, 65536):
        chunk = model.max_chunk(0.010, context)
        assert model.chunk_seconds(chunk, context) <= 0.010 < model.chunk_seconds(chunk + 1, context)
    assert model.max_chunk(0.0, 0) == 0
    assert StepTimeModel(1, 1).max_chunk(0.01, 0) is None  # nothing learnt: no bound


def test_aged_remaining_reaches_zero_at_the_aging_bound():
    assert aged_remaining(1000, 0.0, 30.0) == 1000
    assert aged_remaining(1000, 15.0, 30.0) == 500
    assert aged_remaining(1000, 45.0, 30.0) == 0
    assert aged_remaining(-5, 0.0, 30.0) == 0
