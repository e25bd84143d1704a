"""The one definition of each metric (METHOD.md §4), used by the decoder, eval, training monitors,
sweeps and serving alike — and the one grammar of their MLflow keys, `<kind>/<dataset>/<method>/<setting>`,
where `<setting>` is `jetflow.tree.setting_key`: the tree's `TreeSpec.key` and the temperature
(`accum_logp-b32w7-t0`), or the temperature alone for the baselines (`t0`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from jetflow.errors import JetFlowError
from jetflow.tree import TreeSpec, setting_key


def tau_from_totals(tokens: int, forwards: int) -> float:
    """Acceptance length τ: tokens committed per target verify forward, bonus included (AR = 1.0);
    0.0 when nothing was verified."""
    return tokens / forwards if forwards else 0.0


def tau(committed_per_round: Sequence[int]) -> float:
    """τ from the tokens each round committed (its accepted drafts + the bonus)."""
    return tau_from_totals(sum(committed_per_round), len(committed_per_round))


def speedup(baseline_seconds_per_token: float, seconds_per_token: float) -> float:
    """Baseline time per token ÷ our time per token (same target, hardware, prompts and run)."""
    return baseline_seconds_per_token / seconds_per_token if seconds_per_token > 0 else float("nan")


def per_depth_acceptance(accepted_depth_hist: Mapping[int, int], max_depth: int) -> list[float]:
    """Fraction of rounds whose accepted path reaches depth d, for d = 1..max_depth.

    accepted_depth_hist[d] = number of rounds that accepted exactly d draft tokens.
    """
    rounds = sum(accepted_depth_hist.values())
    if rounds == 0:
        return [0.0] * max_depth
    return [sum(c for k, c in accepted_depth_hist.items() if k >= d) / rounds for d in range(1, max_depth + 1)]


def simulated_tau_chain(hits) -> float:
    """τ of a chain walk simulated on blocks: hits (N, D) bool tensor, the draft's argmax equal to the
    target's token at each depth; a block commits its leading run of hits plus the bonus."""
    if hits.numel() == 0:
        return math.nan
    return tau([a + 1 for a in hits.long().cumprod(dim=1).sum(dim=1).tolist()])


def simulated_tau_tree(accepted_per_block: Sequence[int]) -> float:
    """τ of a tree walk simulated on blocks, from the drafts it accepted in each (bonus added here)."""
    return tau([a + 1 for a in accepted_per_block])


def per_rank_acceptance(accepted_ranks: Mapping[tuple[int, int], int], rounds: int) -> dict[tuple[int, int], float]:
    """Fraction of rounds whose accepted path takes the rank-r draft token at depth d (rank 0 = the
    head's top-1 at that depth): {(d, r): fraction}, the input of profile-guided tree shaping.

    accepted_ranks[(d, r)] = accepted nodes at depth d with rank r, over `rounds` verify rounds.
    """
    if rounds <= 0:
        return {}
    return {key: count / rounds for key, count in sorted(accepted_ranks.items())}


# ---------------------------------------------------------------------------------- metric keys
# Our decoder with a head, by the head's attention inside the block; the others are baselines measured on
# the same prompts. A row's method is one or the other: nothing else decides what is "the head's".
HEAD_METHODS = ("causal", "bidirectional")
BASELINE_METHODS = ("ar", "hf_generate", "hf_prompt_lookup", "vllm_ar", "vllm_dflash")
_METRIC_KEY = re.compile(
    r"^(?P<kind>[^/]+)/(?P<dataset>.+)/(?P<method>[^/]+)/(?:(?P<tree>[^/]+)-)?t(?P<temp>\d+(?:\.\d+)?)$")


def head_method(causal: bool) -> str:
    return HEAD_METHODS[0] if causal else HEAD_METHODS[1]


def metric_key(kind: str, dataset: str, method: str, tree: TreeSpec | None, temperature: float) -> str:
    """`tau/mtbench/causal/accum_logp-b32w7-t0`, `speedup_vs_ar/humaneval/ar/t0`."""
    return f"{kind}/{dataset}/{method}/{setting_key(tree, temperature)}"


@dataclass(frozen=True)
class MetricKey:
    kind: str            # tau, speedup_vs_ar, speedup_vs_hf, e2e_speedup, tokens_per_s, accept_by_depth, ...
    dataset: str
    method: str
    tree: TreeSpec | None
    temperature: float

    @property
    def setting(self) -> str:
        return setting_key(self.tree, self.temperature)


def parse_metric_key(key: str) -> MetricKey | None:
    """`tau/mtbench/causal/accum_logp-b32w7-t0` → MetricKey; None for flat keys such as `lossless`.
    The dataset may itself contain slashes (everything between the first and the last two parts)."""
    m = _METRIC_KEY.match(key)
    if m is None:
        return None
    try:
        tree = TreeSpec.from_key(m["tree"]) if m["tree"] else None
    except JetFlowError:  # an algorithm this install does not know: not one of our keys
        return None
    return MetricKey(m["kind"], m["dataset"], m["method"], tree, float(m["temp"]))
