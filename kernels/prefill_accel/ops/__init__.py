"""The ops, one file per job, each Triton file with its plain-PyTorch reference beside it:

- ``search.py`` / ``search_reference.py``: pooled key blocks, block selection, the exact estimate.
- ``attention.py`` / ``attention_reference.py``: block-sparse FlashAttention over the paged cache,
  split-KV of long dense rows; dense causal attention (the reference is also the dense fallback).
- ``staging.py`` / ``staging_reference.py``: K/V copied out of the pages (TMA staging, the cuDNN
  route's gather), TMA descriptors.
- ``launch.py``: launch policy: tile lists and autotuning, the K/V read mode, split decisions, the
  search's launch shape, the ``PREFILL_ACCEL_KV_READS`` / ``PREFILL_ACCEL_AUTOTUNE`` switches.
- ``common.py``: the Triton helpers every kernel uses.

Validated inputs come from :mod:`prefill_accel.api`; block geometry is :mod:`prefill_accel.layout`.
The Triton files read K through the page table one token row at a time, so any page size works
(1 for SGLang, 16 for vLLM); attention reads K/V tiles that way too, or with TMA bulk copies where
the GPU has them (``launch.kv_read_mode``).
"""
