"""Evaluation of heads with the real (lossless) decoder: held-out τ, the side-by-side comparison
against AR / HF baselines, and the verify cost model."""

from jetflow.eval.acceptance import measure_acceptance
from jetflow.eval.compare import EvalConfig, evaluate
from jetflow.eval.cost_model import CostCurve, measure_verify_curve

__all__ = ["CostCurve", "EvalConfig", "evaluate", "measure_acceptance", "measure_verify_curve"]
