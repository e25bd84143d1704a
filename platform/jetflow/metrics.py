"""The one definition of each metric (METHOD.md §4), used by the decoder, eval, training monitors,
sweeps and serving alike."""

from __future__ import annotations

from typing import Mapping, Sequence


def tau(committed_per_round: Sequence[int]) -> float:
    """Acceptance length: tokens committed per target verify forward, bonus included (AR = 1.0)."""
    return sum(committed_per_round) / len(committed_per_round) if committed_per_round else 0.0


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


def simulated_tau_chain(acceptance_per_depth: Sequence[float]) -> float:
    """Chain τ from per-depth conditional top-1 agreement acc_k: 1 (bonus) + Σ_k Π_{i≤k} acc_i."""
    total, prod = 1.0, 1.0
    for acc in acceptance_per_depth:
        prod *= acc
        total += prod
    return total


def per_rank_acceptance(accepted_ranks: Mapping[tuple[int, int], int], rounds: int) -> dict[tuple[int, int], float]:
    """Fraction of rounds whose accepted path takes the rank-r draft token at depth d (rank 0 = the
    head's top-1 at that depth): {(d, r): fraction}, the input of profile-guided tree shaping.

    accepted_ranks[(d, r)] = accepted nodes at depth d with rank r, over `rounds` verify rounds.
    """
    if rounds <= 0:
        return {}
    return {key: count / rounds for key, count in sorted(accepted_ranks.items())}
