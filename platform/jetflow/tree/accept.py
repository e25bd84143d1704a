"""Acceptance: walk the tree from the root along the target's own choices.

Greedy: the target's argmax at each node. Sampled (T > 0): a sample from the target's (temperature,
top-k, top-p adjusted) distribution at each node. Either way every committed token is exactly what the
target alone would have produced at that point, so decoding is lossless; the draft only decides how
many of those tokens one verify forward yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator

from jetflow.tree.draft_tree import DraftTree


@dataclass
class Acceptance:
    path: list[int]    # accepted node indices, root first (len = accepted drafts + 1)
    bonus: int         # the target's own next token after the last accepted node

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (the root is the anchor, already committed)."""
        return len(self.path) - 1


def walker(tree: DraftTree) -> Generator[int, int, Acceptance]:
    """The acceptance walk, one node at a time: yields the node whose next token it needs and is sent that
    token; returns the Acceptance (as StopIteration.value). `walk` drives one with a callback; a batched
    engine drives many side by side, computing target logits for all of them at once."""
    node, path, kids = 0, [0], tree.children
    while True:
        tok = yield node
        child = kids[node].get(tok)
        if child is None:
            return Acceptance(path=path, bonus=tok)
        path.append(child)
        node = child


def walk(tree: DraftTree, next_token: Callable[[int], int]) -> Acceptance:
    """next_token(node) → the target's token after that node (argmax or a sample)."""
    steps = walker(tree)
    node = next(steps)
    try:
        while True:
            node = steps.send(next_token(node))
    except StopIteration as done:
        return done.value


def accept_greedy(tree: DraftTree, argmax_at: Callable[[int], int]) -> Acceptance:
    return walk(tree, argmax_at)


def accept_sampled(tree: DraftTree, sample_at: Callable[[int], int]) -> Acceptance:
    return walk(tree, sample_at)
