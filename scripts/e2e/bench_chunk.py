"""Time one chunk of a long chunked prefill the way vLLM computes it: our sparse path against vLLM's own
FlashAttention on the same paged cache, per stage.

The chunk is the last ``--chunk`` queries of a ``length``-token sequence, its keys and values in a paged
cache of ``--page-size`` tokens, GQA heads as in the model (SmolLM2-135M: 9 query / 3 KV heads of 64).
Baseline: ``vllm.vllm_flash_attn.flash_attn_varlen_func`` with the block table (FA3 on Hopper), what
upstream vLLM runs for that chunk. Ours: block search, attention over the kept blocks, and the whole
call with and without a prebuilt layout. Inputs: structured random Q/K/V (see bench_kernels.py), or
``--real`` captures from the accuracy harness (``python -m prefill_accel.accuracy --capture``), whose
density is the one a model produces. Needs vLLM on the path (run it under the patched site's path), unless
``--baseline none`` leaves FA3 out (the GPU image without an engine: our stages alone).

With ``--prefill`` every chunk of a whole chunked prefill is timed instead (chunk i: queries
[i * chunk, (i + 1) * chunk) over keys [0, (i + 1) * chunk)) and the chunks summed: one layer's attention
time in a prefill of that length, FA3 against ours (search and attention), the figure that explains a
TTFT ratio; each chunk's own figures are in the row's ``chunks``. The attention is timed with split-KV
and without it, from an idle GPU (the host launching as it goes) and queued behind a sleep (its GPU
time alone, what it costs inside a forward pass, where the host runs ahead).

  python scripts/e2e/bench_chunk.py --lengths 32768,65536,131072 --chunk 16384 --out chunk.json
  python scripts/e2e/bench_chunk.py --prefill --heads 12 --kv-heads 2 --head-dim 128 --estimators mixed \
      --lengths 32768,131008 --real captures/*.pt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import cuda_time, paged, queued_time, split_rows, structured_qkv  # noqa: E402
from prefill_accel import (  # noqa: E402
    BatchLayout,
    SparsePrefillConfig,
    block_sparse_attention,
    select_blocks,
    sparse_prefill_attention,
)
from prefill_accel.ops import attention, attention_reference, search  # noqa: E402


def chunk_inputs(q_full, k, v, chunk: int, page_size: int):
    """The last ``chunk`` queries of the sequence, its paged cache, and the call's length tensors."""
    length = k.shape[0]
    k_cache, v_cache, table = paged(k, v, page_size)
    q = q_full[length - chunk :].contiguous()
    cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([length], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, cu, seqlens


def time_chunk(name: str, q, k_cache, v_cache, table, cu, seqlens, config, scale, repeats: int) -> dict:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    chunk, length = q.shape[0], int(seqlens[0])
    out = torch.empty_like(q)

    def fa3():
        flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, max_seqlen_q=chunk, cu_seqlens_q=cu, max_seqlen_k=length, seqused_k=seqlens,
            softmax_scale=scale, causal=True, block_table=table, out=out, fa_version=3,
        )  # fmt: skip

    args = (q, k_cache, v_cache, table, cu, seqlens)
    layout = BatchLayout.build(cu.cpu(), seqlens.cpu(), config, q.device)
    index = select_blocks(q, k_cache, table, cu, seqlens, config=config, softmax_scale=scale)
    row = {
        "input": name, "estimator": config.estimator, "length": length, "chunk": chunk, "heads": q.shape[1], "kv_heads": k_cache.shape[2],
        "head_dim": q.shape[2], "density": index.density(),
        "fa3_ms": cuda_time(fa3, repeats),
        "select_ms": cuda_time(lambda: select_blocks(q, k_cache, table, cu, seqlens, config=config,
                                                     softmax_scale=scale), repeats),
        "attention_ms": cuda_time(lambda: block_sparse_attention(*args, index, softmax_scale=scale, out=out), repeats),
        "attention_unsplit_ms": cuda_time(lambda: attention.block_sparse_attention(
            *args, layout, index, scale, False, out, split_kv=False), repeats),
        "total_ms": cuda_time(lambda: sparse_prefill_attention(*args, config=config, softmax_scale=scale, out=out),
                              repeats),
        "total_layout_ms": cuda_time(lambda: sparse_prefill_attention(*args, config=config, softmax_scale=scale,
                                                                      out=out, layout=layout), repeats),
    }  # fmt: skip
    dense_config = config.replace(threshold=0.0)
    row["dense_mode_ms"] = cuda_time(
        lambda: sparse_prefill_attention(*args, config=dense_config, softmax_scale=scale, out=out), repeats
    )
    fa3()
    want = out.float().clone()
    got, _ = sparse_prefill_attention(*args, config=dense_config, softmax_scale=scale)
    row["dense_mode_err_vs_fa3"] = ((got.float() - want).norm() / want.norm()).item()
    if length <= 32768:  # the float32 reference on the whole chunk
        ref, _ = attention_reference.dense_paged_attention(*args, softmax_scale=scale)
        row["fa3_err_vs_reference"] = ((want - ref).norm() / ref.norm()).item()
    row["speedup_vs_fa3"] = row["fa3_ms"] / row["total_layout_ms"]
    return row


def time_prefill(name: str, q_full, k, v, chunk: int, page_size: int, config, scale, repeats: int,
                 baseline: bool = True) -> dict:
    """One layer's attention in a whole chunked prefill of ``k.shape[0]`` tokens: every chunk timed
    (FA3 unless not ``baseline``; our search and attention with a prebuilt layout, as the engine calls
    them), summed."""
    if baseline:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

    length = k.shape[0]
    totals = {"fa3_ms": 0.0, "select_ms": 0.0, "select_gpu_ms": 0.0, "attention_ms": 0.0, "attention_unsplit_ms": 0.0,
              "attention_gpu_ms": 0.0, "attention_unsplit_gpu_ms": 0.0, "total_layout_ms": 0.0}
    kept = causal = 0
    chunks = []
    for end in range(chunk, length + chunk, chunk):
        end = min(end, length)
        q, k_cache, v_cache, table, cu, seqlens = chunk_inputs(q_full[:end], k[:end], v[:end], end - (end - 1) // chunk * chunk, page_size)
        args = (q, k_cache, v_cache, table, cu, seqlens)
        out = torch.empty_like(q)

        def fa3():
            flash_attn_varlen_func(
                q=q, k=k_cache, v=v_cache, max_seqlen_q=q.shape[0], cu_seqlens_q=cu, max_seqlen_k=end,
                seqused_k=seqlens, softmax_scale=scale, causal=True, block_table=table, out=out, fa_version=3,
            )  # fmt: skip

        layout = BatchLayout.build(cu.cpu(), seqlens.cpu(), config, q.device)
        run_search = lambda: search.select_blocks(q, k_cache, table, cu, seqlens, layout, config, scale)  # noqa: B023, E731
        index = None if layout.all_dense else run_search()
        attend = lambda: attention.block_sparse_attention(*args, layout, index, scale, False, out)  # noqa: B023, E731
        unsplit = lambda: attention.block_sparse_attention(*args, layout, index, scale, False, out, split_kv=False)  # noqa: B023, E731
        whole = lambda: sparse_prefill_attention(*args, config=config, softmax_scale=scale, out=out, layout=layout)  # noqa: B023, E731
        # The search and the attention from an idle GPU (the host launching as it goes) and queued behind
        # a sleep (their GPU time alone: their cost inside a forward pass, where the host runs ahead).
        times = {"fa3_ms": cuda_time(fa3, repeats) if baseline else 0.0,
                 "select_ms": 0.0 if index is None else cuda_time(run_search, repeats),
                 "select_gpu_ms": 0.0 if index is None else queued_time(run_search, repeats),
                 "attention_ms": cuda_time(attend, repeats), "attention_unsplit_ms": cuda_time(unsplit, repeats),
                 "attention_gpu_ms": queued_time(attend, repeats),
                 "attention_unsplit_gpu_ms": queued_time(unsplit, repeats),
                 "total_layout_ms": cuda_time(whole, repeats)}  # fmt: skip
        for stage, ms in times.items():
            totals[stage] += ms
        blocks = layout.causal_blocks() * k_cache.shape[2]
        kept_here = blocks if index is None else int(index.counts.long().sum())
        kept, causal = kept + kept_here, causal + blocks
        chunks.append({"queries": q.shape[0], "keys": end, "sparse": index is not None,
                       "density": kept_here / max(blocks, 1),
                       "split_rows": 0 if index is None else split_rows(index, q.shape[1]), **times})  # fmt: skip
    row = {"input": name, "estimator": config.estimator, "length": length, "chunk": chunk, "heads": q_full.shape[1],
           "kv_heads": k.shape[1], "head_dim": q_full.shape[2], "density": kept / max(causal, 1), **totals}  # fmt: skip
    fa3_ms = totals["fa3_ms"] or float("nan")  # nan without the baseline
    row["search_share_of_fa3"] = totals["select_ms"] / fa3_ms
    row["search_gpu_share_of_fa3"] = totals["select_gpu_ms"] / fa3_ms
    row["speedup_vs_fa3"] = fa3_ms / totals["total_layout_ms"]
    row["chunks"] = chunks
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32768,65536,131072")
    parser.add_argument("--chunk", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--estimators", default="pooled,exact", help="block-importance estimators to time")
    parser.add_argument("--real", nargs="*", default=[], help="captured q/k/v .pt files (accuracy harness)")
    parser.add_argument("--prefill", action="store_true", help="time every chunk of a whole prefill, summed")
    parser.add_argument("--baseline", choices=("fa3", "none"), default="fa3",
                        help="none: no FA3 (no vLLM needed; --prefill only), our stages alone")
    parser.add_argument("--threshold", type=float, help="the config's threshold (default: SparsePrefillConfig's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.baseline == "none" and not args.prefill:
        parser.error("--baseline none needs --prefill")

    # The engine's default config: sequences whose chunk is below min_q_len stay dense there too.
    fields = {} if args.threshold is None else {"threshold": args.threshold}
    configs = [SparsePrefillConfig(min_q_len=0 if not args.prefill else SparsePrefillConfig.min_q_len, estimator=name,
                                   **fields) for name in args.estimators.split(",")]  # fmt: skip
    rows = []

    def measure(name, q, k, v, scale):
        for config in configs:
            if args.prefill:
                rows.append(time_prefill(name, q, k, v, args.chunk, args.page_size, config, scale, args.repeats,
                                         baseline=args.baseline == "fa3"))
            else:
                chunk = min(args.chunk, q.shape[0] // 2) if name != "structured" else args.chunk
                rows.append(time_chunk(name, *chunk_inputs(q, k, v, chunk, args.page_size), config, scale, args.repeats))
            print(json.dumps(rows[-1]), flush=True)

    for length in (int(x) for x in args.lengths.split(",")):
        q, k, v = structured_qkv(length, args.heads, args.kv_heads, args.head_dim, configs[0].block_size,
                                 torch.bfloat16, seed=length)  # fmt: skip
        measure("structured", q, k, v, args.head_dim**-0.5)
    for path in map(Path, args.real):
        data = torch.load(path, map_location="cuda")
        q, k, v = (data[name].to(torch.bfloat16).contiguous() for name in ("q", "k", "v"))
        measure(path.name, q, k, v, data.get("scale") or q.shape[2] ** -0.5)

    if args.prefill:
        header = ("| input | length | chunk | density | FA3 ms | search ms (GPU) | attention ms | ours ms | search / FA3 "
                  "(GPU) | vs FA3 |")  # fmt: skip
        cells = lambda r: (f"{r['input']} | {r['length']} | {r['chunk']} | {r['density']:.3f} | {r['fa3_ms']:.2f} | "  # noqa: E731
                           f"{r['select_ms']:.2f} ({r['select_gpu_ms']:.2f}) | {r['attention_ms']:.2f} | "
                           f"{r['total_layout_ms']:.2f} | {100 * r['search_share_of_fa3']:.1f}% "
                           f"({100 * r['search_gpu_share_of_fa3']:.2f}%)")  # fmt: skip
    else:
        header = ("| input | length | chunk | estimator | density | FA3 ms | search ms | attention ms | ours ms (layout) "
                  "| vs FA3 |")  # fmt: skip
        cells = lambda r: (f"{r['input']} | {r['length']} | {r['chunk']} | {r['estimator']} | {r['density']:.3f} | "  # noqa: E731
                           f"{r['fa3_ms']:.3f} | {r['select_ms']:.3f} | {r['attention_ms']:.3f} | "
                           f"{r['total_ms']:.3f} ({r['total_layout_ms']:.3f})")  # fmt: skip
    print("\n" + header + "\n" + "|---" * header.count(" | ") + "|---|")
    for r in rows:
        print(f"| {cells(r)} | {r['speedup_vs_fa3']:.2f}x |")
    if args.prefill:
        print("\n| input | length | chunk's queries x keys | sparse | density | split rows | FA3 ms | search ms (GPU) "
              "| attention ms, split / unsplit | attention GPU ms, split / unsplit | ours ms | vs FA3 |\n"
              + "|---" * 12 + "|")  # fmt: skip
        for r in rows:
            for c in r["chunks"]:
                print(f"| {r['input']} | {r['length']} | {c['queries']} x {c['keys']} | {c['sparse']} | {c['density']:.3f} "
                      f"| {c['split_rows']} | {c['fa3_ms']:.2f} | {c['select_ms']:.2f} ({c['select_gpu_ms']:.2f}) "
                      f"| {c['attention_ms']:.2f} / {c['attention_unsplit_ms']:.2f} "
                      f"| {c['attention_gpu_ms']:.2f} / {c['attention_unsplit_gpu_ms']:.2f} | {c['total_layout_ms']:.2f} "
                      f"| {(c['fa3_ms'] or float('nan')) / c['total_layout_ms']:.2f}x |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()
