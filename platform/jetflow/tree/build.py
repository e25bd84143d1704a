"""Tree construction algorithms behind a registry. Each turns per-depth top-W draft log-probs into a
`DraftTree` of at most `spec.budget` nodes (the root counted), for a validated `TreeSpec`."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from jetflow.tree.draft_tree import DraftTree

if TYPE_CHECKING:
    from jetflow.tree.spec import TreeSpec


class TreeBuilder(Protocol):
    def __call__(self, root: int, logp: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]], budget: int,
                 width: int, **params) -> DraftTree: ...


@dataclass(frozen=True)
class TreeAlgorithm:
    """A registered builder and the parameters it accepts, with their defaults (what `TreeSpec` validates)."""

    name: str
    build: TreeBuilder
    params: dict[str, float] = field(default_factory=dict)
    chain: bool = False          # drafts one path: width is meaningless, at most D + 1 nodes


TREE_BUILDERS: dict[str, TreeAlgorithm] = {}


def register_tree(name: str, chain: bool = False, **params: float) -> Callable[[TreeBuilder], TreeBuilder]:
    """Register a builder under `name`; `params` are the extra keyword parameters it accepts, with defaults."""
    def deco(fn: TreeBuilder) -> TreeBuilder:
        TREE_BUILDERS[name] = TreeAlgorithm(name, fn, dict(params), chain)
        return fn

    return deco


def build_tree(spec: "TreeSpec", root: int, logp: Sequence[Sequence[float]],
               tokens: Sequence[Sequence[int]]) -> DraftTree:
    """logp, tokens: D rows of W entries, each row sorted by descending log-prob (depth 1..D)."""
    algo = TREE_BUILDERS[spec.algorithm]
    return algo.build(root, logp, tokens, spec.budget, spec.width, **{**algo.params, **dict(spec.params)})


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


def _fanout(logp: Sequence[Sequence[float]], width: int) -> int:
    """The fanout a width allows: at most the W tokens given per depth."""
    return min(width, len(logp[0])) if logp else 0


@register_tree("accum_logp")
def accum_logp(root, logp, tokens, budget, width) -> DraftTree:
    """Best-first on cumulative log-prob, fanout up to `width`."""
    return _best_first(root, logp, tokens, budget, [_fanout(logp, width)] * len(logp))


@register_tree("chain", chain=True)
def chain(root, logp, tokens, budget, width) -> DraftTree:
    """The DFlash-style linear draft: the argmax spine, width 1."""
    return _best_first(root, logp, tokens, budget, [1] * len(logp))


@register_tree("top2gap", margin=2.0)
def top2gap(root, logp, tokens, budget, width, margin: float) -> DraftTree:
    """Per-depth fanout caps: keep the ranks whose log-prob is within `margin` nats of the top-1,
    so a confident depth (top-1/top-2 gap > margin) gets fanout 1 and an uncertain one up to `width`."""
    cap = _fanout(logp, width)
    caps = [max(1, sum(1 for r in range(cap) if row[0] - row[r] <= margin)) for row in logp]
    return _best_first(root, logp, tokens, budget, caps)
