"""Tree construction algorithms behind a registry. Each turns per-depth top-W draft log-probs into a
`DraftTree` of at most `budget` nodes (the root counted)."""

from __future__ import annotations

import heapq
from typing import Callable, Protocol, Sequence

from jetflow.errors import InvalidSettingError
from jetflow.tree.draft_tree import DraftTree


class TreeBuilder(Protocol):
    def __call__(
        self, root: int, logp: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]], budget: int, **opts
    ) -> DraftTree: ...


TREE_BUILDERS: dict[str, TreeBuilder] = {}


def register_tree(name: str) -> Callable[[TreeBuilder], TreeBuilder]:
    def deco(fn: TreeBuilder) -> TreeBuilder:
        TREE_BUILDERS[name] = fn
        return fn

    return deco


def build_tree(
    algorithm: str, root: int, logp: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]], budget: int, **opts
) -> DraftTree:
    """logp, tokens: D rows of W entries, each row sorted by descending log-prob (depth 1..D)."""
    if algorithm not in TREE_BUILDERS:
        raise InvalidSettingError(f"unknown tree algorithm {algorithm!r}; known: {', '.join(sorted(TREE_BUILDERS))}")
    if budget < 1:
        raise InvalidSettingError(f"budget must be >= 1 (it counts the root), got {budget}")
    return TREE_BUILDERS[algorithm](root, logp, tokens, budget, **opts)


def _best_first(
    root: int,
    logp: Sequence[Sequence[float]],
    tokens: Sequence[Sequence[int]],
    budget: int,
    caps: Sequence[int],
) -> DraftTree:
    """Exact top-`budget` nodes by cumulative log-prob of the tree in which every node at depth d
    has the top-caps[d] tokens of depth d+1 as children.

    Lazy enumeration: popping (parent, rank r) pushes its first child and its next sibling; since
    log-probs are <= 0 and each row is sorted, pops come in non-increasing score order.
    """
    tree = DraftTree.root_only(root)
    depth_max = len(logp)
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, tiebreak, parent, depth, rank)
    counter = 0
    if depth_max and caps[0] > 0:
        heap.append((-logp[0][0], counter, 0, 1, 0))
    while heap and tree.size < budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        node = tree.add(int(tokens[depth - 1][rank]), parent, -neg, rank)
        parent_score = tree.scores[parent]
        if rank + 1 < caps[depth - 1]:
            counter += 1
            heapq.heappush(heap, (-(parent_score + logp[depth - 1][rank + 1]), counter, parent, depth, rank + 1))
        if depth < depth_max and caps[depth] > 0:
            counter += 1
            heapq.heappush(heap, (neg - logp[depth][0], counter, node, depth + 1, 0))
    return tree


@register_tree("accum_logp")
def accum_logp(root, logp, tokens, budget, width: int | None = None, **_) -> DraftTree:
    """Best-first on cumulative log-prob, fanout up to `width` (default: all W given)."""
    w = len(logp[0]) if logp else 0
    cap = w if width is None else min(width, w)
    return _best_first(root, logp, tokens, budget, [cap] * len(logp))


@register_tree("chain")
def chain(root, logp, tokens, budget, **_) -> DraftTree:
    """The DFlash-style linear draft: the argmax spine, width 1."""
    return _best_first(root, logp, tokens, budget, [1] * len(logp))


@register_tree("top2gap")
def top2gap(root, logp, tokens, budget, width: int | None = None, margin: float = 2.0, **_) -> DraftTree:
    """Per-depth fanout caps: keep the ranks whose log-prob is within `margin` nats of the top-1,
    so a confident depth (top-1/top-2 gap > margin) gets fanout 1 and an uncertain one up to `width`."""
    w = len(logp[0]) if logp else 0
    cap = w if width is None else min(width, w)
    caps = [max(1, sum(1 for r in range(cap) if row[0] - row[r] <= margin)) for row in logp]
    return _best_first(root, logp, tokens, budget, caps)
