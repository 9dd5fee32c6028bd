#!/usr/bin/env python3
"""Experiment (H200, 2026-12-01) that led to the attention kernel's TMA reads: a plain causal
FlashAttention-2 forward over contiguous K/V loaded with TMA descriptors, at several tile shapes, with
and without Triton's warp specialisation, against cuDNN and our dense mode with pointer reads.

  python3 scripts/experiments/tma_contiguous.py 8192,32768,131072

(The kernel's two loops share one softmax helper since that run.)
"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import causal_flops, cuda_time, paged, sdpa, structured_qkv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
from prefill_accel import BatchLayout, SparsePrefillConfig, reference, triton_kernels  # noqa: E402


@triton.jit
def _fold(logits, values, row_max, row_sum, acc):
    """Fold one tile of scaled base-2 logits and its values into the running softmax state."""
    new_max = tl.maximum(row_max, tl.max(logits, 1))
    p = tl.exp2(logits - new_max[:, None])
    alpha = tl.exp2(row_max - new_max)
    return new_max, row_sum * alpha + tl.sum(p, 1), tl.dot(p.to(values.dtype), values, acc * alpha[:, None])


@triton.jit
def _fwd(desc_q, desc_k, desc_v, out, lse, n_ctx, qk_scale, stride_ot, stride_oh, stride_lh,
         H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         WS: tl.constexpr, STAGES: tl.constexpr):
    n_mb = tl.cdiv(n_ctx, BM)
    pid = tl.program_id(0)
    head = pid % H
    mb = n_mb - 1 - pid // H
    kvh = head // GROUP
    q = desc_q.load([mb * BM, head * D])
    row_max = tl.full([BM], float("-inf"), tl.float32)
    row_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    hi = mb * BM
    for start in tl.range(0, hi, BN, num_stages=STAGES, warp_specialize=WS):
        logits = tl.dot(q, desc_k.load([start, kvh * D]).T) * qk_scale
        row_max, row_sum, acc = _fold(logits, desc_v.load([start, kvh * D]), row_max, row_sum, acc)
    rows = mb * BM + tl.arange(0, BM)
    for start in tl.range(hi, hi + BM, BN):
        cols = start + tl.arange(0, BN)
        logits = tl.dot(q, desc_k.load([start, kvh * D]).T) * qk_scale
        logits = tl.where(cols[None, :] <= rows[:, None], logits, float("-inf"))
        row_max, row_sum, acc = _fold(logits, desc_v.load([start, kvh * D]), row_max, row_sum, acc)
    acc = acc / row_sum[:, None]
    dims = tl.arange(0, D)
    tl.store(out + rows[:, None].to(tl.int64) * stride_ot + head * stride_oh + dims[None, :], acc.to(out.dtype.element_ty),
             mask=rows[:, None] < n_ctx)
    tl.store(lse + head * stride_lh + rows, (row_max + tl.log2(row_sum)) * 0.6931471805599453, mask=rows < n_ctx)


def tma_attention(q, k, v, bm, bn, warps, stages, ws, out, lse):
    n, h, d = q.shape
    hkv = k.shape[1]
    dq = TensorDescriptor(q.view(n, h * d), [n, h * d], [h * d, 1], [bm, d])
    dk = TensorDescriptor(k.view(n, hkv * d), [n, hkv * d], [hkv * d, 1], [bn, d])
    dv = TensorDescriptor(v.view(n, hkv * d), [n, hkv * d], [hkv * d, 1], [bn, d])
    grid = (triton.cdiv(n, bm) * h,)
    _fwd[grid](dq, dk, dv, out, lse, n, d ** -0.5 * 1.4426950408889634, out.stride(0), out.stride(1), lse.stride(0),
               H=h, GROUP=h // hkv, D=d, BM=bm, BN=bn, WS=ws, STAGES=stages, num_warps=warps, num_stages=stages)
    return out


CONFIGS = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
           (128, 128, 4, 2), (128, 64, 8, 4), (64, 64, 4, 3), (64, 128, 4, 3)]


def main():
    lengths = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8192, 32768, 131072]
    h, hkv, d = 32, 8, 128
    for n in lengths:
        q, k, v = structured_qkv(n, h, hkv, d, 128, torch.bfloat16, seed=n)
        k_cache, v_cache, table = paged(k, v, 16)
        flops = causal_flops(n, n, h, d)
        reps = 5 if n <= 65536 else 3
        cudnn = cuda_time(sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), reps)
        ref = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)()[0].transpose(0, 1).float()
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        sl = torch.tensor([n], dtype=torch.int32, device="cuda")
        layout = BatchLayout.build(cu, sl, SparsePrefillConfig(threshold=0.0), q.device)
        outp = torch.empty_like(q)
        ours = cuda_time(lambda: triton_kernels.block_sparse_attention(q, k_cache, v_cache, table, cu, sl, layout, None, d ** -0.5, False, outp, kv_reads="pointer"), reps)
        gather = cuda_time(lambda: [reference.gather_kv(c, table, 0, n) for c in (k_cache, v_cache)], reps)
        print(f"N={n}: cuDNN {cudnn:.2f} ms ({flops / cudnn / 1e9:.0f} TF/s); ours paged dense {ours:.2f} ms "
              f"({flops / ours / 1e9:.0f}, {cudnn / ours:.0%}); gather K+V {gather:.3f} ms", flush=True)
        out = torch.empty_like(q)
        lse = torch.empty(h, n, device="cuda", dtype=torch.float32)
        for ws in (False, True):
            for bm, bn, w, s in CONFIGS:
                try:
                    fn = lambda: tma_attention(q, k, v, bm, bn, w, s, ws, out, lse)  # noqa: E731
                    fn()
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = cuda_time(fn, reps)
                    print(f"  tma ws={ws:d} {bm},{bn},{w},{s}: {ms:.2f} ms {flops / ms / 1e9:.0f} TF/s "
                          f"{cudnn / ms:.0%} of cuDNN, err {err:.1e}", flush=True)
                except Exception as error:  # noqa: BLE001 - a shape or mode that does not compile is reported, not fatal
                    print(f"  tma ws={ws:d} {bm},{bn},{w},{s}: FAILED {type(error).__name__}", flush=True)


if __name__ == "__main__":
    main()
