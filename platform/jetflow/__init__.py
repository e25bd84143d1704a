"""JetFlow: causal parallel tree drafting (arXiv 2606.18394) — train, sweep and serve draft heads."""

__version__ = "0.1.0"
