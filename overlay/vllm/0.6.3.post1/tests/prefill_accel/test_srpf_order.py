"""prefill-accel: --prefill-order srpf (shortest remaining prefill first, with aging) in the V0 scheduler.

Ids 1 and 2 are long documents, 3 and 4 short chat prompts.
"""

import argparse

import pytest

from scheduler_harness import add, make_scheduler, step
from vllm.config import SchedulerConfig
from vllm.core.srpf_order import srpf_ordered
from vllm.engine.arg_utils import EngineArgs


def test_short_prompt_goes_ahead_of_a_document_that_arrived_first():
    scheduler = make_scheduler(512, prefill_order="srpf")
    add(scheduler, "1", 3000)
    add(scheduler, "3", 64, first_token=20_000)
    assert step(scheduler) == {"3": 64, "1": 448}


def test_arrival_order_is_the_default():
    scheduler = make_scheduler(512)
    add(scheduler, "1", 3000)
    add(scheduler, "3", 64, first_token=20_000)
    assert step(scheduler) == {"1": 512}


def test_aging_puts_a_long_wait_ahead_of_a_short_newcomer():
    scheduler = make_scheduler(512, prefill_order="srpf")
    doc = add(scheduler, "1", 3000)
    chat = add(scheduler, "3", 64, first_token=20_000)
    now = chat.arrival_time
    doc.arrival_time = now - 10.0
    # Aged key: 3000 * (1 - 10 / 30) = 2000 for the document against 64: the chat first.
    assert [g.request_id for g in srpf_ordered([doc, chat], 30.0, False, now)] == ["3", "1"]
    # Past the aging bound the document's key is 0: it goes first.
    doc.arrival_time = now - 31.0
    assert [g.request_id for g in srpf_ordered([doc, chat], 30.0, False, now)] == ["1", "3"]


def test_priority_comes_before_the_srpf_key():
    scheduler = make_scheduler(512, prefill_order="srpf", policy="priority")
    doc = add(scheduler, "1", 3000)
    chat = add(scheduler, "3", 64, first_token=20_000)
    other = add(scheduler, "4", 32, first_token=30_000)
    doc.priority, chat.priority, other.priority = 0, 1, 1
    ordered = srpf_ordered([chat, doc, other], 30.0, by_priority=True, now=chat.arrival_time)
    assert [g.request_id for g in ordered] == ["1", "4", "3"]


@pytest.mark.parametrize("options, message", [
    (dict(prefill_order="lifo"), "prefill_order"),
    (dict(prefill_aging_s=0.0), "prefill_aging_s"),
])
def test_invalid_options_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(4096, 16, 4096, enable_chunked_prefill=True, **options)


def test_cli_flags_reach_engine_args():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--prefill-order", "srpf", "--prefill-aging-s", "12.5"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.prefill_order, engine_args.prefill_aging_s) == ("srpf", 12.5)
