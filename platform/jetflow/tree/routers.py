"""The paper's profile-guided and prompt-adaptive tree algorithms, in our own code: each turns what it knows
(a measured acceptance profile, the prompt's class) into per-depth fanout caps for the paper's heap (`expand`).

- `depth_rank_histogram`: caps from the head's per-(depth, rank) acceptance profile.
- `task_router`: the prompt's task class → that class's template.
- `reasoning_router`: a step-by-step reasoning prompt → a chain; otherwise the open-ended template.
- `class_histogram`: the prompt's class → caps from that class's measured table, else its template.

How a prompt is classified follows the paper: a caller's label first (`PromptInfo.task`, `.mode`), then (the
reasoning router) marker phrases in the prompt text, and otherwise a fingerprint of the round's own draft —
the mean top-1/top-2 log-prob gap over its depths: a decisive draft reads as math/code, a split one as chat.
Templates are config (`ShapeTemplates`, `templates/shapes.json`). Each recovers accum_logp at
`force_baseline=1` (the routers) or with no profile (depth_rank_histogram).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from jetflow.errors import InvalidSettingError
from jetflow.tree.build import check_flag, expand, fanout, full_caps, register_tree
from jetflow.tree.context import PromptInfo, TreeContext
from jetflow.tree.draft_tree import DraftTree
from jetflow.tree.profile import histogram_caps, support_caps
from jetflow.tree.templates import ShapeTemplates, expand_template


def mean_top2_gap(logp: Sequence[Sequence[float]], width: int) -> float | None:
    """The draft's fingerprint: the mean over depths of top-1 minus top-2 log-prob (None: no runner-up)."""
    if fanout(logp, width) < 2:
        return None
    return sum(row[0] - row[1] for row in logp) / len(logp)


def task_class(prompt: PromptInfo | None, logp: Sequence[Sequence[float]], width: int, gap_high: float,
               gap_low: float, shapes: ShapeTemplates) -> str:
    """A caller's task label through the aliases (unknown: the default class); without one, the fingerprint:
    gap > gap_high decisive, gap < gap_low uncertain, else (or no runner-up) the default class."""
    if prompt is not None and prompt.task:
        return shapes.class_of(prompt.task)
    gap = mean_top2_gap(logp, width)
    if gap is None:
        return shapes.default_class
    if gap > gap_high:
        return "decisive_task"
    if gap < gap_low:
        return "uncertain_task"
    return shapes.default_class


def is_reasoning(prompt: PromptInfo | None, logp: Sequence[Sequence[float]], width: int, gap_threshold: float,
                 shapes: ShapeTemplates) -> bool:
    """A reasoning mode or label, a reasoning marker in the prompt text, or else a decisive draft (mean
    top-2 gap > gap_threshold) — the paper's order."""
    if prompt is not None:
        if prompt.mode and prompt.mode.lower() in shapes.reasoning_modes:
            return True
        if prompt.task and prompt.task.lower() in shapes.reasoning_labels:
            return True
        text = (prompt.text or "").lower()
        if any(marker in text for marker in shapes.reasoning_markers):
            return True
    gap = mean_top2_gap(logp, width)
    return gap is not None and gap > gap_threshold


def _check_gaps(params: Mapping[str, float]) -> None:
    check_flag("force_baseline", params["force_baseline"])
    if params["gap_high"] < params["gap_low"]:
        raise InvalidSettingError(f"gap_high ({params['gap_high']:g}) must be >= gap_low ({params['gap_low']:g})")


def _parts(context: TreeContext | None) -> tuple[PromptInfo | None, ShapeTemplates]:
    return (context.prompt if context else None), (context.shapes if context else ShapeTemplates.shipped())


@register_tree("depth_rank_histogram", source="paper", context=True, threshold=0.02)
def depth_rank_histogram(root, logp, tokens, budget, width, threshold: float,
                         context: TreeContext | None = None) -> DraftTree:
    """The paper's depth_rank_histogram: cap_d = how many ranks of depth d+1 the head's profile says the target
    takes with probability >= `threshold` (`histogram_caps`), so measured-useless ranks are never drafted and
    the budget goes where acceptance data says it pays. No profile, or threshold <= 0: accum_logp."""
    profile = context.profile if context else None
    rows = profile.depth_rank if profile is not None else ()
    return expand(root, logp, tokens, budget, histogram_caps(rows, threshold, fanout(logp, width), len(logp)))


@register_tree("task_router", source="paper", context=True, check=_check_gaps, gap_high=2.0, gap_low=1.0,
               force_baseline=0.0)
def task_router(root, logp, tokens, budget, width, gap_high: float, gap_low: float, force_baseline: float,
                context: TreeContext | None = None) -> DraftTree:
    """The paper's task_router: the prompt's task class (`task_class`) → that class's template (decisive: a
    chain; balanced: small fanout early; uncertain: wide early). force_baseline=1: accum_logp."""
    if force_baseline:
        return expand(root, logp, tokens, budget, full_caps(logp, width))
    prompt, shapes = _parts(context)
    cls = task_class(prompt, logp, width, gap_high, gap_low, shapes)
    return expand(root, logp, tokens, budget, expand_template(shapes.template(cls), len(logp), fanout(logp, width)))


@register_tree("reasoning_router", source="paper", context=True, gap_threshold=1.5, force_baseline=0.0,
               check=lambda p: check_flag("force_baseline", p["force_baseline"]))
def reasoning_router(root, logp, tokens, budget, width, gap_threshold: float, force_baseline: float,
                     context: TreeContext | None = None) -> DraftTree:
    """The paper's reasoning_router: a step-by-step reasoning prompt (`is_reasoning`) drafts a chain — each next
    token is the obvious one — and any other the open-ended template. force_baseline=1: accum_logp."""
    if force_baseline:
        return expand(root, logp, tokens, budget, full_caps(logp, width))
    prompt, shapes = _parts(context)
    template = (1,) if is_reasoning(prompt, logp, width, gap_threshold, shapes) else shapes.open_ended
    return expand(root, logp, tokens, budget, expand_template(template, len(logp), fanout(logp, width)))


@register_tree("class_histogram", source="paper", context=True, check=_check_gaps, gap_high=2.0, gap_low=1.0,
               force_baseline=0.0)
def class_histogram(root, logp, tokens, budget, width, gap_high: float, gap_low: float, force_baseline: float,
                    context: TreeContext | None = None) -> DraftTree:
    """The paper's class_histogram: the prompt's class as task_router finds it, then caps from that class's
    measured table in the profile (`support_caps`: up to the deepest rank ever accepted), else the class's
    template (then it is task_router). force_baseline=1: accum_logp."""
    if force_baseline:
        return expand(root, logp, tokens, budget, full_caps(logp, width))
    prompt, shapes = _parts(context)
    cls = task_class(prompt, logp, width, gap_high, gap_low, shapes)
    k, depths = fanout(logp, width), len(logp)
    table = context.profile.classes.get(cls) if context and context.profile else None
    caps = support_caps(table, k, depths) if table else expand_template(shapes.template(cls), depths, k)
    return expand(root, logp, tokens, budget, caps)
