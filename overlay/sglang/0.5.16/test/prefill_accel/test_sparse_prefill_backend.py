"""prefill-accel: the sparse_prefill prefill attention backend on CPU, with SGLang's own pools and layers.

Real MHATokenToKVPool, ReqToTokenPool, RadixAttention and ForwardBatch; the wrapped dense backend is
SGLang's torch_native backend (the GPU ones need CUDA), and the kernels run through Triton's
interpreter. Each batch mixes an extend after a cached prefix (chunked prefill or a radix-cache hit),
a fresh prefill and a short extend, at page size 1 and 16, with the requests' pages scattered over
the pool. The backend's translation of SGLang's metadata (req_to_token, extend and sequence lengths,
the token-level KV buffer) is checked two ways: at threshold 0 (exact attention) against SGLang's
dense backend, and with pruning against the kernel called on a page table built independently here.
"""

import os
import random
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from prefill_accel import sparse_prefill_attention  # noqa: E402
from prefill_accel.flags import settings_from_flags  # noqa: E402
from sglang.srt.layers.attention.sparse_prefill_backend import (  # noqa: E402
    SparsePrefillAttnBackend,
    sparse_batch,
)
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

HEAD_DIM, Q_HEADS, KV_HEADS, LAYERS = 64, 4, 2, 3
DTYPE = torch.float16
# (cached prefix, new tokens) per request: a continuation chunk, a fresh prefill, a short extend.
REQUESTS = [(128, 192), (0, 160), (96, 24)]
MIN_LEN = 128  # the first two go to the kernel's sparse path, the third is computed dense by it
SLOTS = 2048


class RecordingDense(TorchNativeAttnBackend):
    """SGLang's torch_native backend, counting the extend calls it computes and the batches it plans."""

    def __init__(self, runner):
        super().__init__(runner)
        self.extend_calls = 0
        self.planned = []

    def init_forward_metadata(self, forward_batch):
        self.planned.append(forward_batch)
        return super().init_forward_metadata(forward_batch)

    def forward_extend(self, *args, **kwargs):
        self.extend_calls += 1
        return super().forward_extend(*args, **kwargs)


def settings(**flags):
    values = {"min_len": MIN_LEN, "block_size": 64, "local_blocks": 0, "last_query_blocks": 0}
    return settings_from_flags({**values, **flags})


class Engine:
    """The pools, the dense backend and ours, and one extend batch laid out in the pools."""

    def __init__(self, page_size, requests=REQUESTS, mode=ForwardMode.EXTEND, **flags):
        torch.manual_seed(0)
        self.page_size = page_size
        self.kv_pool = MHATokenToKVPool(
            size=SLOTS, page_size=page_size, dtype=DTYPE, head_num=KV_HEADS, head_dim=HEAD_DIM,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )
        self.req_pool = ReqToTokenPool(size=8, max_context_len=1024, device="cpu", enable_memory_saver=False)
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool)
        self.dense = RecordingDense(runner)
        self.backend = SparsePrefillAttnBackend(
            dense=self.dense, settings=settings(**flags), req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool, page_size=page_size,
        )
        self.requests = requests
        self.batch = self._lay_out(requests, mode)

    def _lay_out(self, requests, mode) -> ForwardBatch:
        """Give each request whole pages in a shuffled order (slots 0..page_size-1 are SGLang's
        padding page), fill req_to_token, and return the batch's ForwardBatch."""
        pages = list(range(1, SLOTS // self.page_size))
        random.Random(1).shuffle(pages)
        pool_indices, extend_slots = [], []
        for row, (prefix, extend) in enumerate(requests, start=1):
            count = -(-(prefix + extend) // self.page_size)
            owned, pages = pages[:count], pages[count:]
            slots = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in owned])
            slots = slots[: prefix + extend].to(torch.int32)
            self.req_pool.req_to_token[row, : prefix + extend] = slots
            pool_indices.append(row)
            extend_slots.append(slots[prefix:])
            for layer in range(LAYERS):  # the cached prefix, written by earlier batches
                self.kv_pool.k_buffer[layer][slots[:prefix].long()] = torch.randn(prefix, KV_HEADS, HEAD_DIM, dtype=DTYPE)
                self.kv_pool.v_buffer[layer][slots[:prefix].long()] = torch.randn(prefix, KV_HEADS, HEAD_DIM, dtype=DTYPE)
        prefix_lens = [p for p, _ in requests]
        extend_lens = [e for _, e in requests]
        seq_lens = torch.tensor([p + e for p, e in requests], dtype=torch.int64)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(requests),
            input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
            req_pool_indices=torch.tensor(pool_indices, dtype=torch.int64),
            seq_lens=seq_lens,
            out_cache_loc=torch.cat(extend_slots).long(),
            seq_lens_sum=int(seq_lens.sum()),
            seq_lens_cpu=seq_lens.clone(),
            extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32),
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
            extend_seq_lens_cpu=extend_lens,
            extend_prefix_lens_cpu=prefix_lens,
        )

    def layer(self, layer_id=LAYERS - 1, **kwargs):
        return RadixAttention(Q_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, layer_id, **kwargs)

    def qkv(self):
        tokens = sum(e for _, e in self.requests)
        return (torch.randn(tokens, Q_HEADS * HEAD_DIM, dtype=DTYPE),
                torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE),
                torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE))

    def forward(self, backend, layer, q, k, v):
        backend.init_forward_metadata(self.batch)
        return backend.forward_extend(q, k, v, layer, self.batch)


@pytest.mark.parametrize("page_size", [1, 16])
def test_exact_mode_matches_sglang_dense_backend(page_size):
    engine = Engine(page_size, threshold=0.0)
    layer, (q, k, v) = engine.layer(), engine.qkv()
    ours = engine.forward(engine.backend, layer, q, k, v)
    assert engine.dense.extend_calls == 0, "the batch should have gone to the kernel"
    dense = engine.forward(engine.dense, layer, q, k, v)
    assert ours.shape == dense.shape == q.shape
    torch.testing.assert_close(ours.float(), dense.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("page_size", [1, 16])
def test_pruned_batch_equals_the_kernel_on_an_independent_page_table(page_size):
    """With pruning, the backend's call is the kernel's on the same pages: its page table, lengths and
    KV view are the ones built here from the requests' slots."""
    engine = Engine(page_size, threshold=1.0, sink_blocks=0)
    layer, (q, k, v) = engine.layer(), engine.qkv()
    ours = engine.forward(engine.backend, layer, q, k, v)

    k_pages = engine.kv_pool.k_buffer[layer.layer_id].view(-1, page_size, KV_HEADS, HEAD_DIM)
    v_pages = engine.kv_pool.v_buffer[layer.layer_id].view(-1, page_size, KV_HEADS, HEAD_DIM)
    width = max(-(-(p + e) // page_size) for p, e in REQUESTS)
    page_table = torch.zeros(len(REQUESTS), width, dtype=torch.int32)
    for row, (prefix, extend) in enumerate(REQUESTS):
        slots = engine.req_pool.req_to_token[row + 1, : prefix + extend].long()
        assert torch.equal(k_pages.flatten(0, 1)[slots[prefix:]], k[sum(e for _, e in REQUESTS[:row]):][:extend])
        pages = slots[::page_size] // page_size
        page_table[row, : len(pages)] = pages.to(torch.int32)
    cu_seqlens_q = torch.tensor([0, 192, 352, 376], dtype=torch.int32)
    seqlens_k = torch.tensor([p + e for p, e in REQUESTS], dtype=torch.int32)
    expected, _ = sparse_prefill_attention(
        q.view(-1, Q_HEADS, HEAD_DIM), k_pages, v_pages, page_table, cu_seqlens_q, seqlens_k,
        config=engine.backend.settings.kernel, softmax_scale=layer.scaling,
    )
    torch.testing.assert_close(ours, expected.view(q.shape), atol=0, rtol=0)
    # Pruning happened: the exact result differs.
    assert not torch.allclose(ours.float(), engine.forward(engine.dense, layer, q, k, v).float(), atol=2e-3)


def test_batch_translation_reads_the_pools_through_req_to_token():
    engine = Engine(16)
    plan = sparse_batch(engine.batch, engine.req_pool.req_to_token, 16, engine.backend.settings)
    assert plan.cu_seqlens_q.tolist() == [0, 192, 352, 376]
    assert plan.seqlens_k.tolist() == [320, 160, 120]
    assert plan.total_q == 376 and plan.page_table.dtype == torch.int32
    for row, (prefix, extend) in enumerate(REQUESTS):
        slots = engine.req_pool.req_to_token[row + 1, : prefix + extend]
        pages = plan.page_table[row, : -(-(prefix + extend) // 16)]
        assert torch.equal(pages, (slots[::16] // 16).to(torch.int32))
        # the slots of a request's pages, in order, are its token slots
        assert torch.equal((pages[:, None] * 16 + torch.arange(16)).flatten()[: prefix + extend], slots)


@pytest.mark.parametrize("case", ["short extends", "dense layer", "sliding window", "logit cap", "target verify"])
def test_what_stays_on_the_dense_backend(case):
    requests, mode, layer_kwargs = REQUESTS, ForwardMode.EXTEND, {}
    if case == "short extends":
        requests = [(128, 60), (0, 100)]  # under a block of new tokens; less work than a fresh 128-token prompt
    elif case == "sliding window":
        layer_kwargs = {"sliding_window_size": 256}
    elif case == "logit cap":
        layer_kwargs = {"logit_cap": 30.0}
    elif case == "target verify":
        mode = ForwardMode.TARGET_VERIFY
    engine = Engine(1, requests=requests, mode=mode, dense_layers=2)
    layer = engine.layer(layer_id=1 if case == "dense layer" else LAYERS - 1, **layer_kwargs)
    q, k, v = engine.qkv()
    ours = engine.forward(engine.backend, layer, q, k, v)
    assert engine.dense.extend_calls == 1
    torch.testing.assert_close(ours, engine.forward(engine.dense, layer, q, k, v), atol=0, rtol=0)


def test_a_quantized_or_hybrid_pool_keeps_every_batch_dense():
    class HybridPool(MHATokenToKVPool):
        pass

    pool = HybridPool(size=64, page_size=1, dtype=DTYPE, head_num=KV_HEADS, head_dim=HEAD_DIM, layer_num=1,
                      device="cpu", enable_memory_saver=False)
    backend = SparsePrefillAttnBackend(dense=None, settings=settings(), req_to_token_pool=None,
                                       token_to_kv_pool=pool, page_size=1)
    assert "HybridPool" in backend.pool_reason


def test_the_registry_wraps_the_decode_backend(monkeypatch):
    from prefill_accel.engine import warmup
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ServerArgs

    engine = Engine(1)
    args = ServerArgs(model_path="dummy", prefill_attention_backend="sparse_prefill",
                      attention_backend="torch_native", sparse_prefill_min_len=4096, chunked_prefill_size=8192)
    model = SimpleNamespace(num_attention_heads=2 * engine.kv_pool.head_num, context_len=131072,
                            get_num_kv_heads=lambda tp_size: engine.kv_pool.head_num // tp_size)  # fmt: skip
    runner = SimpleNamespace(server_args=args, device="cpu", req_to_token_pool=engine.req_pool,
                             token_to_kv_pool=engine.kv_pool, page_size=1, model_config=model)
    warmed = []
    monkeypatch.setattr(warmup, "warm_up", lambda **shapes: warmed.append(shapes))
    backend = ATTENTION_BACKENDS["sparse_prefill"](runner)
    assert type(backend.dense) is TorchNativeAttnBackend and backend.settings.kernel.min_q_len == 4096
    # The kernels warmed up for the runner's shapes: the pool's heads and pages, the chunk size, the context.
    [shapes] = warmed
    assert (shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"]) == (
        2 * engine.kv_pool.head_num, engine.kv_pool.head_num, engine.kv_pool.head_dim)
    assert (shapes["chunk_tokens"], shapes["max_context"], shapes["page_size"]) == (8192, 131072, 1)
    assert shapes["config"] is backend.settings.kernel and shapes["dtype"] == engine.kv_pool.dtype
    args.attention_backend = None
    with pytest.raises(ValueError, match="set --attention-backend or --decode-attention-backend"):
        ATTENTION_BACKENDS["sparse_prefill"](runner)


def test_every_hook_of_the_base_class_is_the_dense_backends():
    """What SGLang's AttentionBackend defines (graph hooks, verify buffers, support_triton, ...) reaches the
    dense backend, not the base class's default; a batch whose metadata a graph captures stays dense."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    defaults = {"needs_cpu_seq_lens", "prefill_attention_backend_str", "decode_attention_backend_str"}  # set per object
    fallen_through = [name for name in vars(AttentionBackend) if not name.startswith("_") and name not in defaults
                      and name != "forward" and name not in vars(SparsePrefillAttnBackend)]  # fmt: skip
    assert fallen_through == []
    engine = Engine(1)
    calls = []
    engine.dense.support_triton = lambda: calls.append("support_triton") or False
    engine.dense.init_forward_metadata_for_breakable_cuda_graph_capture = lambda batch: calls.append("capture")
    engine.dense.use_captured_forward_metadata_for_breakable_cuda_graph = True
    assert engine.backend.support_triton() is False
    assert engine.backend.use_captured_forward_metadata_for_breakable_cuda_graph is True
    engine.backend.init_forward_metadata(engine.batch)
    assert engine.backend._batch is not None  # a long extend: the kernel's batch
    engine.backend.init_forward_metadata_for_breakable_cuda_graph_capture(engine.batch)
    assert engine.backend._batch is None and calls == ["support_triton", "capture"]


def test_the_dense_backend_plans_a_kernel_batch_only_where_a_layer_stays_dense():
    """A batch the kernel takes is not planned on the dense backend unless some layer of it goes there
    (then once, before that layer); any other batch is planned as SGLang plans it."""
    engine = Engine(1, dense_layers=1)
    q, k, v = engine.qkv()
    engine.backend.init_forward_metadata(engine.batch)
    assert engine.dense.planned == []
    engine.backend.forward_extend(q, k, v, engine.layer(layer_id=2), engine.batch)
    assert engine.dense.planned == [] and engine.dense.extend_calls == 0
    for layer_id in (0, 1):  # layer 0 stays dense (--sparse-prefill-dense-layers 1): planned once, there
        engine.backend.forward_extend(q, k, v, engine.layer(layer_id=layer_id), engine.batch)
    assert engine.dense.planned == [engine.batch] and engine.dense.extend_calls == 1
    short = Engine(1, requests=[(128, 60), (0, 100)])
    short.backend.init_forward_metadata(short.batch)
    assert short.dense.planned == [short.batch]


def test_sglang_s_hybrid_setup_wraps_the_decode_backend_s_own_instance(monkeypatch):
    """Where SGLang builds its hybrid of a prefill and a decode backend (patch 0002), sparse_prefill wraps
    the decode backend it has just built: one instance, whose graph state the hybrid sets up once."""
    from prefill_accel.engine import warmup
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.model_executor.model_runner_components import attention_backend_setup as setup
    from sglang.srt.server_args import ServerArgs

    engine = Engine(1)
    args = ServerArgs(model_path="dummy", prefill_attention_backend="sparse_prefill", attention_backend="torch_native")
    model = SimpleNamespace(num_attention_heads=2 * engine.kv_pool.head_num, context_len=131072,
                            get_num_kv_heads=lambda tp_size: engine.kv_pool.head_num // tp_size)  # fmt: skip
    runner = SimpleNamespace(server_args=args, device="cpu", req_to_token_pool=engine.req_pool,
                             token_to_kv_pool=engine.kv_pool, page_size=1, model_config=model,
                             kv_cache_dtype=DTYPE)  # fmt: skip
    monkeypatch.setattr(warmup, "warm_up", lambda **shapes: None)
    monkeypatch.setattr(setup, "attn_backend_wrapper", lambda runner, backend: backend)  # model-level wrappers
    built = []

    def build_dense(runner):
        built.append(RecordingDense(runner))
        return built[-1]

    monkeypatch.setitem(setup.ATTENTION_BACKENDS, "torch_native", build_dense)
    resolved = setup.ResolvedAttentionBackendStr(prefill="sparse_prefill", decode="torch_native")
    hybrid = setup._build_resolved_backend(model_runner=runner, resolved=resolved, init_new_workspace=False)
    assert isinstance(hybrid, HybridAttnBackend) and len(built) == 1
    assert hybrid.prefill_backend.dense is hybrid.decode_backend is built[0]
    graph_states = []
    built[0].init_cuda_graph_state = lambda max_bs, max_num_tokens: graph_states.append((max_bs, max_num_tokens))
    hybrid.init_cuda_graph_state(8, 64)
    hybrid.prefill_backend.init_cuda_graph_state(8, 64)  # as the hybrid does for speculative verification
    assert graph_states == [(8, 64)]
