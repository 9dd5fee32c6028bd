"""vLLM general plugin of prefill-accel (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in each of its processes. The SPARSE_PREFILL backend itself is named in
vLLM's backend registry by the prefill-accel patch series and its code is placed by the overlay, so a
patched vLLM needs nothing registered at run time; this hook makes a missing patch series visible:
on an unpatched vLLM of a supported version it says how to patch it instead of letting
``--attention-backend SPARSE_PREFILL`` fail as an unknown name. Without vLLM, or with another
version, it does nothing.
"""

from __future__ import annotations

import logging

BACKEND_NAME = "SPARSE_PREFILL"
SUPPORTED_VLLM_VERSIONS = ("0.26.0",)

logger = logging.getLogger(__name__)


def register() -> None:
    try:
        import vllm
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return
    if BACKEND_NAME in AttentionBackendEnum.__members__:
        return
    version = getattr(vllm, "__version__", "unknown")
    if version in SUPPORTED_VLLM_VERSIONS:
        logger.warning(
            "prefill-accel is installed but vLLM %s is not patched, so --attention-backend %s is unavailable; "
            "patch this environment with `prefill-accel install vllm-%s`",
            version,
            BACKEND_NAME,
            version,
        )
    else:
        logger.debug("prefill-accel has no patch series for vLLM %s; plugin inactive", version)
