"""Scaled dot-product attention without cuDNN's backend: every attention call of the target and the head.

PyTorch picks an SDPA backend per call; on Hopper GPUs it prefers cuDNN's attention, and cuDNN builds an
execution plan for every new (query length, key length) it meets. In decoding the key length grows with
every committed token, so every step paid a plan build in every model: on an H200 (torch 2.11, bf16), 1.5 ms
of host time per attention call in a plain engine step and 8 ms in a 128-node tree step, against ~0.12 ms
for a shape it had seen — most of a step's time, with the GPU idle (benchmarks/HISTORY.md, "GPU"). JetFlow's
attention therefore runs with cuDNN's backend switched off for the call: PyTorch then takes flash attention
where there is no mask and memory-efficient attention with one (the math kernel where neither applies). The
same function, other kernels; CPU and the backends it picks there are unchanged.

`JETFLOW_SDPA_CUDNN=1` in the environment (or `allow_cudnn(True)`) leaves PyTorch's choice alone, cuDNN
included; `benchmarks/gpu_check.py` measures both side by side.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_allow_cudnn = os.environ.get("JETFLOW_SDPA_CUDNN", "0") == "1"


def allow_cudnn(allow: bool) -> bool:
    """Let JetFlow's attention use cuDNN's backend (True) or not (False, the default); returns the old value."""
    global _allow_cudnn
    old, _allow_cudnn = _allow_cudnn, bool(allow)
    return old


class without_cudnn:
    """cuDNN's SDPA backend off inside the block (PyTorch's global flag, set and restored: ~1 µs, where
    `torch.nn.attention.sdpa_kernel` costs ~12 µs on a 2-core CPU); a no-op where JetFlow is told to allow
    cuDNN, where the flag is off already, and under torch.compile (the compiler chooses)."""

    def __enter__(self):
        self._switched = (not _allow_cudnn and not torch.compiler.is_compiling()
                          and torch.backends.cuda.cudnn_sdp_enabled())
        if self._switched:
            torch.backends.cuda.enable_cudnn_sdp(False)
        return self

    def __exit__(self, *exc) -> None:
        if self._switched:
            torch.backends.cuda.enable_cudnn_sdp(True)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention` with cuDNN's backend off for the call."""
    with without_cudnn():
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
