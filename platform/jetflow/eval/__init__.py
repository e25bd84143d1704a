"""Evaluation of heads with the real (lossless) decoder: held-out τ, the side-by-side comparison
against AR / HF baselines, and the verify cost model."""

from jetflow.exports import lazy_exports

# Imported on first use: `jetflow.eval.config` and `jetflow.eval.job` alone (`jobs/evaluate.py --help`) stay
# torch-free.
__getattr__, __dir__ = lazy_exports(__name__, {
    ".acceptance": ("measure_acceptance",),
    ".compare": ("evaluate",),
    ".config": ("EvalConfig",),
    ".cost_model": ("CostCurve", "measure_verify_curve"),
})

__all__ = ["CostCurve", "EvalConfig", "evaluate", "measure_acceptance", "measure_verify_curve"]
