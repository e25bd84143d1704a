"""Where a target runs and in which precision, chosen the same way by every entry point: `--device` (cpu,
cuda, cuda:N; default cuda when a GPU is visible, else cpu) and `--dtype` (fp32, bf16, fp16; default bf16 on
a GPU, fp32 on a CPU, where bf16 matmuls are far slower)."""

from __future__ import annotations

import re

import torch

from jetflow.errors import InvalidSettingError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def placement(device: str | None = None, dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) for the given names; None picks the default described above. InvalidSettingError for a
    name that is not one, or for cuda on a machine without a GPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not _DEVICE.match(device):
        raise InvalidSettingError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidSettingError(f"device {device!r} asked for, but no CUDA GPU is visible on this machine")
    if dtype is None:
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    if dtype not in DTYPES:
        raise InvalidSettingError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return torch.device(device), DTYPES[dtype]
