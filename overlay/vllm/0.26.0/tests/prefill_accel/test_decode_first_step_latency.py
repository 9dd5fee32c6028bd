"""prefill-accel: running decodes are scheduled first; --max-step-latency-ms sizes prefill chunks.

The scheduler is real; the "GPU" is a fake clock advanced by a linear cost model between
schedule() and update_from_output(), so the step times the scheduler measures are known.
"""

import math

import pytest
from scheduler_harness import BLOCK_SIZE, make_request, make_scheduler, run_step


def test_decode_is_not_pushed_out_by_a_prefill_ahead_of_it():
    # Sharing (two partial prefills) admits "chat" next to "doc" in the first step, so the
    # running list is [doc (prefilling), chat (decoding)]: doc comes first in every step.
    scheduler = make_scheduler(
        max_num_batched_tokens=256,
        max_num_partial_prefills=2,
        long_prefill_token_threshold=1024,
    )
    scheduler.add_request(make_request("doc", 1500))
    scheduler.add_request(make_request("chat", 10))
    assert run_step(scheduler).num_scheduled_tokens == {"doc": 246, "chat": 10}

    for _ in range(4):
        step = run_step(scheduler)
        assert step.num_scheduled_tokens["chat"] == 1
        assert step.num_scheduled_tokens["doc"] == 255


class FakeGpu:
    """A clock that a step advances by fixed + per_token * tokens + per_pair * attention pairs
    + per_context * the context each prefill chunk reads before its own tokens, in seconds."""

    def __init__(self, fixed_s: float, per_token_s: float, per_pair_s: float = 0.0, per_context_s: float = 0.0,
                 scheduler=None) -> None:  # fmt: skip
        self.now = 1000.0
        self.fixed_s, self.per_token_s, self.per_pair_s = fixed_s, per_token_s, per_pair_s
        self.per_context_s = per_context_s
        self.scheduler = scheduler

    def __call__(self) -> float:
        return self.now

    def run(self, output) -> None:
        from prefill_accel.scheduling.step_time import attention_pairs

        pairs = context = 0
        for req_id, n in output.num_scheduled_tokens.items():
            if self.scheduler is None:
                continue
            request = self.scheduler.requests[req_id]
            # schedule() has already advanced num_computed_tokens past this step's chunk.
            computed = request.num_computed_tokens - n
            pairs += attention_pairs(computed, n)
            if computed < request.num_prompt_tokens:
                context += computed
        self.now += (self.fixed_s + self.per_token_s * output.total_num_scheduled_tokens
                     + self.per_pair_s * pairs + self.per_context_s * context)  # fmt: skip


def decoding_chats(scheduler, gpu, count: int, max_tokens: int) -> None:
    """Start `count` chats on the fake GPU and run them into decoding: their prefill step and the
    decode steps after it teach the step-time model the fixed and per-token costs."""
    scheduler.prefill_planner.clock = gpu
    for i in range(count):
        scheduler.add_request(make_request(f"chat{i}", 32, max_tokens=max_tokens))
    for _ in range(6):
        run_step(scheduler, gpu.run)


def prefill_document(scheduler, gpu, decodes: int, max_steps: int) -> tuple[list[float], list[int]]:
    """Step until "doc" finishes (or max_steps): each step's time, and doc's chunk in it; every
    step must carry one token for each of the `decodes` decoding chats."""
    step_times, doc_chunks = [], []
    while "doc" in scheduler.requests and len(step_times) < max_steps:
        before = gpu.now
        step = run_step(scheduler, gpu.run)
        assert all(step.num_scheduled_tokens[f"chat{i}"] == 1 for i in range(decodes))
        step_times.append(gpu.now - before)
        doc_chunks.append(step.num_scheduled_tokens.get("doc", 0))
    return step_times, doc_chunks


def test_step_latency_target_limits_prefill_tokens_next_to_decodes():
    target_ms = 20.0
    gpu = FakeGpu(fixed_s=0.005, per_token_s=20e-6)  # 2048 tokens: 46 ms
    scheduler = make_scheduler(max_num_batched_tokens=2048, max_step_latency_ms=target_ms)
    decoding_chats(scheduler, gpu, 4, max_tokens=200)
    scheduler.add_request(make_request("doc", 2000, max_tokens=1))

    step_times, doc_chunks = prefill_document(scheduler, gpu, decodes=4, max_steps=20)

    # Every step stays within the target: a first chunk of one KV block (no prefill step timed yet),
    # then chunks of about the largest size that fits next to the four decodes (746 tokens), where
    # the budget alone would allow 2044.
    best_chunk = math.floor((target_ms / 1e3 - gpu.fixed_s) / gpu.per_token_s) - 4
    assert sum(doc_chunks) == 2000
    assert max(step_times) <= target_ms / 1e3 * 1.001
    assert doc_chunks[0] == BLOCK_SIZE
    assert all(0.99 * best_chunk <= c <= best_chunk for c in doc_chunks[1:-1])


def test_step_latency_charges_a_short_prompt_its_own_cost_next_to_a_long_prefill():
    # Attention dominates late chunks of the document: at ~1200 tokens of context a chunk token
    # costs ~130 us, a token of a fresh 64-token chat ~13 us. The step's time is shared by cost.
    target_ms = 12.0
    scheduler = make_scheduler(
        max_num_batched_tokens=512, max_step_latency_ms=target_ms,
        max_num_partial_prefills=2, long_prefill_token_threshold=256,
    )  # fmt: skip
    gpu = FakeGpu(fixed_s=0.002, per_token_s=10e-6, per_pair_s=100e-9, scheduler=scheduler)
    decoding_chats(scheduler, gpu, 4, max_tokens=400)
    scheduler.add_request(make_request("doc", 2000, max_tokens=1))
    while scheduler.requests["doc"].num_computed_tokens < 1200:
        run_step(scheduler, gpu.run)

    scheduler.add_request(make_request("late", 64, max_tokens=4))
    before = gpu.now
    step = run_step(scheduler, gpu.run)
    # The whole chat prompt fits next to the decodes and a (smaller) document chunk.
    assert step.num_scheduled_tokens["late"] == 64
    assert 0 < step.num_scheduled_tokens["doc"] < 100
    assert gpu.now - before <= target_ms / 1e3 * 1.05


def test_a_chunk_that_cannot_fit_its_context_read_waits_instead_of_crawling():
    # Reading 1000 tokens of context costs 10 ms here, a whole 10 ms step: late chunks of the
    # document cannot fit next to the decodes at any size. Cutting them to a few tokens would
    # overrun the target in every step for little progress; they wait, and one step in
    # STARVATION_STEPS takes a whole chunk, so the document still finishes.
    from prefill_accel.scheduling.step_budget import STARVATION_STEPS

    target_ms = 10.0
    scheduler = make_scheduler(max_num_batched_tokens=512, max_step_latency_ms=target_ms)
    gpu = FakeGpu(fixed_s=0.002, per_token_s=10e-6, per_context_s=10e-6, scheduler=scheduler)
    decoding_chats(scheduler, gpu, 2, max_tokens=900)
    scheduler.add_request(make_request("doc", 1800, max_tokens=1))

    step_times, doc_chunks = prefill_document(scheduler, gpu, decodes=2, max_steps=800)

    assert "doc" not in scheduler.requests, "the document never finished"
    chunks = [c for c in doc_chunks if c]
    over = [t for t in step_times if t > target_ms / 1e3 * 1.001]
    assert chunks[0] == BLOCK_SIZE  # the probe before any prefill step was timed
    assert min(chunks[1:-1]) >= 128, chunks  # no crawling in tiny chunks
    # Over the target: the step that taught the model the context cost, and the starved steps.
    assert len(over) <= 1 + len(step_times) // STARVATION_STEPS, (len(over), len(step_times))


def test_every_partial_prefill_keeps_a_floor_when_decodes_alone_exceed_the_target():
    # A 5 ms target next to decode steps that take 10 ms: no time is left for prefills, yet the
    # running document and a newly arrived chat both advance by one KV block per step.
    scheduler = make_scheduler(
        max_num_batched_tokens=512, max_step_latency_ms=5.0,
        max_num_partial_prefills=2, long_prefill_token_threshold=256,
    )  # fmt: skip
    gpu = FakeGpu(fixed_s=0.010, per_token_s=10e-6)
    decoding_chats(scheduler, gpu, 1, max_tokens=400)
    scheduler.add_request(make_request("doc", 2000, max_tokens=1))
    run_step(scheduler, gpu.run)
    scheduler.add_request(make_request("late", 64, max_tokens=4))
    step = run_step(scheduler, gpu.run)
    assert step.num_scheduled_tokens["doc"] == BLOCK_SIZE
    assert step.num_scheduled_tokens["late"] == BLOCK_SIZE


def test_without_a_target_prefill_uses_the_whole_budget_left_by_decodes():
    # A guard, not a new behaviour: without a target nothing but decodes limits prefill.
    scheduler = make_scheduler(max_num_batched_tokens=2048)
    scheduler.add_request(make_request("chat", 32, max_tokens=50))
    for _ in range(6):
        run_step(scheduler)
    scheduler.add_request(make_request("doc", 2000, max_tokens=1))
    assert run_step(scheduler).num_scheduled_tokens == {"chat": 1, "doc": 2000}


def test_step_time_model_fits_fixed_token_and_attention_costs():
    from prefill_accel.scheduling.step_time import StepTimeModel, attention_pairs

    c0, c1, c2, p0 = 0.004, 30e-6, 2e-9, 0.001
    model = StepTimeModel(token_scale=2048, pair_scale=2048 * 131072)
    for step in range(80):
        context, chunk, decodes = 2048 * step, 256 + 384 * (step % 5), 8 + step % 3
        decode_pairs = decodes * 4096
        model.observe(c0 + c1 * decodes + c2 * decode_pairs, decode_tokens=decodes, decode_pairs=decode_pairs)
        pairs = attention_pairs(context, chunk)
        seconds = c0 + c1 * (decodes + chunk) + c2 * (decode_pairs + pairs) + p0
        model.observe(seconds, decode_tokens=decodes, decode_pairs=decode_pairs, prefill_tokens=chunk,
                      prefill_pairs=pairs, prefill_keys=context if step % 2 else 0)  # fmt: skip
    assert model.decode_seconds(8, 8 * 4096) == pytest.approx(c0 + c1 * 8 + c2 * 8 * 4096, rel=1e-3)
    assert model.prefill_step_seconds == pytest.approx(p0, rel=0.05)

    # The largest chunk at 64K context that, next to 8 decodes, keeps a step within 50 ms.
    slack = 0.050 - model.decode_seconds(8, 8 * 4096) - model.prefill_step_seconds
    chunk = model.max_chunk(slack, 65536)

    def predicted(n):
        return c0 + c1 * (8 + n) + c2 * (8 * 4096 + attention_pairs(65536, n)) + p0

    assert 0 < chunk < 2048
    assert predicted(chunk) == pytest.approx(0.050, rel=0.01)


def test_cli_accepts_max_step_latency_ms():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["--max-step-latency-ms", "40"]).max_step_latency_ms == 40.0
    assert EngineArgs.max_step_latency_ms is None
