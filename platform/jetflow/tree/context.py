"""`TreeContext`: the one way a tree algorithm receives more than the per-depth log-probs — the head's measured
profile, what is known of the prompt, the shape templates, and a per-request online state — and the
feedback hook (`observe`) the decoder and the engine call after every verify.

Per request (a serving loop, the reference `Decoder`, the batched engine):

    context = TreeContext.for_request(spec, profile=..., prompt=PromptInfo(task=..., text=...), seed=...)
    every round:  tree = build_tree(round_spec, anchor, logp, tokens, context)
                  ... verify, acceptance walk → acc ...
                  observe(context.state, tree, acc)

Every field may be missing: a builder that lacks what it reads behaves as its identity setting (the paper's
accum_logp), or, for the routers, classifies from the draft's own log-probs, as the paper's do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

from jetflow.tree.accept import Acceptance
from jetflow.tree.build import TREE_BUILDERS
from jetflow.tree.draft_tree import DraftTree
from jetflow.tree.profile import AcceptanceProfile
from jetflow.tree.templates import ShapeTemplates

if TYPE_CHECKING:
    from jetflow.tree.spec import TreeSpec


@dataclass(frozen=True)
class PromptInfo:
    """What the caller knows of the prompt, for the prompt-adaptive routers. All optional."""

    task: str | None = None   # a label: a task (math, code, chat) or a prompt set (gsm, humaneval, mtbench)
    mode: str | None = None   # "reasoning" / "cot" when the caller knows the request asks for step-by-step work
    text: str | None = None   # the prompt's text (the user turn, or the decoded prompt ids): reasoning markers


# (depth-1 tokens c_1..c_F) → per token, the head's rows for depths 2..D drafted with that token in the block
# in place of the first MASK: (log-probs, tokens), F lists of D - 1 rows, each row sorted by descending log-prob
Redraft = Callable[[Sequence[int]], tuple[list[list[list[float]]], list[list[list[int]]]]]


@runtime_checkable
class TreeState(Protocol):
    """Per-request state of an online tree algorithm: its builder reads it (and may note what it chose), and
    `observe` feeds it each verified round. Not thread-safe: one request's rounds are sequential."""

    algorithm: str

    def observe(self, tree: DraftTree, acceptance: Acceptance) -> None: ...


@dataclass(frozen=True)
class TreeContext:
    """profile: the head's per-(depth, rank) acceptance (depth_rank_histogram, class_histogram, online_warmup
    before its warmup ends); prompt: for the routers; templates: None = the shipped `templates/shapes.json`;
    state: the request's online state (`new_tree_state`), for online_warmup and template_bandit; redraft: this
    round's second head pass (`Redraft`), set per round by the decoder and the engine for an algorithm
    registered with `drafter=True` (path_conditional_refresh), its time counted as draft time."""

    profile: AcceptanceProfile | None = None
    prompt: PromptInfo | None = None
    templates: ShapeTemplates | None = None
    state: TreeState | None = None
    redraft: Redraft | None = None

    @classmethod
    def for_request(cls, spec: "TreeSpec", *, profile: AcceptanceProfile | None = None,
                    prompt: PromptInfo | None = None, templates: ShapeTemplates | None = None,
                    seed: int = 0) -> "TreeContext":
        """A request's context, with a fresh online state when `spec`'s algorithm keeps one (seeded: the same
        request, the same trees, in the reference decoder and in the engine)."""
        return cls(profile, prompt, templates, new_tree_state(spec, seed))

    @property
    def shapes(self) -> ShapeTemplates:
        return self.templates if self.templates is not None else ShapeTemplates.shipped()

    def with_redraft(self, redraft: Redraft | None) -> "TreeContext":
        """This context for one round, with that round's second head pass (the online state is shared)."""
        return replace(self, redraft=redraft)

    def state_of(self, algorithm: str) -> TreeState | None:
        """The online state if it belongs to `algorithm` (a round drafted with another algorithm ignores it)."""
        return self.state if self.state is not None and self.state.algorithm == algorithm else None


def new_tree_state(spec: "TreeSpec", seed: int = 0) -> TreeState | None:
    """A fresh per-request state for `spec`'s algorithm, or None for an algorithm without one."""
    factory = TREE_BUILDERS[spec.algorithm].state
    return factory(spec.options(), seed) if factory is not None else None


def observe(state: TreeState | None, tree: DraftTree, acceptance: Acceptance) -> None:
    """After a verify: feed the round's tree and accepted path to the request's online state (None: nothing
    to feed). Call it for every round, plain ones included; a state ignores rounds it did not shape."""
    if state is not None:
        state.observe(tree, acceptance)
