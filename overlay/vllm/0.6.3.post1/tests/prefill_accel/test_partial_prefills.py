"""prefill-accel: partial-prefill limits in the V0 chunked-prefill scheduler (vLLM 0.6.3.post1).

Real `Scheduler`, driven step by step as upstream's chunked-prefill tests do; requests are
upstream's dummy prompts. Ids are numbers (V0 sequences take int ids): 1 and 2 are long
documents, 3 is a short chat prompt.
"""

import argparse

import pytest

from tests.core.utils import create_dummy_prompt
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import EngineArgs
from vllm.sequence import Logprob

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
        first_token: int = 0) -> None:
    tokens = list(range(first_token, first_token + prompt_length))
    _, seq_group = create_dummy_prompt(request_id, prompt_length,
                                       block_size=BLOCK_SIZE,
                                       prompt_tokens=tokens)
    scheduler.add_seq_group(seq_group)


def step(scheduler: Scheduler) -> dict:
    """One schedule(); returns {request id: tokens scheduled}, after advancing the computed
    tokens and giving every group that finished its prompt a sampled token, as the engine does."""
    metas, out, _ = scheduler.schedule()
    chunks = {}
    for scheduled, meta in zip(out.scheduled_seq_groups, metas):
        seq_group = scheduled.seq_group
        seq_group.update_num_computed_tokens(meta.token_chunk_size)
        if not seq_group.is_prefill():
            for seq in seq_group.get_seqs():
                seq.append_token_id(1, {1: Logprob(0.0)})
        chunks[seq_group.request_id] = meta.token_chunk_size
    return chunks


def test_short_prompt_shares_the_step_with_a_long_one():
    scheduler = make_scheduler(512, max_num_partial_prefills=2,
                               long_prefill_token_threshold=256)
    add(scheduler, "1", 3000)
    add(scheduler, "3", 64)
    # The document's chunk stops at the threshold; the chat prompt is done in the first step.
    assert step(scheduler) == {"1": 256, "3": 64}
    assert step(scheduler) == {"1": 256, "3": 1}


def test_a_second_long_prompt_waits_for_the_long_slot_while_a_short_one_passes():
    scheduler = make_scheduler(512, max_num_partial_prefills=3,
                               max_long_partial_prefills=1,
                               long_prefill_token_threshold=256)
    add(scheduler, "1", 3000)
    add(scheduler, "2", 3000, first_token=10_000)
    add(scheduler, "3", 64, first_token=20_000)
    assert step(scheduler) == {"1": 256, "3": 64}
    # Document 2 kept its place at the head of the queue.
    assert scheduler.waiting[0].request_id == "2"
    for _ in range(12):
        step(scheduler)
    assert "2" in step(scheduler), "the second document starts once the first one is done"


def test_prefills_share_the_budget_max_min_fairly():
    scheduler = make_scheduler(512, max_num_partial_prefills=4,
                               max_long_partial_prefills=2,
                               long_prefill_token_threshold=1024)
    add(scheduler, "1", 3000)
    add(scheduler, "2", 3000, first_token=10_000)
    add(scheduler, "3", 100, first_token=20_000)
    # Water level over demands (1024, 1024, 100) and 512 tokens: 100 for the chat, 206 each.
    assert step(scheduler) == {"1": 206, "2": 206, "3": 100}


def test_prefix_caching_cuts_chunks_at_block_boundaries():
    scheduler = make_scheduler(512, prefix_caching=True,
                               long_prefill_token_threshold=100)
    add(scheduler, "1", 3000)
    assert step(scheduler) == {"1": 96}


def test_defaults_change_nothing():
    scheduler = make_scheduler(512)
    add(scheduler, "1", 3000)
    add(scheduler, "3", 64)
    assert step(scheduler) == {"1": 512}


@pytest.mark.parametrize("options, message", [
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3),
     "max_long_partial_prefills"),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False),
     "needs chunked prefill"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
])
def test_invalid_options_are_rejected(options, message):
    kwargs = dict(max_num_batched_tokens=4096, max_num_seqs=16,
                  max_model_len=4096, enable_chunked_prefill=True)
    kwargs.update(options)
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_cli_flags_reach_engine_args():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2",
        "--long-prefill-token-threshold", "8192"
    ])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.max_num_partial_prefills,
            engine_args.max_long_partial_prefills,
            engine_args.long_prefill_token_threshold) == (4, 2, 8192)
