"""prefill-accel: --max-step-latency-ms on SGLang's scheduler.

The scheduler's own code forms every batch: get_next_batch_to_run, get_new_batch_prefill and the real
PrefillAdder over real Req objects, SchedulePolicy and a simulated radix cache, init_schedule_policy
builds the planner and process_batch_result reports each result. What needs a model, its pools or a GPU
(building the batch's tensors, running it, caching a chunk, the result processor) is stood in for, and a
batch "runs" on a fake clock advanced by a cost model, which the planner's model was first fitted to.
On an unpatched SGLang these fail: the flag does not parse and the scheduler has no step_latency.
"""

from types import SimpleNamespace

import pytest
import torch
from prefill_accel.scheduling.step_time import attention_pairs
from test_scheduler_policies import NOW, make_req, server_args

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers import srpf_order
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.step_latency import StepLatency
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import set_global_server_args_for_scheduler

CHUNK = 8192
TARGET_MS = 20.0


class Costs:
    """Batch wall times: a decode batch 2 ms + 0.1 ms per request; a prefill batch 3 ms + ``per_token``
    per new token + ``per_key`` per token of context each request's extend reads; a mixed batch its
    prefill batch + 0.1 ms per decoding request it carries."""

    def __init__(self, per_token: float = 4e-6, per_key: float = 2e-7) -> None:
        self.per_token, self.per_key = per_token, per_key

    def decode(self, requests: int) -> float:
        return 2e-3 + 1e-4 * requests

    def prefill(self, extends: list[tuple[int, int]]) -> float:
        """``extends``: (context, tokens) of each request."""
        return 3e-3 + sum(self.per_token * tokens + self.per_key * context for context, tokens in extends)

    def mixed(self, extends: list[tuple[int, int]], decodes: int) -> float:
        return self.prefill(extends) + 1e-4 * decodes

    def teach(self, model) -> None:
        """Fit the planner's model as the scheduler would, on batches of these costs: decodes of 1-8
        requests at various contexts, prefill batches of fresh prompts and of later chunks of long ones."""
        for step in range(64):
            n, context = 1 + step % 8, 300 + 700 * (step % 5)
            model.observe(self.decode(n), decode_tokens=n, decode_pairs=n * (context + 1))
            tokens, context = 256 * (1 + step % 32), 4096 * (step % 11)
            model.observe(self.prefill([(context, tokens)]), prefill_tokens=tokens,
                          prefill_pairs=attention_pairs(context, tokens), prefill_keys=context)  # fmt: skip


@pytest.fixture
def stand_in_batches(monkeypatch):
    """ScheduleBatch.init_new and prepare_for_extend build a batch's tensors from the pools: here the
    batch is its requests."""
    monkeypatch.setattr(srpf_order, "clock", lambda: NOW)
    monkeypatch.setattr(ScheduleBatch, "init_new", staticmethod(
        lambda reqs, *args, **kwargs: ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND)))
    monkeypatch.setattr(ScheduleBatch, "prepare_for_extend", lambda batch: None)
    monkeypatch.setattr(ScheduleBatch, "prepare_for_decode", lambda batch: None)
    monkeypatch.setattr(ScheduleBatch, "filter_batch", lambda batch: None)
    monkeypatch.setattr(ScheduleBatch, "mix_with_running", mix_with_running)


def mix_with_running(batch, running_batch):
    """ScheduleBatch.mix_with_running on the requests alone (--enable-mixed-chunk): each decoding request
    extends by its next token after what it holds, and joins the prefill batch."""
    batch.forward_mode = ForwardMode.MIXED
    for req in running_batch.reqs:
        req._refresh_fill_ids()
        held = len(req.full_untruncated_fill_ids)
        req.set_extend_range(held - 1, held)
    batch.reqs = batch.reqs + running_batch.reqs


class Harness:
    """A scheduler made of Scheduler's own batch-forming and result-reporting methods, on stand-ins
    for what needs a model; `round` runs one event-loop iteration (the normal loop)."""

    get_next_batch_to_run = Scheduler.get_next_batch_to_run
    get_new_batch_prefill = Scheduler.get_new_batch_prefill
    _get_new_batch_prefill_raw = Scheduler._get_new_batch_prefill_raw
    init_schedule_policy = Scheduler.init_schedule_policy
    process_batch_result = Scheduler.process_batch_result

    def __init__(self, costs: Costs, *flags: str) -> None:
        self.server_args = server_args("--chunked-prefill-size", str(CHUNK), *flags)
        set_global_server_args_for_scheduler(self.server_args)
        self.costs, self.now = costs, 1000.0
        self.tree_cache = RadixCache.create_simulated()
        self.schedule_policy = self.server_args.schedule_policy
        self.enable_hierarchical_cache = self.enable_priority_scheduling = False
        self.schedule_low_priority_values_first = False
        self.chunked_prefill_size, self.page_size = CHUNK, 1
        self.is_mixed_chunk = self.server_args.enable_mixed_chunk
        self.model_config = SimpleNamespace(context_len=131072)
        self.init_schedule_policy()
        if self.step_latency.planner is not None:
            self.step_latency.planner.clock = lambda: self.now
            costs.teach(self.step_latency.planner.time.model)
        self.waiting_queue, self.chunked_req, self.running = [], None, ScheduleBatch(reqs=[])
        self.token_to_kv_pool_allocator = SimpleNamespace(available_size=lambda: 1 << 20)
        self.req_to_token_pool = SimpleNamespace()
        self.max_prefill_tokens, self.max_running_requests = 16384, 64
        self.truncation_align_size = self.dllm_config = self.min_free_slots_delayer = None
        self.enable_lora = self.enable_hicache_storage = self.enable_hisparse = self.enable_fpm = False
        self.is_hybrid_swa = self.require_mlp_sync = self.enable_overlap = self.enable_dynamic_chunking = False
        self.disaggregation_mode = DisaggregationMode.NULL
        self.priority_scheduling_preemption_threshold = 0
        self.grammar_manager = SimpleNamespace(has_waiting_grammars=lambda: False)
        self.load_inquirer = SimpleNamespace(_get_num_pending_tokens=lambda chunk_deduct: 0)
        self.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(prefill_aware_swa=False))
        self.dp_attn_adapter = SimpleNamespace(maybe_prepare_mlp_sync_batch=lambda batch, need_sync=False: batch)
        self.ngram_embedding_manager = SimpleNamespace(prepare_for_forward=lambda batch, chunked_req: batch)
        self.batch_result_processor = SimpleNamespace(process_batch_result_prefill=self.prefilled,
                                                      process_batch_result_decode=self.decoded)  # fmt: skip
        self.metrics_reporter = SimpleNamespace(log_batch_result_stats=lambda batch, result: None,
                                                update_device_timer=lambda: None)  # fmt: skip
        self.spec_algorithm = None

    def get_num_allocatable_reqs(self, running_bs):
        return self.max_running_requests - running_bs

    def stash_chunked_request(self, req):  # the chunk's KV is cached: it is prefix from now on
        req.prefix_indices = torch.arange(req.extend_range.end)

    def update_running_batch(self, batch):
        batch.forward_mode = ForwardMode.DECODE
        return batch

    def prefilled(self, batch, result):
        """As SGLang's result processor: a middle chunk is accounted, a finished prefill samples its
        first token and (if it has more to generate) decodes from the next round."""
        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(0)
            if len(req.output_ids) < req.sampling_params.max_new_tokens:
                self.running.reqs.append(req)

    def decoded(self, batch, result):
        for req in batch.reqs:
            req.output_ids.append(1)
        batch.reqs = [req for req in batch.reqs if len(req.output_ids) < req.sampling_params.max_new_tokens]

    def _nothing(self, *args, **kwargs):
        """What the scheduler does around batch forming that these tests leave out (aborts, health, load)."""

    process_pending_chunked_abort = publish_load_snapshot = maybe_send_health_check_signal = _nothing
    _abort_on_waiting_timeout = _abort_on_running_timeout = _maybe_clear_mm_inputs = _nothing

    def arrive(self, rid: str, tokens: int, max_new_tokens: int = 1):
        req = make_req(rid, tokens, NOW)
        req.sampling_params.max_new_tokens = max_new_tokens
        self.waiting_queue.append(req)
        return req

    def decoding(self, rid: str, tokens: int, max_new_tokens: int):
        """A request past its prefill, in the running batch."""
        req = make_req(rid, tokens, NOW - 5)
        req.sampling_params.max_new_tokens = max_new_tokens
        req.output_ids.append(0)
        self.running.reqs.append(req)

    def round(self):
        """One scheduling round: the batch chosen, run on the fake clock, its result processed. Returns
        the batch's requests with their new tokens ("DECODE" for a decode batch) and its seconds."""
        plan = self.get_next_batch_to_run(self.running, last_batch=None)
        self.running, batch = plan.running_batch, plan.batch_to_run
        if batch is None:
            return None, 0.0
        if batch.forward_mode.is_decode():
            ran, seconds = "DECODE", self.costs.decode(len(batch.reqs))
        else:
            ran = {req.rid: req.extend_range.length for req in batch.reqs}
            decoding = batch.decoding_reqs or []
            extends = [(req.extend_range.start, req.extend_range.length) for req in batch.reqs if req not in decoding]
            seconds = self.costs.mixed(extends, len(decoding))
        self.now += seconds
        self.process_batch_result(batch, None)
        return ran, seconds

    def prefill_document(self, max_rounds: int = 64):
        """Rounds until the request "doc" has its first token: the document's chunk in each prefill batch."""
        chunks = []
        for _ in range(max_rounds):
            ran, seconds = self.round()
            if isinstance(ran, dict) and "doc" in ran:
                chunks.append((ran["doc"], seconds))
            if self.doc.output_ids:
                return chunks
        raise AssertionError(f"the document did not finish in {max_rounds} rounds: {chunks}")


def largest_chunk(costs: Costs, context: int, seconds: float) -> int:
    """The chunk of a prefill batch of the document alone (after `context`) that takes `seconds`."""
    return int((seconds - costs.prefill([(context, 0)])) / costs.per_token)


def test_a_documents_chunk_is_cut_to_the_target_while_a_request_decodes(stand_in_batches):
    """A request decodes while a 30000-token document prefills: SGLang runs each prefill batch instead of
    its decode step, so under the target every batch is cut to the largest chunk that fits 20 ms (within a
    percent of the cost model's own answer, the fit's error). Without the flag, upstream's chunks of 8192
    take 36-39 ms each."""
    costs = Costs()
    pa = Harness(costs, "--max-step-latency-ms", str(TARGET_MS))
    pa.decoding("chat", 300, max_new_tokens=40)
    pa.doc = pa.arrive("doc", 30000)
    chunks = pa.prefill_document()
    done = 0
    for tokens, seconds in chunks[:-1]:
        assert tokens == pytest.approx(largest_chunk(costs, done, TARGET_MS / 1e3), rel=0.01)
        assert seconds == pytest.approx(TARGET_MS / 1e3, rel=0.01)
        done += tokens
    assert done + chunks[-1][0] == 30000

    upstream = Harness(costs)
    upstream.decoding("chat", 300, max_new_tokens=40)
    upstream.doc = upstream.arrive("doc", 30000)
    assert [tokens for tokens, _ in upstream.prefill_document()] == [CHUNK] * 3 + [30000 - 3 * CHUNK]


def test_with_mixed_chunks_the_batch_carrying_the_decodes_is_cut_to_the_target(stand_in_batches):
    """--enable-mixed-chunk: 16 decoding requests ride in every prefill batch, so their inter-token
    latency is the batch's time. Under the target the decodes' predicted 1.6 ms comes off the batch's 20 ms
    and the chunk gets the rest: every batch but the document's last takes 20 ms (within a percent, the
    fit's error; timing the chunk alone would give 21.6), every request gets a token in each, and the
    chunks shrink as the document's context grows. Upstream's mixed batches carry chunks of 8192 less the
    decodes' tokens and take 37-41 ms each."""
    costs = Costs()
    for flags, document_chunks in (
        (["--enable-mixed-chunk", "--max-step-latency-ms", str(TARGET_MS)], None),
        (["--enable-mixed-chunk"], [CHUNK - 16] * 3 + [30000 - 3 * (CHUNK - 16)]),
    ):
        scheduler = Harness(costs, *flags)
        for i in range(16):
            scheduler.decoding(f"chat{i}", 300 + 10 * i, max_new_tokens=64)
        chats = list(scheduler.running.reqs)
        scheduler.doc = scheduler.arrive("doc", 30000)
        rounds = []
        while not scheduler.doc.output_ids and len(rounds) < 64:
            tokens = [len(chat.output_ids) for chat in chats]
            ran, seconds = scheduler.round()
            rounds.append((ran["doc"], seconds))
            assert [len(chat.output_ids) for chat in chats] == [n + 1 for n in tokens], (flags, ran)
        chunks = [tokens for tokens, _ in rounds]
        assert sum(chunks) == 30000, (flags, rounds)
        if document_chunks is not None:
            assert chunks == document_chunks and all(0.036 < seconds < 0.041 for _, seconds in rounds[:-1]), rounds
            continue
        assert all(seconds == pytest.approx(TARGET_MS / 1e3, rel=0.01) for _, seconds in rounds[:-1]), rounds
        assert rounds[-1][1] <= TARGET_MS / 1e3 * 1.01
        assert chunks[:-1] == sorted(chunks[:-1], reverse=True) and chunks[0] < CHUNK // 2, rounds


def test_with_mixed_chunks_a_chat_is_not_held_back_by_a_target_below_a_prefills_fixed_cost(stand_in_batches):
    """Run 4 (H100, 2026-12-06): under --enable-mixed-chunk and a 10.3 ms target, the fitted cost of carrying
    a prefill exceeded what the decodes left, and chats that arrived while others decoded waited for those
    decodes to end (only 13 of 145 chats prefilled beside a decode, against 42 upstream). Here a prefill
    batch costs 1 ms more than a decode batch, and a 2.8 ms target leaves 0.7 ms beside one decode: the
    chat still starts in the next batch, its chunk given that 1 ms (about 250 tokens), the decode riding in
    every batch, and has its first token within three; on the old rule it waited for the decode's 20
    tokens."""
    scheduler = Harness(Costs(), "--enable-mixed-chunk", "--max-step-latency-ms", "2.8")
    scheduler.decoding("reply", 300, max_new_tokens=20)
    reply = scheduler.running.reqs[0]
    chat = scheduler.arrive("chat", 500, max_new_tokens=4)
    rounds = []
    while not chat.output_ids and len(rounds) < 6:
        tokens = len(reply.output_ids)
        ran, _ = scheduler.round()
        rounds.append(ran)
        assert len(reply.output_ids) == tokens + 1, rounds
    assert all(isinstance(ran, dict) and ran["reply"] == 1 for ran in rounds), rounds
    assert 200 < rounds[0]["chat"] < 300 and len(rounds) <= 3 and chat.output_ids, rounds


def test_with_nobody_waiting_the_chunk_is_the_chunked_prefill_size(stand_in_batches):
    """Nothing decodes and nothing else waits: nobody's latency is at stake, the document gets whole
    chunks of --chunked-prefill-size, as upstream's (the vLLM targets time only steps others wait for)."""
    pa = Harness(Costs(), "--max-step-latency-ms", str(TARGET_MS))
    pa.doc = pa.arrive("doc", 30000)
    assert [tokens for tokens, _ in pa.prefill_document()] == [CHUNK] * 3 + [30000 - 3 * CHUNK]


def test_under_srpf_a_chat_beside_the_chunk_gets_its_first_token_within_the_target(stand_in_batches):
    """A chat arrives while the document prefills and nothing decodes. Under srpf it joins the next
    batch whole, before the document's chunk (srpf_order); with the target the batch is timed for it:
    the chat is charged its own cost and the chunk cut to the rest, so the chat's first token comes
    within 20 ms, not after a 37 ms batch of 500 + 7692 tokens. Under fcfs the chat waits behind the
    document's chunks whatever their size, so nothing is cut for it."""
    costs = Costs()
    for flags, document_chunks in (
        (["--schedule-policy", "srpf", "--max-step-latency-ms", str(TARGET_MS)], None),
        (["--schedule-policy", "srpf"], [CHUNK, CHUNK - 500]),
        (["--schedule-policy", "fcfs", "--max-step-latency-ms", str(TARGET_MS)], [CHUNK, CHUNK]),
    ):
        scheduler = Harness(costs, *flags)
        scheduler.doc = scheduler.arrive("doc", 30000)
        first, _ = scheduler.round()
        chat = scheduler.arrive("chat", 500, max_new_tokens=8)
        second, seconds = scheduler.round()
        if document_chunks is not None:
            assert [first["doc"], second["doc"]] == document_chunks, flags
            continue
        assert first == {"doc": CHUNK}
        left = TARGET_MS / 1e3 - costs.prefill([(0, 500)]) + costs.prefill([])
        assert second["chat"] == 500 and chat.output_ids
        assert second["doc"] == pytest.approx(largest_chunk(costs, CHUNK, left), rel=0.01)
        assert seconds == pytest.approx(TARGET_MS / 1e3, rel=0.01)


def test_a_chunk_whose_context_read_does_not_fit_waits_outside_the_batch(stand_in_batches):
    """Reading 36864 tokens of context costs 18.4 ms here, more than a 20 ms batch leaves any chunk: while
    a request decodes, the document's next chunk waits outside the batch (a chat that arrives goes without
    it), the decodes run, and once nobody waits the document continues with whole chunks and finishes
    (its middle-chunk count untouched while it waited: it gets its first token)."""
    costs = Costs(per_key=5e-7)
    pa = Harness(costs, "--schedule-policy", "srpf", "--max-step-latency-ms", str(TARGET_MS))
    pa.decoding("chat", 300, max_new_tokens=4)
    pa.doc = make_req("doc", 36864 + 10000, NOW - 10)
    pa.doc.init_next_round_input(pa.tree_cache)
    pa.doc.prefix_indices = torch.arange(36864)
    pa.doc.set_extend_range(36864, 36864)
    pa.chunked_req = pa.doc
    pa.arrive("late", 200, max_new_tokens=2)
    rounds = [pa.round()[0] for _ in range(6)]
    assert rounds[0] == {"late": 200}
    assert rounds[1:4] == ["DECODE"] * 3  # the chat's last 3 tokens, the late chat's one
    assert rounds[4] == {"doc": CHUNK} and rounds[5] == {"doc": 10000 - CHUNK}
    assert pa.doc.output_ids and pa.doc.inflight_middle_chunks == 0


def test_under_srpf_chats_ahead_of_a_held_document_go_whole_rather_than_wait(stand_in_batches):
    """Run 6 (H100, 2026-12-07): with mixed chunks, srpf and a 4.4 ms target, three chats that arrived during a
    98K-token document waited 237-430 ms. SGLang holds one chunked request at a time and the document held
    it, so a chat the target would cut could not be chunked: the planner refused it, the document's chunk
    (its context read too costly beside the decodes) took nothing or a few tokens, and each chat started
    only once the one before it had stopped decoding. Here the document holds the chunked slot at 49152
    tokens of context (a 9.8 ms read, over any batch's time), a reply decodes and two 600-token chats
    wait, each cut to about 250 tokens by a 4 ms target beside one decode: each batch now takes the first
    chat waiting whole beside the decodes (over the target by that chat's prefill), so both have their
    first token within two batches, the decodes riding in each; the document waits while they decode and
    then finishes with whole chunks."""
    scheduler = Harness(Costs(), "--enable-mixed-chunk", "--schedule-policy", "srpf", "--max-step-latency-ms", "4")
    scheduler.decoding("reply", 300, max_new_tokens=12)
    reply = scheduler.running.reqs[0]
    doc = scheduler.doc = make_req("doc", 98304, NOW - 10)
    doc.init_next_round_input(scheduler.tree_cache)
    doc.prefix_indices = torch.arange(49152)
    doc.set_extend_range(49152, 49152)
    scheduler.chunked_req = doc
    chats = [scheduler.arrive("chat0", 600, max_new_tokens=4), scheduler.arrive("chat1", 600, max_new_tokens=4)]
    rounds = [scheduler.round() for _ in range(2)]
    assert [ran for ran, _ in rounds] == [{"chat0": 600, "reply": 1}, {"chat1": 600, "reply": 1, "chat0": 1}], rounds
    assert all(chat.output_ids for chat in chats) and len(reply.output_ids) == 3
    assert all(seconds == pytest.approx(Costs().mixed([(0, 600)], decodes), rel=1e-6)
               for (_, seconds), decodes in zip(rounds, (1, 2)))  # fmt: skip
    chunks = scheduler.prefill_document()
    assert [tokens for tokens, _ in chunks] == [CHUNK] * 6 and doc.inflight_middle_chunks == 0


def test_the_target_is_refused_where_it_cannot_apply():
    assert server_args("--max-step-latency-ms", "25").max_step_latency_ms == 25.0
    assert server_args().max_step_latency_ms is None
    for flags, message in (
        (["--max-step-latency-ms", "0"], "--max-step-latency-ms must be a positive number of milliseconds"),
        (["--max-step-latency-ms", "25", "--pp-size", "2"], "cannot apply with --pp-size 2"),
        (["--max-step-latency-ms", "25", "--enable-dynamic-chunking"], "cannot apply with --enable-dynamic-chunking"),
        (["--max-step-latency-ms", "25", "--chunked-prefill-size", "-1"], "with --chunked-prefill-size -1"),
        (["--max-step-latency-ms", "25", "--disaggregation-mode", "prefill"], "--disaggregation-mode prefill"),
    ):
        with pytest.raises(ValueError, match=message):
            server_args(*flags)
    with pytest.raises(ValueError, match="runs without chunked prefill"):
        StepLatency(25.0, None, 1, 131072, mixed_chunk=False, srpf=False)
