"""Draft vocabularies: the head drafts over a subset of target ids; train/infer still agree, losses
skip what the subset cannot express, decoding stays lossless, checkpoints keep the subset."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jetflow.tree import TreeSpec
from jetflow.data.vocab import build_draft_vocab, coverage
from jetflow.decode import DecodeConfig, Decoder
from jetflow.errors import InvalidSettingError
from jetflow.head import DraftHead, HeadConfig, load_head, save_head
from jetflow.train.losses import draft_loss
from tests.conftest import tiny_target


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("llama", vocab=128)


def _head(tiny, size: int = 48, seed: int = 0) -> DraftHead:
    cfg = HeadConfig.for_target(tiny, num_hidden_layers=1, block_size=5, target_layer_ids=[1, 3],
                                mask_token_id=0, draft_vocab_size=size)
    torch.manual_seed(seed)
    head = DraftHead(cfg)
    ids = torch.randperm(tiny.vocab_size, generator=torch.Generator().manual_seed(seed))[:size]
    head.set_draft_vocab(ids)
    return head.eval()


def test_draft_vocab_is_the_most_frequent_ids_plus_the_forced_ones_sorted():
    counts = torch.tensor([5, 0, 9, 1, 7, 3, 0, 2])
    vocab = build_draft_vocab(None, 3, always=[6], counts=counts)
    assert vocab.tolist() == [2, 4, 6]
    assert build_draft_vocab(None, 4, counts=counts, vocab_size=10).tolist() == [0, 2, 4, 5]
    with pytest.raises(InvalidSettingError, match="1..8"):
        build_draft_vocab(None, 9, counts=counts)
    assert coverage(vocab, [2, 2, 3, 6]) == 0.75


def test_target_ids_map_to_draft_indices_and_back_with_minus_one_outside(tiny):
    head = _head(tiny)
    inside = head.draft_vocab[[0, 7, 47]]
    assert head.to_draft_index(inside).tolist() == [0, 7, 47]
    assert torch.equal(head.to_target_ids(head.to_draft_index(inside)), inside)
    outside = torch.tensor([i for i in range(tiny.vocab_size) if i not in set(head.draft_vocab.tolist())][:5])
    assert head.to_draft_index(outside).tolist() == [-1] * 5


def test_output_logits_are_the_targets_logits_at_the_draft_ids(tiny):
    head = _head(tiny)
    h = torch.randn(3, 4, tiny.hidden_size)
    torch.testing.assert_close(head.output_logits(tiny, h), tiny.logits(h)[..., head.draft_vocab])


def test_losses_skip_labels_and_teacher_entries_outside_the_draft_vocab():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 10, requires_grad=True)
    labels = torch.tensor([[1, -1, 4], [-1, -1, -1]])
    # CE: only the three known labels count
    ce = draft_loss(logits, labels, None, None, "ce")
    logq = torch.log_softmax(logits, -1)
    expected = -(logq[0, 0, 1] + logq[0, 2, 4]) / 6  # mean over N=2 blocks x D=3 depths (uniform weights)
    torch.testing.assert_close(ce, expected)
    # fkl: an unknown teacher entry is dropped and the rest renormalised; an all-unknown row adds nothing
    t_ids = torch.tensor([[[1, -1]] * 3, [[-1, -1]] * 3])
    t_logp = torch.log(torch.tensor([[[0.6, 0.4]] * 3, [[0.5, 0.5]] * 3]))
    fkl = draft_loss(logits, labels, t_ids, t_logp, "fkl")
    torch.testing.assert_close(fkl, -(logq[0, :, 1]).sum() / 6)
    for kind in ("fkl", "rkl", "ce"):
        logits.grad = None
        draft_loss(logits, labels, t_ids, t_logp, kind).backward()
        assert torch.isfinite(logits.grad).all() and logits.grad[1].abs().sum() == 0


def test_a_draft_vocab_head_round_trips_through_its_checkpoint(tiny, tmp_path):
    head = _head(tiny, seed=3)
    loaded = load_head(save_head(head, tmp_path / "h"))
    assert loaded.config.draft_vocab_size == 48
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    for (k, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("budget", [4, 16])
def test_tree_decoding_with_a_draft_vocab_head_is_token_identical_to_greedy(tiny, budget):
    head = _head(tiny, size=64)
    prompt = torch.randint(1, 127, (12,), generator=torch.Generator().manual_seed(budget)).tolist()
    ar = Decoder(tiny).generate(prompt, DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=40))
    spec = Decoder(tiny, head).generate(prompt, DecodeConfig(tree=TreeSpec(budget=budget, width=3), max_new_tokens=40))
    assert spec.token_ids == ar.token_ids
    decoder = Decoder(tiny, head)
    with torch.inference_mode():
        state = decoder._prefill(prompt, DecodeConfig(tree=TreeSpec(budget=budget)))
        _, top_ids = decoder.draft(state, DecodeConfig(tree=TreeSpec(budget=budget, width=3)))
    drafted = {t for row in top_ids for t in row}
    assert drafted and drafted <= set(head.draft_vocab.tolist())  # drafts are target ids from the subset


def test_draft_vocab_size_is_validated(tiny):
    base = HeadConfig.for_target(tiny, target_layer_ids=[1], mask_token_id=0)
    with pytest.raises(InvalidSettingError, match="draft_vocab_size"):
        dataclasses.replace(base, draft_vocab_size=tiny.vocab_size + 1)
