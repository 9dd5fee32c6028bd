"""The end-to-end driver's own arithmetic (scripts/e2e/vllm_e2e.py): token comparison, percentiles,
prompt windows. Its GPU runs are in docs/e2e-vllm.md; here only what can go wrong without a GPU."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "e2e" / "vllm_e2e.py"


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location("vllm_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_tokens_reports_first_difference_and_upstream_margin(driver):
    upstream = {
        "tokens": [[1, 2, 3], [4, 5, 6], [7, 8]],
        "top": [None, [[[4, -0.1]], [[5, -0.2], [9, -0.325]], [[6, -0.1]]], None],
    }
    patched = {"tokens": [[1, 2, 3], [4, 9, 6], [7, 8, 1]]}
    rows = driver.compare_tokens(upstream, patched)
    assert [r["equal"] for r in rows] == [True, False, False]
    assert rows[1]["first_diff"] == 1 and rows[1]["upstream_margin"] == pytest.approx(0.125)
    assert rows[2]["first_diff"] == 2  # one side stopped earlier
    assert "upstream_margin" not in rows[2]


def test_percentile_interpolates_between_ranks(driver):
    values = [float(v) for v in range(1, 101)]
    assert driver.percentile(values, 50) == pytest.approx(50.5)
    assert driver.percentile(values, 99) == pytest.approx(99.01)
    assert driver.percentile([3.0], 99) == 3.0


def test_corpus_windows_differ_from_their_first_token(driver):
    corpus = driver.Corpus.__new__(driver.Corpus)
    corpus.ids = list(range(200_000))
    windows = [corpus.window(131072, i) for i in range(12)]
    assert all(len(w) == 131072 for w in windows)
    assert len({w[0] for w in windows}) == len(windows)


def test_engine_kwargs_size_the_rotary_table_for_long_runs(driver):
    long = driver.engine_kwargs("smollm2", max_model_len=132096, chunk=16384, eager=False)
    short = driver.engine_kwargs("smollm2", max_model_len=8192, chunk=2048, eager=True)
    assert long["hf_overrides"] == {"max_position_embeddings": 132096}
    assert "hf_overrides" not in short
    assert driver.sparse(threshold=0.0)["sparse_prefill_threshold"] == 0.0


def test_sparse_flags_of_the_run_reach_every_patched_engine_under_a_stages_own(driver, monkeypatch):
    monkeypatch.setattr(driver, "SPARSE_FLAGS", {})
    driver.SPARSE_FLAGS.update([driver.parse_sparse_flag("estimator=exact"), driver.parse_sparse_flag("threshold=0.01")])
    kwargs = driver.sparse(threshold=0.0)
    assert kwargs["sparse_prefill_estimator"] == "exact" and kwargs["sparse_prefill_threshold"] == 0.0
    assert driver.parse_sparse_flag("exact_rows=2") == ("exact_rows", 2)
    assert driver.parse_sparse_flag("mean_correction=true") == ("mean_correction", True)
    assert "--sparse-prefill-estimator=exact" in driver.sparse_flags_note()
    with pytest.raises(Exception, match="NAME=VALUE"):
        driver.parse_sparse_flag("exact")


def test_mixed_load_servers_share_the_scheduler_flags_and_differ_in_backend(driver):
    ours, alone = driver.mixed_flags("SPARSE_PREFILL", 5.5), driver.mixed_flags("default", 5.5)
    assert ours[:2] == ["--attention-backend", "SPARSE_PREFILL"] and "--attention-backend" not in alone
    assert ours[2:] == alone and alone[-2:] == ["--max-step-latency-ms", "5.5"]


def test_long_runs_use_the_models_documented_rope_scaling_where_it_has_one(driver, tmp_path, monkeypatch):
    monkeypatch.setattr(driver, "MODELS", tmp_path)
    (tmp_path / driver.QWEN).mkdir()
    (tmp_path / driver.QWEN / "config.json").write_text('{"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}')
    assert driver.long_len(driver.QWEN) == 131072 and driver.long_len("smollm2") == driver.LONG_LEN
    assert driver.engine_kwargs(driver.QWEN, max_model_len=32768, chunk=16384, eager=True).get("hf_overrides") is None
    long = driver.engine_kwargs(driver.QWEN, max_model_len=131072, chunk=16384, eager=False)
    assert long["hf_overrides"] == {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 32768, "rope_theta": 1e6}}
    # The 128K prompt leaves room for the answer inside YaRN's 128K; SmolLM2's speed runs do not need it.
    assert driver.prompt_len(driver.QWEN, 131072) == 131072 - 64 and driver.prompt_len(driver.QWEN, 65536) == 65536
    assert driver.prompt_len("smollm2", 131072) == 131072


def qwen_checkpoint(models: Path, name: str) -> None:
    """A converted checkpoint's files as transformers 5 writes them (Qwen2.5-Coder-1.5B's shape)."""
    (models / name).mkdir()
    (models / name / "config.json").write_text(json.dumps({
        "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "num_hidden_layers": 28,
        "dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}))  # fmt: skip
    (models / name / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer", "extra_special_tokens": []}')
    (models / name / "model.safetensors").write_bytes(b"weights")


def test_v0_engines_get_the_backend_chunking_cache_and_rope_scaling_in_vllm_06_terms(driver, tmp_path, monkeypatch):
    monkeypatch.setattr(driver, "MODELS", tmp_path)
    qwen_checkpoint(tmp_path, driver.QWEN)
    kwargs = driver.engine_kwargs(driver.QWEN, max_model_len=131072, chunk=16384, eager=False, **driver.sparse())
    engine, env = driver.v0_engine(kwargs)
    assert env == {"VLLM_ATTENTION_BACKEND": "SPARSE_PREFILL"}
    assert "attention_backend" not in engine and "hf_overrides" not in engine and "kv_cache_memory_bytes" not in engine
    assert engine["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert engine["enable_chunked_prefill"] and engine["max_num_batched_tokens"] == 16384
    # 8 GiB of bf16 K+V at 28 layers x 2 KV heads x 128 per token: 16-token blocks of 448 KiB.
    assert engine["num_gpu_blocks_override"] == driver.KV_BYTES // (16 * 28 * 2 * 2 * 128 * 2) == 18724
    upstream, env = driver.v0_engine(driver.engine_kwargs(driver.QWEN, max_model_len=32768, chunk=2048, eager=True))
    assert env == {} and "rope_scaling" not in upstream
    # V0 reads the checkpoint through transformers 4.46: rope_theta at the top, no list of extra tokens.
    v0 = Path(engine["model"])
    assert v0 != tmp_path / driver.QWEN and (v0 / "model.safetensors").resolve() == tmp_path / driver.QWEN / "model.safetensors"
    config = json.loads((v0 / "config.json").read_text())
    assert config["rope_theta"] == 1e6 and config["torch_dtype"] == "bfloat16" and "rope_type" not in config
    tokenizer = json.loads((v0 / "tokenizer_config.json").read_text())
    assert "extra_special_tokens" not in tokenizer and tokenizer["tokenizer_class"] == "Qwen2Tokenizer"
    # Past the training length without a documented scaling (SmolLM2's speed runs) V0 has no override.
    qwen_checkpoint(tmp_path, "smollm2")
    with pytest.raises(driver.EngineError, match="hf_overrides"):
        driver.v0_engine(driver.engine_kwargs("smollm2", max_model_len=132096, chunk=16384, eager=False))


def test_a_v0_checkpoint_names_a_tokenizer_json_only_tokenizer_by_the_class_transformers_446_has(driver, tmp_path,
                                                                                               monkeypatch):  # fmt: skip
    """SmolLM2 converted by transformers 5 names its tokenizer TokenizersBackend; 4.46 (vLLM 0.6.3's) failed
    to load it on the H100 (run 3, 2026-12-07: "Tokenizer class TokenizersBackend does not exist")."""
    monkeypatch.setattr(driver, "MODELS", tmp_path)
    qwen_checkpoint(tmp_path, "smollm2")
    (tmp_path / "smollm2" / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
    v0 = driver.v0_checkpoint("smollm2")
    assert json.loads((v0 / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


# ServerArgs fields of SGLang 0.5.16 (read in its wheel's sglang/srt/server_args.py) and the patch's flags.
SGLANG_FIELDS = {"model_path", "dtype", "random_seed", "context_length", "tp_size", "chunked_prefill_size",
                 "max_prefill_tokens", "disable_radix_cache", "max_total_tokens", "mem_fraction_static",
                 "disable_cuda_graph", "attention_backend", "log_level", "json_model_override_args",
                 "prefill_attention_backend"}  # fmt: skip


def test_sglang_engines_get_fa3_decoding_sparse_prefill_the_chunk_pool_and_yarn_in_serverargs_terms(driver, tmp_path,
                                                                                                   monkeypatch):  # fmt: skip
    monkeypatch.setattr(driver, "MODELS", tmp_path)
    qwen_checkpoint(tmp_path, driver.QWEN)
    kwargs = driver.engine_kwargs(driver.QWEN, max_model_len=131072, chunk=16384, eager=False, **driver.sparse(min_len=512))
    engine, env = driver.sglang_engine(kwargs)
    assert set(engine) - {k for k in engine if k.startswith("sparse_prefill_")} <= SGLANG_FIELDS
    assert engine["attention_backend"] == "fa3" and engine["prefill_attention_backend"] == "sparse_prefill"
    assert engine["sparse_prefill_min_len"] == 512
    assert engine["chunked_prefill_size"] == engine["max_prefill_tokens"] == 16384
    assert engine["context_length"] == 131072 and not engine["disable_radix_cache"] and not engine["disable_cuda_graph"]
    # 8 GiB of bf16 K+V at 28 layers x 2 KV heads x 128 per token.
    assert engine["max_total_tokens"] == driver.KV_BYTES // (28 * 2 * 2 * 128 * 2) == 299593
    assert json.loads(engine["json_model_override_args"])["rope_parameters"]["rope_type"] == "yarn"
    assert env == {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    upstream, env = driver.sglang_engine(driver.engine_kwargs(driver.QWEN, max_model_len=32768, chunk=2048, eager=True))
    assert env == {} and "prefill_attention_backend" not in upstream and "json_model_override_args" not in upstream
    assert upstream["disable_cuda_graph"] and upstream["model_path"] == str(tmp_path / driver.QWEN)
    with pytest.raises(driver.EngineError, match=r"no SGLang translation for \['block_size'\]"):
        driver.sglang_engine({**kwargs, "block_size": 16})


def test_an_sglang_server_gets_the_engine_fields_as_flags_and_sglang_defaults_without_a_chunk(driver, tmp_path,
                                                                                            monkeypatch):  # fmt: skip
    """`sglang.launch_server` for what `vllm serve` gets (parsed by SGLang 0.5.16's own ServerArgs in a stand-in
    for the GPU image, 2026-12-04)."""
    monkeypatch.setattr(driver, "MODELS", tmp_path)
    monkeypatch.setattr(driver, "ENGINE", "sglang")
    qwen_checkpoint(tmp_path, driver.QWEN)
    command, env = driver.sglang_server(driver.QWEN, 8111, ["--max-num-batched-tokens", "16384",
                                                            "--attention-backend", "SPARSE_PREFILL"])  # fmt: skip
    assert command[1:3] == ["-m", "sglang.launch_server"] and env == {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    flags = dict(zip(command[3::2], command[4::2]))
    assert flags["--port"] == "8111" and flags["--host"] == "127.0.0.1"
    assert flags["--chunked-prefill-size"] == flags["--max-prefill-tokens"] == "16384"
    assert flags["--attention-backend"] == "fa3" and flags["--prefill-attention-backend"] == "sparse_prefill"
    assert "--disable-cuda-graph" not in command and "--disable-radix-cache" not in command
    defaults, _ = driver.sglang_server(driver.QWEN, 8103, [])
    assert "--chunked-prefill-size" not in defaults and "--prefill-attention-backend" not in defaults
    mixed, _ = driver.sglang_server(driver.QWEN, 8104, driver.mixed_flags("SPARSE_PREFILL", 20.0))
    assert mixed[-6:] == ["--max-consecutive-prefill-batches", "2", "--schedule-policy", "srpf",
                          "--max-step-latency-ms", "20.0"]  # fmt: skip
    assert "sparse_prefill" in mixed


def test_the_sglang_phase_runs_alone(driver, monkeypatch):
    monkeypatch.setattr("sys.argv", ["vllm_e2e.py", "--phases", "sglang,qwen"])
    with pytest.raises(SystemExit):
        driver.main()


def test_a_v0_server_takes_the_backend_from_the_environment_and_keeps_v0_defaults_without_flags(driver, tmp_path,
                                                                                              monkeypatch):  # fmt: skip
    """vLLM 0.6.3's OpenAI server for what `vllm serve` gets on 0.26 (arguments checked against 0.6.3's own
    parser and create_engine_config on CPU, 2026-12-04)."""
    monkeypatch.setattr(driver, "MODELS", tmp_path)
    qwen_checkpoint(tmp_path, driver.QWEN)
    command, env = driver.v0_server(driver.QWEN, 8111, ["--max-num-batched-tokens", "16384",
                                                        "--attention-backend", "SPARSE_PREFILL"])  # fmt: skip
    assert env == {"VLLM_ATTENTION_BACKEND": "SPARSE_PREFILL"} and "--attention-backend" not in command
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--model") + 1] == str(tmp_path / "v0" / driver.QWEN)
    assert command[command.index("--max-model-len") + 1] == "131072"
    assert json.loads(command[command.index("--rope-scaling") + 1])["rope_type"] == "yarn"
    assert {"--enable-prefix-caching", "--enable-chunked-prefill"} <= set(command)
    assert command[-2:] == ["--max-num-batched-tokens", "16384"]
    # Upstream 0.6.3 imports its default guided backend, outlines, for every request (run 3 on the H100,
    # 2026-12-07: each request failed on `No module named 'pyairports'`); both sides take lm-format-enforcer.
    assert command[command.index("--guided-decoding-backend") + 1] == "lm-format-enforcer"
    # The scheduler's flags need chunked prefill; upstream at its defaults keeps V0's own choice.
    assert "--enable-chunked-prefill" in driver.v0_server(driver.QWEN, 8104, driver.mixed_flags("default", 20.0))[0]
    defaults, env = driver.v0_server(driver.QWEN, 8103, [])
    assert env == {} and "--enable-chunked-prefill" not in defaults
    assert defaults[defaults.index("--guided-decoding-backend") + 1] == "lm-format-enforcer"


def test_the_v0_phase_runs_alone(driver, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["vllm_e2e.py", "--phases", "v0,qwen"])
    with pytest.raises(SystemExit):
        driver.main()
    assert "runs alone" in capsys.readouterr().err


def test_needle_depths_are_eight_spread_over_the_prompt(driver):
    assert len(driver.NEEDLE_DEPTHS) == 8 and driver.NEEDLE_DEPTHS[0] == 0.05 and driver.NEEDLE_DEPTHS[-1] == 0.95


def test_the_mixed_load_and_served_ttft_go_through_the_products_client(driver):
    """The driver's requests are prefill_accel.serving's (here against the test stub: 20 ms to the first
    token, 2 ms between tokens)."""
    from types import SimpleNamespace

    from serving_stub import StubServer

    with StubServer(ttft_base=0.02, itl=0.002) as stub:
        server = SimpleNamespace(port=int(stub.url.rsplit(":", 1)[1]), model="stub-model")
        assert 0.02 <= driver.served_ttft(server, "a short prompt") < 0.5
        result = driver.mixed_load(server, ["chat one", "chat two"], "a long document " * 50, rate=20.0, seconds=1.5,
                                   seed=3)  # fmt: skip
        bodies = [entry for entry in stub.state.log if entry["path"] == "/v1/completions"]
    assert result["short_requests"] >= 10 and 20 <= result["ttft_p50_ms"] < 500
    assert 1.5 <= result["itl_p50_ms"] < 50 and result["long_ttft_ms"] >= 20
    sent, ttfts, gaps = zip(*result["requests"])
    assert len(sent) == result["short_requests"] and list(sent) == sorted(sent) and sent[-1] < 1.5
    assert min(ttfts) >= 20 and max(gaps) >= 1.5 and 0.9 <= result["long_sent_s"] < 1.5
    assert len(bodies) == 1 + result["short_requests"] + 1  # served_ttft, the chats, the long request
    assert {entry["max_tokens"] for entry in bodies} == {1, 48, 4}


def test_compilations_lists_the_warm_up_and_what_compiled_during_inference(driver, tmp_path):
    (tmp_path / "patched.log").write_text(
        "(EngineCore pid=1) INFO 12-02 09:16:28 [warmup.py:120] prefill-accel: compiled and tuned the kernels for "
        "12 / 2 heads, d=128, chunks of up to 16384 tokens, at (query, key) lengths 16384/16384 1/16385, in 40.1 s\n"
        "(EngineCore pid=1) WARNING 12-02 09:17:07 [jit_monitor.py:135] Triton kernel JIT compilation during "
        "inference: _split_attention_kernel. This causes a latency spike; consider extending warmup.\n"
        "(EngineCore pid=1) WARNING 12-02 09:18:09 [jit_monitor.py:135] Triton kernel JIT compilation during "
        "inference: _select_kernel. This causes a latency spike; consider extending warmup.\n")  # fmt: skip
    (tmp_path / "upstream.log").write_text("INFO nothing of ours\n")
    found = driver.compilations(tmp_path)
    assert list(found) == ["patched"]
    assert found["patched"]["jit_during_inference"] == ["_split_attention_kernel", "_select_kernel"]
    assert found["patched"]["warmup"] == ["for 12 / 2 heads, d=128, chunks of up to 16384 tokens, at (query, key) "
                                          "lengths 16384/16384 1/16385, in 40.1 s"]  # fmt: skip


def test_the_qwen_checks_share_the_gpu_and_every_timed_stage_waits_for_all_of_them(driver, tmp_path, monkeypatch):
    """Checks run side by side (a failing one is recorded, the rest go on); the timed stages start only
    when every check has ended, and then one at a time."""
    import argparse
    import threading
    import time

    monkeypatch.setattr(driver, "OUT_DIR", tmp_path)
    monkeypatch.setattr(driver, "SKIP", {"qwen_rope_check"})
    events, running, lock = [], [0], threading.Lock()

    def stage(name, seconds=0.05, fail=False):
        def run(*_, **__):
            with lock:
                running[0] += 1
                events.append(("start", name, running[0]))
            time.sleep(seconds)
            with lock:
                running[0] -= 1
                events.append(("end", name, running[0]))
            if fail:
                raise RuntimeError(f"{name} broke")

        return run

    monkeypatch.setattr(driver, "needle_stage", stage("needles", 0.2))
    monkeypatch.setattr(driver, "equality_stage", stage("equality", fail=True))
    monkeypatch.setattr(driver, "accuracy_stage", stage("accuracy", 0.1))
    monkeypatch.setattr(driver, "capture_stage", stage("captures"))
    monkeypatch.setattr(driver, "engine_density_stage", stage("density"))
    for name in ("offline_ttft_stage", "variant_ttft_stage", "serve_bench_stage", "layer_time_stage"):
        monkeypatch.setattr(driver, name, stage(name))
    args = argparse.Namespace(accuracy_run=["--lengths 32768", "--lengths 65536"], check_workers=3, lengths=[8192],
                              repeats=1, variant_env=[("PREFILL_ACCEL_SPLIT_KV", "0")])  # fmt: skip
    results = {}
    driver.qwen_phase(results, "0", args)

    starts = [name for kind, name, _ in events if kind == "start"]
    assert starts.count("accuracy") == 2 and "rope" not in " ".join(starts)
    timed = ["offline_ttft_stage", "variant_ttft_stage", "layer_time_stage", "serve_bench_stage"]
    assert starts[-4:] == timed
    first_timed = next(i for i, e in enumerate(events) if e[1] in timed)
    assert all(e[1] not in timed for e in events[:first_timed]) and events[first_timed - 1][2] == 0
    assert max(depth for kind, _, depth in events if kind == "start" and _ not in timed) == 3
    assert all(depth == 1 for kind, name, depth in events if kind == "start" and name in timed)
    assert "equality broke" in results["errors"]["qwen_equality"]
    assert set(results["stage_seconds"]) >= {"qwen_needles", "qwen_accuracy_1", "qwen_accuracy_2", "qwen_layer_times"}
    assert (tmp_path / "results-partial.json").is_file()


def test_the_variant_ttft_stage_runs_only_when_a_setting_is_given(driver, tmp_path, monkeypatch):
    import argparse

    monkeypatch.setattr(driver, "OUT_DIR", tmp_path)
    ran = []
    for name in ("needle_stage", "equality_stage", "capture_stage", "engine_density_stage", "rope_check_stage",
                 "offline_ttft_stage", "variant_ttft_stage", "serve_bench_stage", "layer_time_stage"):
        monkeypatch.setattr(driver, name, lambda *args, name=name, **kwargs: ran.append((name, args)))
    args = argparse.Namespace(accuracy_run=[], check_workers=2, lengths=[8192, 32768, 131072], repeats=1, variant_env=[])
    driver.qwen_phase({}, "0", args)
    assert "variant_ttft_stage" not in [name for name, _ in ran]
    args.variant_env = [driver.parse_env_setting("PREFILL_ACCEL_SPLIT_KV=0")]
    ran.clear()
    driver.qwen_phase({}, "0", args)
    (_, call_args), = [call for call in ran if call[0] == "variant_ttft_stage"]
    assert call_args[3] == [32768, 131072] and call_args[5] == {"PREFILL_ACCEL_SPLIT_KV": "0"}
    with pytest.raises(argparse.ArgumentTypeError):
        driver.parse_env_setting("no-equals-sign")


def test_ttft_pairs_name_the_two_sides_and_alternate_which_goes_first(driver, monkeypatch):
    monkeypatch.setattr(driver, "say", lambda text: None)

    class Corpus:
        def window(self, length, seed):
            return [seed] * 4

    order = []
    times = {"a": 0.2, "b": 0.1}
    table = driver.ttft_pairs("a", "b", lambda side, ids: order.append(side) or times[side], [1024], 3, Corpus(), 0,
                              ("variant", "default"))  # fmt: skip
    row = table[1024]
    assert (row["variant_ms"], row["default_ms"]) == (200.0, 100.0) and row["speedup"] == pytest.approx(2.0)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then the first side alternates


def test_a_v0_equality_report_says_why_the_teacher_forced_check_did_not_run(driver):
    results = {"engine": "vLLM 0.6.3.post1", "device": "1x GPU", "date": "2026-12-04", "v0_qwen_greedy_threshold0": {
        "model": driver.QWEN, "tp": 1, "equal": 11, "prompts": 11, "rows": [], "engine": "chunked prefill 2048",
        "teacher_forced": {"skipped": driver.V0_NO_PROMPT_LOGPROBS}}}
    text = driver.report(results)
    assert "**11/11** prompts equal" in text
    assert "teacher-forced comparison not run: vLLM 0.6.3.post1 fails prompt_logprobs on a prefix-cache hit" in text


def test_the_sglang_worker_reads_output_ids_and_top_logprobs_as_sglang_returns_them(monkeypatch):
    """SGLang's Engine.generate: one dict per prompt, "output_ids", and per position (logprob, token id, text)
    triples in meta_info (None where it has none, as for the first prompt position)."""
    import sys
    import types

    spec = importlib.util.spec_from_file_location("engine_worker", SCRIPT.with_name("engine_worker.py"))
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    calls = []

    class Engine:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def generate(self, input_ids, sampling_params, **options):
            calls.append((sampling_params, options))
            return [{"output_ids": [7, 8], "meta_info": {
                "output_top_logprobs": [[(-0.1, 7, "a"), (-2.5, 9, "b")], [(-3.0, 1, None), (-0.2, 8, None)]],
                "input_top_logprobs": [None, [(-1.0, 5, None)]]}} for _ in input_ids]

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    engine = worker.ENGINES["sglang"]({"model_path": "m"})
    tokens, tops = engine.generate([[1, 2], [3]], 2, 2)
    assert tokens == [[7, 8], [7, 8]]
    assert tops[0] == [[(7, -0.1), (9, -2.5)], [(8, -0.2), (1, -3.0)]]  # best first
    assert calls[-1] == ({"temperature": 0.0, "max_new_tokens": 2}, {"return_logprob": True, "top_logprobs_num": 2})
    assert engine.generate([[1]], 1, 0) == ([[7, 8]], None)
    assert engine.prompt_top([[1, 2]], 1) == [[None, [(5, -1.0)]]]
    assert calls[-1][1] == {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1}


def test_the_tokens_a_prefix_hit_computed_sparse_come_from_the_runtimes_own_statistics_lines(driver, tmp_path):
    """Equality's prefix-cache hit: the patched engine logs prefill_accel.stats' line once per forward (every
    layer x rank calls), and the driver reads back how many query tokens the kernel took."""
    from prefill_accel.stats import SparseCallStats

    log = tmp_path / "engine.log"
    forward = SparseCallStats(calls=28 * 2, q_tokens=28 * 2 * 1500, kept_blocks=90, causal_blocks=100)
    log.write_text(f"INFO starting\n[2026-12-04 21:03:32 TP0] {forward.line()}\nsparse prefill attention: ready\n"
                   f"{forward.line()}\n")  # fmt: skip
    lines = driver.stats_lines(log)
    assert len(lines) == 2 and lines[0].startswith("56 calls, 84000 query tokens")
    assert driver.sparse_tokens(lines[1:], 28 * 2) == 1500
    assert driver.sparse_tokens([], 28) == 0
    results = {"engine": "SGLang 0.5.16", "device": "1x GPU", "date": "2026-12-04", "sglang_smollm2_greedy_threshold0": {
        "model": "smollm2", "tp": 1, "equal": 11, "prompts": 11, "rows": [], "engine": "chunked prefill 2048",
        "prefix_hit": {"prompt_tokens": 4572, "shared_prefix_tokens": 3072, "computed_sparse_tokens": 1500}}}
    assert "prefix-cache hit: 1500 of its 4572 tokens computed by the sparse kernel" in driver.report(results)


def test_bench_serving_sends_corpus_text_as_token_ids_and_keeps_each_requests_outcome(driver, tmp_path, monkeypatch):
    """SGLang's bench_serving warms up with its first measured prompt; without --flush-cache that request is
    a full radix-cache hit (run 1, 2026-12-04: one of five TTFTs near zero). Its prompts are the corpus's
    text, one dataset entry per request longer than the length, sent as token ids cut to the length asked
    (run 4, 2026-12-06: as text they came back another length; run 5: its random-ids prompts failed at
    131008). A run that records no first token has no figure and keeps why. Its runs share one process,
    upstream and patched in turn at each length."""
    calls = []

    def run(command, input, **kwargs):
        runs = json.loads(input)
        calls.append((command, runs))
        for i, argv in enumerate(runs[:-1]):  # the last run writes nothing, as a failed one
            out = Path(argv[argv.index("--output-file") + 1])
            port = argv[argv.index("--base-url") + 1].rsplit(":", 1)[1]
            ttft = 0.0 if i == 2 else 100.0 if port == "8111" else 50.0  # the third recorded no first token
            errors = ["Traceback ...\nValueError: too long"] if i == 2 else [""]
            out.write_text(json.dumps({"median_ttft_ms": ttft, "ttfts": [ttft / 1e3], "errors": errors}) + "\n")
        return type("Done", (), {"stdout": "", "stderr": "", "returncode": 1})()

    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

    class Corpus:
        def window(self, length, index):
            return list(range(index, index + length))

    monkeypatch.setattr(driver.subprocess, "run", run)
    monkeypatch.setattr(driver, "OUT_DIR", tmp_path)
    monkeypatch.setattr(driver, "LOGS", tmp_path)
    server = type("Server", (), {"model": "m"})
    up, pa = server(), server()
    up.port, pa.port = 8111, 8112
    args = type("Args", (), {"lengths": [8192, 16384], "repeats": 5})()
    result = driver.sglang_bench_serving(up, pa, driver.QWEN, Tok(), Corpus(), args)
    (command, runs), = calls
    assert command[-1].endswith("sglang_bench_serving.py") and len(runs) == 4
    assert all("--flush-cache" in argv and "--tokenize-prompt" in argv and "--output-details" in argv for argv in runs)
    assert "--flush-cache" in result["command"] and "--tokenize-prompt" in result["command"]
    assert [argv[argv.index("--base-url") + 1][-4:] for argv in runs] == ["8111", "8112", "8111", "8112"]
    for argv, length in zip(runs, (8192, 8192, 16384, 16384)):
        assert argv[argv.index("--dataset-name") + 1] == "random"
        assert argv[argv.index("--random-input-len") + 1] == str(length)
        entries = json.loads(Path(argv[argv.index("--dataset-path") + 1]).read_text())
        texts = [entry["conversations"][0]["value"] for entry in entries]
        assert len(texts) == 6 and len(set(texts)) == 6  # the warm-up's and five unique prompts
        assert all(len(text.split()) > length for text in texts)
    assert runs[0][runs[0].index("--dataset-path") + 1] != runs[2][runs[2].index("--dataset-path") + 1]
    assert result["by_length"][8192]["speedup"] == 2.0 and result["exit"] == 1
    assert result["by_length"][8192]["upstream_ttfts_ms"] == [100.0]
    assert result["by_length"][16384]["upstream_error"].endswith("ValueError: too long")
    assert result["by_length"][16384]["patched_error"].startswith("no result written")
    assert result["by_length"][16384]["patched_ms"] is None and "speedup" not in result["by_length"][16384]


def test_the_engine_phases_run_the_measured_stages_last_and_smollm2_ttft_on_sglang_only(driver, monkeypatch):
    """The served TTFT, the longest stage, comes last; SmolLM2's TTFT past its 8K needs a rotary-table override
    that only SGLang takes (V0 refuses hf_overrides other than rope scaling)."""
    monkeypatch.setattr(driver, "ENGINE", driver.ENGINE)  # engine_phase sets it: restored afterwards
    monkeypatch.setattr(driver, "tokenizer_for", lambda model: None)
    monkeypatch.setattr(driver, "Corpus", lambda tok, n: None)
    for engine, tag in (("sglang", "sglang"), ("vllm-v0", "v0")):
        names = []
        monkeypatch.setattr(driver, "run_stage", lambda results, name, stage: names.append(name))
        driver.engine_phase({}, "0", None, engine, tag)
        expected = [f"{tag}_{s}" for s in ("equality", "needles", "offline_ttft", "mixed_load", "smol_equality")]
        expected += [f"{tag}_smol_offline_ttft"] if engine == "sglang" else []
        assert names == expected + [f"{tag}_serve"]


def test_the_mixed_load_runs_one_patched_server_per_target_factor_after_upstreams(driver, monkeypatch):
    """--mixed-target-factors 1.3,3: upstream's defaults first (their unloaded ITL p99 sets the targets), then
    upstream with the engine arguments, then one patched server per target, each with the scheduler flags."""
    import contextlib

    started = []

    @contextlib.contextmanager
    def serving(name, side, gpus, model, port, flags):
        started.append((name, side, flags))
        yield name

    def run_mixed(server, prompts, args):
        return {window: {"ttft_p99_ms": 20.0, "itl_p99_ms": 3.5} for window in ("unloaded", "loaded")}

    monkeypatch.setattr(driver, "ENGINE", "sglang")
    monkeypatch.setattr(driver, "serving", serving)
    monkeypatch.setattr(driver, "run_mixed", run_mixed)
    monkeypatch.setattr(driver, "chat_prompt", lambda tok, corpus, rng, length, i: [i])
    corpus = type("Corpus", (), {"window": lambda self, length, index: [index] * length})()
    args = type("Args", (), {"mixed_rate": 4.0, "mixed_seconds": 2.0, "mixed_long": 64, "mixed_target_ms": None,
                             "mixed_target_factors": "1.3,3", "mixed_backends": "SPARSE_PREFILL",
                             "mixed_engine_args": "--enable-mixed-chunk"})()  # fmt: skip
    results = {}
    driver.mixed_stage(results, "0", None, corpus, Path("m"), args)
    assert [(name, side) for name, side, _ in started] == [
        ("mixed-upstream", "upstream"), ("mixed-upstream-args", "upstream"),
        ("mixed-patched-0", "patched"), ("mixed-patched-1", "patched")]
    targets = [flags[flags.index("--max-step-latency-ms") + 1] for _, side, flags in started if side == "patched"]
    assert targets == ["4.5", "10.5"] and all("--enable-mixed-chunk" in flags for _, _, flags in started[1:])
    assert len(results["mixed_load"]["configs"]) == 4


def test_the_step_target_follows_upstreams_decode_latency_where_decodes_ride_in_the_step(driver, monkeypatch):
    assert driver.mixed_target([], 3.5) == 4.5  # vLLM: 1.3x, rounded
    assert driver.mixed_target([], 2.0) == 4.0  # at least 4 ms
    monkeypatch.setattr(driver, "ENGINE", "sglang")
    assert driver.mixed_target([], 3.5) == driver.SGLANG_STEP_TARGET_MS  # prefill-only batches: the chats' TTFT
    assert driver.mixed_target(["--enable-mixed-chunk"], 3.5) == 4.5
    assert driver.mixed_target(["--enable-mixed-chunk"], 3.5, 3.0) == 10.5  # --mixed-target-factors 1.3,3
    assert driver.mixed_target([], 3.5, 3.0) == driver.SGLANG_STEP_TARGET_MS


def test_a_failed_stage_names_the_last_exception_of_each_server_it_started(driver, tmp_path, monkeypatch, capsys):
    """vLLM 0.6.3's server failed every request after its 200 header (outlines could not be imported): the
    client saw only a stream that ended early; the stage's failure now carries the server log's reason."""
    logs = [tmp_path / "earlier.log", tmp_path / "serve-upstream.log", tmp_path / "serve-patched.log"]
    logs[0].write_text("ValueError: a failure of an earlier stage\n")
    logs[1].write_text("INFO started\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                       "ModuleNotFoundError: No module named 'pyairports'\nINFO still serving\n")
    logs[2].write_text("INFO started\n")
    monkeypatch.setattr(driver, "SERVER_LOGS", logs[:1])
    monkeypatch.setattr(driver, "OUT_DIR", tmp_path, raising=False)

    def stage():
        driver.SERVER_LOGS.extend(logs[1:])
        raise RuntimeError("POST /v1/completions: the stream ended before its last event")

    results = {}
    driver.run_stage(results, "v0_serve", stage)
    said = capsys.readouterr().out
    assert "serve-upstream.log: ModuleNotFoundError: No module named 'pyairports'" in said
    assert "earlier.log" not in said and "serve-patched.log" not in said
    assert "pyairports" in results["errors"]["v0_serve"]


def test_a_served_pair_starts_side_by_side_on_vllm_026_and_one_at_a_time_elsewhere(driver, monkeypatch):
    """Run 15 (H100, 2026-12-07): the two servers started one after the other and the session's device time
    ended while the second compiled; vLLM 0.26's are given their KV cache in bytes, so both start at once."""
    import threading

    events, both_started = [], threading.Barrier(2, timeout=30)

    class Server:
        def __init__(self, name, *rest):
            self.name = name
            events.append(("start", name))

        def wait_ready(self):
            if driver.ENGINE == "vllm":
                both_started.wait()  # breaks (and the test fails) unless the other has started too
            events.append(("ready", self.name))
            if self.name == "broken":
                raise driver.EngineError("broken exited")

        def close(self):
            events.append(("close", self.name))

    monkeypatch.setattr(driver, "Server", Server)
    with driver.serving_pair(("up",), ("pa",)) as (up, pa):
        assert (up.name, pa.name) == ("up", "pa")
    assert set(events[:2]) == {("start", "up"), ("start", "pa")}
    assert set(events[-2:]) == {("close", "up"), ("close", "pa")}
    events.clear()
    both_started.reset()
    with pytest.raises(driver.EngineError, match="broken exited"), driver.serving_pair(("up",), ("broken",)):
        pass
    assert {("close", "up"), ("close", "broken")} <= set(events)
    events.clear()
    monkeypatch.setattr(driver, "ENGINE", "vllm-v0")  # V0 sizes its memory from what is free: one at a time
    with driver.serving_pair(("up",), ("pa",)):
        pass
    assert [kind for kind, _ in events] == ["start", "ready", "start", "ready", "close", "close"]
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1]
