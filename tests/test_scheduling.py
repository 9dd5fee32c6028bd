"""prefill_accel.scheduling: the engine-agnostic parts of the scheduler policies (pure Python)."""

import pytest

from prefill_accel.scheduling.prefills import Chunk, PartialPrefills, aged_remaining, water_level, whole_beside
from prefill_accel.scheduling.step_budget import FIXED_FLOOR_STEPS, STARVATION_STEPS, PrefillTime, check_target
from prefill_accel.scheduling.step_time import StepTimeModel, attention_pairs

MAX_MODEL_LEN = 131072
# A step as measured on the H200 (SmolLM2 under vLLM serve): ~2 ms of fixed cost and decodes, ~1.5 ms
# more when it carries a prefill chunk, and a prefill chunk that reads its whole context at ~0.16 us
# per key however few queries it holds.
C0, C1, C2, C3, P0 = 2e-3, 2e-6, 1e-11, 1.6e-7, 1.5e-3


def step_seconds(decodes: int, chunk: int = 0, context: int = 0) -> float:
    pairs = decodes * 600 + attention_pairs(context, chunk)
    return C0 + C1 * (decodes + chunk) + C2 * pairs + (P0 + C3 * context if chunk else 0.0)


def observe(model: StepTimeModel, decodes: int, chunk: int = 0, context: int = 0, factor: float = 1.0) -> None:
    """Feed the model one step of `decodes` decodes (600 keys each) and a prefill chunk after `context`
    tokens, timed at `factor` times its cost."""
    model.observe(step_seconds(decodes, chunk, context) * factor, decode_tokens=decodes, decode_pairs=decodes * 600,
                  prefill_tokens=chunk, prefill_pairs=attention_pairs(context, chunk),
                  prefill_keys=context if chunk else 0)  # fmt: skip


def fitted_budget(target_ms: float) -> PrefillTime:
    """A step-time budget whose model has seen decode steps and small and large chunks of a long prompt."""
    budget = PrefillTime(target_ms, token_scale=8192, max_model_len=MAX_MODEL_LEN, min_prefill_tokens=16)
    for step in range(400):
        decodes, chunk, context = 1 + step % 5, [0, 96, 0, 300, 0, 8192][step % 6], (512 * step) % 98304
        observe(budget.model, decodes, chunk, context)
    return budget


def test_water_level_shares_tokens_and_seconds_max_min_fairly():
    assert water_level([100, 5000, 5000], 2100) == 1000  # the short one whole, the rest split
    assert water_level([100, 200], 1000) == 1000  # enough for everyone: nobody is capped
    assert water_level([0.0, 0.0], 0.002) == 0.002  # predicted free: still nobody is capped
    assert water_level([], 512) == 512
    level = water_level([0.001, 0.050, 0.020], 0.012)
    assert level == pytest.approx(0.0055)
    assert sum(min(d, level) for d in [0.001, 0.050, 0.020]) == pytest.approx(0.012)


def test_whole_prefills_beside_a_partial_one_take_their_fair_share_uncut():
    """Waiting prefills go whole, in order, while the partial prefill keeps at least the largest of them
    (its max-min share), or all it has left when that is less."""
    assert whole_beside(100000, [100, 300], 1024) == 2  # the document keeps 624 >= 300
    assert whole_beside(100000, [500] * 20, 8192) == 15  # 16 would leave it 192 < 500
    assert whole_beside(100000, [900, 100], 1024) == 0  # 124 < 900: order holds, nobody jumps the queue
    assert whole_beside(50, [600], 1024) == 1  # it needs only 50 of the 424 left
    assert whole_beside(50, [1000], 1024) == 0  # 24 is not all it needs
    assert whole_beside(100000, [1023], 1024) == 0 and whole_beside(0, [1023], 1024) == 1  # at least a token
    assert whole_beside(100000, [], 1024) == 0
    # It is the water level with nobody cut: the partial prefill's share is at least every admitted demand.
    demands = [64, 200, 200, 350, 700, 1200]
    taken = whole_beside(10**6, demands, 2048)
    assert taken == 4 and water_level([10**6, *demands[:taken]], 2048) >= max(demands[:taken])


def test_partial_prefills_admit_share_and_keep_long_slots():
    # Two slots, one of them for a long request; prefills by their remaining tokens.
    limits = PartialPrefills(max_partial=2, max_long=1, long_threshold=1000)
    level, seconds = limits.shares(prefilling=[Chunk(5000)], waiting=[Chunk(8000), Chunk(300), Chunk(200)], tokens=2048)
    # Expected: the running 5000 (asks for 1000, the threshold) and the 300 (the 8000 finds the long
    # slot taken and is passed over): 1000 + 300 fit in 2048, so nobody is capped.
    assert (level, seconds) == (2048, None)
    assert limits.admission(Chunk(8000)) == PartialPrefills.SKIP
    assert limits.admission(Chunk(300)) == PartialPrefills.ADMIT
    limits.admitted(Chunk(300))
    assert limits.admission(Chunk(200)) == PartialPrefills.STOP
    level, seconds = limits.shares([Chunk(5000)], [Chunk(300)], tokens=512, chunk_seconds=lambda c, n: n * 1e-5,
                                   seconds=0.004)  # fmt: skip
    assert level == 256 and seconds == pytest.approx(0.002)
    assert PartialPrefills(1, 1, 0).admission(Chunk(8000)) == PartialPrefills.ADMIT  # limits off


def test_a_model_that_prices_prefill_at_nothing_does_not_refuse_it():
    """Seen in simulation with noisy step times: a fit that priced prefill chunks at zero made the time
    share of the step's prefills their predicted zero, every chunk was refused and a short prompt waited
    for the starvation step (128 steps, ~0.26 s: the unloaded TTFT tail of the H200 mixed load)."""
    budget = PrefillTime(4.7, token_scale=8192, max_model_len=MAX_MODEL_LEN, min_prefill_tokens=16)
    for step in range(50):
        observe(budget.model, decodes=1)
        if step % 10 == 9:  # prefill steps timed like decode steps: chunks priced at nothing
            budget.model.observe(step_seconds(1), decode_tokens=1, decode_pairs=600, prefill_tokens=100 * step)
    assert budget.model.chunk_seconds(736, 0) + budget.model.prefill_step_seconds == pytest.approx(0.0, abs=1e-9)
    budget.start(decode_tokens=1, decode_pairs=600)
    limits = PartialPrefills(max_partial=4, max_long=1, long_threshold=4096)
    _, seconds = limits.shares([], [Chunk(736)], 8192, lambda c, n: budget.model.chunk_seconds(n, 0), budget.seconds_left)
    assert budget.limit_tokens(0, 736, seconds, floor_each=True) == 736


def test_before_any_prefill_step_is_timed_a_chunk_is_a_probe():
    """Nothing known of prefill costs: one chunk of min_prefill_tokens, not the whole prompt (a whole 8K
    chunk next to running decodes took a 294 ms step under a 60 ms target, simulated); its time starts the
    fit, and the chunks grow from there."""
    budget = PrefillTime(5.5, token_scale=8192, max_model_len=MAX_MODEL_LEN, min_prefill_tokens=16)
    for _ in range(8):
        observe(budget.model, decodes=3)
    granted = []
    for _ in range(6):
        budget.start(decode_tokens=3, decode_pairs=3 * 600)
        granted.append(budget.limit_tokens(0, 8192))
        budget.charge(0, granted[-1])
        observe(budget.model, decodes=3, chunk=granted[-1])
    assert granted[0] == 16
    assert granted == sorted(granted) and granted[-1] == pytest.approx((5.5e-3 - step_seconds(3) - P0) / C1, rel=0.05)


def test_a_step_without_decodes_is_timed_while_others_wait_for_it():
    """Prefills are timed while someone outside them waits: decodes in the step, or (an engine that runs
    a prefill batch instead of the decodes, or whose waiting requests join a chunk's batch) others named
    by the caller; nobody waiting, they are not."""
    budget = fitted_budget(20.0)
    budget.start(decode_tokens=0, decode_pairs=0)
    assert budget.seconds_left is None and budget.limit_tokens(40000, 8192) == 8192
    budget.start(decode_tokens=0, decode_pairs=0, others_waiting=True)
    assert budget.seconds_left == pytest.approx(20e-3 - budget.model.decode_seconds(0, 0))
    assert 0 < budget.limit_tokens(40000, 8192) < 8192


@pytest.mark.parametrize("target_ms", [0, -5.0])
def test_a_target_that_is_not_a_positive_time_is_refused_naming_the_flag(target_ms):
    with pytest.raises(ValueError, match="--max-step-latency-ms must be a positive number of milliseconds"):
        check_target(target_ms)
    with pytest.raises(ValueError, match="--max-step-latency-ms"):
        PrefillTime(target_ms, token_scale=8192, max_model_len=MAX_MODEL_LEN, min_prefill_tokens=16)
    check_target(None)


def test_attention_pairs_of_a_chunk_after_a_prefix():
    assert attention_pairs(0, 4) == 10  # causal triangle 1 + 2 + 3 + 4
    assert attention_pairs(100, 1) == 101  # a decode reads its context and itself


def test_max_chunk_inverts_the_chunk_cost():
    model = StepTimeModel(token_scale=2048, pair_scale=2048 * 131072)
    for _ in range(8):
        observe(model, decodes=1)
    for step in range(30):
        tokens, pairs = 512 + 16 * (step % 7), attention_pairs(1024 * step, 512 + 16 * (step % 7))
        model.observe(step_seconds(1) + 0.002 + 20e-6 * tokens + 1e-9 * pairs, decode_tokens=1, decode_pairs=600,
                      prefill_tokens=tokens, prefill_pairs=pairs)  # fmt: skip
    for context in (0, 4096, 65536):
        chunk = model.max_chunk(0.010, context)
        assert model.chunk_seconds(chunk, context) <= 0.010 < model.chunk_seconds(chunk + 1, context)
    assert model.max_chunk(0.0, 0) == 0
    assert StepTimeModel(1, 1).max_chunk(0.01, 0) is None  # nothing learnt: no bound


def test_small_chunks_at_long_context_are_priced_by_the_context_they_read():
    """The cost of a few queries at a long context is the context read: fitted as such, it does not
    leak into the fixed cost, so a step of decodes alone is still predicted at its real time."""
    model = fitted_budget(5.0).model
    assert model.decode_seconds(3, 3 * 600) == pytest.approx(step_seconds(3), rel=0.02)
    for chunk in (96, 8192):
        assert model.chunk_seconds(chunk, 90000) == pytest.approx(step_seconds(0, chunk, 90000) - C0 - P0, rel=0.02)


def test_the_fixed_cost_of_a_prefill_step_is_not_charged_per_token():
    """Run 7 on the H200: fitted together with the decode steps, the extra time of a step that carries a
    prefill chunk went into the per-token cost (20-45 us instead of < 6), and chat prompts were cut into
    chunks of ~80 tokens. Apart, and remembered across the decode-only steps between prompts, a chat
    prompt that fits the target is scheduled whole."""
    budget = PrefillTime(5.5, token_scale=8192, max_model_len=MAX_MODEL_LEN, min_prefill_tokens=16)
    for step in range(60):
        observe(budget.model, decodes=2 + step % 3, chunk=[0, 0, 0, 250, 0, 800][step % 6])
    for _ in range(2000):
        observe(budget.model, decodes=3)
    assert budget.model.prefill_step_seconds == pytest.approx(P0, rel=0.05)
    assert budget.model.chunk_seconds(700, 0) == pytest.approx(700 * C1 + C2 * attention_pairs(0, 700), rel=0.05)
    budget.start(decode_tokens=3, decode_pairs=3 * 600)  # 2 ms of decodes leave 3.5 ms: 1.5 + 700 x 2 us fit
    assert budget.limit_tokens(0, 700) == 700
    budget.charge(0, 700)
    assert budget.seconds_left == pytest.approx(5.5e-3 - step_seconds(3, 700), rel=0.05)  # P0 charged once
    assert budget.limit_tokens(0, 700) == pytest.approx(budget.seconds_left / C1, rel=0.05)  # a second chunk: no P0
    budget.start(decode_tokens=3, decode_pairs=3 * 600)
    # A large chunk gets what is left after the decodes and the step's fixed prefill cost.
    assert budget.limit_tokens(0, 3000) == pytest.approx((5.5e-3 - step_seconds(3) - P0) / C1, rel=0.02)


def test_a_chunk_whose_context_does_not_fit_waits_but_never_starves():
    budget = fitted_budget(5.0)  # decodes ~2 ms; reading 90K keys alone ~14 ms
    granted = []
    for _ in range(STARVATION_STEPS + 1):
        budget.start(decode_tokens=3, decode_pairs=3 * 600)
        granted.append(budget.limit_tokens(90000, 4096))
        budget.charge(90000, granted[-1])
    assert granted[:STARVATION_STEPS] == [0] * STARVATION_STEPS
    assert granted[-1] == 4096  # one step in STARVATION_STEPS takes the long prompt's chunk whole
    budget.start(decode_tokens=3, decode_pairs=3 * 600)
    assert budget.limit_tokens(90000, 4096) == 0
    assert 0 < budget.limit_tokens(0, 4096) < 4096  # a fresh chat prompt fits partly, no floor needed


def test_a_fixed_prefill_cost_above_what_the_decodes_leave_does_not_hold_a_new_prompt_back():
    """SGLang run 4 (H100, 2026-12-06, mixed chunks): where the fitted cost of carrying a prefill exceeded
    the time the decodes left under the target, every chat was refused while others decoded and waited
    for their decodes to end (TTFT p99 247 ms unloaded, against 54 ms upstream). No prefill step can meet
    such a target, so the step's chunks get as much time for their own costs as carrying them costs: a
    chat prompt goes whole, a long one gets that much, and the step is predicted within the decodes plus
    twice the fixed cost. A chunk whose context read alone exceeds that still waits."""
    budget = fitted_budget(3.0)  # decodes ~2 ms leave ~1 ms, below the 1.5 ms of carrying a prefill
    budget.start(decode_tokens=3, decode_pairs=3 * 600)
    assert 0 < budget.seconds_left < budget.model.prefill_step_seconds
    assert budget.limit_tokens(0, 300) == 300
    budget.start(decode_tokens=3, decode_pairs=3 * 600)
    chunk = budget.limit_tokens(0, 8192)
    assert budget.model.chunk_seconds(chunk, 0) == pytest.approx(budget.model.prefill_step_seconds, rel=0.01)
    predicted = budget.model.step_seconds(3, 3 * 600, chunk, attention_pairs(0, chunk), 0)
    assert predicted == pytest.approx(budget.model.decode_seconds(3, 3 * 600) + 2 * P0, rel=0.05)
    budget.charge(0, chunk)
    assert budget.limit_tokens(0, 300) == 0  # the step's time is spent: a second prompt waits
    budget.start(decode_tokens=3, decode_pairs=3 * 600)
    assert budget.limit_tokens(90000, 4096) == 0  # reading 90K keys (~14 ms) does not fit 1.5 ms


def test_a_target_that_leaves_chunks_only_the_fixed_cost_floor_is_said_once_with_the_target_that_would_not(caplog):
    """SGLang run 6 (H100, 2026-12-07): a 4.4 ms target beside decodes of 2.2 ms and a fitted fixed prefill
    cost of 1.9 ms left every step with a prefill the floor alone, so chats went in 250-token pieces, each
    a batch over the target. After FIXED_FLOOR_STEPS such steps one warning says so and names the target
    that keeps them within it (the decodes and twice that cost); a target above it says nothing."""
    with caplog.at_level("WARNING", logger="prefill_accel.scheduling"):
        for target_ms in (3.0, 6.0):  # decodes ~2 ms and carrying a prefill 1.5 ms: 3 ms is below 5
            budget = fitted_budget(target_ms)
            for _ in range(2 * FIXED_FLOOR_STEPS):
                budget.start(decode_tokens=3, decode_pairs=3 * 600)
                for _ in range(2):  # counted once per step
                    budget.limit_tokens(0, 300)
                budget.charge(0, 300)
    [warning] = [r.getMessage() for r in caplog.records if "carrying a prefill costs" in r.getMessage()]
    floor_ms = (budget.model.decode_seconds(3, 3 * 600) + 2 * budget.model.prefill_step_seconds) * 1e3
    assert warning.startswith("--max-step-latency-ms 3.0 leaves a prefill chunk beside the running decodes")
    assert f"runs at about {floor_ms:.1f} ms" in warning and "A target of at least that" in warning


def test_prefills_keep_the_floor_when_decodes_alone_exceed_the_target():
    budget = fitted_budget(1.0)  # below the decodes' own ~2 ms
    budget.start(decode_tokens=3, decode_pairs=3 * 600)
    assert budget.limit_tokens(90000, 4096) == 16
    budget.charge(90000, 16)
    assert budget.limit_tokens(0, 4096) == 0  # only the step's first chunk has the floor


def test_aged_remaining_reaches_zero_at_the_aging_bound():
    assert aged_remaining(1000, 0.0, 30.0) == 1000
    assert aged_remaining(1000, 15.0, 30.0) == 500
    assert aged_remaining(1000, 45.0, 30.0) == 0
    assert aged_remaining(-5, 0.0, 30.0) == 0


def test_budget_stats_report_what_the_target_did(monkeypatch, caplog):
    monkeypatch.setenv("PREFILL_ACCEL_BUDGET_STATS", "3")
    budget = fitted_budget(5.0)
    with caplog.at_level("INFO", logger="prefill_accel.scheduling"):
        for _ in range(3):
            budget.start(decode_tokens=3, decode_pairs=3 * 600)
            budget.charge(90000, budget.limit_tokens(90000, 4096))  # refused: the context read does not fit
            budget.charge(0, budget.limit_tokens(0, 300))  # a chat prompt fits whole
        budget.start(decode_tokens=3, decode_pairs=3 * 600)  # the fourth step logs the three before it
    [line] = [r.getMessage() for r in caplog.records if "step-latency budget" in r.getMessage()]
    assert "last 3 timed steps: 6 prefill chunks, 3 capped, 3 refused, 0 at the floor" in line
    assert "900 of 13188 tokens granted" in line
    monkeypatch.setenv("PREFILL_ACCEL_BUDGET_STATS", "often")
    with pytest.raises(ValueError, match="PREFILL_ACCEL_BUDGET_STATS"):
        fitted_budget(5.0)


def test_step_trace_writes_each_step_with_the_prediction_before_it(monkeypatch, tmp_path):
    import json

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PREFILL_ACCEL_STEP_TRACE", str(path))
    model = StepTimeModel(token_scale=8192, pair_scale=8192 * MAX_MODEL_LEN)
    for step in range(12):
        observe(model, decodes=2, chunk=[0, 300, 0, 800][step % 4])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 12
    assert records[-1]["prefill_tokens"] == 800 and records[-1]["decode_tokens"] == 2
    assert records[-1]["seconds"] == pytest.approx(step_seconds(2, 800))
    assert records[0]["predicted"] == 0.0  # nothing learnt before the first step
    assert records[-1]["predicted"] == pytest.approx(step_seconds(2, 800), rel=0.05)


def test_replaying_a_trace_gives_the_engines_predictions(monkeypatch, tmp_path):
    """scripts/replay_step_trace.py feeds a fresh model the traced steps in order, as the engine did, so
    its predictions equal the ones the trace recorded."""
    import gzip
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "replay_step_trace", Path(__file__).resolve().parents[1] / "scripts" / "replay_step_trace.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PREFILL_ACCEL_STEP_TRACE", str(path))
    model = StepTimeModel(token_scale=8192, pair_scale=8192 * MAX_MODEL_LEN)
    for step in range(40):
        observe(model, decodes=2, chunk=[0, 300, 0, 800, 0, 900][step % 6])
    packed = tmp_path / "steps.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    steps = replay.read_trace(packed)
    predicted = replay.replay(steps, 8192, MAX_MODEL_LEN)
    assert [g for _, g in predicted] == pytest.approx([s["predicted"] for s in steps], abs=1e-12)
    rows = {r["kind"]: r for r in replay.report(predicted, capture_size=512)}
    assert rows["decodes only"]["steps"] == 20
    assert rows["decodes + prefill, <= 512 tokens"]["steps"] == 7
    assert rows["decodes + prefill, > 512 tokens"]["steps"] == 13
    assert json.loads(path.read_text().splitlines()[0])["pid"] > 0
