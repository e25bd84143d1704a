"""Copy inputs (head option copy_ngram): the longest earlier match of the context's suffix, and what followed it."""

from __future__ import annotations

import pytest

from jetflow.head.copy import NO_COPY, copy_block_inputs, copy_candidates


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 7, 4, 6, 7]
    # suffix (6, 7) occurred at 1..2 (followed by 8, 9, 1); the bare 7 at 6 is more recent but shorter
    assert copy_candidates(tokens, 9, 3, max_ngram=4) == ([8, 9, 1], 2)
    # capped at unigrams the most recent 7 wins
    assert copy_candidates(tokens, 9, 3, max_ngram=1) == ([4, 6, 7], 1)


def test_only_tokens_up_to_the_anchor_are_read_and_a_near_match_repeats_periodically():
    tokens = [3, 1, 2, 1, 2, 99, 99]
    # anchor at 4 (token 2): suffix (1, 2) last occurred ending at 2, two back: period 2 → 1, 2, 1, 2
    assert copy_candidates(tokens, 4, 4, max_ngram=3) == ([1, 2, 1, 2], 2)
    assert copy_candidates([4, 4], 1, 3, max_ngram=2) == ([4, 4, 4], 1)


def test_no_earlier_occurrence_gives_no_candidates():
    assert copy_candidates([1, 2, 3], 2, 2, max_ngram=3) == ([NO_COPY, NO_COPY], 0)


def test_block_inputs_leave_the_anchor_offset_empty():
    ids, lens = copy_block_inputs([5, 6, 7, 5, 6], [4, 2], block_size=3, max_ngram=3)
    assert ids.tolist() == [NO_COPY, 7, 5, NO_COPY, NO_COPY, NO_COPY]
    assert lens.tolist() == [0, 2, 2, 0, 0, 0]


@pytest.mark.parametrize("bad", [-1, 17])
def test_copy_ngram_out_of_range_is_refused(bad):
    from jetflow.errors import InvalidSettingError
    from jetflow.head.config import HeadConfig

    from jetflow.train.config import TrainConfig

    with pytest.raises(InvalidSettingError, match="copy_ngram"):
        HeadConfig(hidden_size=8, vocab_size=16, target_layer_ids=[0], mask_token_id=0, copy_ngram=bad)
    with pytest.raises(InvalidSettingError, match="copy_ngram"):  # before any data is generated
        TrainConfig(copy_ngram=bad)
