# SPDX-License-Identifier: Apache-2.0
"""The SPARSE_PREFILL backend's runs (``prefill_accel.runs``) applied to vLLM's FlashAttention metadata.

Placed by the prefill-accel overlay. Pure metadata translation, no kernels: each run of requests gets
FlashAttention metadata restricted to it, so each path is called on plain slices of the query,
output, block table and sequence lengths (no gathers, no copies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from prefill_accel.runs import RequestRun, split_long_prefills, with_layouts

__all__ = ["RequestRun", "forward_runs", "run_metadata", "split_long_prefills", "with_layouts"]


def run_metadata(attn_metadata, run: RequestRun):
    """``attn_metadata`` (a FlashAttentionMetadata) restricted to one run, with rows renumbered from 0.

    The ahead-of-time FA3 schedule describes the whole batch, so it is dropped (FA then schedules
    itself); ``max_seq_len`` stays an upper bound of the batch, which FA accepts.
    """
    query_start_loc = attn_metadata.query_start_loc[run.req_start : run.req_end + 1] - run.token_start
    return dataclasses.replace(
        attn_metadata,
        num_actual_tokens=run.token_end - run.token_start,
        max_query_len=run.max_query_len,
        query_start_loc=query_start_loc,
        seq_lens=attn_metadata.seq_lens[run.requests],
        block_table=attn_metadata.block_table[run.requests],
        scheduler_metadata=None,
        sparse_runs=None,
        sparse_layout=run.layout,
    )


def forward_runs(
    runs: tuple[RequestRun, ...],
    attn_metadata,
    dense: Callable[[slice, object], None],
    sparse: Callable[[slice, object], None],
) -> None:
    """Call ``dense(rows, run_metadata)`` or ``sparse(rows, run_metadata)`` once per run, in batch order.

    Each call computes the query rows ``rows`` of the step into the same rows of the output.
    """
    for run in runs:
        (sparse if run.sparse else dense)(run.rows, run_metadata(attn_metadata, run))
