"""The target's sampling distribution (temperature, top-k, top-p) and `DecodeConfig` validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from jetflow.decode.sampling import DecodeConfig, target_probs
from jetflow.errors import InvalidSettingError
from jetflow.tree import TREE_BUILDERS, TreeSpec

FAST = settings(max_examples=60, deadline=None)
SUM_TOL = 1e-5

# any logits, near-ties included
logit_lists = st.lists(st.floats(-30.0, 30.0, width=32), min_size=1, max_size=40)
# exact ties common; distinct values 0.5 apart, so dividing by a temperature cannot merge them
tied_logit_lists = st.lists(st.integers(-6, 6), min_size=1, max_size=40).map(lambda xs: [x / 2 for x in xs])
# distinct logits at least 0.1 apart, so "the k largest" and "the argmax" are unambiguous
separated_logit_lists = st.lists(st.integers(-150, 150), min_size=1, max_size=40, unique=True).map(
    lambda xs: [x / 10 for x in xs]
)
temperatures = st.floats(0.05, 10.0)
# ordinary nucleus sizes; top_p below float32 resolution has its own test
top_ps = st.one_of(st.just(1.0), st.floats(1e-6, 1.0))


def softmax64(logits: list[float], temperature: float) -> np.ndarray:
    """The tempered softmax in float64, of the float32 logits that `torch.tensor(logits)` hands the code.

    Starting from the Python floats instead would charge the code for rounding its input: 13.8 and 13.9
    each move by up to 5e-7 in float32, which a temperature of 1/16 scales into a 1.3e-6 error in the
    probabilities, with nothing wrong in the code.
    """
    x = np.asarray(logits, dtype=np.float32).astype(np.float64) / temperature
    e = np.exp(x - x.max())
    return e / e.sum()


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs).flatten().tolist())


# ---------------------------------------------------------------------------------------------
# target_probs


@FAST
@given(logit_lists, temperatures, st.integers(0, 45), top_ps)
def test_target_probs_is_a_probability_distribution(logits, temperature, top_k, top_p):
    probs = target_probs(torch.tensor(logits), temperature, top_k, top_p)
    assert probs.shape == (len(logits),) and probs.dtype == torch.float32
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert probs.sum().item() == pytest.approx(1.0, abs=SUM_TOL)


@FAST
@given(separated_logit_lists, temperatures, st.integers(0, 45), top_ps)
def test_the_argmax_token_always_survives_and_stays_the_most_likely(logits, temperature, top_k, top_p):
    probs = target_probs(torch.tensor(logits), temperature, top_k, top_p)
    best = int(np.argmax(logits))
    assert probs[best] > 0
    assert probs[best] == probs.max()


@FAST
@given(separated_logit_lists, temperatures, st.integers(1, 45))
@example(logits=[13.8, 13.9], temperature=0.0625, top_k=2)  # a near-tie at a low temperature
def test_top_k_keeps_only_the_k_largest_logits_renormalised(logits, temperature, top_k):
    probs = target_probs(torch.tensor(logits), temperature, top_k=top_k)
    k = min(top_k, len(logits))
    largest = set(np.argsort(logits)[::-1][:k].tolist())
    assert len(support(probs)) <= k
    assert support(probs) <= largest
    # within the kept set the target's relative odds are untouched
    ref = np.zeros(len(logits))
    idx = sorted(largest)
    ref[idx] = softmax64([logits[i] for i in idx], temperature)
    np.testing.assert_allclose(probs.numpy(), ref, atol=1e-6)


@FAST
@given(tied_logit_lists, temperatures, st.integers(1, 45))
def test_top_k_with_ties_keeps_nothing_below_the_kth_largest_logit(logits, temperature, top_k):
    probs = target_probs(torch.tensor(logits), temperature, top_k=top_k)
    kth = sorted(logits, reverse=True)[min(top_k, len(logits)) - 1]
    assert all(logits[i] >= kth for i in support(probs))


@FAST
@given(separated_logit_lists, temperatures, st.floats(1e-6, 1.0, exclude_max=True))
def test_top_p_keeps_the_smallest_prefix_of_sorted_probs_reaching_top_p(logits, temperature, top_p):
    full = softmax64(logits, temperature)
    order = np.argsort(-full)
    cum = np.cumsum(full[order])
    # stay clear of float32 rounding at the boundary: no prefix mass within 1e-4 of top_p
    assume(np.all(np.abs(cum - top_p) > 1e-4))
    m = int(np.searchsorted(cum, top_p)) + 1  # the smallest m with cum[m-1] >= top_p
    kept = order[:m]
    probs = target_probs(torch.tensor(logits), temperature, top_p=top_p)
    assert support(probs) == set(kept.tolist())
    assert int(np.argmax(logits)) in support(probs)
    ref = np.zeros(len(logits))
    ref[kept] = full[kept] / full[kept].sum()
    np.testing.assert_allclose(probs.numpy(), ref, atol=1e-5)


@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.7500001, 4), (1.0, 4)])
def test_top_p_stops_at_the_first_prefix_whose_mass_reaches_top_p_exactly(top_p, kept):
    probs = target_probs(torch.zeros(4), 1.0, top_p=top_p)  # four tokens of exactly 0.25 each
    assert len(support(probs)) == kept
    assert probs[probs > 0].tolist() == pytest.approx([1.0 / kept] * kept)


@FAST
@given(separated_logit_lists, temperatures, st.floats(1e-9, 1e-3))
def test_a_tiny_top_p_keeps_only_the_top_token(logits, temperature, top_p):
    probs = target_probs(torch.tensor(logits), temperature, top_p=top_p)
    assert support(probs) == {int(np.argmax(logits))}
    assert probs.max().item() == 1.0


# a few fixed logit vectors: these two checks pin down edge cases, not random shapes
EDGE_LOGITS = [[3.5], [2.0, 1.0, 0.0], [12.0, -3.0, 7.5, 0.0]]


@pytest.mark.parametrize("logits", EDGE_LOGITS)
@pytest.mark.parametrize("top_p", [1e-30, 1e-45, 1e-46, 5e-324])
def test_any_top_p_decode_config_accepts_keeps_the_top_token(top_p, logits):
    """DecodeConfig accepts every top_p in (0, 1], including ones float32 rounds to 0."""
    DecodeConfig(temperature=1.0, top_p=top_p)
    probs = target_probs(torch.tensor(logits), 1.0, top_p=top_p)
    assert torch.isfinite(probs).all()
    assert support(probs) == {int(np.argmax(logits))}


@FAST
@given(logit_lists, temperatures)
def test_top_p_one_and_top_k_zero_leave_the_tempered_softmax_untouched(logits, temperature):
    probs = target_probs(torch.tensor(logits), temperature, top_k=0, top_p=1.0)
    np.testing.assert_allclose(probs.numpy(), softmax64(logits, temperature), atol=1e-6)


@FAST
@given(separated_logit_lists)
def test_lowering_the_temperature_approaches_the_argmax_one_hot(logits):
    best = int(np.argmax(logits))
    p_best = [target_probs(torch.tensor(logits), t)[best].item() for t in (10.0, 1.0, 0.3, 0.1, 0.03, 1e-3)]
    assert all(a <= b + 1e-6 for a, b in zip(p_best, p_best[1:]))  # monotone as T falls
    assert p_best[-1] == 1.0  # a 0.1 gap at T = 1e-3 is e^-100: one-hot in float32


@pytest.mark.parametrize("logits", EDGE_LOGITS)
@pytest.mark.parametrize("temperature", [1e-6, 1e-20, 1e-30, 1e-37, 1e-38, 1e-40])
def test_any_sampling_temperature_decode_config_accepts_gives_the_argmax_one_hot_when_tiny(temperature, logits):
    """DecodeConfig takes every temperature > 0 as sampling, so target_probs must stay a distribution."""
    assert not DecodeConfig(temperature=temperature).greedy
    probs = target_probs(torch.tensor(logits), temperature)
    assert torch.isfinite(probs).all()
    assert probs[int(np.argmax(logits))].item() == 1.0


# ---------------------------------------------------------------------------------------------
# DecodeConfig


bad_settings = st.one_of(
    st.tuples(st.just("budget"), st.integers(max_value=0)),
    st.tuples(st.just("budget"), st.integers(min_value=4097, max_value=10**6)),
    st.tuples(st.just("budget"), st.floats(1.0, 64.0)),  # not an integer
    st.tuples(st.just("width"), st.integers(max_value=0)),
    st.tuples(st.just("width"), st.floats(1.0, 8.0)),
    st.tuples(st.just("temperature"), st.floats(max_value=-1e-12) | st.just(math.nan)),
    st.tuples(st.just("top_p"), st.floats(max_value=0.0) | st.floats(min_value=1.0, exclude_min=True) | st.just(math.nan)),
    st.tuples(st.just("top_k"), st.integers(max_value=-1)),
    st.tuples(st.just("max_new_tokens"), st.integers(max_value=0)),
    st.tuples(st.just("algorithm"), st.text(max_size=12).filter(lambda s: s not in TREE_BUILDERS)),
)


@FAST
@given(bad_settings)
def test_decode_config_rejects_out_of_range_settings_with_invalid_setting_error(bad):
    name, value = bad
    message = "unknown tree algorithm" if name == "algorithm" else name
    with pytest.raises(InvalidSettingError, match=message):
        if name in ("algorithm", "budget", "width"):
            DecodeConfig(tree=TreeSpec(**{name: value}))  # a tree setting is validated by TreeSpec, once
        else:
            DecodeConfig(**{name: value})


@FAST
@given(
    budget=st.integers(1, 4096),
    width=st.integers(1, 64),
    algorithm=st.sampled_from(sorted(TREE_BUILDERS)),
    temperature=st.just(0.0) | st.floats(0.0, 100.0),
    top_p=top_ps,
    top_k=st.integers(0, 1000),
)
def test_decode_config_accepts_every_in_range_setting(budget, width, algorithm, temperature, top_p, top_k):
    cfg = DecodeConfig(tree=TreeSpec(algorithm, budget, width=width), temperature=temperature, top_p=top_p, top_k=top_k)
    assert cfg.greedy == (temperature == 0)


def test_invalid_setting_error_is_a_value_error():
    with pytest.raises(ValueError):
        DecodeConfig(tree=TreeSpec(budget=0))
