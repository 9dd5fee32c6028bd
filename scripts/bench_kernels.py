#!/usr/bin/env python3
"""Check and time prefill-accel's kernels against dense attention on one CUDA GPU, in one process.

For each length: dense cuDNN SDPA, dense FlashAttention-2 SDPA, our kernel in dense mode
(threshold 0) and our full sparse path (selection + attention) at controlled densities, plus
real Q/K/V files when given. Prints a Markdown table and writes JSON.

  python scripts/bench_kernels.py --lengths 8192,32768,131072 --densities 0.02,0.05,0.1,0.25 --out bench.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from prefill_accel import SparsePrefillConfig, block_sparse_attention, select_blocks, sparse_prefill_attention  # noqa: E402
from prefill_accel import BatchLayout, dense_route  # noqa: E402
from prefill_accel.ops import attention, attention_reference, launch, search, search_reference, staging, staging_reference  # noqa: E402


def cuda_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs, timed with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def causal_flops(q_len: int, k_len: int, heads: int, head_dim: int) -> float:
    """Matmul FLOPs of causal attention (QK^T and PV) for queries at the end of k_len keys."""
    prefix = k_len - q_len
    pairs = q_len * prefix + q_len * (q_len + 1) / 2
    return 4.0 * pairs * heads * head_dim


def paged(k: torch.Tensor, v: torch.Tensor, page_size: int):
    """A shuffled paged cache (num_pages, page_size, Hkv, D) holding one sequence's K and V."""
    length, num_kv, head_dim = k.shape
    n_pages = -(-length // page_size)
    order = torch.randperm(n_pages, device=k.device)
    k_cache = torch.empty(n_pages, page_size, num_kv, head_dim, dtype=k.dtype, device=k.device)
    v_cache = torch.empty_like(k_cache)
    padded = n_pages * page_size
    kp = F.pad(k, (0, 0, 0, 0, 0, padded - length)).view(n_pages, page_size, num_kv, head_dim)
    vp = F.pad(v, (0, 0, 0, 0, 0, padded - length)).view(n_pages, page_size, num_kv, head_dim)
    k_cache[order], v_cache[order] = kp, vp
    return k_cache, v_cache, order.to(torch.int32).view(1, -1)


def structured_qkv(length: int, heads: int, num_kv: int, head_dim: int, block: int, dtype, seed: int):
    """Random Q/K/V where key blocks differ in relevance, so a search has something to find: every
    key block gets a random offset along a direction the queries share (log-normal strengths)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(length, heads, head_dim, device="cuda", generator=gen)
    k = torch.randn(length, num_kv, head_dim, device="cuda", generator=gen)
    v = torch.randn(length, num_kv, head_dim, device="cuda", generator=gen)
    direction = F.normalize(torch.randn(num_kv, head_dim, device="cuda", generator=gen), dim=-1)
    n_blocks = -(-length // block)
    strength = torch.randn(n_blocks, num_kv, 1, device="cuda", generator=gen).mul(1.5).exp()
    k += (strength.repeat_interleave(block, 0)[:length] * direction) * 2.0
    q += direction.repeat_interleave(heads // num_kv, 0) * 2.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sdpa(q, k, v, backend):
    """Causal SDPA on (L, H, D) tensors with GQA expanded, as a serving engine's dense baseline."""
    group = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)
    kt = k.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
    vt = v.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    return run


# Tile shapes (BLOCK_M, BLOCK_N, num_warps, num_stages) timed by --tiles: the autotuned list and neighbours.
TILE_CANDIDATES = [
    (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 4, 4),
    (128, 128, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 32, 4, 2), (64, 32, 4, 2),
]  # fmt: skip


def tile_sweep(kernel_args, layout, scale, out, flops, cudnn_ms, reps) -> list[dict]:
    """Our dense-mode kernel at each candidate tile shape (shapes that fail to compile are skipped)."""
    rows = []
    for block_m, block_n, warps, stages in TILE_CANDIDATES:
        tile = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        run = lambda: attention.block_sparse_attention(*kernel_args, layout, None, scale, False, out, tile=tile)  # noqa: B023, E731
        try:
            ms = cuda_time(run, reps)
        except Exception as error:  # out of shared memory or registers for this head size
            rows.append(dict(tile=[block_m, block_n, warps, stages], error=str(error).splitlines()[0][:120]))
            continue
        rows.append(dict(tile=[block_m, block_n, warps, stages], ms=ms, tflops=flops / ms / 1e9, of_cudnn=cudnn_ms / ms))
    return rows


def split_rows(index, num_heads: int) -> int:
    """Rows (query block, KV head) of the index that the attention walks in several key ranges."""
    counts = index.counts.contiguous()
    plan = attention._plan_splits(counts, index.layout.block_size, num_heads // counts.shape[1], 0)
    return int((plan.row_splits > 1).sum())


def pipelined_time(fn, reps: int, calls: int = 8) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls (the host runs ahead, as in a model's forward).
    Where launching a call takes the host longer than the GPU takes to run it, this is the host's time."""
    return cuda_time(lambda: [fn() for _ in range(calls)], reps) / calls


def queued_time(fn, reps: int, calls: int = 8) -> float:
    """GPU milliseconds per call of ``calls`` calls queued behind a sleeping kernel: the host has
    launched them all before the first starts, so launch time is not counted, whatever it is. The
    sleep is sized from the host's measured launch time and lengthened until it covers it."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = 1e3 * (time.perf_counter() - start)
    torch.cuda.synchronize()
    sleep_ms = 2.0 * host_ms + 1.0
    times = []
    while len(times) < reps:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * _sleep_cycles_per_ms()))
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        enqueue = time.perf_counter()
        first.record()
        for _ in range(calls):
            fn()
        last.record()
        enqueued_ms = 1e3 * (time.perf_counter() - enqueue)
        if first.query():  # the sleep ended before the calls were all queued: sleep longer
            sleep_ms = 2.0 * max(sleep_ms, enqueued_ms)
            last.synchronize()
            continue
        last.synchronize()
        times.append(first.elapsed_time(last) / calls)
    return statistics.median(times)


_CYCLES_PER_MS: list[float] = []


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles of torch.cuda._sleep per millisecond, measured once."""
    if not _CYCLES_PER_MS:
        cycles = 20_000_000
        ms = cuda_time(lambda: torch.cuda._sleep(cycles), 3)
        _CYCLES_PER_MS.append(cycles / ms)
    return _CYCLES_PER_MS[0]


# Launch shapes of the search kernel timed beside its own choice ({}) by --search-launches: key-tile
# width and warps, then fewer rows per chunk (the registers a program holds grow with them).
SEARCH_LAUNCHES = (
    [{}]
    + [{"num_warps": warps, "BLOCK_J": tile} for warps in (2, 4, 8) for tile in (32, 64, 128)]
    + [{"ROW_CHUNK": rows, "num_warps": warps, "BLOCK_J": tile} for rows in (32, 64) for warps in (4, 8) for tile in (32, 64)]
)


def search_launches(select_args, config: SparsePrefillConfig, scale: float, reps: int) -> list[dict]:
    """The search at each launch shape (rows per chunk, key-tile width, warps), a prebuilt layout, calls back to back;
    a shape past the shared memory is reported, not timed."""
    q, k_cache, table, cu, seqlens = select_args
    layout = BatchLayout.build(cu.cpu(), seqlens.cpu(), config, q.device)
    rows = []
    for shape in SEARCH_LAUNCHES:
        run = lambda: search.select_blocks(q, k_cache, table, cu, seqlens, layout, config, scale, launch=shape)  # noqa: B023, E731
        try:
            rows.append({"launch": shape or "default", "ms": pipelined_time(run, reps), "gpu_ms": queued_time(run, reps)})
        except Exception as error:  # noqa: BLE001 - a tile past the shared memory of this GPU
            rows.append({"launch": shape, "error": str(error).splitlines()[0][:120]})
    return rows


def search_breakdown(select_args, config: SparsePrefillConfig, scale: float, reps: int) -> dict:
    """Where the block search's time goes at one shape: the public call from an idle GPU (lengths read
    from the device, the layout built, allocations and two launches), the layout build alone (host), the
    search with a prebuilt layout as an engine runs it (once per layer, one layout per step) from an idle
    GPU, back to back, and queued (its GPU time alone, as in a model's forward where the host runs
    ahead), the pooling kernel alone back to back and queued, and the host time of launching it."""
    q, k_cache, table, cu, seqlens = select_args
    host = (cu.cpu(), seqlens.cpu())
    layout = BatchLayout.build(*host, config, q.device)
    run_search = lambda: search.select_blocks(q, k_cache, table, cu, seqlens, layout, config, scale)  # noqa: E731
    with_means, with_bounds = config.estimator in ("pooled", "mixed"), config.estimator in ("bound", "mixed")
    pool = lambda: search.pool_blocks(k_cache, table, seqlens, layout, with_means, with_bounds, q.dtype)  # noqa: E731
    row = {"public_ms": cuda_time(lambda: select_blocks(*select_args, config=config, softmax_scale=scale), reps),
           "prebuilt_ms": cuda_time(run_search, reps), "pipelined_ms": pipelined_time(run_search, reps),
           "gpu_ms": queued_time(run_search, reps), "pipelined_pool_ms": pipelined_time(pool, reps),
           "gpu_pool_ms": queued_time(pool, reps)}  # fmt: skip
    builds, launches = [], []
    for _ in range(reps):
        start = time.perf_counter()
        BatchLayout.build(*host, config, q.device)
        builds.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        run_search()
        launches.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    row["layout_build_ms"], row["host_launch_ms"] = 1e3 * statistics.median(builds), 1e3 * statistics.median(launches)
    return row


def dense_route_breakdown(q, k_cache, v_cache, table, length: int, reps: int, rounds: int = 3) -> dict:
    """Where the public function's dense route (cuDNN, below min_q_len) spends its time on one fresh
    sequence, each part alone from an idle GPU (``*_ms``) and back to back (``pipelined_*``): the page
    gather, cuDNN on the gathered K/V, the copy into a caller's ``out``, the length read. Then the
    whole function as an engine calls it (a prebuilt layout, calls back to back, with and without
    ``out``), with lengths read from the device, and the cuDNN baseline the same way, in ``rounds``
    interleaved rounds (each figure a list, one per round)."""
    gather = lambda: staging.gather_kv(k_cache, v_cache, table, 0, length)  # noqa: E731
    k, v = gather()
    cudnn = lambda: dense_route.cudnn_causal_attention(q, k, v, q.shape[2] ** -0.5)  # noqa: E731
    out = torch.empty_like(q)
    o, _ = cudnn()
    lengths = torch.tensor([0, length, length], dtype=torch.int32, device=q.device)
    row = {"api_uses_native_gqa": dense_route.CUDNN_ROUTE.native_gqa}
    for name, fn in (("gather", gather), ("cudnn_native_gqa", cudnn), ("copy_out", lambda: out.copy_(o))):
        row[f"{name}_ms"], row[f"pipelined_{name}_ms"] = cuda_time(fn, reps), pipelined_time(fn, reps)
    row["length_read_ms"] = cuda_time(lambda: lengths.long().cpu(), reps)
    cu, seqlens = lengths[:2], lengths[2:]
    layout = BatchLayout.build(torch.tensor([0, length]), torch.tensor([length]), SparsePrefillConfig(), q.device)
    calls = {
        "cudnn": sdpa(q, *(staging_reference.gather_kv(c, table, 0, length) for c in (k_cache, v_cache)), SDPBackend.CUDNN_ATTENTION),
        "public_layout": lambda: sparse_prefill_attention(q, k_cache, v_cache, table, cu, seqlens, out=out, layout=layout),
        "public_layout_no_out": lambda: sparse_prefill_attention(q, k_cache, v_cache, table, cu, seqlens, layout=layout),
        "public": lambda: sparse_prefill_attention(q, k_cache, v_cache, table, cu, seqlens, out=out),
    }
    for name in calls:
        row[f"{name}_rounds_ms"], row[f"pipelined_{name}_rounds_ms"] = [], []
    for _ in range(rounds):
        for name, fn in calls.items():
            row[f"{name}_rounds_ms"].append(cuda_time(fn, reps))
            row[f"pipelined_{name}_rounds_ms"].append(pipelined_time(fn, reps))
    return row


def print_dense_route(row: dict) -> None:
    route = row["dense_route"]
    print(f"\nDense route at {row['length'] // 1024}K (cuDNN GQA native: {route['api_uses_native_gqa']}); parts, ms alone / back to back: "
          + ", ".join(f"{name} {route[name + '_ms']:.3f} / {route['pipelined_' + name + '_ms']:.3f}"
                      for name in ("gather", "cudnn_native_gqa", "copy_out")) + f", length read {route['length_read_ms']:.3f}")  # fmt: skip
    print("| call | one call, ms (rounds) | back to back, ms per call (rounds) | median back to back |\n|---|---|---|---|")
    for name, label in (("cudnn", "cuDNN on contiguous tensors (baseline)"), ("public_layout", "public, prebuilt layout, out given"),
                        ("public_layout_no_out", "public, prebuilt layout, no out"), ("public", "public, lengths read, out given")):  # fmt: skip
        alone, piped = route[f"{name}_rounds_ms"], route[f"pipelined_{name}_rounds_ms"]
        print(f"| {label} | {' / '.join(f'{t:.3f}' for t in alone)} | {' / '.join(f'{t:.3f}' for t in piped)} "
              f"| {statistics.median(piped):.3f} |")


def threshold_for_density(args, target: float, base: SparsePrefillConfig) -> tuple[float, float]:
    """Bisect the threshold until the searched index keeps about ``target`` of the causal blocks."""
    low, high = 0.0, 1.0
    best = (0.0, 1.0)
    for _ in range(22):
        mid = (low + high) / 2
        density = select_blocks(*args, config=base.replace(threshold=mid)).density()
        best = (mid, density)
        if abs(density - target) < 0.1 * target:
            break
        if density > target:
            low = mid
        else:
            high = mid
    return best


def check_correctness(dtypes, head_dims, page_sizes, log=lambda line: None) -> list[str]:
    """Fresh random inputs vs the float32 reference, with a poisoned output buffer, for each way of
    reading K/V the GPU has (TMA from compute capability 9.0). The keys have blocks of different
    relevance (``structured_qkv``), so the sparse cases drop blocks (each line gives the density kept); TMA
    also needs a Triton with tensor descriptors."""
    lines = []
    kv_reads = ("tma", "pointer") if launch.tma_capable(torch.device("cuda")) else ("pointer",)
    for dtype, head_dim, page_size, reads in itertools.product(dtypes, head_dims, page_sizes, kv_reads):
        launch.KV_READS = reads
        q_lens, k_lens = [3000, 1000, 517], [3000, 5000, 2600]
        heads, num_kv = 8, 2
        seeds = torch.randint(1 << 30, (len(k_lens),)).tolist()
        seqs = [structured_qkv(k_len, heads, num_kv, head_dim, 128, dtype, seed) for k_len, seed in zip(k_lens, seeds)]
        q = torch.cat([sq[k_len - q_len :] for (sq, _, _), q_len, k_len in zip(seqs, q_lens, k_lens)])
        n_pages = sum(-(-k // page_size) for k in k_lens)
        k_cache = torch.zeros(n_pages, page_size, num_kv, head_dim, device="cuda", dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        perm = torch.randperm(n_pages, device="cuda").to(torch.int32)
        table = torch.zeros(len(k_lens), max(-(-k // page_size) for k in k_lens), dtype=torch.int32, device="cuda")
        used = 0
        for i, ((_, k, v), k_len) in enumerate(zip(seqs, k_lens)):
            n = -(-k_len // page_size)
            table[i, :n] = perm[used : used + n]
            used += n
            for cache, x in ((k_cache, k), (v_cache, v)):
                cache[table[i, :n].long()] = F.pad(x, (0, 0, 0, 0, 0, n * page_size - k_len)).view(n, page_size, num_kv, head_dim)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        seqlens = torch.tensor(k_lens, dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, table, cu, seqlens)
        ref_out, ref_lse = attention_reference.dense_paged_attention(*args)
        cases = ((0.0, 0, "mixed"), (0.05, 0, "pooled/4"), (0.05, 0, "bound/4"), (0.05, 0, "mixed/4"), (0.05, 0, "mixed/8"),
                 (0.05, 0, "exact"), (0.05, 1 << 20, "mixed"))  # fmt: skip
        for threshold, min_q_len, estimator in cases:
            config = estimator_config(estimator, SparsePrefillConfig.query_stride, threshold=threshold, min_q_len=min_q_len)
            if min_q_len:  # an all-dense batch of fresh prefills: the cuDNN route
                fresh = slice(0, q_lens[0])
                args = (q[fresh], k_cache, v_cache, table[:1], cu[:2], seqlens[:1].clone().fill_(q_lens[0]))
                ref_out, ref_lse = attention_reference.dense_paged_attention(*args)
            out = torch.full_like(args[0], float("nan"))
            got, lse = sparse_prefill_attention(*args, config=config, out=out)
            if threshold == 0 or min_q_len:
                target, target_lse = ref_out, ref_lse
            else:
                index = select_blocks(q, k_cache, table, cu, seqlens, config=config)
                target, target_lse = attention_reference.block_masked_attention(*args, index)
            err = ((got.float() - target).norm() / target.norm()).item()
            lse_err = (lse - target_lse).abs().max().item()
            ok = torch.isfinite(got).all().item() and err < 2e-2 and lse_err < 1e-2
            scores = ""
            if threshold and not min_q_len:  # the search's estimate itself against the float64 reference
                want = search_reference.select_blocks(q, k_cache, table, cu, seqlens, config)
                score_err = (index.scores - want.scores).abs().max().item()
                # The exact estimate is computed in float32; the pooled ones multiply in q's dtype.
                ok = ok and score_err < (1e-3 if config.estimator == "exact" else 2e-2)
                scores = f" score_err={score_err:.1e}"
            kept = "" if threshold == 0 or min_q_len else f" density={index.density():.2f}"
            lines.append(
                f"{'ok ' if ok else 'BAD'} {str(dtype):15s} d={head_dim:3d} page={page_size:2d} {reads:7s} th={threshold} "
                f"min_q_len={min_q_len} {estimator}:{kept} rel_err={err:.2e} lse_err={lse_err:.1e}{scores}"
            )
            log(lines[-1])
    launch.KV_READS = "auto"
    return lines


def estimator_config(spec: str, query_stride: int, **fields) -> SparsePrefillConfig:
    """The configuration an ``--estimators`` entry names: ``mixed``, or ``mixed/8`` to score every 8th
    query row instead of every ``query_stride``-th."""
    estimator, _, stride = spec.partition("/")
    return SparsePrefillConfig(estimator=estimator, query_stride=int(stride) if stride else query_stride, **fields)


def bench_length(length, args, results):
    heads, num_kv, head_dim = args.heads, args.kv_heads, args.head_dim
    dtype = torch.bfloat16
    q, k, v = structured_qkv(length, heads, num_kv, head_dim, 128, dtype, seed=length)
    k_cache, v_cache, table = paged(k, v, args.page_size)
    cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([length], dtype=torch.int32, device="cuda")
    kernel_args = (q, k_cache, v_cache, table, cu, seqlens)
    flops = causal_flops(length, length, heads, head_dim)
    reps = args.repeats if length <= 65536 else max(3, args.repeats // 2)
    row = {"length": length}
    row["cudnn_ms"] = cuda_time(sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), reps)
    row["fa2_ms"] = cuda_time(sdpa(q, k, v, SDPBackend.FLASH_ATTENTION), reps)
    out = torch.empty_like(q)
    layout = BatchLayout.build(cu, seqlens, SparsePrefillConfig(threshold=0.0), q.device)
    scale = 1.0 / math.sqrt(head_dim)
    triton_dense = lambda: attention.block_sparse_attention(*kernel_args, layout, None, scale, False, out)  # noqa: E731
    row["ours_dense_ms"] = cuda_time(triton_dense, reps)
    row["autotuned_tile"] = str(getattr(attention._attention_kernel, "best_config", None))
    row["kv_reads"] = launch.kv_read_mode(q, k_cache, v_cache)
    pointer_dense = lambda: attention.block_sparse_attention(*kernel_args, layout, None, scale, False, out, kv_reads="pointer")  # noqa: E731
    row["ours_dense_pointer_ms"] = cuda_time(pointer_dense, reps)
    stage = lambda: staging.stage_kv(k_cache, v_cache, table, seqlens, layout, range(num_kv))  # noqa: E731
    row["stage_ms"] = cuda_time(stage, reps)
    if args.tiles:
        row["tiles"] = tile_sweep(kernel_args, layout, scale, out, flops, row["cudnn_ms"], reps)
    row["public_default_ms"] = cuda_time(lambda: sparse_prefill_attention(*kernel_args, out=out), reps)
    if length < SparsePrefillConfig().min_q_len:
        row["dense_route"] = dense_route_breakdown(q, k_cache, v_cache, table, length, reps)
    dense_out = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)()[0].transpose(0, 1).float()
    ours_dense = triton_dense()[0].clone()
    row["ours_dense_err"] = ((ours_dense.float() - dense_out).norm() / dense_out.norm()).item()
    for name in ("cudnn", "fa2", "ours_dense", "ours_dense_pointer"):
        row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
    row["sparse"] = []
    select_args = (q, k_cache, table, cu, seqlens)
    for estimator, target in itertools.product(args.estimators, args.densities):
        base = estimator_config(estimator, args.query_stride, min_q_len=0)
        threshold, density = threshold_for_density(select_args, target, base)
        config = base.replace(threshold=threshold)
        total = cuda_time(lambda: sparse_prefill_attention(*kernel_args, config=config, out=out), reps)
        select = cuda_time(lambda: select_blocks(*select_args, config=config), reps)
        breakdown = search_breakdown(select_args, config, scale, reps)
        if args.search_launches:
            breakdown["launches"] = search_launches(select_args, config, scale, reps)
        index = select_blocks(*select_args, config=config)
        attend = cuda_time(lambda: block_sparse_attention(*kernel_args, index, out=out), reps)
        unsplit = lambda: attention.block_sparse_attention(*kernel_args, index.layout, index, scale, False, out, split_kv=False)  # noqa: B023, E731
        attend_unsplit = cuda_time(unsplit, reps)
        pointer = lambda: attention.block_sparse_attention(*kernel_args, index.layout, index, scale, False, out, kv_reads="pointer")  # noqa: B023, E731
        attend_pointer = cuda_time(pointer, reps)
        sparse_out, _ = sparse_prefill_attention(*kernel_args, config=config)
        err = ((sparse_out.float() - dense_out).norm() / dense_out.norm()).item()
        row["sparse"].append(
            dict(estimator=estimator, target=target, threshold=threshold, density=density, total_ms=total, select_ms=select,
                 search=breakdown, search_share_of_cudnn=breakdown["gpu_ms"] / row["cudnn_ms"],
                 attention_ms=attend, attention_unsplit_ms=attend_unsplit, attention_pointer_ms=attend_pointer,
                 split_rows=split_rows(index, q.shape[1]), rel_err=err, speedup_cudnn=row["cudnn_ms"] / total, speedup_fa2=row["fa2_ms"] / total)
        )
    results.append(row)
    return row


def bench_real(path: Path, estimators: list[str], repeats: int, page_size: int) -> list[dict]:
    """Time and check one captured layer, a .pt file holding q (L, Hq, D), k and v (L, Hkv, D), with
    the default configuration under each estimator (``min_q_len`` 0, so every length is sparse)."""
    data = torch.load(path, map_location="cuda")
    q, k, v = (data[name].to(torch.bfloat16).contiguous() for name in ("q", "k", "v"))
    length, heads, head_dim = q.shape
    k_cache, v_cache, table = paged(k, v, page_size)
    cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([length], dtype=torch.int32, device="cuda")
    kernel_args = (q, k_cache, v_cache, table, cu, seqlens)
    scale = data.get("scale")
    dense_out, _ = attention_reference.dense_paged_attention(*kernel_args, softmax_scale=scale)
    out = torch.empty_like(q)
    base = dict(file=path.name, length=length, heads=heads, kv_heads=k.shape[1], head_dim=head_dim)
    # cuDNN is timed only up to head_dim 128; for Gemma 3 (256) FA2 is the dense baseline.
    base["cudnn_ms"] = cuda_time(sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), repeats) if head_dim <= 128 else float("nan")
    base["fa2_ms"] = cuda_time(sdpa(q, k, v, SDPBackend.FLASH_ATTENTION), repeats)
    rows = []
    for estimator in estimators:
        cfg = estimator_config(estimator, SparsePrefillConfig.query_stride, min_q_len=0)
        row = dict(base, estimator=estimator, threshold=cfg.threshold)
        row["total_ms"] = cuda_time(lambda: sparse_prefill_attention(*kernel_args, config=cfg, softmax_scale=scale, out=out), repeats)  # noqa: B023
        row["select_ms"] = cuda_time(lambda: select_blocks(q, k_cache, table, cu, seqlens, config=cfg, softmax_scale=scale), repeats)  # noqa: B023
        got, _ = sparse_prefill_attention(*kernel_args, config=cfg, softmax_scale=scale)
        row["density"] = select_blocks(q, k_cache, table, cu, seqlens, config=cfg, softmax_scale=scale).density()
        row["rel_err"] = ((got.float() - dense_out).norm() / dense_out.norm()).item()
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,32768,131072",
                        help="random-input lengths; empty for none (then, without --real and --skip-check, the check alone)")
    parser.add_argument("--densities", default="0.02,0.05,0.1,0.25")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--query-stride", type=int, default=SparsePrefillConfig().query_stride)
    parser.add_argument("--estimators", default="pooled,exact", help="block-importance estimators of the sparse rows; name/N scores every N-th query row (mixed/8)")
    parser.add_argument("--real", nargs="*", default=[], help="captured q/k/v .pt files to time and check at the default config, under each of --estimators")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--tiles", action="store_true", help="also time the dense-mode kernel at each candidate tile shape")
    parser.add_argument("--search-launches", action="store_true",
                        help="also time the block search at each launch shape (key-tile width, warps)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.densities = [float(x) for x in args.densities.split(",")]
    args.estimators = args.estimators.split(",")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d")}
    if not args.skip_check:
        lines = check_correctness((torch.bfloat16, torch.float16), (64, 128, 256), (1, 16, 64), log=lambda line: print(line, flush=True))
        report["correctness"] = lines
    results = report["random"] = []
    for length in (int(x) for x in args.lengths.split(",") if x):
        t0 = time.time()
        row = bench_length(length, args, results)
        torch.cuda.empty_cache()  # the length's tensors were freed on return
        print(json.dumps(row), f"# {time.time() - t0:.0f}s", flush=True)
        if args.out:  # each finished length is kept, should the run be stopped before the next
            args.out.write_text(json.dumps(report, indent=1))
    report["real"] = [row for p in args.real for row in bench_real(Path(p), args.estimators, args.repeats, args.page_size)]
    for row in report["real"]:
        print(json.dumps(row), flush=True)
    print("\n| N | cuDNN ms (TFLOP/s) | FA2 ms (TFLOP/s) | ours dense ms (TFLOP/s, % cuDNN) | pointer reads ms (% cuDNN) | staging ms | default config ms | estimator | density | sparse ms | select ms | attention ms split / unsplit / pointer | vs cuDNN | vs FA2 | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        head = (
            f"| {row['length'] // 1024}K | {row['cudnn_ms']:.2f} ({row['cudnn_tflops']:.0f}) | {row['fa2_ms']:.2f} ({row['fa2_tflops']:.0f}) "
            f"| {row['ours_dense_ms']:.2f} ({row['ours_dense_tflops']:.0f}, {100 * row['cudnn_ms'] / row['ours_dense_ms']:.0f}%) "
            f"| {row['ours_dense_pointer_ms']:.2f} ({100 * row['cudnn_ms'] / row['ours_dense_pointer_ms']:.0f}%) | {row['stage_ms']:.2f} "
            f"| {row['public_default_ms']:.2f} "
        )
        for s in row["sparse"]:
            print(
                head + f"| {s['estimator']} | {100 * s['density']:.1f}% | {s['total_ms']:.2f} | {s['select_ms']:.2f} "
                f"| {s['attention_ms']:.2f} / {s['attention_unsplit_ms']:.2f} / {s['attention_pointer_ms']:.2f} "
                f"| {s['speedup_cudnn']:.1f}x | {s['speedup_fa2']:.1f}x | {s['rel_err']:.1e} |"
            )
    print(f"\nBlock search at {args.heads} / {args.kv_heads} heads, d={args.head_dim}: share of dense cuDNN attention "
          "(engine-style: prebuilt layout; GPU time of calls queued behind a sleep, so launch time is not counted; "
          "back to back: the host launching as it goes, its time where it is the longer)")
    print("| N | estimator | density | cuDNN ms | public call ms | prebuilt ms | back to back ms | GPU ms | pooling GPU ms "
          "| layout build ms | host launch ms | share of cuDNN (GPU) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        for s in row["sparse"]:
            b = s["search"]
            print(f"| {row['length'] // 1024}K | {s['estimator']} | {100 * s['density']:.1f}% | {row['cudnn_ms']:.2f} "
                  f"| {b['public_ms']:.3f} | {b['prebuilt_ms']:.3f} | {b['pipelined_ms']:.3f} | {b['gpu_ms']:.3f} "
                  f"| {b['gpu_pool_ms']:.3f} | {b['layout_build_ms']:.3f} | {b['host_launch_ms']:.3f} "
                  f"| {100 * s['search_share_of_cudnn']:.2f}% |")  # fmt: skip
    for row in results:
        for s in row["sparse"]:
            for timed in s["search"].get("launches", []):
                if timed is s["search"]["launches"][0]:
                    print(f"\nSearch launch shapes at {row['length'] // 1024}K, {s['estimator']} (ms per call)")
                    print("| launch | back to back | GPU | GPU vs the kernel's choice |\n|---|---|---|---|")
                base = s["search"]["launches"][0].get("gpu_ms")
                if "error" in timed:
                    print(f"| {timed['launch']} | - | - | {timed['error']} |")
                else:
                    print(f"| {timed['launch']} | {timed['ms']:.3f} | {timed['gpu_ms']:.3f} | {timed['gpu_ms'] / base:.2f} |")
    if report["real"]:
        print("\n| layer | N | heads q/kv, d | estimator | FA2 ms | cuDNN ms | sparse ms | select ms | density | rel err vs dense |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["real"]:
        print(f"| {r['file']} | {r['length'] // 1024}K | {r['heads']}/{r['kv_heads']}, {r['head_dim']} | {r['estimator']} | {r['fa2_ms']:.2f} "
              f"| {r['cudnn_ms']:.2f} | {r['total_ms']:.2f} | {r['select_ms']:.2f} | {100 * r['density']:.1f}% | {r['rel_err']:.1e} |")  # fmt: skip
    for row in results:
        if "dense_route" in row:
            print_dense_route(row)
    for row in results:
        if "tiles" in row:
            print(f"\nDense-mode tiles at {row['length'] // 1024}K (autotuned: {row['autotuned_tile']}); cuDNN {row['cudnn_ms']:.2f} ms")
            print("| BLOCK_M, BLOCK_N, warps, stages | ms | TFLOP/s | % cuDNN |\n|---|---|---|---|")
            for t in row["tiles"]:
                shape = ", ".join(map(str, t["tile"]))
                if "error" in t:
                    print(f"| {shape} | - | - | {t['error']} |")
                else:
                    print(f"| {shape} | {t['ms']:.2f} | {t['tflops']:.0f} | {100 * t['of_cudnn']:.0f}% |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
