"""prefill_accel.engine: the engine-neutral policy the adapters call into."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from prefill_accel import SparsePrefillConfig
from prefill_accel.engine.banner import STAMP_NAME, series_banner
from prefill_accel.engine.layers import LayerTraits, dense_reason
from prefill_accel.engine.planner import PlannerOptions, PrefillStreak, Scheduled, StepPlanner, srpf_key
from prefill_accel.engine import startup
from prefill_accel.engine.startup import ChunkLimit, EngineFacts, check_flags, check_schedule, inert_reason
from prefill_accel.flags import HELP, SUFFIXES, settings_from_flags
from prefill_accel.layout import BatchLayout
from prefill_accel.runs import split_long_prefills
from prefill_accel.scheduling.prefills import Chunk
from prefill_accel.scheduling.step_time import attention_pairs

ROOT = Path(__file__).resolve().parents[1]


def test_the_banner_names_the_series_from_the_stamp(tmp_path):
    stamp = tmp_path / STAMP_NAME
    stamp.write_text(json.dumps({"target": "vllm-0.26.0", "series_hash": "0123456789ab", "patches": ["a", "b"]}))
    banner = series_banner(stamp)
    assert banner.startswith("prefill-accel ") and "patch series 0123456789ab applied (vllm-0.26.0, 2 patch(es))" in banner


def test_the_banner_says_unknown_without_a_readable_stamp(tmp_path):
    assert "patch series unknown applied (unknown target, 0 patch(es))" in series_banner(tmp_path / "missing.json")
    (tmp_path / STAMP_NAME).write_text("{not json")
    assert "unknown target" in series_banner(tmp_path / STAMP_NAME)


def test_an_adapter_logs_the_banner_once(tmp_path, caplog):
    """What each overlay's prefill_accel_series.log_series does, loaded from one of them."""
    source = ROOT / "overlay" / "vllm" / "0.26.0" / "vllm" / "prefill_accel_series.py"
    (tmp_path / "prefill_accel_series.py").write_text(source.read_text())
    (tmp_path / STAMP_NAME).write_text(json.dumps({"target": "t", "series_hash": "feedfacecafe", "patches": ["p"]}))
    spec = importlib.util.spec_from_file_location("adapter_under_test", tmp_path / "prefill_accel_series.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with caplog.at_level(logging.INFO, logger="banner-test"):
        module.log_series(logging.getLogger("banner-test"))
    assert [r.getMessage() for r in caplog.records] == [series_banner(tmp_path / STAMP_NAME)]
    assert "feedfacecafe applied (t, 1 patch(es))" in caplog.records[0].getMessage()


FACTS = EngineFacts(backend="SPARSE_PREFILL", selector="attention backend", select_hint="--attention-backend SPARSE_PREFILL",
                    dense="FlashAttention")  # fmt: skip


def test_the_startup_check_logs_the_effective_values_once_with_the_backend(caplog):
    logger = logging.getLogger("startup-test")
    with caplog.at_level(logging.INFO, logger="startup-test"):
        settings = check_flags({"threshold": 0.01, "min_len": 8192}, True, FACTS, logger)
    assert (settings.kernel.threshold, settings.kernel.min_q_len) == (0.01, 8192)
    [record] = caplog.records
    assert record.levelname == "INFO" and "prefill chunks of >= 8192 tokens, or as much attention work after a prefix, use block-sparse attention" in record.getMessage()
    assert "--sparse-prefill-threshold=0.01" in record.getMessage()
    assert record.getMessage().endswith("decodes and shorter chunks use FlashAttention")


def test_the_startup_check_warns_about_changed_flags_without_the_backend_and_is_quiet_otherwise(caplog):
    logger = logging.getLogger("startup-test")
    with caplog.at_level(logging.INFO, logger="startup-test"):
        assert check_flags({"threshold": SparsePrefillConfig().threshold}, False, FACTS, logger) is None
        assert caplog.records == []
        assert check_flags({"threshold": 0.01, "min_len": 8192}, False, FACTS, logger, chosen="FLASH_ATTN") is None
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage() == ("--sparse-prefill-threshold, --sparse-prefill-min-len set but the attention backend "
                                   "is FLASH_ATTN; they only apply with --attention-backend SPARSE_PREFILL")  # fmt: skip


def test_a_bad_value_fails_the_startup_check_naming_its_flag():
    with pytest.raises(ValueError, match="--sparse-prefill-block-size"):
        check_flags({"block_size": 100}, True, FACTS, logging.getLogger("startup-test"))


def test_a_schedule_that_cannot_reach_the_minimum_work_is_said_once_naming_the_setting(caplog):
    settings = settings_from_flags({})  # --sparse-prefill-min-len 24576
    budget = ChunkLimit("--max-num-batched-tokens", 8192)
    model = ChunkLimit("--max-model-len", 131072, fix="a longer --max-model-len")
    assert inert_reason(settings, [ChunkLimit("--max-num-batched-tokens", 16384), model], 131072) is None
    assert inert_reason(settings, [], 131072) is None
    # Chunks of 2048 bring half a 24K prompt's work from a context of 37888 tokens: within 128K, not 32K.
    cap = ChunkLimit("--long-prefill-token-threshold", 2048)
    assert inert_reason(settings, [budget, model, cap], 131072) is None
    assert inert_reason(settings, [budget, model, cap], None) is None  # the context unbounded
    # The tightest limit binds and is the one named, with the fix in the engine's words.
    assert inert_reason(settings, [budget, model, cap], 32768) == (
        "--long-prefill-token-threshold caps a prefill chunk at 2048 tokens, which takes the sparse path under "
        "--sparse-prefill-min-len=24576 only from a context of 37888 tokens, beyond the 32768 the engine holds; set "
        "--long-prefill-token-threshold 24576 (or lower --sparse-prefill-min-len) for long prompts to take the "
        "sparse path")  # fmt: skip
    # Within the minimum length itself nothing goes sparse, whatever the chunk.
    short_model = ChunkLimit("--max-model-len", 16384, "a longer --max-model-len")
    assert "from a context of 24576 tokens, beyond the 16384" in inert_reason(settings, [short_model], 16384)
    assert "set a longer --max-model-len" in inert_reason(settings, [short_model], 16384)
    tiny = ChunkLimit("--max-num-batched-tokens", 64)  # below a block: never sparse, at any context
    assert "caps a prefill chunk at 64 tokens, below --sparse-prefill-min-len=24576" in inert_reason(settings, [tiny])
    off = ChunkLimit("chunked prefill off", 0, fix="--enable-chunked-prefill --max-num-batched-tokens 24576")
    assert inert_reason(settings, [off]).startswith("chunked prefill off admits no prefill chunk to it")
    logger = logging.getLogger("startup-test")
    with caplog.at_level(logging.INFO, logger="startup-test"):
        assert check_schedule(None, [budget], FACTS, logger) is None  # without the backend: nothing to say
        assert check_schedule(settings, [ChunkLimit("--max-num-batched-tokens", 32768)], FACTS, logger) is None
        # Chunks of 8192 go sparse from the minimum context itself: nothing late to say either.
        assert check_schedule(settings, [budget, model], FACTS, logger, max_context=131072) is None
        assert caplog.records == []
        reason = check_schedule(settings, [budget, short_model], FACTS, logger, max_context=16384)
        assert check_schedule(settings, [cap, model], FACTS, logger, max_context=131072) is None
    warning, late = caplog.records
    assert warning.levelname == "WARNING" and reason in warning.getMessage()
    assert warning.getMessage().startswith("SPARSE_PREFILL never runs: --max-num-batched-tokens caps a prefill chunk at 8192")
    assert warning.getMessage().endswith("every prefill uses FlashAttention")
    assert late.levelname == "INFO" and late.getMessage() == (
        "SPARSE_PREFILL: --long-prefill-token-threshold caps a prefill chunk at 2048 tokens, below "
        "--sparse-prefill-min-len=24576: a chunk takes the sparse path from a context of 37888 tokens")  # fmt: skip


def test_the_package_declares_the_triton_the_kernels_need():
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"triton>={startup.KERNELS_NEED_TRITON}" in dependencies


def test_kernels_that_cannot_import_keep_every_layer_dense_and_are_said_at_startup(monkeypatch, caplog):
    """On a CUDA machine whose Triton lacks what the kernels import, the layers stay on the engine's
    dense path and the startup line says why; without CUDA the reference path serves and nothing changes."""
    import builtins
    import sys

    from prefill_accel.ops import attention

    assert attention.block_sparse_attention  # triton is imported whole before the hook, not half under it
    real_import = builtins.__import__

    def no_triton_language(name, *args, **kwargs):
        if name == "triton.language":
            raise ImportError("cannot import name 'language'")
        return real_import(name, *args, **kwargs)

    settings = settings_from_flags({})
    startup.kernels_unavailable.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert startup.kernels_unavailable() is None and dense_reason(LayerTraits(head_size=128), settings) is None
    startup.kernels_unavailable.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builtins, "__import__", no_triton_language)
    for module in ("prefill_accel.ops.common", "prefill_accel.ops.staging", "prefill_accel.ops.attention",
                   "prefill_accel.ops.search"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    try:
        reason = startup.kernels_unavailable()
        assert reason is not None and "need triton >= 3.0" in reason and "'language'" in reason
        assert dense_reason(LayerTraits(head_size=128), settings) == reason
        with caplog.at_level(logging.INFO, logger="startup-test"):
            check_flags({}, True, FACTS, logging.getLogger("startup-test"))
        assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
        assert caplog.records[1].getMessage() == f"SPARSE_PREFILL cannot run its kernels here: {reason}; every layer uses FlashAttention"
    finally:
        monkeypatch.undo()
        startup.kernels_unavailable.cache_clear()


def test_a_triton_without_tensor_descriptors_is_said_at_startup_on_a_gpu_with_tma(monkeypatch, caplog):
    """Triton 3.0 (vLLM 0.6.3's) on an H100/H200: the kernels run, reading K/V through the page table,
    and the startup line after the settings says so; on older GPUs, or with tensor descriptors, nothing."""
    from prefill_accel.ops import common

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(startup, "kernels_unavailable", lambda: None)
    monkeypatch.setattr(common, "TENSOR_DESCRIPTORS", False)
    for capability, said in ((8, False), (9, True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda capability=capability: (capability, 0))
        startup.kernels_without_tma.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="startup-test"):
            check_flags({}, True, FACTS, logging.getLogger("startup-test"))
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 + said and all(r.levelname == "INFO" for r in caplog.records)
        if said:
            assert lines[1].startswith("SPARSE_PREFILL: triton ") and "no tensor descriptors (triton >= 3.4)" in lines[1]
            assert lines[1].endswith("through the page table, not with TMA bulk copies")
    monkeypatch.setattr(common, "TENSOR_DESCRIPTORS", True)
    startup.kernels_without_tma.cache_clear()
    assert startup.kernels_without_tma() is None
    startup.kernels_without_tma.cache_clear()


def test_the_warm_up_runs_each_path_a_server_meets_once(monkeypatch, caplog):
    from prefill_accel.engine import warmup
    from prefill_accel.ops import launch, search

    default = SparsePrefillConfig()  # min_q_len 24576
    tma = launch.TMA_SPARSE_MIN_KEYS
    # Sparse at the minimum context and with bulk K/V reads; dense: a token after a chunk, the first chunk
    # of a prompt (below the minimum context), a fresh block.
    assert warmup.warmup_cases(16384, default, 12, 131072) == [(16384, 24576), (16384, tma), (1, 16385), (16384, 16385),
                                                               (128, 128)]  # fmt: skip
    assert warmup.warmup_cases(65536, default, 12) == [(65536, 65536), (21632, 24576), (21632, tma), (1, 65537),
                                                       (21632, 21633), (128, 128)]  # fmt: skip
    # Chunks below the minimum length go sparse from the minimum context too, shorter ones later.
    assert warmup.warmup_cases(8192, default, 12, 131072)[:2] == [(8192, 24576), (8192, tma)]
    assert warmup.warmup_cases(2048, default, 12, 131072)[0] == (2048, 37888)
    assert warmup.warmup_cases(8192, default, 12, 16384) == []  # never sparse within the model length
    # 32 heads: a 16K chunk tunes in the second size class, chunks up to 63 blocks in the first.
    cases = warmup.warmup_cases(16384, default, 32, 131072)
    assert [launch.size_class(-(-q // 128) * 32) for q, _ in cases[:4]] == [1, 1, 0, 0]
    assert (8064, 8065) in cases  # a chunk of the first class that stays dense after a prefix
    monkeypatch.setattr(launch, "TMA_SPARSE_MIN_KEYS", 256)  # a short second context for the interpreter
    monkeypatch.setattr(warmup, "_done", set())
    assert warmup.warm_up(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_size=16,
                          config=SparsePrefillConfig(), chunk_tokens=16384, device=torch.device("cpu")) is None
    monkeypatch.setattr(warmup, "_compiles_on", lambda device: True)  # the interpreter stands in for a GPU
    searched = []
    real_select = search.select_blocks
    monkeypatch.setattr(search, "select_blocks", lambda *args, **kwargs: searched.append(args[4].tolist()) or real_select(*args, **kwargs))
    config = SparsePrefillConfig(block_size=64, min_q_len=128)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = dict(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_size=16, config=config,
                  chunk_tokens=128, device=device)  # fmt: skip
    logger = logging.getLogger("warmup-test")
    with caplog.at_level(logging.INFO, logger="warmup-test"):
        warmup.warm_up_logged(logger, "4 / 2 heads, d=64", **shapes)
        assert warmup.warm_up(**shapes) is None  # the same shapes again: nothing to compile
    assert searched == [[128], [256]], "one sparse call (search, then attention) per sparse case"
    [record] = caplog.records
    assert record.levelname == "INFO" and "at (query, key) lengths 128/128 128/256 1/129 64/64, in" in record.getMessage()
    monkeypatch.setenv(warmup.ENV, "0")
    assert warmup.warm_up(**{**shapes, "chunk_tokens": 192}) is None and searched == [[128], [256]]
    monkeypatch.delenv(warmup.ENV)

    def fails(**_):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(warmup, "warm_up", fails)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="warmup-test"):
        warmup.warm_up_logged(logger, "4 / 2 heads, d=64", **shapes)
    [record] = caplog.records
    assert record.levelname == "WARNING" and "RuntimeError: out of resources" in record.getMessage()


def test_every_flag_has_one_help_text_in_the_engines_words():
    assert set(HELP) == set(SUFFIXES)
    assert FACTS.help("dense_layers") == "SPARSE_PREFILL backend: the first N attention layers always use FlashAttention."
    assert all(FACTS.help(suffix).endswith(".") and "{" not in FACTS.help(suffix) for suffix in SUFFIXES)


def test_a_layer_stays_dense_for_the_first_reason_that_applies():
    settings = settings_from_flags({"dense_layers": 2})
    plain = LayerTraits(head_size=128, index=5, name="model.layers.5.self_attn.attn")
    assert dense_reason(plain, settings) is None
    cases = [
        (dict(attention_type="ENCODER"), "attention type ENCODER (the kernel computes causal self-attention)"),
        (dict(sliding_window=512, alibi=True), "sliding window of 512"),
        (dict(chunked_local=True), "chunked local attention (iRoPE)"),
        (dict(alibi=True), "ALiBi"),
        (dict(soft_cap=True), "logit soft-capping"),
        (dict(sinks=True), "attention sinks"),
        (dict(quantized_kv="fp8_e4m3"), "KV cache dtype fp8_e4m3"),
        (dict(context_parallel=True), "decode context parallelism"),
        (dict(v_head_size=64), "K head size 128 != V head size 64"),
        (dict(head_size=96), "head size 96 (the kernel has (64, 128, 256))"),
        (dict(index=1), "layer 1 < --sparse-prefill-dense-layers=2"),
        (dict(index=None), "no layer index in 'model.layers.5.self_attn.attn'"),
    ]
    for changes, reason in cases:
        assert dense_reason(dataclasses.replace(plain, **changes), settings) == reason, changes
    assert dense_reason(dataclasses.replace(plain, index=None), settings_from_flags({})) is None  # no index needed
    assert dense_reason(plain, None).startswith("no settings")


def test_a_chunk_is_long_by_its_context_and_its_attention_work():
    """Sparse once the context holds min_q_len keys and the chunk brings a fresh min_q_len / 2 prompt's
    work, q * k - q**2 / 2 query-key pairs: a fresh prompt from min_q_len tokens, every chunk of a longer
    prompt from that context on down to a few thousand queries, fewer at longer contexts; a prompt's
    first chunk below the minimum context never, nor a chunk shorter than a block (a decode)."""
    config = SparsePrefillConfig()  # min_q_len 24576, blocks of 128
    assert config.long_chunk(24576) and not config.long_chunk(24575)
    assert not config.long_chunk(16384) and not config.long_chunk(16384, 24575)  # a 16K prompt, a first chunk
    assert config.long_chunk(16384, 24576) and config.long_chunk(8192, 24576) and config.long_chunk(16320, 131008)
    # Half a 24K prompt's work, 75.5M pairs: 2048 queries from 37888 keys, 512 from 147712.
    assert not config.long_chunk(2048, 37887) and config.long_chunk(2048, 37888)
    assert config.sparse_from(512) == 147712 and not config.long_chunk(512, 131072)
    assert not config.long_chunk(127, 10**9) and config.long_chunk(128, 10**9)
    for q_len in (128, 1000, 2048, 4096, 16320, 16384, 40000):
        k_len = config.sparse_from(q_len)
        assert config.long_chunk(q_len, k_len) and (k_len == q_len or not config.long_chunk(q_len, k_len - 1))
        assert k_len >= max(q_len, config.min_q_len)
        assert 8 * (q_len * k_len) - 4 * q_len * q_len >= config.min_q_len**2  # the work, in integers
    assert config.sparse_from(127) is None and config.sparse_from(0) is None
    every = config.replace(min_q_len=0)  # everything sparse, as the kernel tests run it
    assert every.long_chunk(1) and every.sparse_from(1) == 1


def test_every_router_asks_the_config_which_chunks_are_long():
    """The engines' batch split (runs) and the block layout route a step the same way: one predicate of
    each request's query and key lengths."""
    config = SparsePrefillConfig(block_size=64, min_q_len=128, last_query_blocks=0)
    q_lens, k_lens = [127, 128, 300, 100, 64], [127, 400, 300, 120, 200]
    cu = torch.tensor([0, 127, 255, 555, 655, 719], dtype=torch.int32)
    runs = split_long_prefills(cu, torch.tensor(k_lens + [0]), 5, config)  # padded past the requests
    assert [(run.req_start, run.req_end, run.sparse) for run in runs] == [(0, 1, False), (1, 3, True), (3, 4, False),
                                                                          (4, 5, True)]  # fmt: skip
    assert [config.long_chunk(q, k) for q, k in zip(q_lens, k_lens)] == [False, True, True, False, True]
    layout = BatchLayout.build(cu, torch.tensor(k_lens, dtype=torch.int32), config, "cpu")
    dense = layout.qblock_dense.tolist()
    starts = layout.seq_qblock_start
    assert all(dense[starts[0]:starts[1]]) and not any(dense[starts[1]:starts[3]])
    assert all(dense[starts[3]:starts[4]]) and not any(dense[starts[4]:starts[5]])


def planner(options=PlannerOptions(), target_ms=None, clock=None, **limits):
    settings = dict(max_partial=1, max_long=1, long_threshold=0) | limits
    return StepPlanner(**settings, max_step_latency_ms=target_ms, token_scale=8192, max_model_len=131072,
                       min_prefill_tokens=16, options=options, clock=clock or (lambda: 0.0))  # fmt: skip


def test_the_planner_serves_decodes_first_and_shares_the_rest():
    plan = planner(max_partial=2, max_long=1, long_threshold=1000)
    decodes = [Scheduled(context=500, tokens=1, prefill=False)] * 48
    left = plan.begin_step(decodes, [Chunk(5000, context=3000)], [Chunk(8000), Chunk(300)], token_budget=2048)
    assert left == 2000  # the decodes' 48 tokens first
    assert plan.admission(Chunk(8000)) == plan.SKIP and plan.admission(Chunk(300)) == plan.ADMIT
    assert plan.cap(Chunk(5000, context=3000), 2000) == 2000  # 1000 + 300 fit: nobody capped
    plan.consume(Chunk(5000, context=3000), 1900, admitted=False)
    assert plan.cap(Chunk(300), 300) == 100  # what the step has left (V1 keeps the budget here)
    plan.consume(Chunk(300), 100, admitted=True)
    assert plan.admission(Chunk(200)) == plan.STOP


def test_engine_options_say_what_the_planner_leaves_to_the_engine():
    v0 = planner(PlannerOptions(bound_tokens=False, cap_long_chunks=True, refuse_chunks=False), long_threshold=512)
    v0.begin_step([], [], [], token_budget=64)
    assert v0.cap(Chunk(4000), 4000) == 512  # V0 cuts chunks at the threshold itself, its own budget bounds them
    assert v0.cap(Chunk(4000), 700, block=16) == 512 and v0.cap(Chunk(4000), 500, block=16) == 500
    v1 = planner(long_threshold=512)
    v1.begin_step([], [], [], token_budget=64)
    assert v1.cap(Chunk(4000), 4000) == 64


def test_the_planner_times_each_step_from_its_start_to_its_output():
    now = [0.0]
    plan = planner(target_ms=5.0, clock=lambda: now[0])
    for step in range(3):
        plan.begin_step([Scheduled(100, 1, False)], [], [], token_budget=256)
        key = object()
        plan.end_step(key, [Scheduled(100, 1, False)])
        now[0] += 0.002
        plan.observe(key)
    assert plan.time.model.decodes.count == 3
    assert plan.time.model.decode_seconds(1, 101) == pytest.approx(0.002, rel=1e-3)
    plan.observe(object())  # an unknown step is nobody's: nothing fitted
    assert plan.time.model.decodes.count == 3


def fitted(plan: StepPlanner) -> StepPlanner:
    """The planner's model fed decode steps (2 ms + 0.1 ms per decode) and prefill-only steps of fresh
    chunks (1 ms more + 5 us per token)."""
    for step in range(60):
        n, q = 1 + step % 48, 256 * (1 + step % 16)
        plan.time.model.observe(2e-3 + 1e-4 * n, decode_tokens=n, decode_pairs=n)
        plan.time.model.observe(3e-3 + 5e-6 * q, prefill_tokens=q, prefill_pairs=attention_pairs(0, q))
    return plan


def test_a_prefill_batch_that_runs_instead_of_the_decodes_is_timed_for_them_without_their_cost():
    """SGLang runs a prefill batch instead of the decodes (decodes_in_step off): while decodes wait the batch
    is timed, but its budget and time are its own; a document's next chunk alone is not timed."""
    decodes = [Scheduled(context=0, tokens=1, prefill=False)] * 48
    document = Chunk(90000, context=8192)
    riding = fitted(planner(target_ms=20.0))
    apart = fitted(planner(PlannerOptions(bound_tokens=False, decodes_in_step=False), target_ms=20.0))
    assert riding.begin_step(decodes, [document], [], token_budget=8192) == 8192 - 48
    assert apart.begin_step(decodes, [document], [], token_budget=8192) == 8192
    model = apart.time.model
    with_decodes = model.max_chunk(20e-3 - model.decode_seconds(48, 48) - model.prefill_step_seconds, 8192)
    alone = model.max_chunk(20e-3 - model.decode_seconds(0, 0) - model.prefill_step_seconds, 8192)
    assert riding.cap(document, 8192) == with_decodes and apart.cap(document, 8192) == alone
    assert with_decodes < 0.8 * alone < 8192  # 48 decodes of 0.1 ms each leave the batch 4.8 ms less
    apart.begin_step([], [document], [], token_budget=8192)
    assert apart.cap(document, 8192) == 8192  # nobody waits for it


def test_with_time_for_waiting_a_chat_beside_a_chunk_times_the_batch():
    """Under time_for_waiting a request waiting beside a partial prefill is someone the batch keeps waiting
    (SGLang under srpf: it joins the chunk's batch whole): the batch is timed though nothing decodes, the
    chat charged its own cost first and the chunk given the rest; a lone prefill is not timed."""
    options = PlannerOptions(bound_tokens=False, decodes_in_step=False, time_for_waiting=True)
    document, chat = Chunk(90000, context=8192), Chunk(300)
    plan = fitted(planner(options, target_ms=20.0))
    plan.begin_step([], [document], (c for c in [chat]), token_budget=8192)
    assert plan.cap(chat, 300) == 300
    plan.consume(chat, 300, admitted=True)
    model = plan.time.model
    left = 20e-3 - model.decode_seconds(0, 0) - model.prefill_step_seconds - model.chunk_seconds(300, 0)
    assert plan.cap(document, 8192 - 300) == model.max_chunk(left, 8192) < 4000
    for prefilling, waiting in (([document], []), ([], [Chunk(90000)])):
        plan.begin_step([], prefilling, iter(waiting), token_budget=8192)
        assert not plan.timed
    default = fitted(planner(PlannerOptions(bound_tokens=False, decodes_in_step=False), target_ms=20.0))
    default.begin_step([], [document], [chat], token_budget=8192)
    assert not default.timed  # vLLM's targets time only steps that carry decodes


def test_a_chunk_that_cannot_be_cut_goes_whole_as_the_steps_first_prefill_and_waits_otherwise():
    """cap_whole, for a request an engine can only take whole this step (SGLang, beside another's chunked
    request): one that fits the step's time goes whole; one that the target would cut goes whole where it is
    the step's first prefill (waiting would hold it for the other's every remaining chunk) and gets nothing
    after another prefill was charged. Counted in the budget statistics."""
    options = PlannerOptions(bound_tokens=False, decodes_in_step=True, time_for_waiting=True)
    decode = [Scheduled(context=300, tokens=1, prefill=False)]
    plan = fitted(planner(options, target_ms=4.0))
    plan.begin_step(decode, [Chunk(49152, context=49152)], [Chunk(600), Chunk(600)], token_budget=8192)
    assert 0 < plan.cap(Chunk(600), 600) < 600  # the target alone would cut a chat beside the decode
    assert plan.cap_whole(Chunk(600), 600) == 600 and plan.time.stats.whole == 1
    plan.consume(Chunk(600), 600, admitted=True)
    assert plan.cap_whole(Chunk(600), 600) == 0  # the second waits for the next step
    plan.begin_step([], [], [Chunk(100)], token_budget=8192)  # nobody at stake: whatever fits the tokens
    assert not plan.timed and plan.cap_whole(Chunk(100), 100) == 100
    roomy = fitted(planner(options, target_ms=50.0))
    roomy.begin_step(decode, [Chunk(49152, context=49152)], [Chunk(600), Chunk(600)], token_budget=8192)
    for _ in range(2):  # both fit the step's time: whole, nothing counted
        assert roomy.cap_whole(Chunk(600), 600) == 600
        roomy.consume(Chunk(600), 600, admitted=True)
    assert roomy.time.stats.whole == 0


def test_srpf_keys_order_by_aged_remaining_then_arrival_and_priority_first():
    young_long, old_long, aged_out, chat = (srpf_key(8000, 1.0, 30.0, 10.0), srpf_key(8000, 29.0, 30.0, 1.0),
                                            srpf_key(9000, 31.0, 30.0, 0.5), srpf_key(100, 0.5, 30.0, 11.0))  # fmt: skip
    assert sorted([young_long, old_long, aged_out, chat]) == [aged_out, chat, old_long, young_long]
    assert srpf_key(100, 0.0, 30.0, 5.0, priority=1, tiebreak="b") > srpf_key(9000, 0.0, 30.0, 1.0, priority=0, tiebreak="a")


def test_a_prefill_streak_bounds_prefills_in_a_row_while_decodes_wait():
    streak = PrefillStreak(2)
    for _ in range(2):
        assert not streak.holds_prefill(decodes_waiting=True)
        streak.record("prefill", decodes_waiting=True)
    assert streak.holds_prefill(decodes_waiting=True) and not streak.holds_prefill(decodes_waiting=False)
    streak.record("decode", decodes_waiting=True)
    assert streak.length == 0
    streak.record("mixed", decodes_waiting=True)
    assert streak.length == 0
    with pytest.raises(ValueError, match="must be at least 1"):
        PrefillStreak(0)


def test_a_loopback_init_method_gets_a_store_listening_on_loopback_alone():
    """torch binds a TCPStore server to every address whatever host the init method names; the store
    loopback_store() makes for tcp://127.0.0.1 listens there alone, serves a process group, and other
    init methods are left to torch."""
    import datetime
    import os
    import socket

    import torch.distributed as dist
    from listening import listening_sockets

    from prefill_accel.engine.network import loopback_address, loopback_store

    assert loopback_address("tcp://127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert loopback_address("tcp://[::1]:29500") == ("::1", 29500)
    for other in ("tcp://10.1.2.3:29500", "tcp://node7:29500", "env://", "file:///tmp/store", "tcp://127.0.0.1", None):
        assert loopback_address(other) is None and loopback_store(other, 1, 0) is None, other
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    before = listening_sockets({os.getpid()})
    store = loopback_store(f"tcp://127.0.0.1:{port}", 1, 0, datetime.timedelta(seconds=30))
    opened = listening_sockets({os.getpid()}) - before
    assert opened == {("127.0.0.1", port)}
    store.set("key", "value")
    assert store.get("key") == b"value"
    dist.init_process_group("gloo", store=store, world_size=1, rank=0)
    try:
        assert dist.get_world_size() == 1
        assert all(address == "127.0.0.1" for address, _ in listening_sockets({os.getpid()}) - before)
    finally:
        dist.destroy_process_group()
