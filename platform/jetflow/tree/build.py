"""Tree construction behind a registry: the dispatch (`build_tree`), the two expansion rules every builder
ends in, and the builders that read nothing but the per-depth top-W draft log-probs.

Inputs, for every builder: `logp`, `tokens` — D rows (depths 1..D) of W entries, each row sorted by
descending log-prob, the W tokens of a row distinct; `budget` — nodes, the root counted; `width` — how many
of a row's entries a node may take as children (at most W).

The two expansion rules (ties in score: the node created first wins, in both):

- `expand` — the paper's (JetSpec `accum_logp`, METHOD §3.2): take the open node with the best cumulative
  log-prob and give it ALL its children at once — the first caps[d] ranks of the next depth, cut only by the
  budget; repeat. A weak sibling enters because its parent was expanded.
- `best_first` — ours: the exact top-`budget` nodes by cumulative log-prob of the tree in which every depth-d
  node has the first caps[d] ranks of the next depth as children, added one node at a time.

Every shape (chain, the paper's fanout caps, the profile-guided and prompt-adaptive ones) is a vector of
per-depth caps fed to one of the two.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Protocol, Sequence

from jetflow.errors import InvalidSettingError
from jetflow.tree.draft_tree import DraftTree

if TYPE_CHECKING:
    from jetflow.tree.context import TreeContext, TreeState
    from jetflow.tree.spec import TreeSpec

Source = Literal["paper", "planned", "ours"]


class TreeBuilder(Protocol):
    """`fn(root, logp, tokens, budget, width, **params)`; a builder registered with `context=True` also takes
    `context: TreeContext | None` (None: it behaves as its identity setting, the paper's accum_logp)."""

    def __call__(self, root: int, logp: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]], budget: int,
                 width: int, **params: Any) -> DraftTree: ...


StateFactory = Callable[[Mapping[str, float], int], "TreeState"]   # (the spec's params, seed) → per-request state
ParamCheck = Callable[[Mapping[str, float]], None]                 # raises InvalidSettingError


@dataclass(frozen=True)
class TreeAlgorithm:
    """A registered builder: the parameters it accepts with their defaults (what `TreeSpec` validates), where
    it comes from, and what else it reads."""

    name: str
    build: TreeBuilder
    source: Source                        # "paper": its published code; "planned": listed there, unbuilt; "ours"
    params: dict[str, float] = field(default_factory=dict)
    chain: bool = False                   # drafts one path: width is meaningless, at most D + 1 nodes
    context: bool = False                 # reads a `TreeContext` (profile, prompt, templates, online state)
    drafter: bool = False                 # may call the head again in a round (`TreeContext.redraft`)
    state: StateFactory | None = None     # keeps per-request state that `observe` feeds after each verify
    check: ParamCheck | None = None       # cross-parameter rules beyond "a finite number"

    def check_params(self, params: Mapping[str, float]) -> None:
        if self.check is not None:
            self.check(params)


TREE_BUILDERS: dict[str, TreeAlgorithm] = {}


def register_tree(name: str, *, source: Source, chain: bool = False, context: bool = False,
                  drafter: bool = False, state: StateFactory | None = None, check: ParamCheck | None = None,
                  **params: float) -> Callable[[TreeBuilder], TreeBuilder]:
    """Register a builder under `name`; `params` are the extra keyword parameters it accepts, with defaults."""
    def deco(fn: TreeBuilder) -> TreeBuilder:
        TREE_BUILDERS[name] = TreeAlgorithm(name, fn, source, dict(params), chain, context, drafter, state, check)
        return fn

    return deco


def build_tree(spec: "TreeSpec", root: int, logp: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]],
               context: "TreeContext | None" = None) -> DraftTree:
    """The tree of `spec` over D rows (depths 1..D) of W (log-prob, token), rows sorted by descending log-prob.
    `context` reaches only the builders that read one; the others ignore it."""
    algo = TREE_BUILDERS[spec.algorithm]
    extra: dict[str, Any] = {"context": context} if algo.context else {}
    return algo.build(root, logp, tokens, spec.budget, spec.width, **spec.options(), **extra)


# ------------------------------------------------------------------------------------ the expansion rules
def fanout(logp: Sequence[Sequence[float]], width: int) -> int:
    """The fanout a width allows: at most the W tokens given per depth."""
    return min(width, len(logp[0])) if logp else 0


def expand(root: int, logp: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]], budget: int,
           caps: Sequence[int]) -> DraftTree:
    """The paper's rule: a max-heap of open nodes on cumulative log-prob, the root first. Pop the best (ties:
    the node created first); a node at depth D has nothing to add; otherwise add min(caps[d], budget - size)
    children — ranks 0, 1, … of depth d + 1, the same tokens under every parent — each scored parent +
    log-prob and pushed. Stop at `budget` nodes or when nothing is open. caps[d] must not exceed the row."""
    tree = DraftTree.root_only(root)
    depth_max = len(logp)
    heap: list[tuple[float, int]] = [(-0.0, 0)]  # (-score, node index): the index is creation order
    while heap and tree.size < budget:
        neg, node = heapq.heappop(heap)
        depth = tree.depths[node]
        if depth >= depth_max:
            continue
        row_lp, row_tok = logp[depth], tokens[depth]
        for rank in range(min(caps[depth], budget - tree.size)):
            child = tree.add(int(row_tok[rank]), node, -neg + row_lp[rank], rank)
            heapq.heappush(heap, (-tree.scores[child], child))
    return tree


def best_first_capped(root: int, logp: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]], budget: int,
                      caps: Sequence[int]) -> DraftTree:
    """Ours: the exact top-`budget` nodes by cumulative log-prob of the tree in which every node at depth d
    has the first caps[d] ranks of depth d + 1 as children (ties: the candidate pushed first).

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


def full_caps(logp: Sequence[Sequence[float]], width: int) -> list[int]:
    """Every depth at the full fanout: the caps of the paper's accum_logp, every shape's identity setting."""
    return [fanout(logp, width)] * len(logp)


# ------------------------------------------------------------------------------------ builders
@register_tree("accum_logp", source="paper")
def accum_logp(root, logp, tokens, budget, width) -> DraftTree:
    """The paper's accum_logp (METHOD §3.2): `expand` at full fanout — the best open node gets all its
    top-`width` children at once, truncated only by the budget."""
    return expand(root, logp, tokens, budget, full_caps(logp, width))


@register_tree("best_first", source="ours")
def best_first(root, logp, tokens, budget, width) -> DraftTree:
    """Ours: the exact top-`budget` subtree by cumulative log-prob at fanout `width` (nodes added one at a
    time, so a weak sibling never rides in with its parent). Under the head's own probabilities its summed
    path probability is never lower than accum_logp's at the same budget."""
    return best_first_capped(root, logp, tokens, budget, full_caps(logp, width))


@register_tree("chain", source="paper", chain=True)
def chain(root, logp, tokens, budget, width) -> DraftTree:
    """The DFlash-style linear draft: the argmax spine, i.e. accum_logp at width 1."""
    return expand(root, logp, tokens, budget, [1] * len(logp))


@register_tree("top2gap", source="ours", margin=2.0)
def top2gap(root, logp, tokens, budget, width, margin: float) -> DraftTree:
    """Ours: per-depth fanout caps — keep the ranks whose log-prob is within `margin` nats of the top-1, so a
    confident depth (top-1/top-2 gap > margin) gets fanout 1 and an uncertain one up to `width` — then the
    exact best-first top-`budget` nodes under those caps."""
    cap = fanout(logp, width)
    caps = [max(1, sum(1 for r in range(cap) if row[0] - row[r] <= margin)) for row in logp]
    return best_first_capped(root, logp, tokens, budget, caps)


def top2gap_fanout_caps(logp: Sequence[Sequence[float]], width: int, beta: float, gap_mid: float) -> list[int]:
    """The paper's top2gap_fanout caps: with K = the fanout and g_d = the top-1 minus top-2 log-prob of depth
    d, cap_d = max(1, round(K · sigmoid(-beta · (g_d - gap_mid)))) — a decisive depth (large gap) tends to 1,
    a split one to K. K < 2 has no runner-up: a chain. Python's round (half to even), as the paper's."""
    k = fanout(logp, width)
    if k < 2:
        return [1] * len(logp)
    caps = []
    for row in logp:
        gap = min(row[0] - row[1], 1e30)  # a -inf runner-up: the most decisive gap, not a NaN below
        arg = -beta * (gap - gap_mid)
        s = 1.0 / (1.0 + math.exp(-arg)) if arg >= 0 else math.exp(arg) / (1.0 + math.exp(arg))
        caps.append(max(1, int(round(k * s))))
    return caps


@register_tree("top2gap_fanout", source="paper", beta=1.0, gap_mid=1.0)
def top2gap_fanout(root, logp, tokens, budget, width, beta: float, gap_mid: float) -> DraftTree:
    """The paper's top2gap_fanout: caps from each depth's top-2 gap (`top2gap_fanout_caps`) fed to the
    paper's heap (`expand`). Identity: a huge `gap_mid` (1e9, beta > 0) puts every cap at K = accum_logp."""
    return expand(root, logp, tokens, budget, top2gap_fanout_caps(logp, width, beta, gap_mid))


# ------------------------------------------------------------------------------------ parameter rules
def check_flag(name: str, value: float) -> None:
    if value not in (0.0, 1.0):
        raise InvalidSettingError(f"tree parameter {name} is a switch: 0 or 1, got {value:g}")


def check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise InvalidSettingError(f"tree parameter {name} must be in {lo:g}..{hi:g}, got {value:g}")
