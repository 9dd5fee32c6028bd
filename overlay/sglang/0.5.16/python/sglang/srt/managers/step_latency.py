"""prefill-accel adapter: ``--max-step-latency-ms`` for SGLang's prefill-first scheduler.

Placed by the prefill-accel overlay. With the target, a prefill batch is sized so that its predicted wall
time stays within it while someone waits for the batch: requests decoding (SGLang runs the prefill batch
instead of their decode step; with --enable-mixed-chunk it carries them, and their time comes off the
target), or, under --schedule-policy srpf, a request waiting beside a chunked one (it joins the chunk's
batch whole and gets its first token only when the batch ends). Each request of the batch is charged its
own cost, its tokens and their attention over its own context; the chunked request's next chunk (or the
new request that gets chunked) is cut to the time left, and one whose context read alone does not fit
waits outside the batch while decodes run. A request that srpf puts ahead of the chunked request cannot
be chunked beside it (SGLang holds one chunked request): the batch's first goes whole even where the
target would cut it, rather than wait for the chunked request's last chunk. With nobody waiting a chunk
is chunked_prefill_size, as upstream's.

The decisions, the step-time model (fitted online to the batches this scheduler runs) and its exceptions
(a probe before any prefill batch is timed, the floor when the target is below a batch's fixed cost, a
chunk refused for STARVATION_STEPS rounds goes through whole) are the runtime step planner's
(``prefill_accel.engine.planner.StepPlanner``), the one the vLLM targets use; this module turns SGLang's
requests and batches into its views and applies its answers to the PrefillAdder, and nothing here calls
the scheduler. Without the flag every method passes straight to the adder: the scheduler is upstream's.

A batch is timed from the scheduling round that formed it to the processing of its result, started no
earlier than the previous result: with the overlap scheduler a batch's result is processed one round
later, once the GPU has finished it, so consecutive results are a batch's running time apart. SGLang
processes every batch's result once and in the order the batches ran, and the copy of a batch its result
queue keeps carries nothing of ours, so the oldest batch in flight is the one whose result came.
"""

import time
from collections import deque
from typing import Callable, List, Optional

from prefill_accel.engine.planner import MAX_IN_FLIGHT_STEPS, PlannerOptions, Scheduled, StepPlanner
from prefill_accel.scheduling.prefills import Chunk
from prefill_accel.scheduling.step_budget import TARGET_FLAG, check_target

from sglang.srt.managers.srpf_order import remaining_prefill_tokens


def check_step_latency_flags(server_args) -> None:
    """Refuse a --max-step-latency-ms that is not a positive time, or that is set with a setting under
    which the scheduler cannot time its batches one after another (ServerArgs, before anything
    model-dependent)."""
    target = server_args.max_step_latency_ms
    check_target(target)
    if target is None:
        return
    conflicts = [
        (server_args.pp_size > 1, f"--pp-size {server_args.pp_size}",
         "pipeline parallelism runs several micro-batches at once, so a batch's wall time is not its own"),
        (server_args.enable_dynamic_chunking, "--enable-dynamic-chunking",
         "SGLang's dynamic chunking sizes the chunks itself"),
        (server_args.disaggregation_mode != "null", f"--disaggregation-mode {server_args.disaggregation_mode}",
         "a disaggregated server runs its own event loop, with prefills or decodes alone"),
        (server_args.enable_pdmux, "--enable-pdmux",
         "PD multiplexing runs prefill and decode batches at once, on split streams"),
        (server_args.dllm_algorithm is not None, f"--dllm-algorithm {server_args.dllm_algorithm}",
         "diffusion LLM batches are formed apart from the prefill batches it sizes"),
        (server_args.chunked_prefill_size is not None and server_args.chunked_prefill_size <= 0,
         f"--chunked-prefill-size {server_args.chunked_prefill_size}", "it sizes prefill chunks"),
    ]  # fmt: skip
    for applies, setting, reason in conflicts:
        if applies:
            raise ValueError(f"{TARGET_FLAG} cannot apply with {setting}: {reason}; unset one of the two")


def in_batch_chunk(req) -> Chunk:
    """A request being added to a batch (its prefix matched): what it has left and the context before it."""
    prefix = len(req.prefix_indices)
    return Chunk(remaining=len(req.full_untruncated_fill_ids) - prefix, context=prefix)


def waiting_chunk(req) -> Chunk:
    return Chunk(remaining=remaining_prefill_tokens(req), context=req.num_matched_prefix_tokens)


def decoding(req) -> Scheduled:
    return Scheduled(req.seqlen - 1, 1, prefill=False)


def scheduled(batch) -> List[Scheduled]:
    """What a batch runs: one token per decoding request, each extend's range after its prefix (in a
    mixed batch the decoding requests' one token each)."""
    if batch.forward_mode.is_decode():
        return [decoding(req) for req in batch.reqs]
    if batch.forward_mode.is_extend():
        decodes = {id(req) for req in batch.decoding_reqs or ()}
        return [Scheduled(req.extend_range.start, req.extend_range.length, prefill=id(req) not in decodes)
                for req in batch.reqs]  # fmt: skip
    return []


class StepLatency:
    """The scheduler's one object of step-latency planning: `begin_step` once per round of
    get_next_batch_to_run, `add_one_req` and `add_chunked_req` in place of the PrefillAdder's,
    `held_back` for a chunk left out of the batch, `end_step` with the batch the round chose and
    `observe_output` when a batch's result has been processed."""

    def __init__(self, target_ms: Optional[float], chunked_prefill_size: Optional[int], page_size: int,
                 context_len: int, mixed_chunk: bool, srpf: bool,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.page_size = page_size
        self.chunk_size = chunked_prefill_size
        self.planner: Optional[StepPlanner] = None
        self._held = None
        self._chunk_pending = False
        self._in_flight: deque = deque(maxlen=MAX_IN_FLIGHT_STEPS)
        if target_ms is None:
            return
        if chunked_prefill_size is None:
            raise ValueError(
                f"{TARGET_FLAG} sizes prefill chunks, but the scheduler runs without chunked prefill (it is "
                "off for this model or backend); unset it or serve a model that SGLang chunks"
            )
        self.planner = StepPlanner(
            1, 1, 0, target_ms, chunked_prefill_size, context_len, min_prefill_tokens=page_size,
            options=PlannerOptions(bound_tokens=False, refuse_chunks=True, decodes_in_step=mixed_chunk,
                                   time_for_waiting=srpf),
            clock=clock,
        )  # fmt: skip

    @property
    def timed(self) -> bool:
        return self.planner is not None and self.planner.timed

    def begin_step(self, running_batch, chunked_req, waiting_queue: List) -> None:
        """A scheduling round: the running batch's decodes, the chunked request (its last chunk cached)
        and the waiting queue."""
        if self.planner is None:
            return
        self._held = None
        self._chunk_pending = chunked_req is not None
        decoding_reqs = [] if running_batch.is_empty() or running_batch.is_prefill_only else running_batch.reqs
        prefilling = [] if chunked_req is None else [in_batch_chunk(chunked_req)]
        self.planner.begin_step(map(decoding, decoding_reqs), prefilling, map(waiting_chunk, waiting_queue),
                                self.chunk_size)  # fmt: skip

    def add_one_req(self, adder, req, has_chunked_req: bool, truncation_align_size: Optional[int],
                    ahead_of_chunk: bool = False):  # fmt: skip
        """``adder.add_one_req``, the request cut to the time the batch has left. While a chunked request
        is unfinished SGLang holds no second one, so a request the target would cut cannot be chunked: one
        that srpf puts ahead of the chunk (``ahead_of_chunk``) goes whole or waits as the planner's
        `cap_whole` says, any other waits."""
        if not self.timed:
            return adder.add_one_req(req, has_chunked_req=has_chunked_req, truncation_align_size=truncation_align_size)
        from sglang.srt.managers.schedule_policy import AddReqResult  # it imports srpf_order, as we do

        view = in_batch_chunk(req)
        asked = min(view.remaining, adder.rem_chunk_tokens)
        if asked > 0:
            if self._chunk_pending and ahead_of_chunk and asked == view.remaining:
                allowed = self.planner.cap_whole(view, asked)
            else:
                allowed = self.planner.cap(view, asked)
            if allowed <= 0 or (allowed < view.remaining and self._chunk_pending):
                return AddReqResult.OTHER
            if allowed < asked:
                adder.rem_chunk_tokens = allowed
        result = adder.add_one_req(req, has_chunked_req=has_chunked_req, truncation_align_size=truncation_align_size)
        if adder.can_run_list and adder.can_run_list[-1] is req:
            self.planner.consume(view, req.extend_range.length, admitted=True)
            self._chunk_pending = self._chunk_pending or adder.new_chunked_req is req
        return result

    def add_chunked_req(self, adder, req):
        """``adder.add_chunked_req``, the next chunk cut to the time the batch has left (whole pages);
        a chunk that gets nothing is held back: it stays the chunked request, out of this batch."""
        if not self.timed:
            return adder.add_chunked_req(req)
        view = in_batch_chunk(req)
        asked = min(view.remaining, adder.rem_chunk_tokens)
        if asked > 0:
            allowed = self.planner.cap(view, asked)
            if allowed < asked:
                allowed -= allowed % self.page_size
                if allowed <= 0:
                    self._held = req
                    return req
                adder.rem_chunk_tokens = allowed
        unfinished = adder.add_chunked_req(req)
        if adder.can_run_list and adder.can_run_list[-1] is req:
            self.planner.consume(view, req.extend_range.length, admitted=False)
            self._chunk_pending = unfinished is not None
        return unfinished

    def held_back(self, req) -> bool:
        """Whether this round left the chunked request out of its batch."""
        return req is self._held

    def end_step(self, batch) -> None:
        """The batch the round chose, about to run."""
        if self.planner is None:
            return
        step = object()
        self._in_flight.append(step)
        self.planner.end_step(step, scheduled(batch))

    def observe_output(self) -> None:
        """The result of the oldest batch in flight has been processed."""
        if self.planner is not None and self._in_flight:
            self.planner.observe(self._in_flight.popleft())
