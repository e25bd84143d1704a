"""`path_conditional_refresh`: the tree algorithm the paper planned (its design A6, "path-conditional draft
logits … ~D forwards, not N") and never built, on our decoder's and engine's per-round head access.

Why: the head drafts every depth in one forward from [anchor, MASK × D], so the rows of depth ≥ 2 are
conditioned on the head's own guess at depth 1 (the argmax spine). Under the paper's `accum_logp` a node
below a rank-r depth-1 token reuses those spine-conditioned rows (METHOD §6: "off-argmax branches reuse
spine-conditioned marginals"). The refresh is a second head pass, in the same round, over the real depth-1
tokens: one batched forward of F blocks [anchor, c_r, MASK × (D - 1)], r = 0 … F - 1, whose outputs at
depths 2..D become the rows of the subtree under c_r. Nothing is ever committed from it unverified: the
target's walk decides as for every tree, so the algorithm is lossless like the others.

Where it pays (the gate): only when the tree can reach depth 2 at all (budget > 1 + fanout: the paper's rule
gives the root its whole fanout first) and depth 1 is uncertain — the top-1/top-2 log-prob gap below `gap`
nats — since a decisive depth 1 puts nearly all the accepted mass under the spine, whose rows already are
spine-conditioned. The second pass costs one head forward of F blocks; the decoder and the engine count it
as draft time. The head was trained on MASK blocks only: a real token at block position 1 is outside its
training: with the `demo` head the refreshed rows barely move and τ equals accum_logp's at every budget
(benchmarks/HISTORY.md, "Tree algorithms") — the pass pays only for a head trained with real tokens in its block.

Identity: `branches` 0, `gap` 0, a chain (fanout 1), or no second pass available (`context.redraft` None:
the simulated-τ monitor, a bare `build_tree`) — the paper's accum_logp exactly.
"""

from __future__ import annotations

import heapq
from typing import Mapping, Sequence

from jetflow.errors import InvalidSettingError
from jetflow.tree.build import check_range, expand, fanout, full_caps, register_tree
from jetflow.tree.context import TreeContext
from jetflow.tree.draft_tree import DraftTree

Rows = tuple[Sequence[Sequence[float]], Sequence[Sequence[int]]]   # (log-probs, tokens) for depths 2..D


def expand_by_branch(root: int, logp: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]], budget: int,
                     caps: Sequence[int], refreshed: Mapping[int, Rows]) -> DraftTree:
    """The paper's rule (`expand`), except that the children of a node under the depth-1 node of rank r come
    from `refreshed[r]` (its rows for depths 2..D) when the refresh gave r rows; from the marginal row of
    their depth otherwise. A child's rank is its rank in the row it came from. With nothing refreshed this
    is `expand`, node for node."""
    tree = DraftTree.root_only(root)
    branch = [-1]                                   # per node: the rank of its depth-1 ancestor (root: -1)
    depth_max = len(logp)
    heap: list[tuple[float, int]] = [(-0.0, 0)]
    while heap and tree.size < budget:
        neg, node = heapq.heappop(heap)
        depth = tree.depths[node]
        if depth >= depth_max:
            continue
        rows = refreshed.get(branch[node]) if depth >= 1 else None
        row_lp, row_tok = (rows[0][depth - 1], rows[1][depth - 1]) if rows is not None else (logp[depth], tokens[depth])
        for rank in range(min(caps[depth], len(row_lp), budget - tree.size)):
            child = tree.add(int(row_tok[rank]), node, -neg + row_lp[rank], rank)
            branch.append(rank if depth == 0 else branch[node])
            heapq.heappush(heap, (-tree.scores[child], child))
    return tree


def refresh_branches(logp: Sequence[Sequence[float]], budget: int, width: int, branches: float,
                     gap: float) -> int:
    """How many depth-1 tokens the gate re-drafts this round (0: no second pass, the tree is accum_logp)."""
    k = fanout(logp, width)
    if len(logp) < 2 or k < 2 or budget <= 1 + k or logp[0][0] - logp[0][1] >= gap:
        return 0
    return min(int(branches), k)


def _check(params: Mapping[str, float]) -> None:
    check_range("branches", params["branches"], 0, 64)
    if params["branches"] != int(params["branches"]):
        raise InvalidSettingError(f"tree parameter branches is a whole number, got {params['branches']:g}")
    check_range("gap", params["gap"], 0.0, 1e9)


@register_tree("path_conditional_refresh", source="planned", context=True, drafter=True, check=_check,
               branches=2.0, gap=1.0)
def path_conditional_refresh(root, logp, tokens, budget, width, branches: float, gap: float,
                             context: TreeContext | None = None) -> DraftTree:
    """Planned by the paper (A6), built here: when the gate opens (`refresh_branches`: the tree reaches depth
    2 and depth 1's top-2 gap is below `gap` nats), a second head pass re-drafts depths 2..D under each of
    the top `branches` depth-1 tokens, with that token in the block; the paper's accum_logp heap then
    expands each such subtree from its own rows (`expand_by_branch`). Gate shut or no second pass: accum_logp."""
    caps = full_caps(logp, width)
    count = refresh_branches(logp, budget, width, branches, gap)
    redraft = context.redraft if context is not None else None
    if count == 0 or redraft is None:
        return expand(root, logp, tokens, budget, caps)
    k = fanout(logp, width)
    lp_rows, tok_rows = redraft([int(t) for t in tokens[0][:count]])
    refreshed = {r: ([row[:k] for row in lp_rows[r]], [row[:k] for row in tok_rows[r]]) for r in range(count)}
    return expand_by_branch(root, logp, tokens, budget, caps, refreshed)
