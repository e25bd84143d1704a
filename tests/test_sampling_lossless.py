"""At temperature > 0 the speculative decoder samples exactly the target's distribution: the empirical
distribution of the first two generated tokens over many seeded runs matches the exact AR
probabilities p(x1) p(x2 | x1) (Pearson chi-square), on a tiny model whose vocabulary is small
enough that draft trees hit often and every branch of the acceptance walk is exercised."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from jetflow.tree import TreeSpec
from jetflow.decode import DecodeConfig, Decoder, target_probs
from jetflow.head import DraftHead, HeadConfig
from tests.conftest import tiny_target

VOCAB = 8
RUNS = 2000
PROMPT = [1, 5, 3, 2, 6]
LOGIT_SCALE = 4.0


def _exact_two_token_distribution(target, temperature, top_k, top_p) -> dict[tuple, float]:
    eos = VOCAB - 1
    with torch.inference_mode():
        def next_probs(ids):
            out = target.forward(torch.tensor(ids), torch.arange(len(ids)), target.new_cache())
            return target_probs(target.logits(out.hidden[-1]), temperature, top_k, top_p)

        p1 = next_probs(PROMPT)
        dist = {}
        for x1 in range(VOCAB):
            if p1[x1] == 0:
                continue
            if x1 == eos:
                dist[(x1,)] = float(p1[x1])
                continue
            p2 = next_probs(PROMPT + [x1])
            for x2 in range(VOCAB):
                if p2[x2] > 0:
                    dist[(x1, x2)] = float(p1[x1] * p2[x2])
    return dist


def _chi_square_p(samples: Counter, exact: dict[tuple, float]) -> float:
    assert set(samples) <= set(exact), f"sampled impossible outcomes: {set(samples) - set(exact)}"
    n = sum(samples.values())
    big = sorted(k for k, p in exact.items() if p * n >= 5)
    observed = [samples[k] for k in big] + [n - sum(samples[k] for k in big)]
    expected = [exact[k] * n for k in big] + [n - sum(exact[k] * n for k in big)]
    if expected[-1] < 1e-6:
        assert observed[-1] == 0
        observed, expected = observed[:-1], expected[:-1]
    scale = sum(observed) / sum(expected)  # the exact probabilities are float32: renormalise
    expected = [e * scale for e in expected]
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("temperature,top_k,top_p,budget", [(1.0, 0, 1.0, 8), (0.7, 4, 0.9, 16)])
def test_speculative_sampling_matches_the_exact_target_distribution(temperature, top_k, top_p, budget):
    target = tiny_target("llama", vocab=VOCAB, seed=11, logit_scale=LOGIT_SCALE, layers=2)
    exact = _exact_two_token_distribution(target, temperature, top_k, top_p)
    assert sum(1 for p in exact.values() if p * RUNS >= 5) >= 8, "distribution too peaked to test"
    torch.manual_seed(0)
    decoder = Decoder(target, DraftHead(HeadConfig.for_target(target, block_size=4)))
    samples: Counter = Counter()
    accepted_drafts = 0
    for seed in range(RUNS):
        cfg = DecodeConfig(tree=TreeSpec(budget=budget, width=4), temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=2, seed=seed)
        result = decoder.generate(PROMPT, cfg)
        samples[tuple(result.token_ids)] += 1
        accepted_drafts += sum(d * c for d, c in result.stats.accepted_depths.items())
    assert accepted_drafts > RUNS // 10, "the tree should supply accepted tokens in many runs"
    assert _chi_square_p(samples, exact) > 1e-3


def test_ar_sampling_on_the_same_machinery_matches_the_exact_distribution():
    target = tiny_target("llama", vocab=VOCAB, seed=11, logit_scale=LOGIT_SCALE, layers=2)
    exact = _exact_two_token_distribution(target, 1.0, 0, 1.0)
    decoder = Decoder(target)
    samples = Counter(tuple(decoder.generate(PROMPT, DecodeConfig(temperature=1.0, max_new_tokens=2, seed=s)).token_ids)
                      for s in range(RUNS))
    assert _chi_square_p(samples, exact) > 1e-3


def test_a_biased_sampler_is_detected():
    """The test has teeth: always taking the draft's first matching branch skews the distribution."""
    target = tiny_target("llama", vocab=VOCAB, seed=11, logit_scale=LOGIT_SCALE, layers=2)
    exact = _exact_two_token_distribution(target, 1.0, 0, 1.0)
    skewed = Counter()
    rng = torch.Generator().manual_seed(0)
    keys, probs = zip(*exact.items())
    for _ in range(RUNS):  # sample from a tempered (T=1.3) version of the exact distribution
        p = torch.tensor(probs) ** (1 / 1.3)
        skewed[keys[int(torch.multinomial(p / p.sum(), 1, generator=rng))]] += 1
    assert _chi_square_p(skewed, exact) < 1e-3
