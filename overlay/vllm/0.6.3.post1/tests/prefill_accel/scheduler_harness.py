"""Helpers for prefill-accel's V0 scheduler tests: a real vLLM 0.6.3 `Scheduler` with our options,
driven step by step as upstream's chunked-prefill tests do (tests/core/test_chunked_prefill_scheduler.py).
Requests are upstream's dummy prompts; V0 sequences take numeric ids."""

from tests.core.utils import create_dummy_prompt
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.scheduler import Scheduler
from vllm.sequence import Logprob, SequenceGroup

BLOCK_SIZE = 16


def make_scheduler(max_num_batched_tokens: int, prefix_caching: bool = False,
                   **options) -> Scheduler:
    scheduler_config = SchedulerConfig(max_num_batched_tokens,
                                       max_num_seqs=16,
                                       max_model_len=4096,
                                       enable_chunked_prefill=True,
                                       **options)
    cache_config = CacheConfig(BLOCK_SIZE, 1.0, 1, "auto",
                               enable_prefix_caching=prefix_caching)
    cache_config.num_cpu_blocks = 1024
    cache_config.num_gpu_blocks = 1024
    return Scheduler(scheduler_config, cache_config, None)


def add(scheduler: Scheduler, request_id: str, prompt_length: int,
        first_token: int = 0) -> SequenceGroup:
    """A prompt of distinct tokens from `first_token` on (no accidental prefix-cache hits)."""
    tokens = list(range(first_token, first_token + prompt_length))
    _, seq_group = create_dummy_prompt(request_id, prompt_length,
                                       block_size=BLOCK_SIZE,
                                       prompt_tokens=tokens)
    scheduler.add_seq_group(seq_group)
    return seq_group


def step(scheduler: Scheduler, during_step=None) -> dict:
    """One schedule(); returns {request id: tokens scheduled}, after `during_step(out)` (e.g. a
    fake clock advanced by the step's cost), advancing the computed tokens and giving every group
    that finished its prompt a sampled token, as the engine does."""
    metas, out, _ = scheduler.schedule()
    if during_step is not None:
        during_step(out)
    chunks = {}
    for scheduled, meta in zip(out.scheduled_seq_groups, metas):
        seq_group = scheduled.seq_group
        seq_group.update_num_computed_tokens(meta.token_chunk_size)
        if not seq_group.is_prefill():
            for seq in seq_group.get_seqs():
                seq.append_token_id(1, {1: Logprob(0.0)})
        chunks[seq_group.request_id] = meta.token_chunk_size
    return chunks
