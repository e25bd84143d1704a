"""The vLLM engines JetFlow builds: one `vllm.LLM` per process and settings, shared by everything that asks for
the same one (regeneration, the baseline rows, the tests), since building one takes about a minute.

One code path for both builds. What differs between vLLM's CPU build (`make setup-vllm`) and a GPU node's
vLLM is the memory knob: on a GPU `gpu_memory_utilization` is the fraction of the GPU's memory the engine takes
(weights, activations, then the KV cache from the rest); on vLLM's CPU build the same knob is the fraction of
the machine's RAM it reserves (0.45 of 24 GiB = 11 GiB per engine), so there the KV cache is sized in bytes
instead (`kv_cache_memory_bytes`; vLLM's own VLLM_CPU_KVCACHE_SPACE, in GiB, wins when set).
"""

from __future__ import annotations

import json
import os
from typing import Any

from jetflow.vllm import require_vllm

# The KV cache of a CPU engine: the bundled target's fp32 KV is 45 KiB per token (30 layers × K and V ×
# 3 heads × 64 × 4 B), so 2 GiB holds ~46k tokens — a regeneration shard of 64 prompts × 512 tokens at once.
CPU_KV_CACHE_GIB = float(os.environ.get("JETFLOW_VLLM_CPU_KV_GIB", "2"))

# settings (all but max_model_len) → [(max_model_len, LLM)]
_ENGINES: dict[str, list[tuple[int | None, Any]]] = {}


def on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (its CPU build, `vllm-cpu`)."""
    require_vllm("a vLLM engine")
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def vllm_dtype(dtype) -> str:
    """vLLM's name of a precision: from a torch dtype (`target.dtype`) or JetFlow's names (fp32, bf16, fp16)."""
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    if isinstance(dtype, str):
        return names.get(dtype, dtype)
    return str(dtype).removeprefix("torch.")


def engine_kwargs(model: str, *, dtype: str = "auto", max_model_len: int | None = None,
                  speculative_config: dict | None = None, enforce_eager: bool = True,
                  attention_backend: str | None = None, gpu_memory_utilization: float = 0.45) -> dict:
    """The `vllm.LLM(**kwargs)` JetFlow builds for `model` (an HF folder or hub id). Greedy outputs do not
    depend on `max_model_len` or the memory settings; they do on `dtype` (pass the target's: float32 on a
    CPU, where vLLM's "auto" would downcast an fp32 checkpoint to bf16)."""
    # disable_log_stats=False: without the stat loggers get_metrics() has no spec_decode counters (τ)
    kwargs: dict = {"model": model, "dtype": dtype, "seed": 0, "enforce_eager": enforce_eager,
                    "disable_log_stats": False}
    if on_cpu():
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = int(CPU_KV_CACHE_GIB * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if speculative_config:
        kwargs["speculative_config"] = dict(speculative_config)
    if attention_backend:
        kwargs["attention_backend"] = attention_backend
    return kwargs


def engine(model: str, **settings) -> Any:
    """A `vllm.LLM` for `engine_kwargs(model, **settings)`: built once per process; a later call with the same
    settings gets it back, and so does one asking for a shorter `max_model_len` (a longer context changes
    nothing but the KV cache's reach)."""
    vllm = require_vllm("a vLLM engine")
    kwargs = engine_kwargs(model, **settings)
    want = kwargs.pop("max_model_len", None)
    key = json.dumps(kwargs, sort_keys=True, default=str)
    for have, llm in _ENGINES.get(key, []):
        if have is None or (want is not None and want <= have):
            return llm
    llm = vllm.LLM(**kwargs, **({"max_model_len": want} if want else {}))
    _ENGINES.setdefault(key, []).append((want, llm))
    return llm


def close_engines() -> None:
    """Shut down every engine this process built (their worker processes end; a GPU engine frees its memory)."""
    while _ENGINES:
        _, built = _ENGINES.popitem()
        for _, llm in built:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()


def spec_counters(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters (vllm:spec_decode_num_drafts / _num_accepted_tokens, summed over
    the engine's life); 0 when speculation is off."""
    out = {"num_drafts": 0, "num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in out:
            out[name] += int(getattr(metric, "value", 0))
    return out


__all__ = ["CPU_KV_CACHE_GIB", "close_engines", "engine", "engine_kwargs", "on_cpu", "spec_counters", "vllm_dtype"]
