"""The LM-head product in the fastest orientation per row count (jetflow.target.projection)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetflow.errors import InvalidSettingError
from jetflow.target.projection import ENV, FORMS, RowProjector, bucket, choices_file


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 70])
def test_every_form_is_the_same_product(rows):
    torch.manual_seed(rows)
    w, x = torch.randn(300, 48), torch.randn(rows, 48)
    p = RowProjector(w, store=False)
    for form in FORMS:
        assert torch.allclose(p.apply(x, form), F.linear(x, w), rtol=1e-5, atol=1e-5), form
    assert p(x[None]).shape == (1, rows, 300)  # leading dimensions kept


class _Clocked(RowProjector):
    """Each form costs a fixed time per call on a fake clock (`cost[form](rows)` seconds)."""

    def __init__(self, weight, cost, store=False):
        self.now = 0.0
        super().__init__(weight, timer=lambda: self.now, store=store)
        self.cost = cost

    def apply(self, flat, form):
        self.now += self.cost[form](flat.shape[0])
        return super().apply(flat, form)


def test_each_row_count_bucket_gets_its_fastest_form_timed_once(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    # "linear" wins at 1-3 rows, "transposed" at 4-8, "swapped" beyond (shapes of what one CPU host measured)
    cost = {"linear": lambda m: 1.0 * m, "transposed": lambda m: 2.5 + 0.2 * m, "swapped": lambda m: 5.0}
    p = _Clocked(torch.randn(64, 16), cost)
    assert p.form_for(1) == "linear" and p.form_for(2) == "linear"
    assert p.form_for(4) == "transposed" and p.form_for(8) == "transposed"
    assert p.form_for(12) == "swapped" and p.form_for(500) == "swapped"
    assert p.choices == {1: "linear", 2: "linear", 4: "transposed", 8: "transposed", 16: "swapped", 64: "swapped"}
    before = p.now
    assert p.form_for(4) == "transposed" and p.form_for(13) == "swapped" and p.now == before, "a bucket is timed once"
    assert [bucket(m) for m in (1, 2, 3, 8, 9, 16, 33, 64, 65, 4096)] == [1, 2, 3, 8, 16, 16, 64, 64, 64, 64]


def test_a_later_projector_on_the_host_reads_the_stored_choices_instead_of_timing(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    cost = {"linear": lambda m: 1.0 * m, "transposed": lambda m: 2.5 + 0.2 * m, "swapped": lambda m: 5.0}
    first = _Clocked(torch.randn(64, 16), cost, store=True)
    first.warm(8)
    assert first.now > 0 and first.choices == {1: "linear", 2: "linear", 3: "linear", 4: "transposed",
                                               5: "transposed", 6: "transposed", 7: "transposed", 8: "transposed"}
    assert choices_file().exists()
    later = _Clocked(torch.randn(64, 16), cost, store=True)  # the same shape and dtype, on the same host
    later.warm(8)
    assert later.now == 0 and later.choices == first.choices  # read, not timed
    other = _Clocked(torch.randn(32, 16), cost, store=True)  # another shape: its own choices
    other.warm(2)
    assert other.now > 0
    unstored = _Clocked(torch.randn(64, 16), cost)
    unstored.warm(1)
    assert unstored.now > 0


def test_a_corrupt_choices_file_means_timing_again(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    choices_file().parent.mkdir(parents=True)
    choices_file().write_text("{not json")
    p = _Clocked(torch.randn(64, 16), {f: (lambda m: 1.0) for f in FORMS}, store=True)
    p.warm(2)
    assert p.now > 0 and set(p.choices) == {1, 2}


def test_fixed_buckets_are_never_timed(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    ticks: list[int] = []
    p = RowProjector(torch.randn(64, 16), timer=lambda: float(len(ticks.append(1) or ticks)), fixed={1: "swapped"},
                     store=False)
    assert p.form_for(1) == "swapped" and not ticks
    assert p.form_for(2) in FORMS and ticks, "a bucket not fixed is timed"


def test_the_transposed_copy_is_dropped_when_no_bucket_uses_it(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    p = _Clocked(torch.randn(64, 16), {"linear": lambda m: 1.0, "transposed": lambda m: 2.0, "swapped": lambda m: 3.0})
    p.form_for(4)
    assert p._transposed is None


def test_a_pinned_form_wins_and_a_bad_one_is_refused(monkeypatch):
    p = RowProjector(torch.randn(64, 16), store=False)
    monkeypatch.setenv(ENV, "swapped")
    assert p.form_for(1) == "swapped" and not p.choices
    monkeypatch.setenv(ENV, "fastest")
    with pytest.raises(InvalidSettingError, match=f"{ENV}='fastest': use one of auto, linear, transposed, swapped"):
        p.form_for(1)


@pytest.mark.slow
def test_the_real_targets_logits_and_the_draft_vocab_logits_are_the_lm_head_product(smollm):
    from jetflow.head import DraftHead, HeadConfig

    torch.manual_seed(0)
    w = smollm.lm_head_weight.detach()
    for rows in (1, 2, 5):
        h = torch.randn(rows, w.shape[1])
        assert torch.allclose(smollm.logits(h), F.linear(h, w), rtol=1e-4, atol=1e-4)
    assert smollm._projector.choices[1] == "transposed", "AR's one-row product is never re-chosen"
    assert {1, 2, 5} <= set(smollm._projector.choices) and set(smollm._projector.choices.values()) <= set(FORMS)
    head = DraftHead(HeadConfig.for_target(smollm, draft_vocab_size=1024))
    head.set_draft_vocab(torch.arange(1000, 2024))
    h = torch.randn(3, 7, w.shape[1])
    assert torch.allclose(head.output_logits(smollm, h), h @ w[1000:2024].T, rtol=1e-4, atol=1e-4)
