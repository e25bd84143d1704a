"""The model-forward API across the transformers releases the extras allow (5.20 for vLLM 0.33.0, 5.24+ for
the rest): a cache we pass must be the cache the model fills. `make test-compat` runs this file on 5.20.2.

On 5.20-5.23 a `cache=` keyword is swallowed by **kwargs: the model builds a cache of its own, ours stays
empty, and every cached step after the first sees no past — wrong logits, no error. These tests fail that way."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn

from jetflow.data.batchgen import generate_batch
from jetflow.errors import UnknownModelError
from jetflow.target.model import cache_keyword
from tests.conftest import tiny_target

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.mark.parametrize("arch", ARCHS)
def test_a_cached_token_by_token_forward_equals_the_full_sequence_forward(arch):
    target = tiny_target(arch)
    ids = torch.randint(0, target.vocab_size - 1, (12,), generator=torch.Generator().manual_seed(0))
    full = target.logits(target.forward(ids, torch.arange(12), target.new_cache()).hidden)

    cache = target.new_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # 5.24 warns on the old keyword: we must not use it there
        steps = [target.logits(target.forward(ids[i : i + 1], torch.tensor([i]), cache).hidden)[0] for i in range(12)]

    assert cache.get_seq_length() == 12, "the forward did not fill the cache it was given"
    torch.testing.assert_close(torch.stack(steps), full, atol=1e-4, rtol=0)


def test_batched_generation_equals_greedy_decoding_without_a_cache():
    """`generate_batch` (left padding, its own buffered cache layers) gives each row the tokens a cache-free
    greedy loop gives its prompt alone."""
    target = tiny_target("llama", vocab=96)
    prompts = [[5, 9, 13], [7, 21, 33, 40, 2, 11], [60]]
    got = generate_batch(target, prompts, max_new_tokens=6, stop_ids=set(), pad_id=0)
    for prompt, row in zip(prompts, got):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(6):
                ids.append(int(target.model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert row == ids[len(prompt):]


def test_the_cache_keyword_is_the_one_the_installed_transformers_takes():
    from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel

    expected = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    assert cache_keyword(LlamaModel) == cache_keyword(LlamaForCausalLM) == expected


def test_a_forward_without_a_cache_parameter_is_a_clear_error():
    class NoCache(nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    with pytest.raises(UnknownModelError, match="neither cache= nor past_key_values="):
        cache_keyword(NoCache)
