"""Helpers for prefill-accel's scheduler tests: a real V1 Scheduler with our options, driven step by step.

The scheduler is built by upstream's tests/v1/core/utils.create_scheduler (model config, KV cache,
structured output manager); only its SchedulerConfig is replaced, so options that exist only in
the patched tree reach a real Scheduler through SchedulerConfig's own validation.
"""

from collections.abc import Callable

from tests.v1.core.utils import create_requests, create_scheduler
from vllm.config import SchedulerConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

BLOCK_SIZE = 16


def make_scheduler(
    max_num_batched_tokens: int, max_num_seqs: int = 16, **scheduler_options
) -> Scheduler:
    """A Scheduler (facebook/opt-125m, max_model_len 2048) with SchedulerConfig(**scheduler_options)."""
    base = create_scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BLOCK_SIZE,
    )
    vllm_config = base.vllm_config
    vllm_config.scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=vllm_config.model_config.max_model_len,
        is_encoder_decoder=False,
        watermark=0.0,
        **scheduler_options,
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=base.kv_cache_config,
        structured_output_manager=base.structured_output_manager,
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def make_request(
    name: str, num_tokens: int, max_tokens: int = 64, priority: int = 0,
    arrival_time: float | None = None,
) -> Request:
    """One request of num_tokens prompt tokens that decodes max_tokens tokens (EOS ignored)."""
    (request,) = create_requests(
        1, num_tokens=num_tokens, max_tokens=max_tokens, ignore_eos=True,
        block_size=BLOCK_SIZE, req_ids=[name],
    )
    request.priority = priority
    if arrival_time is not None:
        request.arrival_time = arrival_time
    return request


def run_step(
    scheduler: Scheduler, during_step: Callable[[SchedulerOutput], None] | None = None
) -> SchedulerOutput:
    """schedule(), then (after during_step, e.g. advancing a fake clock) feed back a model output
    that samples one token for every request whose prefill is complete."""
    output = scheduler.schedule()
    if during_step is not None:
        during_step(output)
    req_ids = list(output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].is_prefill_chunk else [1000] for r in req_ids]
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        ),
    )
    return output
