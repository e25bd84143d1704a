"""The tree algorithms the paper planned but never built because they need a serving loop's feedback, on our
decoder's and engine's per-round `observe` hook (see `jetflow.tree.context`). Each keeps a per-request state
(`TreeContext.for_request` makes it) and, with no feedback yet, drafts exactly the paper's accum_logp.

- `online_warmup`: learn the request's own per-(depth, rank) acceptance over its first `warmup` rounds (drafted
  as accum_logp, or from the head's profile when the context has one), then shape the rest of the request
  with the depth_rank_histogram rule on that request-local table.
- `template_bandit`: epsilon-greedy over shape templates — arm 0 the full fanout (accum_logp), the others the
  config's `bandit_arms` — rewarded by the tokens a round commits per budget node.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping

from jetflow.errors import InvalidSettingError
from jetflow.tree.accept import Acceptance
from jetflow.tree.build import check_range, expand, fanout, full_caps, register_tree
from jetflow.tree.context import TreeContext
from jetflow.tree.draft_tree import DraftTree
from jetflow.tree.profile import Table, acceptance_rates, histogram_caps
from jetflow.tree.templates import expand_template


# ------------------------------------------------------------------------------------ online_warmup
@dataclass
class WarmupState:
    """One request's online_warmup state. offered[d][r] / accepted[d][r]: warm-up rounds in which the accepted
    node at depth d had a rank-r child in the tree / the target took it (d = 0 is the root); `rounds`: warm-up
    rounds counted. Frozen once `rounds` reaches `warmup`: later trees are pruned, and counting under them
    would teach the state that the ranks it stopped drafting are never accepted."""

    warmup: int
    algorithm: str = "online_warmup"
    rounds: int = 0
    offered: list[list[int]] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)

    @classmethod
    def create(cls, params: Mapping[str, float], seed: int) -> "WarmupState":
        return cls(warmup=int(params["warmup"]))

    @property
    def warm(self) -> bool:
        return self.rounds >= self.warmup

    def table(self) -> Table:
        return acceptance_rates(self.offered, self.accepted)

    def observe(self, tree: DraftTree, acceptance: Acceptance) -> None:
        if self.warm or tree.size <= 1:
            return
        kids: dict[int, list[int]] = {}
        for i in range(1, tree.size):
            kids.setdefault(tree.parents[i], []).append(i)
        path = acceptance.path
        for step, node in enumerate(path):
            children = kids.get(node)
            if not children:
                continue  # a leaf offered the target nothing to take
            depth = tree.depths[node]
            while len(self.offered) <= depth:
                self.offered.append([])
                self.accepted.append([])
            width = max(tree.ranks[c] for c in children) + 1
            for counts in (self.offered[depth], self.accepted[depth]):
                counts.extend([0] * (width - len(counts)))
            for c in children:
                self.offered[depth][tree.ranks[c]] += 1
            if step + 1 < len(path):
                self.accepted[depth][tree.ranks[path[step + 1]]] += 1
        self.rounds += 1


def _check_warmup(params: Mapping[str, float]) -> None:
    check_range("warmup", params["warmup"], 0, 1e9)
    if params["warmup"] != int(params["warmup"]):
        raise InvalidSettingError(f"tree parameter warmup is a whole number of rounds, got {params['warmup']:g}")


@register_tree("online_warmup", source="planned", context=True, state=WarmupState.create, check=_check_warmup,
               warmup=8.0, threshold=0.02)
def online_warmup(root, logp, tokens, budget, width, warmup: float, threshold: float,
                  context: TreeContext | None = None) -> DraftTree:
    """Planned by the paper, built here: once the request's state has `warmup` rounds, cap_d = the
    depth_rank_histogram rule (`histogram_caps`, `threshold`) on the request's own acceptance table; before
    that the head's profile if the context has one, else accum_logp. threshold <= 0: accum_logp throughout."""
    state = context.state_of("online_warmup") if context else None
    k, depths = fanout(logp, width), len(logp)
    if isinstance(state, WarmupState) and state.warm:
        caps = histogram_caps(state.table(), threshold, k, depths)
    elif context is not None and context.profile is not None:
        caps = histogram_caps(context.profile.depth_rank, threshold, k, depths)
    else:
        caps = full_caps(logp, width)
    return expand(root, logp, tokens, budget, caps)


# ------------------------------------------------------------------------------------ template_bandit
@dataclass
class BanditState:
    """One request's template_bandit state: per arm (0 = full fanout, then the config's bandit arms) the
    rounds it shaped and their summed reward; `pending`: the (arm, budget) of the tree built last and not
    yet observed; its own seeded generator, so the sampler's stream is never touched."""

    seed: int
    algorithm: str = "template_bandit"
    pulls: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    pending: tuple[int, int] | None = None
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @classmethod
    def create(cls, params: Mapping[str, float], seed: int) -> "BanditState":
        return cls(seed=seed)

    def choose(self, arms: int, epsilon: float) -> int:
        """Epsilon-greedy: with no feedback yet, arm 0 (accum_logp); then with probability epsilon a uniform
        arm, else the best mean reward among the arms tried (ties: the lower arm)."""
        if len(self.pulls) != arms:
            self.pulls, self.rewards = [0] * arms, [0.0] * arms
        if not any(self.pulls):
            return 0
        if self.rng.random() < epsilon:
            return self.rng.randrange(arms)
        tried = [a for a in range(arms) if self.pulls[a]]
        return max(tried, key=lambda a: (self.rewards[a] / self.pulls[a], -a))

    def observe(self, tree: DraftTree, acceptance: Acceptance) -> None:
        if self.pending is None:
            return
        arm, budget = self.pending
        self.pending = None
        self.pulls[arm] += 1
        self.rewards[arm] += (acceptance.accepted + 1) / budget  # committed tokens (bonus incl.) per budget node


@register_tree("template_bandit", source="planned", context=True, state=BanditState.create,
               check=lambda p: check_range("epsilon", p["epsilon"], 0.0, 1.0), epsilon=0.1)
def template_bandit(root, logp, tokens, budget, width, epsilon: float,
                    context: TreeContext | None = None) -> DraftTree:
    """Planned by the paper, built here: each round the request's bandit picks a shape (`BanditState.choose`)
    — the full fanout (accum_logp) or a template of the config's `bandit_arms` — and `observe` credits it
    with (accepted + 1) / budget. No state, no feedback yet, or epsilon 0 before any other arm was tried:
    accum_logp."""
    state = context.state_of("template_bandit") if context else None
    if not isinstance(state, BanditState):
        return expand(root, logp, tokens, budget, full_caps(logp, width))
    arms = context.shapes.bandit_arms
    arm = state.choose(len(arms) + 1, epsilon)
    state.pending = (arm, budget)
    caps = full_caps(logp, width) if arm == 0 else expand_template(arms[arm - 1][1], len(logp), fanout(logp, width))
    return expand(root, logp, tokens, budget, caps)
