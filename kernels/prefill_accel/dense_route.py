"""The dense route of the public function: a batch of fresh prefills that are all computed dense goes to
cuDNN's causal attention, the fastest dense kernel on Hopper, so the public function is never much slower
than dense attention below ``min_q_len`` (cuDNN's causal mask is top-left aligned, hence fresh sequences
only). Everything else the Triton kernels compute.

One object, CUDNN_ROUTE, holds what the torch build taught it: whether cuDNN takes fewer KV than query
heads, and whether it refused the inputs at all (then dense batches go to the Triton kernel from then on).
"""

from __future__ import annotations

import functools
import warnings

import torch

from .config import SparsePrefillConfig


def cudnn_arguments(names) -> dict:
    """The arguments of torch's cuDNN attention op after q, k and v, for a schema with argument
    ``names``: torch 2.5 added attn_bias and compute_log_sumexp, which torch 2.4 (vLLM 0.6.3's) lacks."""
    arguments = dict(dropout_p=0.0, is_causal=True, return_debug_mask=False)
    if "attn_bias" in names:
        arguments["attn_bias"] = None
    if "compute_log_sumexp" in names:
        arguments["compute_log_sumexp"] = True
    return arguments


@functools.cache
def _installed_cudnn_arguments() -> dict:
    schema = torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema
    return cudnn_arguments({argument.name for argument in schema.arguments})


def cudnn_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention of one fresh sequence, (L, H, D) tensors, by cuDNN: ((L, Hq, D) output,
    (Hq, L') float32 natural-log lse, L' >= L). Raises RuntimeError where cuDNN refuses the inputs."""
    to_bhld = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        to_bhld(q), to_bhld(k), to_bhld(v), **_installed_cudnn_arguments(), scale=scale
    )[:2]
    return o[0].transpose(0, 1), lse.view(q.shape[1], -1)


class CudnnRoute:
    """cuDNN for fresh dense batches, over K/V gathered out of the pages once per sequence."""

    def __init__(self) -> None:
        self.refused = False
        """cuDNN raised on a batch: later dense batches use the Triton kernel."""
        self.native_gqa: bool | None = None
        """Whether cuDNN takes fewer KV than query heads; None until tried (else the KV heads are expanded)."""

    def applies(self, q: torch.Tensor, config: SparsePrefillConfig, q_lens, k_lens) -> bool:
        """Whether the whole batch is fresh and dense, so cuDNN can compute it."""
        if not q.is_cuda or self.refused:
            return False
        fresh = all(qn == kn for qn, kn in zip(q_lens, k_lens))
        return fresh and (config.is_dense or not any(config.long_chunk(qn, kn) for qn, kn in zip(q_lens, k_lens)))

    def __call__(self, q, k_cache, v_cache, page_table, q_lens, scale: float, out):
        """(out, lse) of the batch, or None when cuDNN refuses (said once, with a warning)."""
        from .ops.staging import gather_kv

        group = q.shape[1] // k_cache.shape[2]
        single = len(q_lens) == 1
        if single and out is None:
            result_out = None  # cuDNN lays its output out like q: a single sequence needs no copy
        else:
            result_out = torch.empty_like(q) if out is None else out
        lse = None if single else torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        start = 0
        try:
            for seq, length in enumerate(q_lens):
                if length:
                    rows = slice(start, start + length)
                    k, v = gather_kv(k_cache, v_cache, page_table, seq, length)
                    o, seq_lse = self._attend(q[rows], k, v, group, scale)
                    if result_out is None:
                        result_out = o.contiguous()  # already so when cuDNN lays it out like q
                    else:
                        result_out.narrow(0, start, length).copy_(o)  # cheaper on the host than item assignment
                    if single:
                        lse = seq_lse[:, :length].contiguous()  # a view, unless cuDNN padded its rows
                    else:
                        lse[:, rows] = seq_lse[:, :length]
                start += length
        except (RuntimeError, AttributeError) as error:
            self.refused = True
            warnings.warn(
                f"prefill_accel: cuDNN attention unavailable ({error.__class__.__name__}: {error}); "
                "dense batches use the Triton kernel",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        if result_out is None:  # a single sequence of length 0
            result_out = torch.empty_like(q)
        if lse is None:
            lse = torch.empty(q.shape[1], 0, dtype=torch.float32, device=q.device)
        return result_out, lse

    def _attend(self, q, k, v, group: int, scale: float):
        """One sequence, with the GQA groups native where this torch build's cuDNN takes them."""
        if self.native_gqa is not False and group > 1:
            try:
                result = cudnn_causal_attention(q, k, v, scale)
                self.native_gqa = True
                return result
            except RuntimeError:
                if self.native_gqa:
                    raise
                self.native_gqa = False  # this build wants equal head counts: expand from now on
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return cudnn_causal_attention(q, k, v, scale)


CUDNN_ROUTE = CudnnRoute()
