"""Held-out monitoring of a head on cached features: per-depth top-1 agreement with the target,
simulated chain τ, and a tree-aware simulated τ (the real tree builder and acceptance walk run on
each block's draft, following the target's greedy tokens: exact for greedy decoding of that data)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetflow.train.losses import chain_tau_from_hits
from jetflow.tree import build_tree, walk


@dataclass
class HeadEval:
    per_depth_agreement: list[float]
    chain_tau: float
    tree_tau: float
    blocks: int

    def as_metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {f"{prefix}/chain_tau": self.chain_tau, f"{prefix}/tree_tau": self.tree_tau}
        out.update({f"{prefix}/agree_d{k + 1}": v for k, v in enumerate(self.per_depth_agreement)})
        return out


def tree_accepted_for_blocks(logits: torch.Tensor, labels: torch.Tensor, width: int, budget: int,
                             algorithm: str = "accum_logp") -> list[int]:
    """logits (N, D, V), labels (N, D) → drafted tokens the tree walk accepts, per block (bonus excluded)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(width, dim=-1)
    accepted = []
    for b in range(logits.shape[0]):
        tree = build_tree(algorithm, -1, top.values[b].tolist(), top.indices[b].tolist(), budget)
        row = labels[b].tolist()
        accepted.append(walk(tree, lambda node: row[tree.depths[node]] if tree.depths[node] < len(row) else -1).accepted)
    return accepted


def tree_tau_for_blocks(logits: torch.Tensor, labels: torch.Tensor, width: int, budget: int,
                        algorithm: str = "accum_logp") -> float:
    """logits (N, D, V), labels (N, D) → mean committed tokens per round of the tree walk."""
    accepted = tree_accepted_for_blocks(logits, labels, width, budget, algorithm)
    return (sum(accepted) + len(accepted)) / max(1, len(accepted))


def summarize(logits: torch.Tensor, labels: torch.Tensor, width: int, budget: int) -> HeadEval:
    hits = logits.argmax(-1) == labels
    return HeadEval(per_depth_agreement=hits.float().mean(0).tolist(), chain_tau=chain_tau_from_hits(hits),
                    tree_tau=tree_tau_for_blocks(logits, labels, width, budget), blocks=int(labels.shape[0]))
