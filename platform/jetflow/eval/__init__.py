"""Evaluation of heads with the real (lossless) decoder."""

from jetflow.eval.acceptance import measure_acceptance

__all__ = ["measure_acceptance"]
