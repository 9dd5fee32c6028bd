"""scripts/compare_estimators.py: the estimators and the cut it compares, on a synthetic case."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from prefill_accel.accuracy.metrics import block_attention_mass

_spec = importlib.util.spec_from_file_location(
    "compare_estimators", Path(__file__).resolve().parents[1] / "scripts" / "compare_estimators.py"
)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def needle_qk(length=2048, dim=32, seed=0):
    """Queries that attend to one token in each of a few blocks: the block's mean key hides it."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, 2, dim, generator=gen) * 0.3
    k = torch.randn(length, 1, dim, generator=gen) * 0.3
    direction = torch.nn.functional.normalize(torch.randn(dim, generator=gen), dim=0)
    k += torch.randn(length, 1, 1, generator=gen) * 2.0 * direction  # block means along it vary by chance
    needles = torch.randperm(length // 2, generator=gen)[:2]
    k[needles, 0] += 20.0 * direction  # they hold most of a later query's attention
    q += 3.0 * direction
    return q, k


def test_estimates_are_shares_of_each_rows_causal_blocks():
    q, k = needle_qk()
    estimates = (compare.pooled_estimate(q, k, 64, 0.2, 4), compare.bound_estimate(q, k, 64, 0.2, 4),
                 compare.exact_estimate(q, k, 64, 0.2, 2), compare.pooled_estimate(q, k, 64, 0.2, 4, pool=16),
                 compare.gaussian_estimate(q, k, 64, 0.2, 4))  # fmt: skip
    for est in estimates:
        nb = est.shape[0]
        assert torch.allclose(est.sum(-1), torch.ones(nb, 1), atol=1e-4)
        future = torch.arange(nb)[:, None] < torch.arange(nb)[None, :]
        assert (est[:, 0][future] == 0).all()


def test_exact_rows_and_key_bounds_find_the_tokens_the_pooled_keys_wash_out():
    scale = 32**-0.5
    ratios = {"exact": [], "bound": []}
    for seed in range(5):
        q, k = needle_qk(seed=seed)
        mass = block_attention_mass(q, k, 64, scale)
        pooled = compare.at_recall(mass, compare.pooled_estimate(q, k, 64, scale, 4), 0.95, 1, 2)
        exact = compare.at_recall(mass, compare.exact_estimate(q, k, 64, scale, 1), 0.95, 1, 2)
        bound = compare.at_recall(mass, compare.bound_estimate(q, k, 64, scale, 4), 0.95, 1, 2)
        assert min(pooled["recall"], exact["recall"], bound["recall"]) >= 0.95
        ratios["exact"].append(exact["density"] / pooled["density"])
        ratios["bound"].append(bound["density"] / pooled["density"])
    for name, values in ratios.items():
        assert max(values) < 1.0 and sum(values) / len(values) < 0.8, (name, values)


def test_gaussian_keys_favour_the_block_whose_keys_spread_and_equal_pooled_keys_where_none_does():
    """Two key blocks with one mean key: the one whose keys spread holds more of exp's sum, and the Gaussian
    estimate says so by exp(scale^2 / 2 q^2 var); with constant blocks it is the pooled estimate."""
    q = torch.ones(128, 1, 4)
    k = torch.zeros(128, 1, 4)
    k[64:, 0, 0] = torch.tensor([1.0, -1.0]).repeat(32)  # block 1: variance 1 along dimension 0
    gaussian, pooled = compare.gaussian_estimate(q, k, 64, 1.0, 4), compare.pooled_estimate(q, k, 64, 1.0, 4)
    assert torch.allclose(gaussian[0], pooled[0])
    assert torch.allclose(gaussian[1, 0], torch.softmax(torch.tensor([0.0, 0.5]), 0), atol=1e-6)
    assert torch.allclose(pooled[1, 0], torch.tensor([0.5, 0.5]), atol=1e-6)
