"""prefill-accel: --max-step-latency-ms sizes V0 prefill chunks next to decodes.

The scheduler is real; the "GPU" is a fake clock advanced by a cost model during each step, so the
step times the scheduler measures (from one schedule() to the next) are known.
"""

import argparse

import pytest

from prefill_accel.scheduling.step_time import attention_pairs
from scheduler_harness import BLOCK_SIZE, add, make_scheduler, step
from vllm.config import SchedulerConfig
from vllm.engine.arg_utils import EngineArgs


class FakeGpu:
    """A clock a step advances by fixed + per_token * tokens + per_pair * attention pairs
    + per_context * the context each prefill chunk reads before its own tokens."""

    def __init__(self, fixed_s: float, per_token_s: float, per_pair_s: float = 0.0,
                 per_context_s: float = 0.0):
        self.now = 1000.0
        self.fixed_s, self.per_token_s, self.per_pair_s = fixed_s, per_token_s, per_pair_s
        self.per_context_s = per_context_s

    def __call__(self) -> float:
        return self.now

    def run(self, out) -> None:
        tokens = pairs = read = 0
        for scheduled in out.scheduled_seq_groups:
            n = scheduled.token_chunk_size
            context = scheduled.seq_group.get_seqs()[0].data.get_num_computed_tokens()
            tokens += n
            pairs += attention_pairs(context, n)
            if scheduled.seq_group.is_prefill():
                read += context
        self.now += (self.fixed_s + self.per_token_s * tokens + self.per_pair_s * pairs
                     + self.per_context_s * read)


def decoding_chats(scheduler, gpu: FakeGpu, count: int) -> None:
    """Chats that prefill, then decode: their steps teach the model the fixed and per-token costs."""
    scheduler.prefill_planner.clock = gpu
    for i in range(count):
        add(scheduler, str(10 + i), 32, first_token=1000 * (i + 1))
    for _ in range(6):
        step(scheduler, gpu.run)


def test_target_limits_prefill_tokens_next_to_decodes():
    target_ms = 20.0
    gpu = FakeGpu(fixed_s=0.005, per_token_s=20e-6)  # 2048 tokens: 46 ms
    scheduler = make_scheduler(2048, max_step_latency_ms=target_ms)
    decoding_chats(scheduler, gpu, 4)
    add(scheduler, "1", 2000, first_token=50_000)
    step_times, doc_chunks = [], []
    while sum(doc_chunks) < 2000 and len(step_times) < 20:
        before = gpu.now
        chunks = step(scheduler, gpu.run)
        assert all(chunks[str(10 + i)] == 1 for i in range(4))
        step_times.append(gpu.now - before)
        doc_chunks.append(chunks.get("1", 0))
    # A first chunk of one KV block (no prefill step timed yet), then chunks of about the largest size
    # that fits next to the four decodes (746 tokens), where the budget alone would allow 2044; every
    # step within the target.
    best_chunk = round((target_ms / 1e3 - gpu.fixed_s) / gpu.per_token_s) - 4
    assert sum(doc_chunks) == 2000
    assert max(step_times) <= target_ms / 1e3 * 1.001
    assert doc_chunks[0] == BLOCK_SIZE
    assert all(0.99 * best_chunk <= c <= best_chunk for c in doc_chunks[1:-1])


def test_a_short_prompt_is_charged_its_own_cost_next_to_a_long_prefill():
    target_ms = 12.0
    scheduler = make_scheduler(512, max_step_latency_ms=target_ms,
                               max_num_partial_prefills=2,
                               long_prefill_token_threshold=256)
    gpu = FakeGpu(fixed_s=0.002, per_token_s=10e-6, per_pair_s=100e-9)
    decoding_chats(scheduler, gpu, 4)
    doc = add(scheduler, "1", 2000, first_token=50_000)
    while doc.get_seqs()[0].data.get_num_computed_tokens() < 1200:
        step(scheduler, gpu.run)
    add(scheduler, "3", 64, first_token=90_000)
    before = gpu.now
    chunks = step(scheduler, gpu.run)
    assert chunks["3"] == 64
    assert 0 < chunks["1"] < 100
    assert gpu.now - before <= target_ms / 1e3 * 1.05


def test_every_partial_prefill_keeps_a_floor_when_decodes_alone_exceed_the_target():
    scheduler = make_scheduler(512, max_step_latency_ms=5.0,
                               max_num_partial_prefills=2,
                               long_prefill_token_threshold=256)
    gpu = FakeGpu(fixed_s=0.010, per_token_s=10e-6)
    decoding_chats(scheduler, gpu, 1)
    add(scheduler, "1", 2000, first_token=50_000)
    step(scheduler, gpu.run)
    add(scheduler, "3", 64, first_token=90_000)
    chunks = step(scheduler, gpu.run)
    assert chunks["1"] == BLOCK_SIZE and chunks["3"] == BLOCK_SIZE


def test_a_chunk_whose_context_read_does_not_fit_keeps_a_block_and_decodes_keep_running():
    # Reading 1000 tokens of context costs 10 ms, a whole step: late chunks of the document fit at
    # no size. V0's running loop stops at the first group given no tokens, so instead of being
    # refused (as on 0.26.0) the document keeps one block per step and the decodes never stall.
    scheduler = make_scheduler(512, max_step_latency_ms=10.0)
    gpu = FakeGpu(fixed_s=0.002, per_token_s=10e-6, per_context_s=10e-6)
    decoding_chats(scheduler, gpu, 2)
    add(scheduler, "1", 1800, first_token=50_000)
    doc_chunks = []
    for _ in range(12):
        chunks = step(scheduler, gpu.run)
        assert chunks["10"] == 1 and chunks["11"] == 1
        doc_chunks.append(chunks.get("1", 0))
    assert min(doc_chunks) >= BLOCK_SIZE
    assert doc_chunks[-1] == BLOCK_SIZE  # the context read no longer fits: one block


def test_without_a_target_prefill_takes_the_budget_left_by_decodes():
    scheduler = make_scheduler(2048)
    gpu = FakeGpu(fixed_s=0.005, per_token_s=20e-6)
    decoding_chats(scheduler, gpu, 1)
    add(scheduler, "1", 2000, first_token=50_000)
    assert step(scheduler) == {"10": 1, "1": 2000}


@pytest.mark.parametrize("options, message", [
    (dict(max_step_latency_ms=0.0), "must be > 0"),
    (dict(max_step_latency_ms=50.0, enable_chunked_prefill=False), "needs chunked prefill"),
    (dict(max_step_latency_ms=50.0, num_scheduler_steps=8), "one scheduler step"),
])
def test_invalid_targets_are_rejected(options, message):
    kwargs = dict(max_num_batched_tokens=4096, max_num_seqs=16, max_model_len=4096,
                  enable_chunked_prefill=True)
    kwargs.update(options)
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_cli_flag_reaches_engine_args():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--max-step-latency-ms", "40"])
    assert EngineArgs.from_cli_args(args).max_step_latency_ms == 40.0
    assert EngineArgs.max_step_latency_ms is None
