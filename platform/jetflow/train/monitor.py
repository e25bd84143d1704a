"""Held-out monitoring of a head on cached features: per-depth top-1 agreement with the target,
simulated chain τ, and a tree-aware simulated τ (the real tree builder and acceptance walk run on
each block's draft, following the target's greedy tokens: exact for greedy decoding of that data)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetflow import metrics
from jetflow.tree import TreeSpec, build_tree, walk


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


def tree_accepted_for_blocks(logits: torch.Tensor, labels: torch.Tensor, tree: TreeSpec) -> list[int]:
    """logits (N, D, V), labels (N, D) → drafted tokens the tree walk accepts, per block (bonus excluded)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(tree.width, logp.shape[-1]), dim=-1)
    accepted = []
    for b in range(logits.shape[0]):
        drafted = build_tree(tree, -1, top.values[b].tolist(), top.indices[b].tolist())
        row = labels[b].tolist()
        accepted.append(walk(drafted, lambda node: row[drafted.depths[node]]
                             if drafted.depths[node] < len(row) else -1).accepted)
    return accepted


def summarize(logits: torch.Tensor, labels: torch.Tensor, tree: TreeSpec) -> HeadEval:
    hits = logits.argmax(-1) == labels
    return HeadEval(per_depth_agreement=hits.float().mean(0).tolist(), chain_tau=metrics.simulated_tau_chain(hits),
                    tree_tau=metrics.simulated_tau_tree(tree_accepted_for_blocks(logits, labels, tree)),
                    blocks=int(labels.shape[0]))
