"""Which rows of an engine's batch go to the sparse kernel: the batch cut into runs of requests.

Engine-agnostic (torch only): an engine's attention backend gives the query offsets of its requests,
gets maximal runs of consecutive requests that take the same path (the sparse kernel for requests
whose attention work in this step reaches the minimum, the engine's own attention for the others),
and calls each path on plain slices of its tensors, so every result lands in the rows it was
computed for. A sparse run also carries its kernel layout, built once per step on the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import SparsePrefillConfig
from .layout import BatchLayout


@dataclass(frozen=True)
class RequestRun:
    """Consecutive requests ``[req_start, req_end)`` owning query rows ``[token_start, token_end)``."""

    sparse: bool
    req_start: int
    req_end: int
    token_start: int
    token_end: int
    max_query_len: int
    layout: BatchLayout | None = None
    """For a sparse run, the kernel's block layout of its requests, built once per step on the host."""

    @property
    def rows(self) -> slice:
        return slice(self.token_start, self.token_end)

    @property
    def requests(self) -> slice:
        return slice(self.req_start, self.req_end)


def split_long_prefills(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, num_reqs: int,
                        config: SparsePrefillConfig) -> tuple[RequestRun, ...] | None:  # fmt: skip
    """Cut a batch into runs of requests for the dense path and for the sparse path.

    Args:
        query_start_loc_cpu: (num_reqs + 1,) int32 CPU tensor, the query offsets of the requests
            (vLLM's ``CommonAttentionMetadata.query_start_loc_cpu``; may be longer when padded).
        seq_lens_cpu: (num_reqs,) CPU tensor, each request's context after this step (its keys);
            may be longer when padded.
        num_reqs: the number of real requests.
        config: the kernel's configuration; a request whose chunk in this step is a long chunk
            (``config.long_chunk`` of its query and key lengths) goes sparse.

    Returns:
        The runs in batch order, covering every request once, or None when no request is a long
        chunk (decode-only and short batches run upstream's path untouched).
    """
    starts = query_start_loc_cpu[: num_reqs + 1].tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    k_lens = seq_lens_cpu[:num_reqs].tolist()
    long = [config.long_chunk(q_len, k_len) for q_len, k_len in zip(query_lens, k_lens)]
    if not any(long):
        return None
    runs: list[RequestRun] = []
    run_start = 0
    for req in range(1, num_reqs + 1):
        if req == num_reqs or long[req] != long[run_start]:
            runs.append(
                RequestRun(
                    sparse=long[run_start],
                    req_start=run_start,
                    req_end=req,
                    token_start=starts[run_start],
                    token_end=starts[req],
                    max_query_len=max(query_lens[run_start:req]),
                )
            )
            run_start = req
    return tuple(runs)


def with_layouts(
    runs: tuple[RequestRun, ...],
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    config: SparsePrefillConfig,
    device: torch.device,
) -> tuple[RequestRun, ...]:
    """The runs with each sparse run's BatchLayout, built from the step's host-side lengths.

    Built here once per step, the layout spares every layer's kernel call from reading the lengths
    back from the GPU (a synchronisation per layer otherwise).
    """
    return tuple(
        dataclasses.replace(
            run,
            layout=BatchLayout.build(
                query_start_loc_cpu[run.req_start : run.req_end + 1] - run.token_start,
                seq_lens_cpu[run.requests],
                config,
                device,
            ),
        )
        if run.sparse
        else run
        for run in runs
    )
