"""prefill-accel: --max-num-partial-prefills / --max-long-partial-prefills are enforced by the V1 scheduler.

Upstream V1 defines both options but never enforces them (and engine args reject them): the first
waiting prompt takes the whole token budget. Patched, the step's prefill tokens are shared max-min
fairly among the partial prefills, at most max_long_partial_prefills of them long.
"""

from scheduler_harness import make_request, make_scheduler, run_step


def test_short_prompt_shares_the_step_with_a_long_one_and_a_second_long_one_waits():
    scheduler = make_scheduler(
        max_num_batched_tokens=768,
        max_num_partial_prefills=2,
        max_long_partial_prefills=1,
        long_prefill_token_threshold=1000,
    )
    for request in (make_request("long-a", 1800), make_request("long-b", 1200),
                    make_request("short", 300)):
        scheduler.add_request(request)

    first = run_step(scheduler)
    # Water level over the demands {long-a: 1000 (threshold), short: 300} in 768 tokens:
    # short is finished in one step, long-a takes the rest, not the whole budget.
    assert first.num_scheduled_tokens == {"long-a": 468, "short": 300}

    # long-b stays out while long-a is long; it starts once long-a's remainder is short.
    while scheduler.requests["long-a"].num_computed_tokens < 1800 - 1000:
        assert "long-b" not in run_step(scheduler).num_scheduled_tokens
    assert "long-b" in run_step(scheduler).num_scheduled_tokens


def test_at_most_max_num_partial_prefills_prefill_at_once():
    scheduler = make_scheduler(
        max_num_batched_tokens=512,
        max_num_partial_prefills=2,
        max_long_partial_prefills=2,
        long_prefill_token_threshold=1000,
    )
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 600))

    first = run_step(scheduler)
    assert first.num_scheduled_tokens == {"r0": 256, "r1": 256}
    second = run_step(scheduler)
    assert second.num_scheduled_tokens == {"r0": 256, "r1": 256}
    # r0 and r1 finish their prompts (88 tokens each); the freed budget is still shared by two.
    third = run_step(scheduler)
    assert third.num_scheduled_tokens == {"r0": 88, "r1": 88}
    # Only then do r2 and r3 start, next to r0's and r1's decodes.
    fourth = run_step(scheduler)
    assert fourth.num_scheduled_tokens["r0"] == fourth.num_scheduled_tokens["r1"] == 1
    assert set(fourth.num_scheduled_tokens) == {"r0", "r1", "r2", "r3"}


def test_engine_args_accept_concurrent_partial_prefills():
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model="facebook/opt-125m", max_num_partial_prefills=4,
                      max_long_partial_prefills=2)
    args._check_feature_supported()
