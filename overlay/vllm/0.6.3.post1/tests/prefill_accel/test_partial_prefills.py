"""prefill-accel: partial-prefill limits in the V0 chunked-prefill scheduler (vLLM 0.6.3.post1).

Ids 1 and 2 are long documents, 3 is a short chat prompt.
"""

import argparse

import pytest

from scheduler_harness import add, make_scheduler, step
from vllm.config import SchedulerConfig
from vllm.engine.arg_utils import EngineArgs


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
