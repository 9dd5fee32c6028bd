"""prefill-accel: the SPARSE_PREFILL attention backend of the patched vLLM, on CPU.

The backend's forward runs for real: long prefill rows through prefill_accel's Triton kernels (the
interpreter without a GPU), the other rows through upstream's FlashAttentionImpl.forward, whose
``flash_attn_varlen_func`` (a CUDA kernel) is replaced by the dense PyTorch reference of
prefill_accel. Batches mix decodes, short prefills, a chunked-prefill continuation over a cached
prefix and a fresh long prefill, and are checked row by row against dense attention over the
whole batch. The flags are checked through vLLM's own parser and create_engine_config, in a fresh
interpreter (vLLM resolves its platform once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
from prefill_accel import SparsePrefillConfig  # noqa: E402
from prefill_accel.ops import attention_reference  # noqa: E402
from prefill_accel.api import _unsupported_reason  # noqa: E402
from prefill_accel.flags import kernel_field  # noqa: E402

from vllm.config.attention import AttentionConfig  # noqa: E402
from vllm.config.sparse_prefill import SPARSE_PREFILL_FIELDS, flag, sparse_prefill_settings  # noqa: E402
from vllm.v1.attention.backends import flash_attn, sparse_prefill_attn  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.sparse_prefill_runs import RequestRun, split_long_prefills, with_layouts  # noqa: E402

TREE = Path(__file__).resolve().parents[2]
HEAD_DIM = 64
PAGE = 16
MIN_LEN = 64  # the smallest block size, so a tiny batch still has a long prefill
SPLIT = SparsePrefillConfig(block_size=64, min_q_len=MIN_LEN)  # what the builder splits a step by
# (q_len, prefix_len): decode, decode, short prefill, long continuation over a cached prefix,
# fresh long prefill, short continuation.
MIXED_BATCH = [(1, 39), (1, 76), (20, 0), (70, 100), (130, 0), (5, 60)]


def cu(lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


# ---- metadata translation ----------------------------------------------------------------------


def test_split_cuts_the_batch_into_runs_in_order():
    q_lens = [q for q, _ in MIXED_BATCH]
    seq_lens = torch.tensor([q + p for q, p in MIXED_BATCH], dtype=torch.int32)
    runs = split_long_prefills(cu(q_lens), seq_lens, len(q_lens), SPLIT)
    assert runs == (
        RequestRun(sparse=False, req_start=0, req_end=3, token_start=0, token_end=22, max_query_len=20),
        RequestRun(sparse=True, req_start=3, req_end=5, token_start=22, token_end=222, max_query_len=130),
        RequestRun(sparse=False, req_start=5, req_end=6, token_start=222, token_end=227, max_query_len=5),
    )


def test_split_leaves_short_batches_to_upstream_and_ignores_padding():
    assert split_long_prefills(cu([1, 1, 63]), torch.tensor([500, 500, 63]), 3, SPLIT) is None
    padded = torch.cat([cu([64, 1]), torch.tensor([65, 65], dtype=torch.int32)])
    assert split_long_prefills(padded, torch.tensor([64, 70, 0, 0]), 2, SPLIT) == (
        RequestRun(sparse=True, req_start=0, req_end=1, token_start=0, token_end=64, max_query_len=64),
        RequestRun(sparse=False, req_start=1, req_end=2, token_start=64, token_end=65, max_query_len=1),
    )


# ---- the backend's forward ---------------------------------------------------------------------


def reference_flash_attn_varlen_func(calls, windows):
    """flash_attn_varlen_func over a paged cache, computed by prefill_accel's dense reference (full
    causal attention: the window is recorded, not applied)."""

    def fa(*, q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, window_size, **_):
        assert causal is True
        calls.append(cu_seqlens_q.diff().tolist())
        windows.append(list(window_size))
        o, _ = attention_reference.dense_paged_attention(q, k, v, block_table, cu_seqlens_q, seqused_k, softmax_scale)
        out.copy_(o.to(out.dtype))
        return out

    return fa


def paged_batch(batch, num_heads, num_kv_heads, seed=0):
    """Queries and a vLLM FlashAttention KV cache (logical (blocks, kv_heads, page, 2*D), NHD memory)
    holding every request's prefix and this step's keys, with pages scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in batch]
    pages = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.zeros(len(batch), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        block_table[i, :n] = order[used : used + n]
        used += n
    kv = torch.randn(num_blocks, PAGE, num_kv_heads, 2 * HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv_cache = kv.permute(0, 2, 1, 3)
    query = torch.randn(sum(q for q, _ in batch), num_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    return query, kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32)


def metadata_for(batch, block_table, seq_lens, min_len=MIN_LEN, layouts_for=None):
    """The step's metadata as the builder makes it; with ``layouts_for`` (a kernel config) the
    sparse runs carry their host-built layouts, as in the engine."""
    q_lens = [q for q, _ in batch]
    query_start_loc = cu(q_lens)
    runs = split_long_prefills(query_start_loc, seq_lens, len(batch), SPLIT.replace(min_q_len=min_len))
    if layouts_for is not None:
        runs = with_layouts(runs, query_start_loc, seq_lens, layouts_for, torch.device("cpu"))
    return sparse_prefill_attn.SparsePrefillMetadata(
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=torch.empty(0, dtype=torch.int64),
        use_cascade=False,
        common_prefix_len=0,
        cu_prefix_query_lens=None,
        prefix_kv_lens=None,
        suffix_kv_lens=None,
        sparse_runs=runs,
    )


@pytest.fixture
def backend(monkeypatch):
    """Build the backend's Impl as vLLM does, with FlashAttention's CUDA kernel replaced by the reference."""
    fa_calls, fa_windows, sparse_calls, sparse_layouts = [], [], [], []
    fa = reference_flash_attn_varlen_func(fa_calls, fa_windows)
    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", fa, raising=False)
    real_sparse = sparse_prefill_attn.sparse_prefill_attention

    def spy(q, *args, **kwargs):
        sparse_calls.append(q.shape[0])
        sparse_layouts.append(kwargs.get("layout"))
        return real_sparse(q, *args, **kwargs)

    monkeypatch.setattr(sparse_prefill_attn, "sparse_prefill_attention", spy)

    def make(num_heads, num_kv_heads, sliding_window=None, **flags):
        flags = {"sparse_prefill_block_size": 64, "sparse_prefill_min_len": MIN_LEN, "sparse_prefill_threshold": 0.0, **flags}
        config = SimpleNamespace(attention_config=AttentionConfig(backend="SPARSE_PREFILL", **flags))
        monkeypatch.setattr(sparse_prefill_attn, "get_current_vllm_config", lambda: config)
        impl = sparse_prefill_attn.SparsePrefillAttentionImpl(
            num_heads, HEAD_DIM, HEAD_DIM**-0.5, num_kv_heads, None, sliding_window, "auto"
        )
        impl.vllm_flash_attn_version = 3  # what get_flash_attn_version() reports on a Hopper GPU
        return impl

    return SimpleNamespace(
        make=make, fa_calls=fa_calls, fa_windows=fa_windows, sparse_calls=sparse_calls, sparse_layouts=sparse_layouts
    )


def layer(name="model.layers.3.self_attn.attn"):
    one = torch.ones((), dtype=torch.float32)
    return SimpleNamespace(layer_name=name, _q_scale=one, _k_scale=one, _v_scale=one)


def run_forward(impl, query, kv_cache, metadata, the_layer=None):
    output = torch.full_like(query, float("nan"))
    impl.forward(the_layer or layer(), query, None, None, kv_cache, metadata, output)
    return output


def dense_expected(query, kv_cache, block_table, batch, seq_lens):
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
    o, _ = attention_reference.dense_paged_attention(
        query, key_cache, value_cache, block_table, cu([q for q, _ in batch]), seq_lens, HEAD_DIM**-0.5
    )
    return o


def assert_close_rows(actual, expected):
    assert not actual.isnan().any(), "some output rows were never written"
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_mixed_batch_rows_land_where_they_belong(backend):
    impl = backend.make(num_heads=4, num_kv_heads=2)
    query, kv_cache, block_table, seq_lens = paged_batch(MIXED_BATCH, 4, 2)
    metadata = metadata_for(MIXED_BATCH, block_table, seq_lens)
    key_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)[0]
    assert _unsupported_reason(query, key_cache) is None, "the kernels would not run on vLLM's cache view"
    output = run_forward(impl, query, kv_cache, metadata)
    # Decodes and short prefills went to FlashAttention, the two long prefills to the kernel, once each.
    assert backend.fa_calls == [[1, 1, 20], [5]] and backend.fa_windows == [[-1, -1]] * 2
    assert backend.sparse_calls == [200]
    assert_close_rows(output, dense_expected(query, kv_cache, block_table, MIXED_BATCH, seq_lens))


def test_sparse_rows_match_the_kernel_on_those_requests_alone(backend):
    """With real pruning, the long-prefill rows equal the kernel's output computed on those requests by
    themselves, so the batch translation (row offsets, block-table rows, sequence lengths) is exact."""
    batch = [(1, 39), (70, 300), (260, 0), (5, 60)]  # long enough for key blocks off the diagonal and sink
    impl = backend.make(num_heads=4, num_kv_heads=2, sparse_prefill_threshold=1.0, sparse_prefill_local_blocks=0)
    query, kv_cache, block_table, seq_lens = paged_batch(batch, 4, 2, seed=1)
    output = run_forward(impl, query, kv_cache, metadata_for(batch, block_table, seq_lens))
    assert backend.fa_calls == [[1], [5]] and backend.sparse_calls == [330]
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
    long_rows = slice(1, 331)
    alone, _ = sparse_prefill_attn.sparse_prefill_attention(
        query[long_rows].contiguous(), key_cache, value_cache, block_table[1:3].contiguous(), cu([70, 260]),
        seq_lens[1:3].contiguous(), config=impl.settings.kernel, softmax_scale=HEAD_DIM**-0.5,
    )
    torch.testing.assert_close(output[long_rows], alone, atol=0, rtol=0)
    dense = dense_expected(query, kv_cache, block_table, batch, seq_lens)
    assert (output[long_rows].float() - dense[long_rows].float()).abs().max() > 0.1, "nothing was pruned"
    assert_close_rows(output[:1], dense[:1])
    assert_close_rows(output[331:], dense[331:])


def test_host_built_layouts_reach_the_kernel_and_change_nothing(backend):
    batch = [(1, 39), (70, 300), (260, 0), (5, 60)]
    impl = backend.make(num_heads=4, num_kv_heads=2, sparse_prefill_threshold=1.0, sparse_prefill_local_blocks=0)
    query, kv_cache, block_table, seq_lens = paged_batch(batch, 4, 2, seed=1)
    without = run_forward(impl, query, kv_cache, metadata_for(batch, block_table, seq_lens))
    with_layout = run_forward(
        impl, query, kv_cache, metadata_for(batch, block_table, seq_lens, layouts_for=impl.settings.kernel)
    )
    assert backend.sparse_layouts[0] is None
    layout = backend.sparse_layouts[1]
    assert layout.q_lens == (70, 260) and layout.k_lens == (370, 260)
    torch.testing.assert_close(with_layout, without, atol=0, rtol=0)


def test_tensor_parallel_rank_computes_its_head_slice(backend):
    """Rank 1 of TP=2 for a model with 8 query and 4 KV heads holds query heads 4..7 and KV heads 2..3."""
    query, kv_cache, block_table, seq_lens = paged_batch(MIXED_BATCH, 8, 4, seed=2)
    full = dense_expected(query, kv_cache, block_table, MIXED_BATCH, seq_lens)
    rank_query, rank_cache = query[:, 4:].contiguous(), kv_cache[:, 2:]
    impl = backend.make(num_heads=4, num_kv_heads=2)
    output = run_forward(impl, rank_query, rank_cache, metadata_for(MIXED_BATCH, block_table, seq_lens))
    assert backend.sparse_calls == [200]
    assert_close_rows(output, full[:, 4:])


def test_decode_and_short_batches_run_upstreams_path_untouched(backend):
    batch = [(1, 30), (1, 50), (40, 0)]
    impl = backend.make(num_heads=4, num_kv_heads=2)
    query, kv_cache, block_table, seq_lens = paged_batch(batch, 4, 2)
    metadata = metadata_for(batch, block_table, seq_lens)
    assert metadata.sparse_runs is None
    output = run_forward(impl, query, kv_cache, metadata)
    assert backend.fa_calls == [[1, 1, 40]] and backend.sparse_calls == []
    assert_close_rows(output, dense_expected(query, kv_cache, block_table, batch, seq_lens))


@pytest.mark.parametrize(
    "make_kwargs, window, reason",
    [
        ({"sliding_window": 32}, [31, 0], "sliding window"),
        ({"sparse_prefill_dense_layers": 4}, [-1, -1], "--sparse-prefill-dense-layers"),
    ],
)
def test_dense_layers_never_take_the_sparse_path(backend, make_kwargs, window, reason):
    """A sliding-window layer (Gemma 3's local layers) and the first dense layers run upstream's
    forward on the whole step, window included."""
    impl = backend.make(num_heads=4, num_kv_heads=2, **make_kwargs)
    batch = [(1, 30), (70, 0)]
    query, kv_cache, block_table, seq_lens = paged_batch(batch, 4, 2)
    run_forward(impl, query, kv_cache, metadata_for(batch, block_table, seq_lens))
    assert backend.sparse_calls == [] and backend.fa_calls == [[1, 70]] and backend.fa_windows == [window]
    assert reason in impl.dense_reason


def test_layer_past_the_dense_layers_goes_sparse(backend):
    impl = backend.make(num_heads=4, num_kv_heads=2, sparse_prefill_dense_layers=4)
    batch = [(70, 0)]
    query, kv_cache, block_table, seq_lens = paged_batch(batch, 4, 2)
    run_forward(impl, query, kv_cache, metadata_for(batch, block_table, seq_lens), layer("model.layers.4.self_attn.attn"))
    assert backend.sparse_calls == [70] and impl.dense_reason is None


def test_builder_hands_back_upstreams_metadata_for_steps_without_a_long_prefill(monkeypatch):
    """Decode steps and short prefills get upstream's own metadata object: nothing is copied or added."""
    upstream = object()
    monkeypatch.setattr(sparse_prefill_attn.FlashAttentionMetadataBuilder, "build", lambda self, *args, **kwargs: upstream)
    builder = sparse_prefill_attn.SparsePrefillMetadataBuilder.__new__(sparse_prefill_attn.SparsePrefillMetadataBuilder)
    builder.kernel_config = SPLIT
    assert builder.build(0, types.SimpleNamespace(max_query_len=MIN_LEN - 1, max_seq_len=MIN_LEN - 1)) is upstream
    # Decodes at a long context: a block of queries short of the work, whatever the keys.
    assert builder.build(0, types.SimpleNamespace(max_query_len=1, max_seq_len=10**6)) is upstream


def test_builder_turns_cascade_attention_off_for_steps_with_a_long_prefill():
    builder = sparse_prefill_attn.SparsePrefillMetadataBuilder.__new__(sparse_prefill_attn.SparsePrefillMetadataBuilder)
    builder.kernel_config, builder.max_model_len = SPLIT, 4096
    kwargs = dict(num_query_heads=32, num_kv_heads=8, use_alibi=False, use_sliding_window=False,
                  use_local_attention=False, num_sms=132, dcp_world_size=1)
    assert not builder.use_cascade_attention(common_prefix_len=4096, query_lens=np.array([1] * 40 + [MIN_LEN]), **kwargs)
    assert builder.use_cascade_attention(common_prefix_len=4096, query_lens=np.array([1] * 64), **kwargs)


# ---- registry and flags -----------------------------------------------------------------------


def test_backend_is_named_in_the_registry():
    backend = AttentionBackendEnum["SPARSE_PREFILL"]
    assert backend.get_class() is sparse_prefill_attn.SparsePrefillAttentionBackend
    assert backend.get_class().get_name() == backend.name


def test_the_flags_help_is_the_runtimes():
    """vLLM builds --help from AttentionConfig's field docstrings: they say what the runtime's help says."""
    from vllm.config.sparse_prefill import FACTS
    from vllm.config.utils import get_attr_docs

    docs = get_attr_docs(AttentionConfig)
    for name in SPARSE_PREFILL_FIELDS:
        assert " ".join(docs[name].split()) == FACTS.help(name.removeprefix("sparse_prefill_")), name


def test_every_kernel_setting_has_a_flag_with_the_kernels_default():
    kernel_fields = {f for f in SparsePrefillConfig.__dataclass_fields__}
    flagged = {kernel_field(name.removeprefix("sparse_prefill_")) for name in SPARSE_PREFILL_FIELDS}
    assert flagged == kernel_fields | {"dense_layers"}
    settings = sparse_prefill_settings(AttentionConfig())
    assert settings.kernel == SparsePrefillConfig() and settings.dense_layers == 0


FLAGS_SCRIPT = r"""
import json, logging, sys
import vllm.platforms
if vllm.platforms.current_platform.is_unspecified():
    from vllm.platforms.cpu import CpuPlatform
    vllm.platforms.current_platform = CpuPlatform()
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

records = []
handler = logging.Handler()
handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
logging.getLogger("vllm").addHandler(handler)
model = sys.argv[1]
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
results = {"help": parser.format_help()}
for name, argv in json.loads(sys.argv[2]).items():
    records.clear()
    try:
        config = EngineArgs.from_cli_args(parser.parse_args(["--model", model, "--skip-tokenizer-init", *argv]))
        config = config.create_engine_config().attention_config
        results[name] = {"config": {k: v for k, v in vars(config).items() if k.startswith("sparse_prefill_")},
                         "log": [r for r in records if "sparse-prefill" in r[1] or "SPARSE_PREFILL" in r[1]]}
    except Exception as error:
        results[name] = {"error": f"{type(error).__name__}: {error}"}
print("RESULTS" + json.dumps(results))
"""

FLAG_CASES = {
    "given": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-threshold", "0.01", "--sparse-prefill-min-len",
              "4096", "--sparse-prefill-dense-layers", "2", "--sparse-prefill-mean-correction",
              "--sparse-prefill-estimator", "exact", "--sparse-prefill-exact-rows", "2", "--max-num-batched-tokens", "4096"],
    # Schedules whose chunks take the sparse path at no context the tiny model holds (4096 tokens): chunks
    # of 512 bring half a 4096-token prompt's work from a context of 4352.
    "inert_budget": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-min-len", "4096",
                     "--max-num-batched-tokens", "512"],
    "inert_long_chunks": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-min-len", "4096",
                          "--max-num-batched-tokens", "4096", "--max-num-partial-prefills", "2"],
    "inert_model_len": ["--attention-backend", "SPARSE_PREFILL", "--max-num-batched-tokens", "16384"],
    "defaults": ["--attention-backend", "SPARSE_PREFILL"],
    "json_and_flag": ["--attention-backend", "SPARSE_PREFILL", "-ac", '{"sparse_prefill_sink_blocks": 3}',
                      "--sparse-prefill-local-blocks", "5"],
    "bad_threshold": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-threshold", "2"],
    "bad_block_size": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-block-size", "100"],
    "bad_stride": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-query-stride", "5"],
    "bad_estimator": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-estimator", "mean"],
    "min_len_below_block": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-min-len", "32"],
    "bad_dense_layers": ["--attention-backend", "SPARSE_PREFILL", "--sparse-prefill-dense-layers", "-1"],
    "other_backend": ["--sparse-prefill-threshold", "0.01"],
}


@pytest.fixture(scope="module")
def flag_results(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-llama")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
    }))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(TREE), os.environ.get("PYTHONPATH")) if p),
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(FLAGS_SCRIPT), str(model), json.dumps(FLAG_CASES)],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS")]
    assert lines, f"flag script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS"))


def test_flags_are_in_serve_help(flag_results):
    for name in SPARSE_PREFILL_FIELDS:
        assert flag(name) in flag_results["help"]
    assert "--no-sparse-prefill-mean-correction" in flag_results["help"]


def test_flags_reach_the_attention_config_and_are_logged_once(flag_results):
    given = flag_results["given"]
    assert "error" not in given, given.get("error")
    assert given["config"]["sparse_prefill_threshold"] == 0.01
    assert given["config"]["sparse_prefill_min_len"] == 4096
    assert given["config"]["sparse_prefill_dense_layers"] == 2
    assert given["config"]["sparse_prefill_mean_correction"] is True
    assert given["config"]["sparse_prefill_estimator"] == "exact"
    assert given["config"]["sparse_prefill_exact_rows"] == 2
    [(level, message)] = given["log"]
    assert level == "INFO"
    for text in ("--sparse-prefill-threshold=0.01", "--sparse-prefill-min-len=4096", "--sparse-prefill-dense-layers=2",
                 "--sparse-prefill-mean-correction=True", "--sparse-prefill-block-size=128",
                 "--sparse-prefill-estimator=exact", "--sparse-prefill-exact-rows=2"):
        assert text in message
    assert flag_results["defaults"]["config"]["sparse_prefill_threshold"] == AttentionConfig.sparse_prefill_threshold


def test_flags_override_the_attention_config_json(flag_results):
    config = flag_results["json_and_flag"]["config"]
    assert config["sparse_prefill_sink_blocks"] == 3 and config["sparse_prefill_local_blocks"] == 5


@pytest.mark.parametrize(
    "case, named",
    [
        ("bad_threshold", "--sparse-prefill-threshold"),
        ("bad_block_size", "--sparse-prefill-block-size"),
        ("bad_stride", "--sparse-prefill-query-stride"),
        ("bad_estimator", "--sparse-prefill-estimator"),
        ("min_len_below_block", "--sparse-prefill-min-len"),
        ("bad_dense_layers", "--sparse-prefill-dense-layers"),
    ],
)
def test_invalid_flags_fail_at_startup_naming_the_flag(flag_results, case, named):
    error = flag_results[case].get("error", "")
    assert error.startswith("ValueError") and named in error, error


@pytest.mark.parametrize(
    "case, named",
    [
        ("inert_budget", "--max-num-batched-tokens caps a prefill chunk at 512 tokens"),
        # vLLM's default cap of long prefills with partial prefills on: 4% of the model length.
        ("inert_long_chunks", "--long-prefill-token-threshold caps a prefill chunk at 163 tokens"),
        ("inert_model_len", "--max-model-len caps a prefill chunk at 4096 tokens"),
    ],
)
def test_a_schedule_that_leaves_the_backend_inert_is_said_at_startup(flag_results, case, named):
    result = flag_results[case]
    assert "error" not in result, result.get("error")
    [warning] = [message for level, message in result["log"] if level == "WARNING"]
    assert warning.startswith(f"SPARSE_PREFILL never runs: {named}, which takes the sparse path under "
                              "--sparse-prefill-min-len="), warning  # fmt: skip
    assert "beyond the 4096 the engine holds" in warning
    assert warning.endswith("every prefill uses FlashAttention")
    assert not [message for level, message in flag_results["given"]["log"] if level == "WARNING"]


def test_flags_without_the_backend_warn(flag_results):
    [(level, message)] = flag_results["other_backend"]["log"]
    assert level == "WARNING" and "--sparse-prefill-threshold" in message and "SPARSE_PREFILL" in message
