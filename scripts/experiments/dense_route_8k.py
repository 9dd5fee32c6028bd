#!/usr/bin/env python3
"""Where the dense route's time goes at 8K (32 / 8 heads, head_dim 128, bf16, page 16), in one
process, three rounds: every part back to back (eight calls per timing, the host running ahead), as
one call from an idle GPU, and its host time. Compares K/V layouts and GQA handling for cuDNN, ways
to gather the pages (torch, the TMA staging kernel, Triton gathers that also repeat the KV heads),
and splitting the heads over two streams. Raw results: docs/results/bench/dense-route-8k-h200-2026-12-01.md.

  python3 scripts/experiments/dense_route_8k.py
"""

import statistics
import time
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
import bench_kernels  # noqa: E402
from prefill_accel import BatchLayout, SparsePrefillConfig, api, reference, sparse_prefill_attention, triton_kernels  # noqa: E402

LENGTH, HEADS, KV_HEADS, HEAD_DIM, PAGE = 8192, 32, 8, 128, 16


@triton.jit
def _gather(k_cache, v_cache, page_table, k_out, v_out, length, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_or, s_oh,
            PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    p = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(page_table + p).to(tl.int64)
    rows = tl.arange(0, PAGE_SIZE)
    pos = p * PAGE_SIZE + rows
    mask = (pos < length)[:, None]
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.load(k_cache + page * s_kp + h * s_kh + rows[:, None] * s_ks + dims[None, :], mask=mask)
    values = tl.load(v_cache + page * s_vp + h * s_vh + rows[:, None] * s_vs + dims[None, :], mask=mask)
    for g in tl.static_range(GROUP):
        dst = pos.to(tl.int64)[:, None] * s_or + (h * GROUP + g) * s_oh + dims[None, :]
        tl.store(k_out + dst, keys, mask=mask)
        tl.store(v_out + dst, values, mask=mask)


def triton_gather(k_cache, v_cache, table, length, group, heads_first):
    """K and V of sequence 0 as (L, H, D) tensors, H = KV heads x group; heads_first lays the storage
    out as (H, L, D)."""
    heads = k_cache.shape[2] * group
    shape = (heads, length, HEAD_DIM) if heads_first else (length, heads, HEAD_DIM)
    k_out = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    if heads_first:
        k_out, v_out = k_out.transpose(0, 1), v_out.transpose(0, 1)
    n_pages = -(-length // PAGE)
    _gather[(n_pages, k_cache.shape[2])](
        k_cache, v_cache, table, k_out, v_out, length, *k_cache.stride()[:3], *v_cache.stride()[:3],
        k_out.stride(0), k_out.stride(1), PAGE_SIZE=PAGE, GROUP=group, HEAD_DIM=HEAD_DIM,
    )  # fmt: skip
    return k_out, v_out


def gather_rows(k_cache, v_cache, table, rows, warps=4):
    k_out = torch.empty(KV_HEADS, LENGTH, HEAD_DIM, dtype=k_cache.dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    triton_kernels._gather_kernel[(triton.cdiv(LENGTH, rows), KV_HEADS)](
        k_cache, v_cache, table[0], k_out, v_out, LENGTH, *k_cache.stride()[:3], *v_cache.stride()[:3],
        k_out.stride(0), PAGE_SIZE=PAGE, HEAD_DIM=HEAD_DIM, ROWS=rows, num_warps=warps,
    )  # fmt: skip
    return k_out, v_out


def split_heads(q, k_cache, v_cache, table, scale, out, side):
    """The dense route in two halves of the heads; with ``side`` the second half's gather, attention
    and copy run on that stream, beside the first half's."""
    main = torch.cuda.current_stream()
    half_kv, half_q = KV_HEADS // 2, HEADS // 2
    if side is not None:
        side.wait_stream(main)
    result = torch.empty_like(q) if out is None else out
    k1, v1 = triton_kernels.gather_kv(k_cache[:, :, :half_kv], v_cache[:, :, :half_kv], table, 0, LENGTH)
    with torch.cuda.stream(side or main):
        k2, v2 = triton_kernels.gather_kv(k_cache[:, :, half_kv:], v_cache[:, :, half_kv:], table, 0, LENGTH)
    o1, _ = api.cudnn_causal_attention(q[:, :half_q], k1, v1, scale)
    result[:, :half_q].copy_(o1)
    with torch.cuda.stream(side or main):
        o2, _ = api.cudnn_causal_attention(q[:, half_q:], k2, v2, scale)
        result[:, half_q:].copy_(o2)
    if side is not None:
        main.wait_stream(side)
    return result


def host_us(fn, calls=8):
    """Microseconds of host time per call while the GPU is busy (launches never wait)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def pipelined(fn, reps=25):
    return bench_kernels.pipelined_time(fn, reps)


def main() -> None:
    q, k, v = bench_kernels.structured_qkv(LENGTH, HEADS, KV_HEADS, HEAD_DIM, 128, torch.bfloat16, seed=LENGTH)
    k_cache, v_cache, table = bench_kernels.paged(k, v, PAGE)
    group = HEADS // KV_HEADS
    scale = HEAD_DIM**-0.5
    cu = torch.tensor([0, LENGTH], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([LENGTH], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    layout = BatchLayout.build(torch.tensor([0, LENGTH]), torch.tensor([LENGTH]), SparsePrefillConfig(), q.device)

    k_exp, v_exp = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    k_bhsd, v_bhsd = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (k, v)]
    k_exp_bhsd, v_exp_bhsd = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (k_exp, v_exp)]
    q_bhsd = q.transpose(0, 1).contiguous().transpose(0, 1)
    cudnn = lambda qq, kk, vv: api.cudnn_causal_attention(qq, kk, vv, scale)  # noqa: E731
    o_ref, lse_ref = cudnn(q, k_exp, v_exp)

    def sdpa_gqa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
            return F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, enable_gqa=True)

    parts = {
        "baseline: F.sdpa cuDNN, heads expanded, (L,H,D) views, no lse": bench_kernels.sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION),
        "F.sdpa cuDNN, GQA native, no lse": sdpa_gqa,
        "cuDNN + lse, expanded, (L,H,D)": lambda: cudnn(q, k_exp, v_exp),
        "cuDNN + lse, native, (L,H,D)": lambda: cudnn(q, k, v),
        "cuDNN + lse, native, K/V (H,L,D)": lambda: cudnn(q, k_bhsd, v_bhsd),
        "cuDNN + lse, expanded, K/V (H,L,D)": lambda: cudnn(q, k_exp_bhsd, v_exp_bhsd),
        "cuDNN + lse, expanded, q/K/V (H,L,D)": lambda: cudnn(q_bhsd, k_exp_bhsd, v_exp_bhsd),
        "gather: torch index_select x2": lambda: [reference.gather_kv(c, table, 0, LENGTH) for c in (k_cache, v_cache)],
        "gather: stage_kv (one launch)": lambda: triton_kernels.stage_kv(k_cache, v_cache, table, seqlens, layout, range(KV_HEADS)),
        "gather: triton (L,H,D)": lambda: triton_gather(k_cache, v_cache, table, LENGTH, 1, False),
        "gather: triton (H,L,D)": lambda: triton_gather(k_cache, v_cache, table, LENGTH, 1, True),
        "gather: triton expanded (L,H,D)": lambda: triton_gather(k_cache, v_cache, table, LENGTH, group, False),
        "gather: triton expanded (H,L,D)": lambda: triton_gather(k_cache, v_cache, table, LENGTH, group, True),
        "copy into out": lambda: out.copy_(o_ref),
        "public, layout, out given": lambda: sparse_prefill_attention(q, k_cache, v_cache, table, cu, seqlens, out=out, layout=layout),
        "public, layout, no out": lambda: sparse_prefill_attention(q, k_cache, v_cache, table, cu, seqlens, layout=layout),
        "public, lengths read, no out": lambda: sparse_prefill_attention(q, k_cache, v_cache, table, cu, seqlens),
    }
    for name, heads_first, grp in (("(L,H,D)", False, 1), ("(H,L,D)", True, 1), ("expanded (L,H,D)", False, group),
                                   ("expanded (H,L,D)", True, group)):  # fmt: skip
        kk, vv = triton_gather(k_cache, v_cache, table, LENGTH, grp, heads_first)
        assert torch.equal(kk[:, ::grp], k) and torch.equal(vv[:, ::grp], v), name
        parts[f"route: triton gather {name} + cuDNN + lse"] = (
            lambda hf=heads_first, g=grp: cudnn(q, *triton_gather(k_cache, v_cache, table, LENGTH, g, hf))
        )
    parts["route: torch gather + cuDNN + lse"] = lambda: cudnn(q, *[reference.gather_kv(c, table, 0, LENGTH) for c in (k_cache, v_cache)])
    for rows in (32, 64, 128, 256):
        parts[f"gather: triton_kernels.gather_kv, {rows} rows"] = lambda rows=rows: gather_rows(k_cache, v_cache, table, rows)
    for rows, warps in ((64, 8), (128, 8), (256, 8)):
        parts[f"gather: triton_kernels.gather_kv, {rows} rows, {warps} warps"] = (
            lambda rows=rows, warps=warps: gather_rows(k_cache, v_cache, table, rows, warps)
        )
    side = torch.cuda.Stream()
    split_out = split_heads(q, k_cache, v_cache, table, scale, None, side)
    torch.cuda.synchronize()
    print("split heads vs cuDNN expanded: out max diff", (split_out.float() - o_ref.float()).abs().max().item())
    parts["split heads, one stream, out given"] = lambda: split_heads(q, k_cache, v_cache, table, scale, out, None)
    parts["split heads, two streams, out given"] = lambda: split_heads(q, k_cache, v_cache, table, scale, out, side)
    parts["split heads, two streams, no out"] = lambda: split_heads(q, k_cache, v_cache, table, scale, None, side)
    o_pub, lse_pub = sparse_prefill_attention(q, k_cache, v_cache, table, cu, seqlens, layout=layout)
    print("public vs cuDNN expanded: out max diff", (o_pub.float() - o_ref.float()).abs().max().item(),
          "lse max diff", (lse_pub - lse_ref[:, :LENGTH]).abs().max().item())  # fmt: skip
    times = {name: [] for name in parts}
    lone = {name: [] for name in parts}
    host = {name: [] for name in parts}
    for _ in range(3):
        for name, fn in parts.items():
            times[name].append(pipelined(fn))
            lone[name].append(bench_kernels.cuda_time(fn, 15))
            host[name].append(host_us(fn))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| part | back to back, ms per call (3 rounds) | median | one call | host us |\n|---|---|---|---|---|")
    for name in parts:
        rounds = " / ".join(f"{t:.3f}" for t in times[name])
        print(f"| {name} | {rounds} | {statistics.median(times[name]):.3f} | {statistics.median(lone[name]):.3f} | {statistics.median(host[name]):.0f} |")


if __name__ == "__main__":
    main()
