"""Random varlen batches over a shuffled paged KV cache, shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor

    @property
    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.page_table, self.cu_seqlens_q, self.seqlens_k)

    @property
    def search_args(self):
        return (self.q, self.k_cache, self.page_table, self.cu_seqlens_q, self.seqlens_k)


def make_batch(
    q_lens,
    k_lens,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    page_size=16,
    dtype=torch.float16,
    block_size=64,
    structured=True,
    device="cpu",
) -> Batch:
    """A batch whose sequence i has k_lens[i] tokens in the cache and its last q_lens[i] as queries.

    With ``structured`` a random half of the key blocks of each sequence is shifted along a
    direction the queries share, so those blocks draw most of the attention and the others are
    worth pruning (though not worthless: mean correction has something to add). Pages are shuffled, and the
    cache holds spare pages no sequence uses.
    """
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    pages = [-(-k // page_size) for k in k_lens]
    n_pages = sum(pages) + 3
    q = rand(sum(q_lens), num_heads, head_dim)
    k_cache = rand(n_pages, page_size, num_kv_heads, head_dim)
    v_cache = rand(n_pages, page_size, num_kv_heads, head_dim)
    perm = torch.randperm(n_pages, generator=gen)
    page_table = torch.full((len(k_lens), max(pages)), n_pages + 7, dtype=torch.int32)  # junk past the end
    used = 0
    for seq, n in enumerate(pages):
        page_table[seq, :n] = perm[used : used + n].to(torch.int32)
        used += n
    if structured:
        # Offsets of 2 * head_dim**0.25 on both sides raise a shifted block's logits by 4 after scaling.
        direction = torch.nn.functional.normalize(rand(num_kv_heads, head_dim), dim=-1) * 2 * head_dim**0.25
        for seq, k_len in enumerate(k_lens):
            pos = torch.arange(k_len)
            n_blocks = -(-k_len // block_size)
            strength = torch.where(torch.randperm(n_blocks, generator=gen) < (n_blocks + 1) // 2, 1.0, 0.0)
            rows = page_table[seq, pos // page_size].long(), pos % page_size
            k_cache[rows] += strength[pos // block_size].view(-1, 1, 1) * direction
        q += direction.repeat_interleave(num_heads // num_kv_heads, 0)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return Batch(
        q=to(q.to(dtype)),
        k_cache=to(k_cache.to(dtype)),
        v_cache=to(v_cache.to(dtype)),
        page_table=to(page_table),
        cu_seqlens_q=to(cu),
        seqlens_k=to(torch.tensor(k_lens, dtype=torch.int32)),
    )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()
