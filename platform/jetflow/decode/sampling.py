"""The target-side sampling distribution (temperature, top-k, top-p); the decoding settings themselves are
`jetflow.decode.config` (re-exported here)."""

from __future__ import annotations

import torch

from jetflow.decode.config import DecodeConfig, check_temperature  # noqa: F401  (their old import path)


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
