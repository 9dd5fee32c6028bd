"""prefill-accel: the SPARSE_PREFILL attention backend on vLLM 0.6.3 (V0), on CPU: the glue from V0's
metadata to the kernel's arguments, with the kernel itself.

Long prefill rows run through prefill_accel's Triton kernels under the Triton that torch 2.4 (vLLM
0.6.3's image) pins, 3.0, in its interpreter (the test environment holds it:
docker/requirements/vllm-0.6.3.post1-cpu.txt); FlashAttention's CUDA kernels and the cache-write op
are replaced by prefill_accel's float32 reference (the real ones need a GPU). A step mixes a long
continuation chunk (prefix in the cache, goes sparse), a short prefill (FlashAttention) and two
decodes (FlashAttention with the KV cache).
"""

import argparse
import os
import re
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from prefill_accel import BatchLayout, sparse_prefill_attention  # noqa: E402
from prefill_accel.ops import attention_reference  # noqa: E402
from prefill_accel.flags import SUFFIXES, settings_from_flags  # noqa: E402


def _reference_varlen(*, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, block_table, **_):
    assert causal is True
    o, _ = attention_reference.dense_paged_attention(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k.diff(), softmax_scale)
    return o.to(q.dtype)


def _reference_with_kvcache(*, q, k_cache, v_cache, block_table, cache_seqlens, softmax_scale, causal, **_):
    batch = q.shape[0]
    cu = torch.arange(batch + 1, dtype=torch.int32)
    o, _ = attention_reference.dense_paged_attention(q.squeeze(1), k_cache, v_cache, block_table, cu, cache_seqlens,
                                           softmax_scale)
    return o.to(q.dtype).unsqueeze(1)


# vllm.vllm_flash_attn loads CUDA libraries at import; the backend modules get the reference instead.
sys.modules.setdefault("vllm.vllm_flash_attn", types.SimpleNamespace(
    flash_attn_varlen_func=_reference_varlen, flash_attn_with_kvcache=_reference_with_kvcache))

from vllm.attention.backends import sparse_prefill_attn  # noqa: E402
from vllm.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata  # noqa: E402
from vllm.attention.selector import _Backend, backend_name_to_enum, get_attn_backend  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sparse_prefill import (FACTS, check_sparse_prefill_flags, check_sparse_prefill_schedule,  # noqa: E402
                                 name_sparse_prefill_layers)

PAGE, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 64
# (query tokens, cached prefix) per request: a long continuation chunk, a short prefill, two decodes.
BATCH = [(200, 100), (40, 20), (1, 50), (1, 70)]
NUM_PREFILLS = 2


def write_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    key_cache.view(-1, KV_HEADS, HEAD_DIM)[slot_mapping] = key
    value_cache.view(-1, KV_HEADS, HEAD_DIM)[slot_mapping] = value


@pytest.fixture
def step(monkeypatch):
    """The backend with FlashAttention and the cache write on the reference, the kernel itself for the
    sparse path; spies on each path."""
    calls = {"sparse": [], "varlen": [], "kvcache": []}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls[name].append((args[0] if args else kwargs["q"]).shape[0])
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(sparse_prefill_attn, "sparse_prefill_attention", spy("sparse", sparse_prefill_attention))
    monkeypatch.setattr(sparse_prefill_attn, "flash_attn_varlen_func", spy("varlen", _reference_varlen))
    monkeypatch.setattr(sparse_prefill_attn, "flash_attn_with_kvcache", spy("kvcache", _reference_with_kvcache))
    monkeypatch.setattr(sparse_prefill_attn, "ops", types.SimpleNamespace(reshape_and_cache_flash=write_cache))
    return calls


def make_impl(layer="model.layers.3.self_attn.attn", **flags):
    impl = sparse_prefill_attn.SparsePrefillAttentionImpl(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, None,
                                                          "auto")
    impl.configure_sparse_prefill(settings_from_flags({"block_size": 64, "min_len": 128, **flags}), layer)
    return impl


def make_step(seed=0):
    """Queries, new keys/values, a V0 KV cache (2, blocks, page, kv_heads, dim) holding the prefixes, and
    the step's FlashAttentionMetadata."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in BATCH]
    pages = [-(-s // PAGE) for s in seq_lens]
    order = torch.randperm(sum(pages) + 2, generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(BATCH), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        block_tables[i, :n] = order[used:used + n]
        used += n
    kv_cache = torch.randn(2, len(order), PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    num_tokens = sum(q for q, _ in BATCH)
    query = torch.randn(num_tokens, HEADS * HEAD_DIM, generator=gen).to(torch.bfloat16)
    key = torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=gen).to(torch.bfloat16)
    value = torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=gen).to(torch.bfloat16)
    slots = [int(block_tables[i, pos // PAGE]) * PAGE + pos % PAGE
             for i, (q, p) in enumerate(BATCH) for pos in range(p, p + q)]
    cumsum = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    metadata = FlashAttentionMetadata(
        num_prefills=NUM_PREFILLS, num_prefill_tokens=sum(q for q, _ in BATCH[:NUM_PREFILLS]),
        num_decode_tokens=len(BATCH) - NUM_PREFILLS, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens=seq_lens, seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(q for q, _ in BATCH), max_decode_query_len=1, max_prefill_seq_len=max(seq_lens[:2]),
        max_decode_seq_len=max(seq_lens[2:]), query_start_loc=cumsum([q for q, _ in BATCH]),
        seq_start_loc=cumsum(seq_lens), context_lens_tensor=torch.tensor([p for _, p in BATCH], dtype=torch.int32),
        block_tables=block_tables, use_cuda_graph=False,
    )  # fmt: skip
    return query, key, value, kv_cache, metadata


def dense_expected(query, kv_cache, metadata):
    """Every row by the float32 reference, on the cache after this step's keys were written."""
    o, _ = attention_reference.dense_paged_attention(query.view(-1, HEADS, HEAD_DIM), kv_cache[0], kv_cache[1],
                                           metadata.block_tables, metadata.query_start_loc,
                                           metadata.seq_lens_tensor, HEAD_DIM**-0.5)
    return o.reshape(query.shape[0], -1)


def test_mixed_step_rows_land_where_they_belong(step):
    impl = make_impl(threshold=0.0)
    query, key, value, kv_cache, metadata = make_step()
    output = impl.forward(query, key, value, kv_cache, metadata)
    assert step == {"sparse": [200], "varlen": [40], "kvcache": [2]}
    expected = dense_expected(query, kv_cache, metadata)
    assert not output.isnan().any()
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)


def test_sparse_rows_equal_the_kernel_on_that_request_alone(step):
    impl = make_impl(threshold=1.0, local_blocks=0)
    query, key, value, kv_cache, metadata = make_step(seed=1)
    output = impl.forward(query, key, value, kv_cache, metadata)
    cu = torch.tensor([0, 200], dtype=torch.int32)
    layout = BatchLayout.build(cu, metadata.seq_lens_tensor[:1], impl.settings.kernel, "cpu")
    alone, _ = sparse_prefill_attention(query[:200].view(-1, HEADS, HEAD_DIM), kv_cache[0], kv_cache[1],
                                        metadata.block_tables[:1], cu, metadata.seq_lens_tensor[:1],
                                        config=impl.settings.kernel, softmax_scale=HEAD_DIM**-0.5, layout=layout)
    torch.testing.assert_close(output[:200].view(-1, HEADS, HEAD_DIM), alone, atol=0, rtol=0)
    expected = dense_expected(query, kv_cache, metadata)
    assert (output[:200].float() - expected[:200]).abs().max() > 0.05, "nothing was pruned"
    torch.testing.assert_close(output[200:].float(), expected[200:], atol=2e-2, rtol=2e-2)


def test_steps_without_a_long_prefill_and_dense_layers_run_upstreams_forward(step, monkeypatch):
    upstream = []
    monkeypatch.setattr(FlashAttentionImpl, "forward", lambda self, *args, **kwargs: upstream.append(1))
    query, key, value, kv_cache, metadata = make_step()
    # 200 queries over 300 keys: less work than a fresh 320-token prompt.
    make_impl(min_len=320).forward(query, key, value, kv_cache, metadata)
    make_impl(layer="model.layers.1.self_attn.attn", dense_layers=2).forward(query, key, value, kv_cache, metadata)
    short_tables = make_step()[4]
    short_tables.block_tables = short_tables.block_tables[:, :2]  # a prefix-cache hit lists only cached blocks
    make_impl().forward(query, key, value, kv_cache, short_tables)
    assert upstream == [1, 1, 1] and step == {"sparse": [], "varlen": [], "kvcache": []}
    assert make_impl(layer="model.layers.2.self_attn.attn", dense_layers=2).dense_reason is None


def test_dense_layers_are_found_on_a_real_v0_model_class(monkeypatch):
    """Qwen2's V0 model file builds Attention without a prefix: the layers have no index until the
    loader names them from the built model, and then --sparse-prefill-dense-layers keeps the first dense."""
    import vllm.attention.selector as selector
    from transformers import Qwen2Config
    from vllm.config import CacheConfig
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    one_rank = types.SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True)
    monkeypatch.setattr(parallel_state, "_TP", one_rank)  # the parallel layers ask for their group's size
    monkeypatch.setattr(parallel_state, "_PP", one_rank)
    monkeypatch.setattr(selector, "which_attn_to_use", lambda *args, **kwargs: _Backend.SPARSE_PREFILL)
    cache_config = CacheConfig(block_size=PAGE, gpu_memory_utilization=0.9, swap_space=0, cache_dtype="auto")
    cache_config.sparse_prefill = settings_from_flags({"dense_layers": 1})
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3, vocab_size=512, max_position_embeddings=4096)
    model = Qwen2ForCausalLM(config, cache_config=cache_config)
    impls = [m.impl for m in model.modules() if isinstance(getattr(m, "impl", None), sparse_prefill_attn.SparsePrefillAttentionImpl)]
    assert [impl.dense_reason for impl in impls] == ["no layer index in ''"] * 3
    assert name_sparse_prefill_layers(model) == 3 and name_sparse_prefill_layers(model) == 0
    assert [impl.layer_name for impl in impls] == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert [impl.dense_reason for impl in impls] == ["layer 0 < --sparse-prefill-dense-layers=1", None, None]


def test_vision_towers_choose_as_if_no_backend_were_forced(monkeypatch):
    """Qwen2-VL's and Molmo's vision towers read VLLM_ATTENTION_BACKEND for their own attention and
    refused anything but FlashAttention, SDPA and xFormers: with SPARSE_PREFILL they take their own choice."""
    from vllm.model_executor.models.utils import get_vit_attn_backend

    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    unforced = get_vit_attn_backend()
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "SPARSE_PREFILL")
    assert get_vit_attn_backend() == unforced
    assert unforced in (_Backend.FLASH_ATTN, _Backend.TORCH_SDPA, _Backend.XFORMERS)


def test_selector_names_the_backend():
    assert backend_name_to_enum("SPARSE_PREFILL") == _Backend.SPARSE_PREFILL
    import vllm.attention.selector as selector
    original = selector.which_attn_to_use
    selector.which_attn_to_use = lambda *args, **kwargs: _Backend.SPARSE_PREFILL
    try:
        backend = get_attn_backend(HEAD_DIM, None, torch.bfloat16, "auto", PAGE, False)
    finally:
        selector.which_attn_to_use = original
    assert backend is sparse_prefill_attn.SparsePrefillAttentionBackend
    assert backend.get_name() == "SPARSE_PREFILL"


class Log:
    def __init__(self):
        self.lines = []

    def info(self, message, *args):
        self.lines.append(("info", message % args))

    def warning(self, message, *args):
        self.lines.append(("warning", message % args))


def test_flags_parse_validate_and_log(monkeypatch):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--sparse-prefill-threshold", "0.01", "--sparse-prefill-min-len", "8192",
         "--sparse-prefill-mean-correction", "--sparse-prefill-estimator", "exact"]))
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "SPARSE_PREFILL")
    log = Log()
    settings = check_sparse_prefill_flags(args, log)
    assert (settings.kernel.threshold, settings.kernel.min_q_len, settings.kernel.mean_correction) == (0.01, 8192, True)
    assert settings.kernel.estimator == "exact"
    assert log.lines[0][0] == "info" and "--sparse-prefill-min-len=8192" in log.lines[0][1]
    bad = EngineArgs.from_cli_args(parser.parse_args(["--sparse-prefill-block-size", "100"]))
    with pytest.raises(ValueError, match="--sparse-prefill-block-size"):
        check_sparse_prefill_flags(bad, Log())
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND")
    log = Log()
    assert check_sparse_prefill_flags(args, log) is None
    assert log.lines[0][0] == "warning" and "--sparse-prefill-threshold" in log.lines[0][1]


def test_a_schedule_that_leaves_the_backend_inert_is_said_at_startup():
    """V0 turns chunked prefill on only past 32K tokens, and then budgets 512 tokens a step: either way
    no chunk reaches the default minimum work within the model length, and the warning names what to set."""
    from vllm.config import SchedulerConfig

    settings = settings_from_flags({})
    cases = [
        (dict(max_num_batched_tokens=32768, max_model_len=32768, enable_chunked_prefill=False),
         "chunked prefill off admits no prefill chunk to it; set --enable-chunked-prefill "
         "--max-num-batched-tokens 24576"),
        (dict(max_num_batched_tokens=None, max_model_len=65536, enable_chunked_prefill=True),
         "--max-num-batched-tokens caps a prefill chunk at 512 tokens"),
        # Chunks of 2048 bring half a 24K prompt's work from a context of 37888 tokens: not within 32K.
        (dict(max_num_batched_tokens=32768, max_model_len=32768, enable_chunked_prefill=True,
              max_num_partial_prefills=2, long_prefill_token_threshold=2048),
         "--long-prefill-token-threshold caps a prefill chunk at 2048 tokens, which takes the sparse path "
         "under --sparse-prefill-min-len=24576 only from a context of 37888 tokens"),
    ]  # fmt: skip
    for fields, named in cases:
        log = Log()
        reason = check_sparse_prefill_schedule(settings, SchedulerConfig(max_num_seqs=8, **fields), log)
        assert log.lines == [("warning", f"SPARSE_PREFILL never runs: {reason}; until then every prefill uses FlashAttention")]
        assert reason.startswith(named), reason
    log = Log()
    fits = SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=8, max_model_len=65536, enable_chunked_prefill=True)
    assert check_sparse_prefill_schedule(settings, fits, log) is None and log.lines == []
    assert check_sparse_prefill_schedule(None, SchedulerConfig(max_num_batched_tokens=None, max_num_seqs=8,
                                                               max_model_len=4096), log) is None and log.lines == []


def one_line(text: str) -> str:
    """Help text as one line: argparse wraps it at spaces and after hyphens (``block-`` / ``sparse``)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def test_the_flags_help_is_the_runtimes():
    help_text = one_line(EngineArgs.add_cli_args(argparse.ArgumentParser()).format_help())
    for suffix in SUFFIXES:
        assert one_line(FACTS.help(suffix)) in help_text, suffix


def test_engine_args_defaults_are_the_kernels():
    defaults = settings_from_flags({})
    values = {name[len("sparse_prefill_"):]: getattr(EngineArgs, name)
              for name in vars(EngineArgs)["__dataclass_fields__"] if name.startswith("sparse_prefill_")}
    assert settings_from_flags(values) == defaults
