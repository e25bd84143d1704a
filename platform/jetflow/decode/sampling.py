"""Decoding settings and the target-side sampling distribution (temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jetflow.errors import InvalidSettingError
from jetflow.tree.build import TREE_BUILDERS


@dataclass
class DecodeConfig:
    budget: int = 32                 # tree nodes per round, the root counted (1 = plain AR)
    width: int = 7                   # top-W draft tokens per depth
    algorithm: str = "accum_logp"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                   # 0 = off
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 1:
            raise InvalidSettingError(f"budget must be an integer >= 1 (it counts the root), got {self.budget!r}")
        if self.budget > 4096:
            raise InvalidSettingError(f"budget {self.budget} is beyond 4096 nodes; no target verifies that in one pass")
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 1:
            raise InvalidSettingError(f"width must be an integer >= 1, got {self.width!r}")
        if self.algorithm not in TREE_BUILDERS:
            raise InvalidSettingError(
                f"unknown tree algorithm {self.algorithm!r}; known: {', '.join(sorted(TREE_BUILDERS))}"
            )
        if not 0 <= self.temperature < float("inf"):
            raise InvalidSettingError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidSettingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidSettingError(f"top_k must be >= 0, got {self.top_k}")
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise InvalidSettingError("stop strings must be non-empty strings")
        if self.max_new_tokens < 1:
            raise InvalidSettingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(V,) logits → (V,) float32 probabilities of the target's sampling distribution."""
    logits = logits.float()
    # Shift first: the top score becomes 0, so a tiny temperature gives -inf elsewhere, never inf - inf.
    scores = (logits - logits.max()) / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop = (sorted_p.cumsum(0) - sorted_p) >= top_p
        drop[0] = False  # a top_p below float32 resolution must still keep the top token
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        probs = probs / probs.sum()
    return probs
