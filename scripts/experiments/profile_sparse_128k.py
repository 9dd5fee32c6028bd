#!/usr/bin/env python3
"""Where the sparse path's time goes at 128K (32 / 8 heads, head_dim 128, ~1.8% density): the
call's median time, then a torch profile of five calls by kernel (H200, 2026-12-01).

  python3 scripts/experiments/profile_sparse_128k.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
import bench_kernels  # noqa: E402
from prefill_accel import SparsePrefillConfig, sparse_prefill_attention  # noqa: E402

LENGTH = 131072
THRESHOLD = 0.00390625  # the threshold bench_kernels.py bisected to for 2% on these inputs


def main() -> None:
    q, k, v = bench_kernels.structured_qkv(LENGTH, 32, 8, 128, 128, torch.bfloat16, seed=LENGTH)
    k_cache, v_cache, table = bench_kernels.paged(k, v, 16)
    cu = torch.tensor([0, LENGTH], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([LENGTH], dtype=torch.int32, device="cuda")
    config = SparsePrefillConfig(min_q_len=0, threshold=THRESHOLD)
    out = torch.empty_like(q)
    run = lambda: sparse_prefill_attention(q, k_cache, v_cache, table, cu, seqlens, config=config, out=out)  # noqa: E731
    print(f"call: {bench_kernels.cuda_time(run, 9):.2f} ms (median of 9)")
    activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
