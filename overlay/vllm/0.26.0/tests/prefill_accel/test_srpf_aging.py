"""prefill-accel: --prefill-order srpf admits the shortest remaining prefill first, with aging.

Arrival times are set relative to the wall clock, which is what the queue ages requests by.
"""

import time

from scheduler_harness import make_request, make_scheduler, run_step


def test_short_request_overtakes_an_earlier_long_one():
    scheduler = make_scheduler(max_num_batched_tokens=256, prefill_order="srpf")
    now = time.time()
    scheduler.add_request(make_request("doc", 1500, arrival_time=now - 1.0))
    scheduler.add_request(make_request("chat", 20, arrival_time=now))

    step = run_step(scheduler)
    # In arrival order the document would take all 256 tokens and the chat would wait.
    assert [r.req_id for r in step.scheduled_new_reqs] == ["chat", "doc"]
    assert step.num_scheduled_tokens == {"chat": 20, "doc": 236}


def test_precedence_rises_with_waiting_time_until_the_bound():
    # One request per step (max_num_seqs=1 while the first runs) shows the admission order.
    def first_admitted(doc_waited_s: float) -> str:
        scheduler = make_scheduler(
            max_num_batched_tokens=256, max_num_seqs=1, prefill_order="srpf",
            prefill_aging_s=10.0,
        )
        now = time.time()
        scheduler.add_request(make_request("doc", 1000, arrival_time=now - doc_waited_s))
        scheduler.add_request(make_request("chat", 600, arrival_time=now))
        (admitted,) = run_step(scheduler).scheduled_new_reqs
        return admitted.req_id

    # Aged key of the document: 1000 * (1 - waited / 10) against the chat's 600.
    assert first_admitted(doc_waited_s=2.0) == "chat"  # 800 > 600
    assert first_admitted(doc_waited_s=5.0) == "doc"  # 500 < 600
    # Past the bound a request goes ahead of anything that waited less, however short.
    scheduler = make_scheduler(
        max_num_batched_tokens=256, max_num_seqs=1, prefill_order="srpf", prefill_aging_s=10.0
    )
    now = time.time()
    scheduler.add_request(make_request("doc", 2000, arrival_time=now - 11.0))
    for i in range(5):
        scheduler.add_request(make_request(f"chat{i}", 8, arrival_time=now))
    (admitted,) = run_step(scheduler).scheduled_new_reqs
    assert admitted.req_id == "doc"


def test_srpf_orders_within_priority_levels():
    scheduler = make_scheduler(
        max_num_batched_tokens=256, max_num_seqs=1, policy="priority", prefill_order="srpf"
    )
    now = time.time()
    scheduler.add_request(make_request("doc-p0", 1500, priority=0, arrival_time=now - 2.0))
    scheduler.add_request(make_request("chat-p1", 10, priority=1, arrival_time=now - 1.0))
    scheduler.add_request(make_request("chat-p0", 10, priority=0, arrival_time=now))

    # Priority first (the shorter, older chat-p1 still goes last), SRPF within a level.
    assert [r.request_id for r in scheduler.waiting] == ["chat-p0", "doc-p0", "chat-p1"]
    (admitted,) = run_step(scheduler).scheduled_new_reqs
    assert admitted.req_id == "chat-p0"


def test_cli_accepts_prefill_order_and_aging():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--prefill-order", "srpf", "--prefill-aging-s", "5"])
    assert (args.prefill_order, args.prefill_aging_s) == ("srpf", 5.0)
    assert (EngineArgs.prefill_order, EngineArgs.prefill_aging_s) == ("arrival", 30.0)
