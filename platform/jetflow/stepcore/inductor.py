"""How the step core is compiled: inductor's options per device, and the CPU GEMM kernel's register blocking.

A decode step is bound by reading the weights (SmolLM2-135M fp32: 540 MB a step for a handful of tokens). Eager
`F.linear` (MKL) streams them at ~16 GB/s on these CPUs; inductor's own C++ GEMM template, over weights packed
once into its blocked layout, streams them at 40-45 GB/s (`../shared/calibration/linears.py`, BENCHMARKS.md).
Three settings get there:

- `freezing`: the module's parameters become constants of the graph, so the GEMM template can pack them at compile
  time (the packed copy lives with the compiled graph: one graph, one copy — which is why the step core compiles
  ONE graph with dynamic shapes rather than one per shape);
- `max_autotune` with the `CPP` backend only: the template for every GEMM. (With `ATEN` beside it, inductor times
  both per GEMM shape and keeps the faster; on a 2-core host shared with anything else that timing is noise —
  MKL won a 576×3072 GEMM at 13 ms against the template's 22 while a compiler ran beside it, 2× slower than the
  template on a quiet host — and the choice is cached. `JETFLOW_CPP_GEMM_BACKENDS=CPP,ATEN` restores the race.)
- `cpp.enable_concat_linear`: q/k/v and gate/up, which read the same input, become one GEMM each.

And one choice inductor makes badly here: its fp32 AVX-512 micro-kernel takes 8 rows × 48 columns as its register
block, 24 accumulators, which gcc spills — 5 to 8 rows then cost 2.5-3× what 4 rows cost (a tree of 8 nodes 3× a
plain step: the "cliff between 4 and 8" of the calibration). A 4 × 48 block (12 accumulators) keeps every row count
on the weight-read line (8 rows 1.2× one row, 64 rows near the FLOP peak; HISTORY.md "The GEMM cliff").
`tune_cpu_gemm()` puts that block first for fp32 on AVX-512; other dtypes and ISAs keep inductor's choices.
"""

from __future__ import annotations

import logging
import os

import torch

from jetflow.paths import jetflow_home

log = logging.getLogger(__name__)

# fp32 register blocks (rows, columns, k) for the AVX-512 micro-kernel, best first
FP32_AVX512_BLOCKING = ((4, 48, 1), (4, 32, 1))
_tuned = False


def compile_options(device: torch.device) -> dict:
    """Inductor's settings for the step core's graphs on `device` (`apply_compile_settings` sets them)."""
    opts: dict = {"freezing": True}
    if device.type == "cpu":
        opts.update({"max_autotune": True,
                     "max_autotune_gemm_backends": os.environ.get("JETFLOW_CPP_GEMM_BACKENDS", "CPP"),
                     "cpp.enable_concat_linear": True})
    return opts


def apply_compile_settings(device: torch.device, inductor: bool = True) -> dict:
    """Set the step core's compile settings for this process, once: inductor's `compile_options`, the CPU GEMM
    register block, and sizes of 1 traced like any other size (`backed_size_oblivious`: the mask's rows — one row
    is the common case — and the key window stay symbols instead of specialising a graph to 1).

    Process-wide, not `torch.compile(options=...)` nor a `config.patch` around each call: dynamo reads `freezing`
    while tracing (with it a graph is guarded on its module's parameters, so a second module of the same class
    compiles its own graph instead of reusing the first one's frozen weights), `options=` reaches only inductor,
    and a patch entered and left by two threads at once (a replica compiles a new head's graph beside its running
    engine) can restore the wrong value mid-compile. JetFlow's processes compile nothing but the step core.
    `inductor=False` (another backend): only the dynamo setting."""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    fx_config.backed_size_oblivious = True
    if not inductor:  # another backend (tests: eager, aot_eager): dynamo's settings only
        return {}
    options = compile_options(device)
    for name, value in options.items():
        section, _, key = name.rpartition(".")
        setattr(getattr(inductor_config, section) if section else inductor_config, key, value)
    if device.type == "cpu":
        tune_cpu_gemm()
    return options


def tune_cpu_gemm() -> bool:
    """Register the fp32 AVX-512 register blocks of `FP32_AVX512_BLOCKING` in place of inductor's (idempotent).
    `JETFLOW_CPP_GEMM_BLOCKING=inductor` keeps inductor's own. → whether the blocking is ours. A torch whose
    template code moved keeps its own choice (logged), never an error: the blocking changes speed, not results."""
    global _tuned
    if _tuned or os.environ.get("JETFLOW_CPP_GEMM_BLOCKING", "").strip().lower() == "inductor":
        return _tuned
    try:
        import torch._inductor.lowering  # noqa: F401  (the micro-gemm module imports lowering half-way otherwise)
        from torch._inductor.codegen import cpp_micro_gemm as micro

        cls = micro.CppMicroGemmFP32Vec
        configs = micro.micro_gemm_configs[cls]
        ours = micro.generate_gemm_config(micro.VecAVX512, list(FP32_AVX512_BLOCKING), input_dtype=torch.float)
        keep = [c for c in configs if not (c.input_dtype == torch.float and c.input2_dtype == torch.float
                                           and c.vec_isa_cls is micro.VecAVX512)]
        micro.micro_gemm_configs[cls] = ours + keep
        _tuned = True
    except (ImportError, AttributeError, KeyError, TypeError) as exc:
        log.warning("inductor's CPU GEMM blocking left as it is (%s): rows 5-8 of a step may cost 2-3x", exc)
    return _tuned


def use_inductor_cache() -> str:
    """Point inductor's on-disk cache at `$JETFLOW_HOME/cache/inductor` unless the environment chose another
    place. (Importing torch._dynamo already wrote inductor's default, /tmp/torchinductor_<user>, into
    TORCHINDUCTOR_CACHE_DIR; that value is replaced, as if unset. Inductor reads the variable at every use.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(jetflow_home() / "cache" / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(jetflow_home() / "cache" / "triton"))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
