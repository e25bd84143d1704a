"""What "token-identical to greedy decoding" means in floating point, checked.

A tree verify runs N nodes through the target at once; a plain step runs one. Other kernel shapes sum in
another order, so a logit may differ in its last bits — which changes nothing unless the target's own two
best tokens are tied to within that noise. Greedy speculative output therefore equals greedy AR output
token for token, or it first differs exactly where the target's top-2 logits are an fp32 tie (both
choices are greedy there; each output then continues greedily from its own). `first_divergence` finds and
classifies the first difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

TIE = 1e-4  # top-2 logits closer than this (fp32) may be ordered either way by kernels of another shape


@dataclass(frozen=True)
class Divergence:
    index: int            # first generated position where the outputs differ (or where one ends)
    got: int | None
    expected: int | None
    gap: float            # the target's top-1 minus top-2 logit there (inf when lengths differ)

    @property
    def tie(self) -> bool:
        """Both tokens are the target's top two and their logits are an fp32 tie."""
        return self.gap < TIE


@torch.inference_mode()
def first_divergence(target, prompt_ids: Sequence[int], got: Sequence[int],
                     expected: Sequence[int]) -> Divergence | None:
    """None when `got` equals `expected`; else where and how they first differ."""
    k = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if k is None:
        if len(got) == len(expected):
            return None
        k = min(len(got), len(expected))
        return Divergence(k, got[k] if k < len(got) else None, expected[k] if k < len(expected) else None,
                          float("inf"))
    ids = torch.tensor([list(prompt_ids) + list(expected[:k])], device=target.device)
    top = torch.topk(target.model(ids).logits[0, -1].float(), 2)
    gap = float(top.values[0] - top.values[1])
    if got[k] not in top.indices.tolist():
        gap = float("inf")  # not even the runner-up: no tie explains it
    return Divergence(k, got[k], expected[k], gap)


def greedy_equal(target, prompt_ids: Sequence[int], got: Sequence[int], expected: Sequence[int]) -> bool:
    """`got` is greedy decoding's `expected`, up to an fp32 tie (see the module docstring)."""
    d = first_divergence(target, prompt_ids, got, expected)
    return d is None or d.tie
