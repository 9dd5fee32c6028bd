"""Triton kernels against the PyTorch references, on fresh random inputs (interpreter on CPU)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from kernel_inputs import make_batch, rel_err
from prefill_accel import (
    BlockIndex,
    SparsePrefillConfig,
    block_sparse_attention,
    select_blocks,
    sparse_prefill_attention,
)
from prefill_accel import layout as layout_module
from prefill_accel.ops import attention, attention_reference, common, launch, search, search_reference, staging, staging_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# TMA reads need tensor descriptors: Triton >= 3.4 (vLLM 0.6.3's Triton 3.0 reads through the page table)
needs_tma = pytest.mark.skipif(not common.TENSOR_DESCRIPTORS, reason="this Triton has no tensor descriptors")
KV_READS = ["pointer", pytest.param("tma", marks=needs_tma)]
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
# A fresh prefill, a continuation chunk starting mid-block, and a short chunk with a long prefix.
MIXED = dict(q_lens=[200, 70, 33], k_lens=[200, 300, 161])


def sparse_config(**changes) -> SparsePrefillConfig:
    base = SparsePrefillConfig(block_size=64, threshold=0.5, min_q_len=0, sink_blocks=0, local_blocks=0, last_query_blocks=0)
    return base.replace(**changes)


def poisoned_out(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_threshold_zero_is_dense_attention(page_size, dtype, heads):
    batch = make_batch(**MIXED, num_heads=heads[0], num_kv_heads=heads[1], page_size=page_size, dtype=dtype, device=DEVICE)
    out, lse = sparse_prefill_attention(*batch.args, config=sparse_config(threshold=0.0), out=poisoned_out(batch.q))
    want, want_lse = attention_reference.dense_paged_attention(*batch.args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "every output row and lse must be written"
    assert rel_err(out, want) < TOL[dtype]
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims(head_dim):
    batch = make_batch([130, 64], [130, 300], num_heads=4, num_kv_heads=2, head_dim=head_dim, device=DEVICE)
    config = sparse_config()
    index = select_blocks(*batch.search_args, config=config)
    out, lse = sparse_prefill_attention(*batch.args, config=config, out=poisoned_out(batch.q))
    want, want_lse = attention_reference.block_masked_attention(*batch.args, index)
    assert rel_err(out, want) < TOL[torch.float16]
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_sparse_equals_masked_reference_under_own_index(page_size, dtype, heads):
    batch = make_batch(**MIXED, num_heads=heads[0], num_kv_heads=heads[1], page_size=page_size, dtype=dtype, device=DEVICE)
    config = sparse_config()
    index = select_blocks(*batch.search_args, config=config)
    assert index.density() < 0.9, "structured inputs should leave blocks to prune"
    out, lse = sparse_prefill_attention(*batch.args, config=config, out=poisoned_out(batch.q))
    want, want_lse = attention_reference.block_masked_attention(*batch.args, index)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_err(out, want) < TOL[dtype]
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)
    dense, _ = attention_reference.dense_paged_attention(*batch.args)
    assert rel_err(want, dense) > 1e-3, "pruning must change the output on these inputs"


def force_splits(monkeypatch, capacity: int = 30, max_splits: int = 3) -> None:
    """Split-KV made to happen at test sizes: ranges of one block and more, rows over two of them
    split, at most ``max_splits`` ranges a row (the last one ragged), as many program slots as it
    takes, ``capacity`` scratch slots."""
    monkeypatch.setattr(launch, "MIN_SPLIT_BLOCKS", 1)
    monkeypatch.setattr(launch, "SPLIT_OVER_RANGES", 2)
    monkeypatch.setattr(launch, "MAX_SPLITS", max_splits)
    monkeypatch.setattr(launch, "split_slots", lambda group, sms: (10**6, capacity))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("kv_reads", KV_READS)
def test_split_rows_match_the_reference(monkeypatch, page_size, heads, kv_reads):
    """Rows walked in several key ranges and merged (the forced-dense last query blocks, a short
    chunk after a long prefix, sparse rows), beside rows left whole once the scratch slots run out;
    TMA reads staged one KV head per launch, so a launch meets ranges of heads it does not cover."""
    force_splits(monkeypatch)
    monkeypatch.setattr(launch, "KV_READS", kv_reads)
    monkeypatch.setattr(launch, "STAGE_BYTES", 1)
    batch = make_batch(q_lens=[520, 70, 40], k_lens=[520, 600, 460], num_heads=heads[0], num_kv_heads=heads[1],
                       page_size=page_size, device=DEVICE)  # fmt: skip
    config = sparse_config(last_query_blocks=1, min_q_len=64)  # the 40-token chunk is dense as a whole
    index = select_blocks(*batch.search_args, config=config)
    plan = attention._plan_splits(index.counts.contiguous(), 64, heads[0] // heads[1], batch.q.shape[2])
    splits = plan.row_splits.flatten().cpu()
    assert (splits > 1).any()
    assert ((index.counts.flatten().cpu() > 3) & (splits == 1)).any(), "rows past the scratch slots stay whole"
    out, lse = sparse_prefill_attention(*batch.args, config=config, out=poisoned_out(batch.q))
    want, want_lse = attention_reference.block_masked_attention(*batch.args, index)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "every output row and lse must be written"
    assert rel_err(out, want) < TOL[torch.float16]
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("tile", [(32, 32, 4), (64, 16, 2)], ids=["32x32", "64x16"])
@pytest.mark.parametrize("split_kv", [True, False])
def test_explicit_tile_matches_the_reference(monkeypatch, tile, split_kv):
    """The benchmark hooks: one given tile shape instead of the autotuned one, with split rows
    (two query tiles per block write their partials) or every row whole."""
    import triton

    force_splits(monkeypatch)
    batch = make_batch(q_lens=[300, 70], k_lens=[300, 400], device=DEVICE)
    config = sparse_config(last_query_blocks=1)
    index = select_blocks(*batch.search_args, config=config)
    block_m, block_n, warps = tile
    out, lse = attention.block_sparse_attention(
        *batch.args, index.layout, index, batch.q.shape[2] ** -0.5, False, poisoned_out(batch.q),
        tile=triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=1), split_kv=split_kv,
    )  # fmt: skip
    want, want_lse = attention_reference.block_masked_attention(*batch.args, index)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_err(out, want) < TOL[torch.float16]
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("over_ranges", [2, 3])
@pytest.mark.parametrize("group, slots, capacity", [(1, 4096, 64), (6, 528, 192), (4, 2000, 5), (2, 3, 0)])
def test_split_plan_matches_its_reference(group, slots, capacity, over_ranges):
    """The GPU plan against the plain one: a row that keeps everything beside rows that keep a few,
    rows of one block, and scratch slots that run out (capacity 5 and 0)."""
    gen = torch.Generator().manual_seed(group * 1000 + capacity)
    counts = torch.randint(1, 40, (300, 3), generator=gen, dtype=torch.int32)
    counts[7, 1], counts[8] = 1000, 1
    counts = counts.to(DEVICE)
    want = attention_reference.split_plan(counts, group, slots, capacity, min_blocks=4, max_splits=6,
                                         over_ranges=over_ranges)
    row_splits = torch.empty_like(counts)
    slot_row = torch.empty(capacity, dtype=torch.int32, device=DEVICE)
    slot_split = torch.empty(capacity, dtype=torch.int32, device=DEVICE)
    attention._plan_splits_kernel[(1,)](
        counts, row_splits, slot_row, slot_split, counts.numel(), capacity, slots,
        GROUP=group, MIN_BLOCKS=4, MAX_SPLITS=6, OVER_RANGES=over_ranges, CHUNK=128,
    )  # fmt: skip
    assert torch.equal(row_splits.cpu(), want[0])
    assert torch.equal(slot_row.cpu(), want[1])
    used = want[1] >= 0
    assert torch.equal(slot_split.cpu()[used], want[2][used])
    if capacity >= 64:
        assert row_splits.max() > 1 and row_splits.min() == 1


@pytest.mark.parametrize(
    "version, head_dim, means, bounds, rows, warps",
    [
        ((3, 6), 64, True, True, 128, 4),
        ((3, 0), 64, True, True, 64, 4),  # Triton 3.0 miscompiled 128 rows of the mixed search at d=64
        ((3, 0), 64, True, False, 128, 4),  # the pooled and bound searches alone passed with 128
        ((3, 0), 64, False, True, 128, 4),
        ((3, 0), 128, True, True, 128, 4),
        ((3, 6), 256, False, True, 64, 8),
        ((3, 0), 256, False, True, 64, 4),  # with 8 warps Triton 3.0's compiler aborts
    ],
)
def test_search_launch_keeps_older_tritons_off_what_they_get_wrong(monkeypatch, version, head_dim, means, bounds,
                                                                    rows, warps):  # fmt: skip
    monkeypatch.setattr(launch, "TRITON_VERSION", version)
    monkeypatch.setattr(launch, "INTERPRET", False)
    row_chunk, options = launch.search_launch(head_dim, 4 * 32, means, bounds)  # 4 heads a group, stride 4
    assert (row_chunk, options["num_warps"]) == (rows, warps)


@pytest.mark.parametrize(
    "q_len, heads, planned",
    [
        (16384, 12, True),  # a 16K chunk, Qwen2.5-Coder-1.5B's heads: 1536 programs, under 6 waves on an H200
        (2048, 32, True),
        (16384, 32, False),  # 4096 programs: 15 waves, whose rows balance themselves
        (131072, 12, False),  # a whole 128K prompt: measured 1-5% slower planned, nothing to split
    ],
)
def test_split_plan_is_made_for_launches_of_few_waves(monkeypatch, q_len, heads, planned):
    assert launch.plans_splits(-(-q_len // 128) * heads) is planned
    monkeypatch.setattr(launch, "SPLIT_KV", False)
    assert not launch.plans_splits(-(-q_len // 128) * heads)


@pytest.mark.parametrize(
    "q_len, k_len, heads, kv_heads, kept",
    [
        (16384, 131072, 12, 2, (0.9, 0.05)),  # run 13's last chunk: a head that keeps most of a row beside one that keeps few
        (16384, 65536, 12, 2, (0.3, 0.1)),
        (131072, 131072, 32, 8, (0.1, 0.02)),  # a fresh 128K prompt
        (2048, 32768, 9, 3, (1.0, 0.05)),  # a short chunk after a long prefix
    ],
)
def test_split_plan_bounds_the_longest_walk_and_fits_its_scratch(q_len, k_len, heads, kv_heads, kept):
    """On the H200 (132 multiprocessors), whatever the counts: no program walks more than
    SPLIT_OVER_RANGES ranges of the launch's work per program slot over SPLIT_BALANCE (or of
    MIN_SPLIT_BLOCKS, or a row over MAX_SPLITS), and the split rows fit the scratch, so none is left
    whole for want of slots."""
    group = heads // kv_heads
    slots, capacity = launch.split_slots(group, sms=132)
    q_blocks, k_blocks = -(-q_len // 128), -(-k_len // 128)
    position = torch.arange(k_blocks - q_blocks, k_blocks).view(-1, 1) + 1
    share = torch.tensor(kept).repeat(kv_heads)[:kv_heads].view(1, -1)
    counts = (position * share).clamp(min=1).to(torch.int32)
    counts[0] = position[0]  # one row of each head keeps everything
    row_splits, slot_row, _ = attention_reference.split_plan(
        counts, group, slots, capacity, launch.MIN_SPLIT_BLOCKS, launch.MAX_SPLITS, launch.SPLIT_OVER_RANGES
    )
    walks = (counts - 1).long()
    work_per_slot = int(walks.sum()) * group / (launch.PROGRAMS_PER_SM * 132)  # block walks per program slot
    per_split = max(math.ceil(work_per_slot / launch.SPLIT_BALANCE), launch.MIN_SPLIT_BLOCKS)
    longest = int((walks / row_splits).ceil().max())
    over = launch.SPLIT_OVER_RANGES * per_split
    assert longest <= max(over, math.ceil(int(walks.max()) / launch.MAX_SPLITS))
    assert torch.equal(row_splits > 1, walks > over), "every row longer than SPLIT_OVER_RANGES ranges is split"
    assert int((slot_row >= 0).sum()) <= capacity


@pytest.mark.parametrize(
    "k_len, kept, split",
    [
        (98304, 0.179, False),  # the dense last row 1.02 slots' shares long: split before, 9% slower on the GPU
        (114688, 0.070, True),  # 2.4 shares: split, 1.2x faster
        (131072, 0.020, True),  # 6.8 shares: split, 3.2x faster
        (131008, 0.156, False),  # 1.13 shares: a real 128K prompt's last chunk (Qwen2.5-Coder-1.5B's density)
    ],
)
def test_split_plan_splits_rows_that_outlast_the_launch(k_len, kept, split):
    """A 16K-query chunk at 12 / 2 heads on 132 multiprocessors, every row keeping ``kept`` of its
    blocks but the forced-dense last one: that row splits only when it walks well past a program
    slot's share of the work (the cases and timings of docs/benchmarks.md, Split-KV by kept blocks)."""
    group = 6
    slots, capacity = launch.split_slots(group, sms=132)
    q_blocks, k_blocks = 128, -(-k_len // 128)
    position = torch.arange(k_blocks - q_blocks, k_blocks).view(-1, 1) + 1
    counts = (position * kept).clamp(min=1).repeat(1, 2).to(torch.int32)
    counts[-1] = k_blocks
    row_splits, _, _ = attention_reference.split_plan(
        counts, group, slots, capacity, launch.MIN_SPLIT_BLOCKS, launch.MAX_SPLITS, launch.SPLIT_OVER_RANGES
    )
    assert bool((row_splits[-1] > 1).all()) is split
    assert int((row_splits[:-1] > 1).sum()) == 0


def poison_rows_past_the_end(batch) -> None:
    """NaN in every cache row no sequence holds, so a kernel that lets one into a sum is caught."""
    page_size = batch.k_cache.shape[1]
    used = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool, device=batch.k_cache.device)
    for seq, k_len in enumerate(batch.seqlens_k.tolist()):
        pos = torch.arange(k_len, device=used.device)
        used[batch.page_table[seq, pos // page_size].long(), pos % page_size] = True
    batch.k_cache[~used] = float("nan")
    batch.v_cache[~used] = float("nan")


@needs_tma
@pytest.mark.parametrize("page_size", [1, 16, 64], ids=["staged-page1", "staged-page16", "direct-page64"])
@pytest.mark.parametrize("threshold", [0.0, 0.5], ids=["dense", "sparse"])
def test_tma_reads_match_the_reference(monkeypatch, page_size, threshold):
    """K/V read by bulk tensor copies (forced on; the interpreter emulates them): from a staged copy
    when pages are smaller than a tile, from the cache itself at page 64, whose last pages hold NaN
    past each sequence."""
    monkeypatch.setattr(launch, "KV_READS", "tma")
    batch = make_batch(**MIXED, num_heads=8, num_kv_heads=2, page_size=page_size, dtype=torch.bfloat16, device=DEVICE)
    poison_rows_past_the_end(batch)
    assert staging.pages_hold_tiles(batch.k_cache) == (page_size == 64)
    config = sparse_config(threshold=threshold)
    out, lse = sparse_prefill_attention(*batch.args, config=config, out=poisoned_out(batch.q))
    if threshold == 0:
        want, want_lse = attention_reference.dense_paged_attention(*batch.args)
    else:
        want, want_lse = attention_reference.block_masked_attention(*batch.args, select_blocks(*batch.search_args, config=config))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "every output row and lse must be written"
    assert rel_err(out, want) < TOL[torch.bfloat16]
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


@needs_tma
def test_tma_staging_in_head_groups_with_mean_correction(monkeypatch):
    """A staging budget below one KV head's copy: each head is staged and launched on its own."""
    monkeypatch.setattr(launch, "KV_READS", "tma")
    monkeypatch.setattr(launch, "STAGE_BYTES", 1)
    staged = []
    stage = staging.stage_kv
    monkeypatch.setattr(staging, "stage_kv", lambda *a: staged.append(a[-1]) or stage(*a))
    batch = make_batch(**MIXED, num_heads=6, num_kv_heads=3, device=DEVICE)
    config = sparse_config(mean_correction=True)
    index = select_blocks(*batch.search_args, config=config)
    out, lse = sparse_prefill_attention(*batch.args, config=config, out=poisoned_out(batch.q))
    assert staged == [range(0, 1), range(1, 2), range(2, 3)]
    want, want_lse = attention_reference.block_masked_attention(*batch.args, index, mean_correction=True)
    assert rel_err(out, want) < TOL[torch.float16]
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


def test_staged_copy_holds_each_key_block():
    batch = make_batch(q_lens=[70, 0, 33], k_lens=[200, 90, 161], num_heads=6, num_kv_heads=3, device=DEVICE)
    layout = layout_module.BatchLayout.build(batch.cu_seqlens_q, batch.seqlens_k, sparse_config(), batch.q.device)
    pages = layout.staging
    # Blocks of 64: 4 of the first sequence, none of the second (no queries), 3 of the third.
    assert pages.seq.tolist() == [0, 0, 0, 0, 2, 2, 2] and pages.block.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert pages.table[0].tolist() == [0, 1, 2, 3] and pages.table[2, :3].tolist() == [4, 5, 6]
    keys, values = staging.stage_kv(batch.k_cache, batch.v_cache, batch.page_table, batch.seqlens_k, layout, range(1, 3))
    for page, (seq, block) in enumerate(zip(pages.seq.tolist(), pages.block.tolist())):
        k_len = batch.seqlens_k[seq].item()
        pos = torch.arange(block * 64, (block + 1) * 64).clamp(max=k_len - 1)  # past the end: the last row again
        for staged, cache in ((keys, batch.k_cache), (values, batch.v_cache)):
            want = staging_reference.gather_kv(cache, batch.page_table, seq, k_len)[pos, 1:3]
            assert torch.equal(staged[page], want)


@pytest.mark.parametrize("page_size, head_dim", [(1, 64), (16, 128), (16, 256)])
def test_gathered_keys_and_values_of_a_sequence(page_size, head_dim):
    """The dense route's gather: one sequence's K and V out of shuffled pages, at lengths that are no
    multiple of the gather's tile, into storage laid out heads first."""
    batch = make_batch(q_lens=[5, 40], k_lens=[77, 200], head_dim=head_dim, page_size=page_size, device=DEVICE)
    for seq, k_len in enumerate(batch.seqlens_k.tolist()):
        keys, values = staging.gather_kv(batch.k_cache, batch.v_cache, batch.page_table, seq, k_len)
        assert torch.equal(keys, staging_reference.gather_kv(batch.k_cache, batch.page_table, seq, k_len))
        assert torch.equal(values, staging_reference.gather_kv(batch.v_cache, batch.page_table, seq, k_len))
        assert keys.transpose(0, 1).is_contiguous() and values.transpose(0, 1).is_contiguous()
    empty_k, _ = staging.gather_kv(batch.k_cache, batch.v_cache, batch.page_table, 0, 0)
    assert empty_k.shape == (0, batch.k_cache.shape[2], head_dim)


def test_kv_read_mode_and_direct_tma_pages(monkeypatch):
    narrow = make_batch([64], [64], head_dim=64, device=DEVICE)
    wide = make_batch([64], [64], head_dim=128, page_size=64, device=DEVICE)
    hopper = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9 and common.TENSOR_DESCRIPTORS
    assert launch.kv_read_mode(narrow.q, narrow.k_cache, narrow.v_cache) == "pointer"
    assert launch.kv_read_mode(wide.q, wide.k_cache, wide.v_cache) == ("tma" if hopper else "pointer")
    long_sparse = launch.kv_read_mode(wide.q, wide.k_cache, wide.v_cache, sparse_context=32768)
    assert long_sparse == ("tma" if hopper else "pointer")
    assert launch.kv_read_mode(wide.q, wide.k_cache, wide.v_cache, sparse_context=16384) == "pointer"
    for forced in ("tma", "pointer") if common.TENSOR_DESCRIPTORS else ("pointer",):
        monkeypatch.setattr(launch, "KV_READS", forced)
        assert launch.kv_read_mode(narrow.q, narrow.k_cache, narrow.v_cache) == forced
    if common.TENSOR_DESCRIPTORS and not hopper:  # forced TMA where the GPU has none: page-table reads, one warning
        monkeypatch.setattr(launch, "KV_READS", "tma")
        monkeypatch.setattr(launch, "INTERPRET", False)
        monkeypatch.setattr(common, "_warned", set())
        with pytest.warns(RuntimeWarning, match="compute capability 9.0"):
            assert launch.kv_read_mode(narrow.q, narrow.k_cache, narrow.v_cache) == "pointer"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert launch.kv_read_mode(narrow.q, narrow.k_cache, narrow.v_cache) == "pointer"
    assert not staging.pages_hold_tiles(narrow.k_cache), "pages of 16 rows are narrower than a tile"
    assert staging.pages_hold_tiles(wide.k_cache)
    heads_apart = wide.k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert not staging.pages_hold_tiles(heads_apart), "a row of the cache must hold every head side by side"


def test_a_triton_without_tensor_descriptors_reads_through_the_page_table(monkeypatch):
    """Triton < 3.4 (vLLM 0.6.3 runs 3.0): TMA forced by the environment reads through the page table
    with one warning naming the Triton it needs; asked of the kernel directly, it is refused."""
    batch = make_batch([64], [64], head_dim=128, page_size=64, device=DEVICE)
    monkeypatch.setattr(launch, "TENSOR_DESCRIPTORS", False)
    monkeypatch.setattr(attention, "TENSOR_DESCRIPTORS", False)
    monkeypatch.setattr(common, "_warned", set())
    assert launch.kv_read_mode(batch.q, batch.k_cache, batch.v_cache) == "pointer"
    monkeypatch.setattr(launch, "KV_READS", "tma")
    with pytest.warns(RuntimeWarning, match="needs Triton >= 3.4"):
        assert launch.kv_read_mode(batch.q, batch.k_cache, batch.v_cache) == "pointer"
    layout = layout_module.BatchLayout.build(batch.cu_seqlens_q, batch.seqlens_k, sparse_config(), batch.q.device)
    with pytest.raises(ValueError, match="kv_reads='tma' needs Triton >= 3.4"):
        attention.block_sparse_attention(batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.cu_seqlens_q,
                                         batch.seqlens_k, layout, None, 0.1, False, None, kv_reads="tma")  # fmt: skip


@pytest.mark.parametrize(
    "estimator, head_dim, heads",
    # (4, 4): the default stride scores 8 rows of a 64-block per head, fewer than a tile of 16
    [("pooled", 64, (8, 2)), ("bound", 64, (8, 2)), ("mixed", 64, (8, 2)), ("mixed", 256, (8, 2)), ("mixed", 64, (4, 4))],
)
def test_selection_matches_reference_search(estimator, head_dim, heads):
    batch = make_batch(**MIXED, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, dtype=torch.float16,
                       device=DEVICE)  # fmt: skip
    configs = (
        sparse_config(estimator=estimator),
        sparse_config(estimator=estimator, threshold=0.05, query_stride=4, sink_blocks=1, local_blocks=1),
        sparse_config(estimator=estimator, threshold=1.0, target_mass=0.8),
    )
    for config in configs:
        got = select_blocks(*batch.search_args, config=config)
        want = search_reference.select_blocks(*batch.search_args, config=config)
        torch.testing.assert_close(got.scores, want.scores, atol=2e-3, rtol=2e-2)
        got_mask, want_mask = got.to_mask(), want.to_mask()
        # Decisions may differ only where the estimate sits at the cut within rounding.
        cut = config.threshold * want.scores.amax(-1, keepdim=True)
        if config.target_mass:
            cut = torch.minimum(cut, search_reference.mass_cut(want.scores, config.target_mass))
        clear = (want.scores - cut).abs() > 5e-3
        assert torch.equal(got_mask[clear], want_mask[clear])
        assert torch.equal(got.counts, got_mask.sum(-1).int())


def test_the_search_does_not_depend_on_its_launch_shape():
    """Rows per chunk, key-tile width and warps change how the selection kernel walks a query block
    (here 48 scored rows: one chunk, or two and three of 32 and 16), not what it finds."""
    batch = make_batch(**MIXED, num_heads=6, num_kv_heads=1, head_dim=64, dtype=torch.float16, device=DEVICE)
    q, k_cache, table, cu, seqlens = batch.search_args
    config = sparse_config(estimator="mixed", threshold=0.05)
    layout = layout_module.BatchLayout.build(cu.cpu(), seqlens.cpu(), config, q.device)
    scale = q.shape[-1] ** -0.5
    want = search.select_blocks(q, k_cache, table, cu, seqlens, layout, config, scale)
    for shape in ({"ROW_CHUNK": 16}, {"ROW_CHUNK": 32, "BLOCK_J": 32}, {"BLOCK_J": 128, "num_warps": 8}):
        got = search.select_blocks(q, k_cache, table, cu, seqlens, layout, config, scale, launch=shape)
        torch.testing.assert_close(got.scores, want.scores, atol=1e-5, rtol=1e-4)
        assert torch.equal(got.to_mask(), want.to_mask()), shape


@pytest.mark.parametrize("estimator", ["pooled", "bound", "mixed", "exact"])
def test_scores_are_shares_of_attention(estimator):
    batch = make_batch(**MIXED, device=DEVICE)
    index = select_blocks(*batch.search_args, config=sparse_config(estimator=estimator))
    searched = index.layout.qblock_dense == 0
    sums = index.scores.sum(-1)[searched.to(index.scores.device)]
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-3, rtol=0)


def test_bound_estimate_finds_a_single_outstanding_key():
    """In noise keys, one key of a block points along the queries (logit 15) and every key of a
    later block a little (logit 2 each): the single key holds most of the attention. The mean keys
    rank the later block first and prune the other; its largest key keeps it in the bound estimate."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    batch = make_batch([512], [512], num_heads=2, num_kv_heads=1, structured=False, device=DEVICE)
    direction = torch.nn.functional.normalize(torch.randn(64, generator=gen), dim=0)
    target = int(torch.randint(1, 3, (), generator=gen)) * 64 + int(torch.randint(0, 64, (), generator=gen))
    keys = torch.randn(512, 64, generator=gen) * 0.3
    keys[target] += direction * 40  # q . k * scale = 3 * 40 / 8 = 15
    keys[320:384] += direction * 16 / 3  # block 5: logit 2 each
    pos = torch.arange(512)
    k_cache = batch.k_cache.clone()
    k_cache[batch.page_table[0, pos // 16].long(), pos % 16, 0] = keys.to(k_cache.dtype).to(k_cache.device)
    q = (direction.expand(512, 2, 64) * 3).to(batch.q.dtype).to(batch.q.device).contiguous()
    args = (q, k_cache, batch.page_table, batch.cu_seqlens_q, batch.seqlens_k)
    config = sparse_config(threshold=0.5, sink_blocks=0, local_blocks=0)
    bound = select_blocks(*args, config=config.replace(estimator="bound")).to_mask()
    pooled = select_blocks(*args, config=config.replace(estimator="pooled")).to_mask()
    assert bound[-1, 0, target // 64], "the bound estimate keeps the outstanding key's block"
    assert not pooled[-1, 0, target // 64] and pooled[-1, 0, 5], "the mean keys rank block 5 first"


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa3", "gqa8"])
def test_exact_estimate_matches_reference(rows, page_size, heads):
    # Besides MIXED: a short prefill below min_q_len (dense, not scored) and a chunk whose last
    # block ends 21 rows in, where the sampled rows past the end collapse onto its last position.
    batch = make_batch(
        q_lens=MIXED["q_lens"] + [40, 131], k_lens=MIXED["k_lens"] + [40, 213],
        num_heads=heads[0], num_kv_heads=heads[1], page_size=page_size, dtype=torch.bfloat16, device=DEVICE,
    )  # fmt: skip
    config = sparse_config(estimator="exact", exact_rows=rows, threshold=0.05, min_q_len=64)
    got = select_blocks(*batch.search_args, config=config)
    want = search_reference.select_blocks(*batch.search_args, config=config)
    searched = (want.layout.qblock_dense == 0).to(want.scores.device)
    assert searched.sum() >= 4 and (~searched).sum() >= 2
    torch.testing.assert_close(got.scores, want.scores, atol=1e-4, rtol=1e-3)
    clear = (want.scores - config.threshold * want.scores.amax(-1, keepdim=True)).abs() > 1e-3
    assert torch.equal(got.to_mask()[clear], want.to_mask()[clear])
    assert torch.equal(got.counts, got.to_mask().sum(-1).int())


def test_exact_estimate_over_several_tiles_and_sequences():
    # GQA 8 takes 16 query blocks per tile: 44 blocks of one sequence make three tiles, and the
    # third also holds the blocks of a second sequence.
    batch = make_batch(q_lens=[2800, 300], k_lens=[2800, 700], num_heads=8, num_kv_heads=1, device=DEVICE)
    config = sparse_config(estimator="exact", threshold=0.02)
    got = select_blocks(*batch.search_args, config=config)
    want = search_reference.select_blocks(*batch.search_args, config=config)
    assert got.layout.total_q_blocks > 2 * 16
    torch.testing.assert_close(got.scores, want.scores, atol=1e-4, rtol=1e-3)
    out, lse = sparse_prefill_attention(*batch.args, config=config, out=poisoned_out(batch.q))
    masked, masked_lse = attention_reference.block_masked_attention(*batch.args, got)
    assert torch.isfinite(out).all() and rel_err(out, masked) < TOL[batch.q.dtype]
    torch.testing.assert_close(lse, masked_lse, atol=1e-3, rtol=1e-4)


def test_mass_targeted_cut_keeps_the_target_share():
    batch = make_batch([400, 150], [400, 520], device=DEVICE)
    config = sparse_config(threshold=1.0, target_mass=0.9)
    index = select_blocks(*batch.search_args, config=config)
    held = (index.scores * index.to_mask()).sum(-1)
    searched = (index.layout.qblock_dense == 0).to(held.device)
    assert (held[searched] >= 0.9 - 1e-4).all()
    assert index.density() < 0.9, "the cut keeps the fewest blocks, not all of them"


def test_forced_blocks_are_always_kept():
    batch = make_batch([400, 150], [400, 520], device=DEVICE)
    config = sparse_config(threshold=1.0, sink_blocks=2, local_blocks=1, last_query_blocks=2)
    index = select_blocks(*batch.search_args, config=config)
    mask = index.to_mask()
    layout = index.layout
    for qb in range(layout.total_q_blocks):
        pos = int(layout.qblock_pos[qb])
        seq = int(layout.qblock_seq[qb])
        row = mask[qb]
        assert row[:, : min(2, pos + 1)].all(), "sink blocks"
        assert row[:, max(pos - 1, 0) : pos + 1].all(), "local window and diagonal"
        assert not row[:, pos + 1 :].any(), "nothing beyond the diagonal"
        last = -(-layout.k_lens[seq] // 64)
        if pos >= last - 2:
            assert row[:, : pos + 1].all(), "last query blocks are dense"
    assert index.density() < 1.0


def test_short_sequences_are_dense():
    batch = make_batch([300, 100], [300, 100], device=DEVICE)
    config = sparse_config(threshold=1.0, min_q_len=128)
    index = select_blocks(*batch.search_args, config=config)
    layout = index.layout
    short = layout.qblock_seq.cpu() == 1
    assert index.to_mask()[short.to(index.counts.device)].sum() == int((layout.qblock_pos[short].long() + 1).sum()) * 2
    out, _ = sparse_prefill_attention(*batch.args, config=config)
    want, _ = attention_reference.dense_paged_attention(*batch.args)
    assert rel_err(out[300:], want[300:]) < TOL[torch.float16]


@pytest.mark.parametrize("query_stride", [1, 4])
def test_mean_correction_matches_reference(query_stride):
    batch = make_batch(**MIXED, num_heads=4, num_kv_heads=2, device=DEVICE)
    config = sparse_config(mean_correction=True, query_stride=query_stride)
    index = select_blocks(*batch.search_args, config=config)
    out, lse = sparse_prefill_attention(*batch.args, config=config, out=poisoned_out(batch.q))
    want, want_lse = attention_reference.block_masked_attention(*batch.args, index, mean_correction=True)
    plain, _ = attention_reference.block_masked_attention(*batch.args, index)
    assert rel_err(out, want) < TOL[torch.float16]
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)
    assert rel_err(want, plain) > 1e-3, "the correction must contribute on these inputs"


def test_index_reuse_and_from_mask():
    batch = make_batch(**MIXED, device=DEVICE)
    config = sparse_config()
    index = select_blocks(*batch.search_args, config=config)
    rebuilt = BlockIndex.from_mask(index.layout, index.to_mask())
    assert torch.equal(rebuilt.to_mask(), index.to_mask())
    a, lse_a = sparse_prefill_attention(*batch.args, config=config)
    b, lse_b = block_sparse_attention(*batch.args, rebuilt)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(lse_a, lse_b)


def test_preallocated_out_is_used_and_layouts_checked():
    batch = make_batch(**MIXED, device=DEVICE)
    out = poisoned_out(batch.q)
    got, _ = sparse_prefill_attention(*batch.args, config=sparse_config(), out=out)
    assert got.data_ptr() == out.data_ptr()
    other = make_batch([64], [64], device=DEVICE)
    index = select_blocks(*other.search_args, config=sparse_config())
    with pytest.raises(ValueError, match="another batch layout"):
        block_sparse_attention(*batch.args, index)


def test_unsupported_inputs_fall_back_to_dense_with_one_warning():
    batch = make_batch([96], [160], head_dim=64, dtype=torch.float32, device=DEVICE)
    from prefill_accel import api

    api._warned.clear()
    with pytest.warns(RuntimeWarning, match="dense PyTorch path"):
        out, lse = sparse_prefill_attention(*batch.args, config=sparse_config(threshold=1.0))
    want, want_lse = attention_reference.dense_paged_attention(*batch.args)
    torch.testing.assert_close(out, want.to(out.dtype), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sparse_prefill_attention(*batch.args, config=sparse_config(threshold=1.0))  # no second warning


def test_odd_head_dim_falls_back():
    batch = make_batch([80], [80], head_dim=96, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="head_dim 96"):
        out, _ = sparse_prefill_attention(*batch.args, config=sparse_config())
    want, _ = attention_reference.dense_paged_attention(*batch.args)
    assert rel_err(out, want) < TOL[torch.float16]


def test_bad_inputs_raise_clear_errors():
    batch = make_batch([64], [64], device=DEVICE)
    q, k, v, table, cu, lens = batch.args
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        sparse_prefill_attention(q[:, :3], k, v, table, cu, lens)
    with pytest.raises(ValueError, match="query length"):
        sparse_prefill_attention(q, k, v, table, cu, lens - 10)
    with pytest.raises(ValueError, match="page_table has"):
        sparse_prefill_attention(q, k, v, table[:, :1], cu, lens + 64)
    with pytest.raises(ValueError, match="out must match q"):
        sparse_prefill_attention(q, k, v, table, cu, lens, out=torch.empty(1))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        sparse_prefill_attention(q, k, v, table, cu + 1, lens)
    with pytest.raises(ValueError, match="softmax_scale must be a positive"):
        sparse_prefill_attention(q, k, v, table, cu, lens, softmax_scale=-0.125)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float16, 64), (torch.float32, 64), (torch.float16, 96)])
def test_a_query_longer_than_its_sequence_is_refused_on_every_path(dtype, head_dim):
    """The dense fallback (float32, head_dim 96) checks lengths as the kernels' path does: no zero rows."""
    batch = make_batch([64, 32], [64, 96], head_dim=head_dim, dtype=dtype, device=DEVICE)
    q, k, v, table, cu, lens = batch.args
    short = torch.tensor([64, 31], dtype=torch.int32, device=lens.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(ValueError, match="sequence 1: query length 32 exceeds seqlens_k=31"):
            sparse_prefill_attention(q, k, v, table, cu, short, config=sparse_config())
        with pytest.raises(ValueError, match="sequence 1: query length 32 exceeds seqlens_k=31"):
            select_blocks(q, k, table, cu, short, sparse_config())


@pytest.mark.parametrize("bad", [-1, "num_pages", 1 << 30])
@pytest.mark.parametrize("with_layout", [False, True])
def test_a_page_id_outside_the_cache_is_an_error_not_a_crash_or_nan(bad, with_layout):
    from prefill_accel import BatchLayout

    batch = make_batch([64, 40], [100, 40], device=DEVICE)
    q, k, v, table, cu, lens = batch.args
    config = sparse_config()
    broken = table.clone()
    broken[0, 5] = k.shape[0] if bad == "num_pages" else bad  # sequence 0 uses 7 pages of 16 rows
    layout = BatchLayout.build(cu.cpu(), lens.cpu(), config, q.device) if with_layout else None
    with pytest.raises(ValueError, match=r"page_table\[0, 5\] = .* is no page of the KV cache"):
        sparse_prefill_attention(q, k, v, broken, cu, lens, config=config, layout=layout)
    with pytest.raises(ValueError, match="no page of the KV cache"):
        select_blocks(q, k, broken, cu, lens, config)
    index = select_blocks(*batch.search_args, config)
    with pytest.raises(ValueError, match="no page of the KV cache"):
        block_sparse_attention(q, k, v, broken, cu, lens, index)
    # Entries past what a sequence uses may hold anything (make_batch puts junk there).
    assert (table[1, 3:] >= k.shape[0]).all()
    out, _ = sparse_prefill_attention(*batch.args, config=config, layout=layout)
    assert torch.isfinite(out).all()


def test_integer_tensors_and_an_infinite_scale_are_refused():
    batch = make_batch([64], [64], device=DEVICE)
    q, k, v, table, cu, lens = batch.args
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        sparse_prefill_attention(q.to(torch.int8), k, v, table, cu, lens)
    with pytest.raises(TypeError, match="k_cache must be a floating-point tensor"):
        sparse_prefill_attention(q, k.to(torch.int8), v.to(torch.int8), table, cu, lens)
    for scale in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
            sparse_prefill_attention(q, k, v, table, cu, lens, softmax_scale=scale)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(block_size=100), "block_size"),
        (dict(threshold=1.5), "threshold"),
        (dict(threshold="0.1"), "threshold"),
        (dict(target_mass=-0.1), "target_mass"),
        (dict(sink_blocks=-1), "sink_blocks"),
        (dict(query_stride=3), "query_stride"),
        (dict(block_size=64, query_stride=16), "fewer than 8"),
        (dict(mean_correction=1), "bool"),
        (dict(min_q_len=1.5), "int"),
        (dict(estimator="mean"), "estimator"),
        (dict(estimator=1), "string"),
        (dict(exact_rows=3), "exact_rows"),
    ],
)
def test_config_validation(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SparsePrefillConfig(**changes)


def test_prebuilt_layout_from_host_lengths_gives_the_same_result():
    from prefill_accel import BatchLayout

    batch = make_batch(**MIXED, num_heads=8, num_kv_heads=2, device=DEVICE)
    config = sparse_config()
    want, want_lse = sparse_prefill_attention(*batch.args, config=config)
    layout = BatchLayout.build(batch.cu_seqlens_q.cpu(), batch.seqlens_k.cpu(), config, batch.q.device)
    got, lse = sparse_prefill_attention(*batch.args, config=config, out=poisoned_out(batch.q), layout=layout)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)

    with pytest.raises(ValueError, match="another SparsePrefillConfig"):
        sparse_prefill_attention(*batch.args, config=config.replace(threshold=0.1), layout=layout)
    other = BatchLayout.build(batch.cu_seqlens_q[:3].cpu(), batch.seqlens_k[:2].cpu(), config, batch.q.device)
    with pytest.raises(ValueError, match="layout describes 2 sequences"):
        sparse_prefill_attention(*batch.args, config=config, layout=other)
    with pytest.raises(TypeError, match="BatchLayout"):
        sparse_prefill_attention(*batch.args, config=config, layout="layout")


@pytest.mark.parametrize(
    "q_len, k_len, kv_heads, splits",
    [
        (131072, 131072, 8, 2),  # a fresh 128K prompt, 32 query heads: 256 tiles x heads, just short of 2 waves
        (16384, 131072, 3, 22),  # a 16K chunk after a 112K prefix, SmolLM2's heads: 12 programs without a split
        (16384, 16384, 3, 16),  # ranges of at least 8 key blocks
    ],
)
def test_exact_estimate_splits_the_keys_where_tiles_are_few(q_len, k_len, kv_heads, splits):
    config = SparsePrefillConfig(estimator="exact")
    layout = layout_module.BatchLayout.build(
        torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([k_len], dtype=torch.int32), config, "cpu"
    )
    tiles = -(-layout.total_q_blocks // (launch.EXACT_TILE_ROWS // 4))
    assert launch.exact_splits(layout, tiles * kv_heads, sms=132) == splits


def test_the_cudnn_route_calls_torchs_op_as_each_torch_declares_it():
    """torch 2.5 added attn_bias and compute_log_sumexp to the cuDNN attention op; torch 2.4 (vLLM
    0.6.3's) has neither, and refused the call that passed them."""
    from prefill_accel import dense_route

    torch_24 = {"query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"}
    assert dense_route.cudnn_arguments(torch_24) == dict(dropout_p=0.0, is_causal=True, return_debug_mask=False)
    schema = torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema
    given = {"query", "key", "value", "scale", *dense_route.cudnn_arguments({a.name for a in schema.arguments})}
    required = {a.name for a in schema.arguments if not a.has_default_value()}
    assert required <= given and given <= {a.name for a in schema.arguments}


def test_a_tensor_parallel_shard_computes_its_heads_as_the_full_call_does():
    """Tensor parallel 2 hands each GPU half the query heads and its KV heads (Qwen2.5-Coder-1.5B: 6 and 1 of
    12 and 2): the search and attention are per KV head, so each shard's call, with the default estimator,
    gives the full call's rows of its heads, and the index the full call keeps for them."""
    batch = make_batch(**MIXED, num_heads=8, num_kv_heads=2, device=DEVICE)
    config = sparse_config(estimator="mixed", query_stride=8)
    full_index = select_blocks(*batch.search_args, config=config)
    assert full_index.density() < 0.9, "structured inputs should leave blocks to prune"
    full, full_lse = sparse_prefill_attention(*batch.args, config=config)
    for shard in range(2):
        heads, kv = slice(4 * shard, 4 * shard + 4), slice(shard, shard + 1)
        q, k_cache, v_cache = batch.q[:, heads].contiguous(), batch.k_cache[:, :, kv].contiguous(), batch.v_cache[:, :, kv].contiguous()
        args = (q, k_cache, v_cache, batch.page_table, batch.cu_seqlens_q, batch.seqlens_k)
        index = select_blocks(q, k_cache, batch.page_table, batch.cu_seqlens_q, batch.seqlens_k, config=config)
        assert torch.equal(index.counts, full_index.counts[:, kv])
        for row in range(index.counts.shape[0]):
            n = int(index.counts[row, 0])
            assert torch.equal(index.indices[row, 0, :n], full_index.indices[row, shard, :n])
        out, lse = sparse_prefill_attention(*args, config=config)
        torch.testing.assert_close(out, full[:, heads], atol=0, rtol=0)
        torch.testing.assert_close(lse, full_lse[heads], atol=0, rtol=0)
