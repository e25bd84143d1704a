"""Acceptance: walk the tree from the root along the target's own choices.

Greedy: the target's argmax at each node. Sampled (T > 0): a sample from the target's (temperature,
top-k, top-p adjusted) distribution at each node. Either way every committed token is exactly what the
target alone would have produced at that point, so decoding is lossless; the draft only decides how
many of those tokens one verify forward yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jetflow.tree.draft_tree import DraftTree


@dataclass
class Acceptance:
    path: list[int]    # accepted node indices, root first (len = accepted drafts + 1)
    bonus: int         # the target's own next token after the last accepted node

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (the root is the anchor, already committed)."""
        return len(self.path) - 1


def walk(tree: DraftTree, next_token: Callable[[int], int]) -> Acceptance:
    """next_token(node) → the target's token after that node (argmax or a sample)."""
    node = 0
    path = [0]
    kids = tree.children
    while True:
        tok = next_token(node)
        child = kids[node].get(tok)
        if child is None:
            return Acceptance(path=path, bonus=tok)
        path.append(child)
        node = child


def accept_greedy(tree: DraftTree, argmax_at: Callable[[int], int]) -> Acceptance:
    return walk(tree, argmax_at)


def accept_sampled(tree: DraftTree, sample_at: Callable[[int], int]) -> Acceptance:
    return walk(tree, sample_at)
