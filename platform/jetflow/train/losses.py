"""Per-depth draft losses (METHOD.md §2). The teacher is the target's next-token distribution, kept
as its top-K (ids, log-probs) in the feature cache; labels are the target's own greedy tokens."""

from __future__ import annotations

import torch

from jetflow.errors import InvalidSettingError
from jetflow.train.config import LOSSES


def depth_weights(depth: int, gamma: float, device=None) -> torch.Tensor:
    """(D,) w_k = exp(-(k-1)/gamma) (DFlash decay), uniform when gamma == 0."""
    k = torch.arange(depth, dtype=torch.float32, device=device)
    return torch.ones(depth, device=device) if gamma == 0 else torch.exp(-k / gamma)


def draft_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
               kind: str = "fkl", gamma: float = 0.0) -> torch.Tensor:
    """logits (N, D, V) draft; labels (N, D); teacher_ids / teacher_logp (N, D, K). Scalar loss.
    Ids of -1 (outside a draft vocabulary) carry no loss: such labels are skipped, and the teacher is
    renormalised over its in-vocabulary top-K.

    fkl: forward KL(teacher || draft) with the teacher truncated to its top-K and renormalised
         (= soft cross-entropy up to the teacher's entropy, a constant);
    ce:  hard-label cross-entropy on the target's tokens;
    rkl: reverse KL(draft || teacher) on the teacher's top-K support (draft renormalised there).
    """
    if kind not in LOSSES:
        raise InvalidSettingError(f"unknown loss {kind!r}; known: {', '.join(LOSSES)}")
    n, d, _ = logits.shape
    logq = torch.log_softmax(logits.float(), dim=-1)
    if kind == "ce":
        known = labels >= 0
        per = -logq.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * known
    else:
        known = teacher_ids >= 0                                     # (N, D, K)
        # renormalise over the (in-vocabulary) top-K; a row with none of it contributes nothing
        # (finite fills: a fully masked row stays NaN-free in forward and backward)
        t_logp = torch.log_softmax(teacher_logp.float().masked_fill(~known, -1e4), dim=-1)
        q_k = logq.gather(-1, teacher_ids.clamp(min=0))              # (N, D, K)
        row = known.any(-1)
        if kind == "fkl":
            per = -(t_logp.exp() * q_k).sum(-1) * row
        else:
            q_norm = torch.log_softmax(q_k.masked_fill(~known, -1e4), dim=-1)
            per = (q_norm.exp() * (q_norm - t_logp)).sum(-1) * row
    w = depth_weights(d, gamma, logits.device)
    return (per * w).sum() / (w.sum() * n)
