"""Logprobs are the target's own distribution at every committed token — drafted and accepted, or the bonus —
raw (before temperature, top-k, top-p): each equals what one causal forward of the whole final sequence gives
that position, however the tokens were decoded (plain, speculative with deep off-spine acceptance, sampled, on
the eager reference or the compiled step core). Prompt logprobs come in prefill chunks and equal the same forward.
Only requests that ask pay: the eager path reuses the acceptance walk's logits."""

from __future__ import annotations

import pytest
import torch

from jetflow.decode import DecodeConfig, Decoder
from jetflow.decode.config import MAX_TOP_LOGPROBS
from jetflow.engine import Engine, EngineConfig
from jetflow.errors import InvalidSettingError
from jetflow.head import DraftHead, HeadConfig
from jetflow.tree import TreeSpec
from tests.conftest import OracleEngine, random_prompts, tiny_target

TOL = 2e-5   # fp32: a tree verify, a batched plain step and one whole-sequence forward differ in summation order


def _whole_forward(target, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, V) log-probabilities of positions 1.. from one causal forward of `ids` (HF's own model)."""
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_matches_whole_forward(target, ids: list[int], entries, start: int, k: int) -> None:
    """`entries` (TokenLogprobs of ids[start + 1], ids[start + 2], ...) against the whole forward of `ids`."""
    logp = _whole_forward(target, ids)
    for i, e in enumerate(entries):
        row = logp[start + i]
        assert e.token == ids[start + i + 1]
        assert abs(e.logprob - row[e.token].item()) < TOL
        top = torch.topk(row, k)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert max((abs(v - w) for (_, v), w in zip(e.top, top.values.tolist())), default=0.0) < TOL


@pytest.mark.parametrize("graphs", ["off", "compile"])
def test_speculative_and_plain_decoding_give_the_logprobs_of_one_forward_of_the_whole_sequence(graphs, one_thread):
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=8))
    prompts = random_prompts(6, seed=3)
    plain_cfg = DecodeConfig(max_new_tokens=30, logprobs=3)
    reference = [Decoder(target).generate(p, plain_cfg) for p in prompts]
    compiled = {"graphs": graphs, "graphs_backend": "aot_eager"}
    plain = Engine(target, None, EngineConfig(max_slots=4, **compiled)).generate(prompts, plain_cfg)
    spec = OracleEngine(target, head, {tuple(p): p + g.token_ids for p, g in zip(prompts, reference)},
                        EngineConfig(max_slots=4, prefill_chunk=5, prefill_tokens=12, **compiled), seed=2
                        ).generate(prompts, DecodeConfig(tree=TreeSpec("accum_logp", 24, 4), max_new_tokens=30,
                                                         logprobs=3))
    assert sum(g.stats.tau for g in spec) / len(spec) > 2.0                    # deep acceptance happened
    assert any(r > 0 for g in spec for (_, r) in g.stats.accepted_ranks)     # and off the argmax spine
    for prompt, ref, p, s in zip(prompts, reference, plain, spec):
        assert s.token_ids == p.token_ids == ref.token_ids
        assert len(s.logprobs) == len(s.token_ids)
        for a, b, c in zip(s.logprobs, p.logprobs, ref.logprobs):
            assert a.token == b.token == c.token and abs(a.logprob - b.logprob) < TOL
            assert abs(a.logprob - c.logprob) < TOL and [t for t, _ in a.top] == [t for t, _ in c.top]
        _assert_matches_whole_forward(target, prompt + s.token_ids, s.logprobs, len(prompt) - 1, 3)


def test_sampled_tokens_get_the_targets_raw_logprobs_not_the_tempered_ones(one_thread):
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    prompts = random_prompts(4, seed=4)
    cfgs = [DecodeConfig(tree=TreeSpec("accum_logp", 8, 3), temperature=0.7, top_p=0.9, seed=s, max_new_tokens=20,
                         logprobs=2) for s in range(4)]
    reference = [Decoder(target, head).generate(p, c) for p, c in zip(prompts, cfgs)]
    out = Engine(target, head, EngineConfig(max_slots=2)).generate(prompts, cfgs)
    for prompt, ref, gen in zip(prompts, reference, out):
        assert gen.token_ids == ref.token_ids
        _assert_matches_whole_forward(target, prompt + gen.token_ids, gen.logprobs, len(prompt) - 1, 2)
        _assert_matches_whole_forward(target, prompt + ref.token_ids, ref.logprobs, len(prompt) - 1, 2)
    raw = _whole_forward(target, prompts[0] + out[0].token_ids)[len(prompts[0]) - 1]
    tempered = torch.log_softmax(raw / 0.7, dim=-1)[out[0].token_ids[0]].item()
    assert abs(out[0].logprobs[0].logprob - tempered) > 1e-3


def test_prompt_logprobs_come_in_prefill_chunks_and_equal_the_whole_prompts_forward(one_thread):
    target = tiny_target("qwen2")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    prompts = random_prompts(5, seed=6, lo=20, hi=60) + [[7]]                     # chunks of 5; a one-token prompt
    cfg = DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=1, logprobs=1, prompt_logprobs=4)
    out = Engine(target, head, EngineConfig(max_slots=3, prefill_chunk=5, prefill_tokens=12)).generate(prompts, cfg)
    reference = [Decoder(target).generate(p, cfg) for p in prompts]
    for prompt, gen, ref in zip(prompts, out, reference):
        assert len(gen.prompt_logprobs) == len(ref.prompt_logprobs) == len(prompt) - 1
        if len(prompt) > 1:
            _assert_matches_whole_forward(target, prompt, gen.prompt_logprobs, 0, 4)
            _assert_matches_whole_forward(target, prompt, ref.prompt_logprobs, 0, 4)
        assert len(gen.logprobs) == 1 and gen.logprobs[0].token == gen.token_ids[0]


def test_only_requests_that_ask_pay_and_the_eager_path_reuses_the_walks_logits(one_thread, monkeypatch):
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    prompts = random_prompts(4, seed=7)
    rows = []
    logits = target.logits
    monkeypatch.setattr(target, "logits", lambda h: rows.append(h.shape[0]) or logits(h))

    def lm_head_rows(asks: list[bool], graphs: str = "off", every_node: bool = False) -> tuple[int, list]:
        """LM-head rows computed for 4 requests (`asks`: which want logprobs): the eager LM head's, or with the step
        core its LM-head graph's beyond the every-node argmax of small steps (`every_node`) or by the walk."""
        cfgs = [DecodeConfig(tree=TreeSpec("accum_logp", 6, 3), max_new_tokens=12, logprobs=2 if a else None)
                for a in asks]
        engine = Engine(target, head, EngineConfig(max_slots=4, graphs=graphs, graphs_backend="aot_eager"))
        if engine.runner is not None:
            runner, graph_logits = engine.runner, engine.runner.logits
            runner.lm_head_all = 10**6 if every_node else 0
            every = runner.verify

            def verify(*args):  # the every-node argmax is the step's own: not counted
                runner.logits = graph_logits
                try:
                    return every(*args)
                finally:
                    runner.logits = counted

            def counted(h):
                rows.append(h.shape[0])
                return graph_logits(h)

            runner.verify, runner.logits = verify, counted
        rows.clear()
        out = engine.generate(prompts, cfgs)
        return sum(rows), out

    none, _ = lm_head_rows([False] * 4)
    every, out = lm_head_rows([True] * 4)
    assert every == none and all(len(g.logprobs) == len(g.token_ids) for g in out)   # no LM-head row added
    _, mixed = lm_head_rows([True, False, True, False])
    assert [g.logprobs is not None for g in mixed] == [True, False, True, False]
    # the step core with every node's argmax from the step: no further LM head, unless a row asks for logprobs
    assert lm_head_rows([False] * 4, "compile", every_node=True)[0] == 0
    paid, out = lm_head_rows([True, False, False, False], "compile", every_node=True)
    assert 0 < paid <= sum(g.stats.rounds + len(g.token_ids) for g in out[:1])
    # the step core leaving the LM head to the walk (large steps): the walk's logits serve, as on the eager path
    walk_none, _ = lm_head_rows([False] * 4, "compile")
    walk_every, out = lm_head_rows([True] * 4, "compile")
    assert walk_every == walk_none > 0 and all(len(g.logprobs) == len(g.token_ids) for g in out)


def test_logprob_counts_are_validated():
    assert DecodeConfig(logprobs=0).logprobs == 0 and DecodeConfig(prompt_logprobs=MAX_TOP_LOGPROBS)
    for bad in ({"logprobs": -1}, {"logprobs": MAX_TOP_LOGPROBS + 1}, {"prompt_logprobs": True},
                {"logprobs": 1.5}):
        with pytest.raises(InvalidSettingError):
            DecodeConfig(**bad)
