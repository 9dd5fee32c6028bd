"""PREFILL_ACCEL_STATS: the opt-in per-call statistics of the sparse path."""

from __future__ import annotations

import logging

import pytest
import torch

from kernel_inputs import make_batch
from prefill_accel import SparsePrefillConfig, select_blocks, sparse_prefill_attention, stats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def fresh_recorder(monkeypatch):
    monkeypatch.setattr(stats, "_recorder", None)


def test_stats_report_the_searched_density_every_n_calls(monkeypatch, caplog):
    monkeypatch.setenv(stats.ENV, "2")
    batch = make_batch(q_lens=[200, 70], k_lens=[200, 300], device=DEVICE)
    config = SparsePrefillConfig(block_size=64, threshold=0.5, min_q_len=0, sink_blocks=0, local_blocks=0,
                                 last_query_blocks=0)  # fmt: skip
    density = select_blocks(*batch.search_args, config=config).density()
    with caplog.at_level(logging.INFO, logger="prefill_accel.stats"):
        sparse_prefill_attention(*batch.args, config=config)
        assert not caplog.records
        sparse_prefill_attention(*batch.args, config=config)
    (record,) = caplog.records
    assert "2 calls, 540 query tokens" in record.message
    assert f"density {density:.3f}" in record.message
    assert density < 0.9


def test_stats_lines_pass_a_root_logger_at_warning(monkeypatch):
    """Inside an engine the root logger has a handler and sits at WARNING: the lines must still come out."""
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root = logging.getLogger()
    handler = Collect(level=logging.NOTSET)
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "level", logging.WARNING)
    monkeypatch.setattr(stats.logger, "level", logging.NOTSET)
    monkeypatch.setenv(stats.ENV, "1")
    batch = make_batch(q_lens=[130], k_lens=[130], device=DEVICE)
    sparse_prefill_attention(*batch.args, config=SparsePrefillConfig(block_size=64, min_q_len=0))
    assert len(seen) == 1 and seen[0].startswith("sparse prefill: 1 calls, 130 query tokens"), seen


def test_stats_are_off_by_default_and_reject_bad_values(monkeypatch):
    monkeypatch.delenv(stats.ENV, raising=False)
    assert stats.recorder() is None
    monkeypatch.setenv(stats.ENV, "often")
    with pytest.raises(ValueError, match="PREFILL_ACCEL_STATS"):
        stats.recorder()
