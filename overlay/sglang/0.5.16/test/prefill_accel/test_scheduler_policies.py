"""prefill-accel: SGLang's scheduler with decode protection and shortest-remaining-prefill-first.

Real ServerArgs parsed from the command line, real Req, SchedulePolicy, PrefillAdder and ScheduleBatch
objects, and the scheduler's own get_next_batch_to_run; only what a scheduler needs a model and its
pools for (forming the prefill batch, advancing the decodes, DP synchronisation) is stood in for.
On an unpatched SGLang these fail: the flags and the policy name do not parse, the policy is unknown,
and the scheduler never holds a prefill back.
"""

import argparse
import logging
import re
from array import array
from types import SimpleNamespace

import pytest
import torch
from prefill_accel.flags import SUFFIXES

from sglang.srt.managers import srpf_order
from sglang.srt.managers.decode_protection import PrefillStreak
from sglang.srt.managers.schedule_batch import NextBatchPlan, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.step_latency import StepLatency
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.sparse_prefill import FACTS, check_sparse_prefill_schedule

NOW = 1000.0


def server_args(*flags: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *flags]))


def make_req(rid: str, prompt_tokens: int, entered: float, priority=None) -> Req:
    req = Req(rid, "", array("q", range(prompt_tokens)), SamplingParams(max_new_tokens=16), priority=priority)
    req.time_stats.wait_queue_entry_time = entered
    return req


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(srpf_order, "clock", lambda: NOW)


def ordered(queue, *flags):
    args = server_args("--schedule-policy", "srpf", *flags)
    set_global_server_args_for_scheduler(args)
    policy = SchedulePolicy(args.schedule_policy, RadixCache.create_simulated(), False,
                            args.enable_priority_scheduling, args.schedule_low_priority_values_first)
    policy.calc_priority(queue)
    return [r.rid for r in queue]


def test_flags_parse_into_server_args():
    args = server_args(
        "--prefill-attention-backend", "sparse_prefill", "--attention-backend", "triton",
        "--sparse-prefill-min-len", "8192", "--sparse-prefill-dense-layers", "2",
        "--sparse-prefill-threshold", "0.01", "--sparse-prefill-mean-correction", "--sparse-prefill-estimator", "exact",
        "--max-consecutive-prefill-batches", "3", "--schedule-policy", "srpf", "--prefill-aging-s", "12.5",
    )
    assert args.get_attention_backends() == ("sparse_prefill", "triton")
    assert (args.sparse_prefill_min_len, args.sparse_prefill_dense_layers) == (8192, 2)
    assert (args.sparse_prefill_threshold, args.sparse_prefill_mean_correction) == (0.01, True)
    assert args.sparse_prefill_estimator == "exact"
    assert (args.max_consecutive_prefill_batches, args.schedule_policy, args.prefill_aging_s) == (3, "srpf", 12.5)


def one_line(text: str) -> str:
    """Help text as one line: argparse wraps it at spaces and after hyphens (``block-`` / ``sparse``)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def test_the_sparse_prefill_flags_help_is_the_runtimes():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    help_text = one_line(parser.format_help())
    for suffix in SUFFIXES:
        assert one_line(FACTS.help(suffix)) in help_text, suffix


def test_sparse_prefill_defaults_are_the_kernels():
    from prefill_accel import SparsePrefillConfig

    args = server_args()
    assert args.sparse_prefill_min_len == SparsePrefillConfig().min_q_len
    assert args.sparse_prefill_threshold == SparsePrefillConfig().threshold
    assert args.max_consecutive_prefill_batches is None and args.schedule_policy == "fcfs"


@pytest.mark.parametrize("flags, message", [
    (["--prefill-attention-backend", "sparse_prefill", "--sparse-prefill-block-size", "96"], "--sparse-prefill-block-size"),
    (["--prefill-attention-backend", "sparse_prefill", "--sparse-prefill-min-len", "64"], "--sparse-prefill-min-len=64"),
    (["--attention-backend", "sparse_prefill"], "--prefill-attention-backend sparse_prefill"),
    (["--decode-attention-backend", "sparse_prefill"], "computes prefills only"),
])
def test_bad_sparse_prefill_flags_are_refused_at_startup_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        server_args(*flags)


def test_sparse_prefill_flags_without_the_backend_draw_a_warning(caplog):
    server_args("--sparse-prefill-min-len", "4096")
    assert "--sparse-prefill-min-len set but the prefill attention backend is not sparse_prefill" in caplog.text


def test_a_chunk_size_below_the_minimum_length_is_said_at_startup(caplog):
    """The resolved --chunked-prefill-size against --sparse-prefill-min-len (24576): chunks of 8192 (an
    H200's default) go sparse from that context on, silently; chunks of 2048 bring the work needed only
    from a context of 37888 tokens: one INFO line; within a context length shorter than where a chunk goes
    sparse the backend is inert: one warning naming the setting. Parsed args of a dummy model stop before
    the defaults are resolved, so the check is called here as __post_init__ calls it last."""
    logger = logging.getLogger("sglang-schedule-test")
    args = server_args("--prefill-attention-backend", "sparse_prefill", "--attention-backend", "triton")
    with caplog.at_level(logging.INFO, logger="sglang-schedule-test"):
        for size, context, warned in ((8192, None, False), (2048, None, False), (8192, 16384, True),
                                      (24576, 24576, False), (-1, None, False)):  # fmt: skip
            args.chunked_prefill_size, args.context_length = size, context
            reason = check_sparse_prefill_schedule(args, logger)
            assert (reason is not None) == warned, (size, context)
        args.prefill_attention_backend = None
        args.chunked_prefill_size = 2048
        assert check_sparse_prefill_schedule(args, logger) is None
    late, warning = caplog.records
    assert late.levelname == "INFO" and late.getMessage() == (
        "sparse_prefill: --chunked-prefill-size caps a prefill chunk at 2048 tokens, below --sparse-prefill-min-len="
        "24576: a chunk takes the sparse path from a context of 37888 tokens")  # fmt: skip
    assert warning.levelname == "WARNING" and warning.getMessage().startswith(
        "sparse_prefill never runs: --chunked-prefill-size caps a prefill chunk at 8192 tokens, which takes the "
        "sparse path under --sparse-prefill-min-len=24576 only from a context of 24576 tokens, beyond the 16384 "
        "the engine holds; set --chunked-prefill-size 24576")  # fmt: skip


def test_srpf_orders_the_queue_by_remaining_prefill(clock):
    queue = [make_req("document", 8000, NOW - 3), make_req("chat", 100, NOW - 2), make_req("code", 1000, NOW - 1)]
    assert ordered(queue) == ["chat", "code", "document"]


def test_srpf_counts_output_of_retracted_requests_and_the_matched_prefix(clock):
    retracted = make_req("retracted", 300, NOW - 3)
    retracted.output_ids = array("q", range(400))  # 700 tokens to prefill again
    cached = make_req("cached", 2000, NOW - 2)
    cached.num_matched_prefix_tokens = 1800  # 200 left
    fresh = make_req("fresh", 500, NOW - 1)
    assert ordered([retracted, cached, fresh]) == ["cached", "fresh", "retracted"]


def test_aging_puts_a_long_wait_first(clock):
    queue = [make_req("chat", 100, NOW - 1), make_req("document", 8000, NOW - 40)]
    assert ordered(queue, "--prefill-aging-s", "60") == ["chat", "document"]
    # 40 s of a 30 s bound: the document's key is 0, ahead of anything younger.
    assert ordered(queue, "--prefill-aging-s", "30") == ["document", "chat"]


def test_priority_first_then_srpf_within_a_level(clock):
    queue = [
        make_req("low-short", 100, NOW - 4, priority=0),
        make_req("high-long", 8000, NOW - 3, priority=5),
        make_req("high-short", 200, NOW - 2, priority=5),
        make_req("low-long", 4000, NOW - 1, priority=0),
    ]
    assert ordered(queue, "--enable-priority-scheduling") == ["high-short", "high-long", "low-short", "low-long"]
    assert ordered(queue, "--enable-priority-scheduling", "--schedule-low-priority-values-first") == [
        "low-short", "low-long", "high-short", "high-long"]


@pytest.mark.parametrize("policy, admitted", [
    ("fcfs", {"document": 1024}),
    ("srpf", {"chat": 100, "code": 300, "document": 624}),
])
def test_long_and_short_queue_forms_the_prefill_batch_shortest_first(clock, policy, admitted):
    """The scheduler's loop over the sorted queue into a real PrefillAdder (chunked prefill of 1024
    tokens): first come first served spends the whole chunk on the document, srpf admits both short
    requests and gives the document what is left."""
    args = server_args("--schedule-policy", policy)
    set_global_server_args_for_scheduler(args)
    tree_cache = RadixCache.create_simulated()
    queue = [make_req("document", 16000, NOW - 3), make_req("chat", 100, NOW - 2), make_req("code", 300, NOW - 1)]
    SchedulePolicy(policy, tree_cache, False, False, False).calc_priority(queue)
    allocator = SimpleNamespace(available_size=lambda: 1 << 20)
    adder = PrefillAdder(1, tree_cache, allocator, ScheduleBatch(reqs=[]), 0.5, 16384, 1024)
    for req in queue:
        req.init_next_round_input(tree_cache)
        if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
            break
    assert {r.rid: r.extend_range.length for r in adder.can_run_list} == admitted
    assert list(admitted) == [r.rid for r in adder.can_run_list]
    assert adder.new_chunked_req.rid == "document"


def chunk_batch(policy: str, waiting: list, srpf_first: bool = True, max_requests: int = 64) -> dict:
    """One prefill batch while a 16000-token document is prefilled in chunks of 1024 (4096 tokens done):
    the scheduler's call of srpf_order.add_chunk_after_shorter with a real PrefillAdder, then its loop over
    the rest of the sorted queue. Returns each admitted request's tokens, in order."""
    args = server_args("--schedule-policy", policy)
    set_global_server_args_for_scheduler(args)
    tree_cache = RadixCache.create_simulated()
    document = make_req("document", 16000, NOW - 3)
    document.init_next_round_input(tree_cache)
    document.prefix_indices = torch.arange(4096)
    queue = [make_req(rid, tokens, NOW - 1) for rid, tokens in waiting]
    schedule_policy = SchedulePolicy(policy, tree_cache, False, False, False)
    schedule_policy.calc_priority(queue)
    allocator = SimpleNamespace(available_size=lambda: 1 << 20)
    adder = PrefillAdder(1, tree_cache, allocator, ScheduleBatch(reqs=[]), 0.5, 16384, 1024)
    document.init_next_round_input()
    no_target = StepLatency(None, 1024, 1, 131072, mixed_chunk=False, srpf=policy == "srpf")
    unfinished, ahead = srpf_order.add_chunk_after_shorter(adder, schedule_policy, queue, document, tree_cache,
                                                           max_requests, None, srpf_first, no_target)  # fmt: skip
    assert unfinished is document
    for req in [r for r in queue if r not in ahead]:
        req.init_next_round_input(tree_cache)
        if adder.add_one_req(req, has_chunked_req=True, truncation_align_size=None) != AddReqResult.CONTINUE:
            break
    return {r.rid: r.extend_range.length for r in adder.can_run_list}


def test_shorter_requests_go_before_a_chunk_under_srpf(clock):
    """SGLang puts a chunked request's next chunk first in every batch; under srpf the shorter waiting
    requests go first, whole, while the chunk keeps its fair share, and the chunk takes the rest."""
    waiting = [("chat", 100), ("code", 300), ("review", 900)]
    assert list(chunk_batch("fcfs", waiting).items()) == [("document", 1024)]
    # 100 + 300 leave the document 624 >= 300; with the 900 it would keep 124 < 900.
    assert list(chunk_batch("srpf", waiting).items()) == [("chat", 100), ("code", 300), ("document", 624)]
    # As many as the batch may hold (the document's request among them), and only where the scheduler allows.
    assert list(chunk_batch("srpf", waiting, max_requests=2).items()) == [("chat", 100), ("document", 924)]
    assert list(chunk_batch("srpf", waiting, srpf_first=False).items()) == [("document", 1024)]
    # A waiting request with more to prefill than the document does not go first.
    assert list(chunk_batch("srpf", [("book", 20000)]).items()) == [("document", 1024)]


def scheduler_rounds(max_consecutive, rounds):
    """Run the scheduler's get_next_batch_to_run while a long prompt is being prefilled chunk after
    chunk and one request decodes; returns the mode of each batch it chose."""
    decoding = make_req("decoding", 50, NOW)
    running = ScheduleBatch(reqs=[decoding])

    def next_chunk(running_batch):
        chunk = ScheduleBatch(reqs=[make_req("document", 16000, NOW)], forward_mode=ForwardMode.EXTEND)
        return NextBatchPlan(batch_to_run=chunk, running_batch=running_batch)

    def decode(running_batch):
        running_batch.forward_mode = ForwardMode.DECODE
        return running_batch

    scheduler = SimpleNamespace(
        prefill_streak=PrefillStreak(max_consecutive), get_new_batch_prefill=next_chunk,
        step_latency=StepLatency(None, 16384, 1, 131072, mixed_chunk=False, srpf=False), waiting_queue=[],
        update_running_batch=decode, process_pending_chunked_abort=lambda: None, enable_fpm=False,
        _abort_on_waiting_timeout=lambda: None, _abort_on_running_timeout=lambda batch: None,
        dllm_config=None, chunked_req=None, enable_hisparse=False, require_mlp_sync=False,
        dp_attn_adapter=SimpleNamespace(maybe_prepare_mlp_sync_batch=lambda batch, need_sync=False: batch),
        ngram_embedding_manager=SimpleNamespace(prepare_for_forward=lambda batch, chunked_req: batch),
    )
    modes = []
    for _ in range(rounds):
        plan = Scheduler.get_next_batch_to_run(scheduler, running, last_batch=None)
        modes.append(plan.batch_to_run.forward_mode.name)
        running = plan.running_batch
    return modes


def test_decodes_run_after_the_bound_of_consecutive_prefill_batches():
    set_global_server_args_for_scheduler(server_args())
    assert scheduler_rounds(None, 6) == ["EXTEND"] * 6
    assert scheduler_rounds(2, 7) == ["EXTEND", "EXTEND", "DECODE"] * 2 + ["EXTEND"]
    assert scheduler_rounds(1, 4) == ["EXTEND", "DECODE"] * 2


def test_prefill_streak_counts_only_prefills_that_kept_decodes_waiting():
    streak = PrefillStreak(1)
    nobody_decoding = ScheduleBatch(reqs=[])
    chunk = ScheduleBatch(reqs=[make_req("document", 16000, NOW)], forward_mode=ForwardMode.EXTEND)
    streak.record(chunk, nobody_decoding)
    assert streak.length == 0 and not streak.holds_prefill(nobody_decoding)
    decoding = ScheduleBatch(reqs=[make_req("decoding", 50, NOW)])
    streak.record(chunk, decoding)
    assert streak.holds_prefill(decoding)
    with pytest.raises(ValueError, match="--max-consecutive-prefill-batches must be at least 1"):
        PrefillStreak(0)
