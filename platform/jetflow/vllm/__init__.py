"""vLLM integration: DFlash-format export of our heads, and vLLM as a regeneration backend.

vLLM is the optional `[vllm]` extra (GPU machines; it pins its own CUDA torch). Nothing here imports it
at module load: every path that needs it calls `require_vllm()`, which says how to install it.
"""

from __future__ import annotations

import importlib
import importlib.util

from jetflow.errors import VllmUnavailableError

# The release whose DFlash loader (vllm/model_executor/models/qwen3_dflash.py) the exporter was checked
# against; the `[vllm]` extra pins the same one.
VLLM_VERSION = "0.33.0"
INSTALL_COMMAND = "pip install 'jetflow[vllm]'  (from a checkout: pip install -e '.[vllm]')"


def vllm_available() -> bool:
    """Whether `import vllm` would find a package (without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a None placeholder in sys.modules raises ValueError
        return False


def require_vllm(feature: str = "this vLLM path"):
    """Import and return the `vllm` module, or raise VllmUnavailableError naming the install command."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise VllmUnavailableError(
            f"{feature} needs vLLM, which is not installed ({exc.__class__.__name__}: {exc}). "
            f"Install the extra on a machine with an NVIDIA GPU: {INSTALL_COMMAND}; it pins vllm=={VLLM_VERSION} "
            "and the CUDA torch that release needs. Everything else in JetFlow runs without it."
        ) from None


__all__ = ["INSTALL_COMMAND", "VLLM_VERSION", "require_vllm", "vllm_available"]
