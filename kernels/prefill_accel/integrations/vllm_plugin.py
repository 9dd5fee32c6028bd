"""vLLM general plugin of prefill-accel (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in each of its processes (vLLM 0.26.0 and 0.6.3 alike). The SPARSE_PREFILL
backend itself is named by the prefill-accel patch series (in V1's backend registry on 0.26.0, in V0's
selector enum on 0.6.3) and its code is placed by the overlay, so a patched vLLM needs nothing
registered at run time; this hook makes a missing patch series visible: on an unpatched vLLM of a
supported version it says how to patch it instead of letting the backend fail as an unknown name.
Without vLLM, or with another version, it does nothing.
"""

from __future__ import annotations

import logging

from ..flags import BACKEND_NAME

# vLLM version -> (the module holding the enum of backend names, the enum, how the backend is chosen).
SUPPORTED_VLLM_VERSIONS = {
    "0.26.0": ("vllm.v1.attention.backends.registry", "AttentionBackendEnum", f"--attention-backend {BACKEND_NAME}"),
    "0.6.3.post1": ("vllm.attention.selector", "_Backend", f"VLLM_ATTENTION_BACKEND={BACKEND_NAME}"),
}

logger = logging.getLogger(__name__)


def register() -> None:
    try:
        import vllm
    except ImportError:
        return
    version = getattr(vllm, "__version__", "unknown")
    if version not in SUPPORTED_VLLM_VERSIONS:
        logger.debug("prefill-accel has no patch series for vLLM %s; plugin inactive", version)
        return
    module_name, enum_name, selection = SUPPORTED_VLLM_VERSIONS[version]
    try:
        backends = getattr(__import__(module_name, fromlist=[enum_name]), enum_name)
    except (ImportError, AttributeError):
        return
    if BACKEND_NAME not in backends.__members__:
        logger.warning(
            "prefill-accel is installed but vLLM %s is not patched, so %s is unavailable; "
            "patch this environment with `prefill-accel install vllm-%s`",
            version,
            selection,
            version,
        )
