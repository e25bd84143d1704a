"""The batched engine against the reference `Decoder`: for any order of requests joining, finishing and
being cancelled, every request's tokens equal what the reference decoder gives that prompt alone (greedy:
greedy AR; sampling: the same seed, the same tokens). Tiny random targets for the mechanics, the real
bundled SmolLM2 for the property test; a noisy-oracle drafter forces deep, off-spine acceptance so KV
compaction and multi-token commits are exercised."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jetflow.decode import DecodeConfig, Decoder
from jetflow.engine import Engine, EngineConfig, RequestCancelledError, RequestTimeoutError
from jetflow.engine.cost import StepCostCurve
from jetflow.engine.kv import GROW
from jetflow.errors import PromptTooLongError
from jetflow.head import DraftHead, HeadConfig
from jetflow.tree import TreeSpec
from tests.conftest import OracleEngine, assert_greedy, random_prompts, seeded_sampling_case, tiny_target


CONFIGS = [DecodeConfig(tree=TreeSpec(a, b, 3), max_new_tokens=m) for a, b, m in (
    ("accum_logp", 8, 20), ("chain", 4, 9), ("top2gap", 16, 30), ("accum_logp", 1, 15), ("chain", 6, 25),
    ("accum_logp", 12, 5), ("accum_logp", 3, 18))]


# ------------------------------------------------------------------------------ tiny targets
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_tokens_equal_the_reference_decoder_for_mixed_trees_under_slot_pressure(arch, one_thread):
    target = tiny_target(arch)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6, copy_ngram=2, anchor_shortcut=True,
                                           depth_embedding=True))
    prompts = random_prompts(len(CONFIGS), seed=1)
    reference = [Decoder(target, head).generate(p, c).token_ids for p, c in zip(prompts, CONFIGS)]
    engine = Engine(target, head, EngineConfig(max_slots=3, prefill_chunk=7, prefill_tokens=16))
    assert [g.token_ids for g in engine.generate(prompts, CONFIGS)] == reference


@pytest.mark.parametrize("causal", [True, False])
def test_oracle_drafts_accepted_deep_and_off_spine_still_give_greedy_ar(causal, one_thread):
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=8, causal=causal))
    prompts = random_prompts(6, seed=3)
    cfg = DecodeConfig(tree=TreeSpec("accum_logp", 24, 4), max_new_tokens=40)
    ar = [Decoder(target).generate(p, DecodeConfig(max_new_tokens=40)).token_ids for p in prompts]
    engine = OracleEngine(target, head, {tuple(p): p + a for p, a in zip(prompts, ar)},
                          EngineConfig(max_slots=4, prefill_chunk=5, prefill_tokens=12), seed=2)
    out = engine.generate(prompts, cfg)
    assert [g.token_ids for g in out] == ar
    assert sum(g.stats.tau for g in out) / len(out) > 2.0          # deep acceptance happened
    assert any(r > 0 for g in out for (_, r) in g.stats.accepted_ranks)  # and off the argmax spine


def test_sampling_with_a_seed_gives_the_reference_decoders_tokens(one_thread):
    target, head, prompts, cfgs, reference = seeded_sampling_case()
    assert [g.token_ids for g in Engine(target, head, EngineConfig(max_slots=2)).generate(prompts, cfgs)] == reference


def test_an_engine_without_a_head_is_batched_plain_decoding(one_thread):
    target = tiny_target("qwen2")
    prompts = random_prompts(5, seed=5)
    ar = [Decoder(target).generate(p, DecodeConfig(max_new_tokens=12)).token_ids for p in prompts]
    engine = Engine(target, None, EngineConfig(max_slots=5))
    assert [g.token_ids for g in engine.generate(prompts, DecodeConfig(max_new_tokens=12))] == ar
    assert engine.kv.capacity == GROW and not engine.has_work()


def test_slot_buffers_grow_keeping_every_rows_positions_and_let_the_old_buffers_go():
    """Growing copies each layer's rows into a larger buffer, and nothing keeps an old buffer alive: not
    the store, not the views the cache's layers handed to the last forward (a replica's peak memory would
    hold the old and the new buffers of every layer at once)."""
    import weakref

    from jetflow.engine.kv import SlotKV, TargetKV

    store = SlotKV(num_layers=3, slots=2, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                   max_len=4 * GROW)
    cache = TargetKV(store)
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])
    for layer in range(3):
        k = torch.arange(12, dtype=torch.float32).reshape(2, 1, 3, 2) + 100 * layer
        cache.plan(0, 2, positions, 8).layers[layer].update(k, -k)
    before = [t.clone() for t in store.keys + store.values]
    old = [weakref.ref(t) for t in store.keys + store.values]
    cache.plan(0, 2, positions + GROW, GROW + 8)
    assert store.capacity == 2 * GROW and all(r() is None for r in old)
    for was, now in zip(before, store.keys + store.values):
        assert now.shape == (2, 1, 2 * GROW, 2)
        assert torch.equal(now[:, :, :GROW], was) and not now[:, :, GROW:].any()
    store.release()
    assert store.capacity == GROW and all(t.shape[2] == GROW for t in store.keys + store.values)


def test_an_idle_engine_gives_back_buffers_a_long_prompt_grew(one_thread):
    from jetflow.engine.kv import RELEASE_ABOVE

    target = tiny_target("llama", max_positions=2048)
    engine = Engine(target, None, EngineConfig(max_slots=2))
    long = [(7 * i + 1) % 120 + 1 for i in range(RELEASE_ABOVE + 100)]
    engine.add(long, DecodeConfig(max_new_tokens=2))
    grown = 0
    while engine.has_work():
        engine.step()
        grown = max(grown, engine.kv.capacity) if engine.has_work() else grown
    assert grown > RELEASE_ABOVE and engine.kv.capacity == GROW


def test_cancelled_and_late_requests_leave_with_an_error_and_free_their_slot(one_thread):
    target = tiny_target("llama")
    engine = Engine(target, None, EngineConfig(max_slots=1))
    cfg = DecodeConfig(max_new_tokens=50)
    first = engine.add([5, 6, 7], cfg)
    queued = engine.add([8, 9], cfg)
    engine.step()
    assert engine.active == 1 and engine.queued == 1
    engine.cancel(first)
    events = engine.step()                      # the cancelled slot is free within one step
    assert [(e.request_id, type(e.error)) for e in events if e.error] == [(first, RequestCancelledError)]
    assert engine.running and engine.running[0].id == queued
    late = engine.add([1, 2], cfg, deadline=0.0)  # already past its deadline
    events = engine.step()
    assert [(e.request_id, type(e.error)) for e in events if e.error] == [(late, RequestTimeoutError)]
    with pytest.raises(PromptTooLongError, match="positions"):
        engine.add(list(range(500)), DecodeConfig(max_new_tokens=100))


def test_cached_head_forward_equals_the_full_forward():
    target = tiny_target("qwen3")
    for causal in (True, False):
        torch.manual_seed(1)
        head = DraftHead(HeadConfig.for_target(target, block_size=6, causal=causal, anchor_shortcut=True,
                                               depth_embedding=True, tap_norm=True)).eval()
        for p in head.parameters():  # no identity layers: every weight matters
            p.data.add_(torch.randn_like(p) * 0.05)
        past, block = 11, head.config.block_size
        ctx = torch.randn(1, past, target.hidden_size)
        emb = torch.randn(1, block, target.hidden_size)
        ctx_pos, blk_pos = torch.arange(past)[None], torch.arange(past, past + block)[None]
        full = head(ctx, emb, ctx_pos, blk_pos)
        kv = [(torch.zeros(1, k.shape[1], past + block, k.shape[-1]), torch.zeros(1, k.shape[1], past + block, k.shape[-1]))
              for k, _ in head.context_kv(ctx, ctx_pos)]
        for (k, v), (kk, vv) in zip(kv, head.context_kv(ctx, ctx_pos)):
            k[:, :, :past], v[:, :, :past] = kk, vv
        mask = head.block_mask(past, block)
        cached = head.forward_cached(emb, blk_pos, kv, blk_pos, mask, shortcut=ctx[:, -1])
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ the auto policy
def _curve(step_ms) -> StepCostCurve:
    batch, nodes = (1, 2, 4, 8), (1, 4, 8)
    return StepCostCurve("test", 100, batch, nodes, tuple(tuple(step_ms(b, n) for n in nodes) for b in batch))


def test_step_cost_curve_interpolates_between_measured_points():
    curve = _curve(lambda b, n: 10.0 * b + n)
    assert curve.step_ms(2, 4) == 24.0 and curve.step_ms(3, 4) == pytest.approx(34.0)
    assert curve.step_ms(16, 1) == pytest.approx(161.0)          # the last segment, extended
    assert curve.speedup(1, 8, 2.0) == pytest.approx(2 * 11 / 18)
    assert StepCostCurve.from_dict(curve.to_dict()) == curve


def test_a_tree_smaller_than_the_smallest_measured_one_is_not_interpolated_from_plain():
    """A speculative step pays the draft whatever its tree: T(B, 2) is the smallest measured tree's time less the
    next segment's verify slope (never below plain), not a line from plain (which made b2 look 35 % cheaper)."""
    # plain 100 ms; 4 nodes 200 (the draft and a 4-node verify), 8 nodes 240: 10 ms a node
    curve = StepCostCurve("test", 100, (1, 8), (1, 4, 8), ((100.0, 200.0, 240.0), (300.0, 500.0, 580.0)))
    assert curve.step_ms(1, 2) == pytest.approx(180.0)              # linear from plain would say 133
    assert curve.step_ms(8, 3) == pytest.approx(480.0)              # 500 - 1 x 20
    assert curve.step_ms(4.5, 2) == pytest.approx((180.0 + 460.0) / 2)  # rows still bilinear
    assert (curve.step_ms(1, 1), curve.step_ms(1, 4), curve.step_ms(1, 6)) == (100.0, 200.0, 220.0)
    steep = StepCostCurve("test", 100, (1,), (1, 4, 8), ((100.0, 120.0, 400.0),))
    assert steep.step_ms(1, 2) == 100.0                             # extrapolated below plain: plain's time
    one = StepCostCurve("test", 100, (1,), (1, 4), ((100.0, 200.0),))
    assert one.step_ms(1, 2) == 200.0                               # one tree size measured: its time
    assert one.step_ms(1, 8) == pytest.approx(100.0 + 100.0 * 7 / 3)  # above it: the last segment, extended
    # what the load-aware policy weighs at 8 rows with τ(2) 1.43: plain's 8 tokens a step beat b2's 11.4
    assert 8 / curve.step_ms(8, 1) > 8 * 1.43 / curve.step_ms(8, 2)


def test_a_kept_step_curve_that_measured_more_serves_a_smaller_ask_and_nothing_else(monkeypatch, tmp_path):
    """cached_step_curve reads a kept curve of the same target, head shape, threads and step mode that measured
    every batch and tree size asked for: the budget sweep's curve (trees to b64) serves its champion's replica
    (b4). More rows than measured, or another step mode, are measured (here: the measurement recorded)."""
    from jetflow.engine import cost

    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    torch.manual_seed(0)
    target = tiny_target("llama")
    head = DraftHead(HeadConfig.for_target(target, block_size=4))
    asked = []

    def measured(target, head, batch, nodes, context, graphs="off"):
        asked.append((tuple(batch), tuple(nodes), graphs))
        return StepCostCurve("test", context, tuple(batch), tuple(nodes),
                             tuple(tuple(10.0 * b + n for n in nodes) for b in batch))

    monkeypatch.setattr(cost, "measure_step_curve", measured)
    sweep = cost.cached_step_curve(target, head, max_slots=8, max_budget=64)
    assert cost.cached_step_curve(target, head, max_slots=8, max_budget=4) == sweep   # read, not measured
    assert cost.cached_step_curve(target, head, max_slots=4, max_budget=8) == sweep
    cost.cached_step_curve(target, head, max_slots=16, max_budget=4)
    cost.cached_step_curve(target, head, max_slots=8, max_budget=4, graphs="compile")
    assert asked == [((1, 2, 4, 8), (1, 2, 4, 8, 16, 32, 64), "off"), ((1, 2, 4, 8, 16), (1, 2, 4), "off"),
                     ((1, 2, 4, 8), (1, 2, 4), "compile")]
    assert len(list((tmp_path / "cost").glob("steps-*.json"))) == 3


def test_a_long_prompt_is_fed_in_small_chunks_while_short_ones_beside_it_go_in_full(one_thread):
    """While requests run, a prompt longer than prefill_tokens is fed in chunks whose forward costs at most a
    decode step (here the curve prices every chunk above it: 8 tokens); a short prompt admitted with it is not
    held to that chunk (it was: one 8-token chunk a step for everyone, and 8 clients got half a plain replica)."""
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=4))
    dear = StepCostCurve("test", 100, (1,), (1, 4), ((1e6, 1e6),))
    engine = Engine(target, head, EngineConfig(max_slots=4, prefill_chunk=32, prefill_tokens=64, policy="auto",
                                               cost_curve=dear))
    engine.add(random_prompts(1, seed=3)[0][:10], DecodeConfig(max_new_tokens=40))
    while not engine.running:
        engine.step()
    long_id = engine.add([5] * 200, DecodeConfig(max_new_tokens=4))
    short_id = engine.add([7] * 20, DecodeConfig(max_new_tokens=4))
    engine.step()
    fed = {s.id: s.prefilled for s in engine.prefilling}
    assert fed == {long_id: 8}
    assert short_id in {s.id for s in engine.running}   # its 20 tokens in the same step: decoding already


def test_the_step_curve_alternates_batch_and_tree_sizes_step_by_step(monkeypatch):
    """measure_step_curve: per batch size one set of rows, prefilled once (three times at one row, for the
    prefill cost) before any step is timed; then rounds of one decode step per (batch size, tree size), the
    batch sizes in turn and the tree sizes in turn within each, both orders reversed every other round; each
    step verifies B rows x N nodes."""
    from jetflow.engine import cost

    torch.manual_seed(0)
    target = tiny_target("llama")
    head = DraftHead(HeadConfig.for_target(target, block_size=4))
    steps, engines = [], []
    step = Engine.step

    def recording(engine):
        events = step(engine)
        if engine not in engines:
            engines.append(engine)
        t = engine.times
        steps.append((engines.index(engine), "prefill" if t.prefill else "", t.rows, t.nodes))
        return events

    monkeypatch.setattr(Engine, "step", recording)
    curve = cost.measure_step_curve(target, head, batch=(1, 2), nodes=(1, 4), context=16, repeats=2)
    assert curve.batch == (1, 2) and curve.nodes == (1, 4) and curve.prefill_ms_per_token > 0
    assert all(ms > 0 for row in curve.ms for ms in row)
    # a prefill step decodes its new rows too; the timed rounds: warm-up (b1: 1, 4; b2: 1, 4), then reversed
    # (b2: 4, 1; b1: 4, 1), then forward again
    assert steps == [(0, "prefill", 1, 1)] * 3 + [(1, "prefill", 2, 1)] + \
        [(0, "", 1, 1), (0, "", 1, 4), (1, "", 2, 1), (1, "", 2, 4)] + \
        [(1, "", 2, 4), (1, "", 2, 1), (0, "", 1, 4), (0, "", 1, 1)] + \
        [(0, "", 1, 1), (0, "", 1, 4), (1, "", 2, 1), (1, "", 2, 4)] + [(0, "", 0, 0), (1, "", 0, 0)]


def test_the_serving_prediction_counts_each_requests_prefill_in_both_modes():
    """Per request: new_tokens / τ steps of B rows (its share: T / B each) plus its prompt's prefill — the same
    with or without speculation — so a costlier prefill pulls the predicted speedup toward 1."""
    steps = _curve(lambda b, n: 10.0 * b + n)
    assert steps.serving_speedup(4, 8, 2.0, 150, 64) == pytest.approx(steps.speedup(4, 8, 2.0))  # no prefill known
    curve = StepCostCurve.from_dict({**steps.to_dict(), "prefill_ms_per_token": 0.5})
    plain, spec = 64 * 41 / 4 + 150 * 0.5, 64 / 2.0 * 48 / 4 + 150 * 0.5
    assert curve.serving_speedup(4, 8, 2.0, 150, 64) == pytest.approx(plain / spec)
    assert 1 < curve.serving_speedup(4, 8, 2.0, 150, 64) < steps.speedup(4, 8, 2.0)
    assert StepCostCurve.from_dict(curve.to_dict()) == curve


def test_auto_policy_speculates_alone_goes_plain_under_load_and_waits_before_switching(one_thread):
    from jetflow.engine.auto import AutoPolicy

    target = tiny_target("llama")
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    # a device where one row verifies 8 nodes for 1.25x one token, but 8 rows x 8 nodes cost 4x plain
    curve = _curve(lambda b, n: (10.0 if n == 1 else 12.5) * (1 + (b * n - 1) / 16 if b * n > 8 else 1))
    engine = Engine(target, head, EngineConfig(max_slots=8, policy="auto", cost_curve=curve, tau_prior={4: 1.6, 8: 2.0}))
    policy: AutoPolicy = engine.policy
    engine.add([1, 2, 3], DecodeConfig(tree=TreeSpec(budget=8, width=3), max_new_tokens=200))
    engine.step()
    assert policy.last_choice > 1                                # alone: speculating pays
    for k in range(7):
        engine.add([4 + k, 5, 6], DecodeConfig(tree=TreeSpec(budget=8, width=3), max_new_tokens=200))
    engine.step()
    assert policy.last_choice > 1                                # hysteresis: not at the first step under load
    for _ in range(policy.patience + 1):
        engine.step()
    assert policy.last_choice == 1                               # eight rows: plain decoding wins


def _auto(curve, tau_prior=None):
    target = tiny_target("llama")
    head = DraftHead(HeadConfig.for_target(target, block_size=8))
    return Engine(target, head, EngineConfig(max_slots=8, policy="auto", cost_curve=curve, tau_prior=tau_prior)).policy


def test_auto_policy_caps_an_untried_budgets_estimate_by_a_larger_budgets_measured_one():
    """A budget not yet measured takes its prior (else 2.0), but never more than what is known of a larger
    budget (measured, else its prior): a larger tree of the same rule holds the smaller one."""
    from types import SimpleNamespace

    policy = _auto(_curve(lambda b, n: 10.0 * b + n), tau_prior={4: 1.2, 8: 1.9})
    row = SimpleNamespace(id="a")
    assert (policy.tau(row, 4), policy.tau(row, 8), policy.tau(row, 16)) == (1.2, 1.9, 2.0)
    assert policy.tau(row, 2) == 1.2 and policy.tau(row, 6) == 1.9   # no prior: capped by a larger one's
    policy.observe([row], [TreeSpec(budget=16, width=3)], [1.5], None)
    assert policy.tau(row, 16) == 1.5                          # measured: taken as it is
    assert (policy.tau(row, 4), policy.tau(row, 8)) == (1.2, 1.5)  # 8's prior capped by 16's measurement
    policy.observe([row], [TreeSpec(budget=8, width=3)], [1.7], None)
    assert policy.tau(row, 8) == 1.7                           # once measured, its own (noisy) mean wins
    assert policy.tau(SimpleNamespace(id="b"), 4) == 1.2       # another row: the engine-wide estimates


def test_auto_policy_explores_each_budget_in_turn_and_less_often_when_plain_is_far_ahead():
    """While plain, exploration steps rotate over the candidate budgets, at least `explore_every` plain steps
    apart; the further plain is predicted ahead, the longer the interval (capped at 8x)."""
    from types import SimpleNamespace

    rows = [SimpleNamespace(id=str(i), cfg=DecodeConfig(tree=TreeSpec(budget=8, width=3))) for i in range(8)]

    def explorations(cost_of_trees: float) -> list[tuple[int, int]]:
        policy = _auto(_curve(lambda b, n: 10.0 * b * (1 if n == 1 else cost_of_trees)))
        seen = []
        for step in range(1200):
            trees = policy.choose(rows)
            if trees[0].budget > 1 and step > 2 * policy.patience:  # past the first steps' optimistic prior
                seen.append((step, trees[0].budget))
            policy.observe(rows, trees, [1.5 if t.budget > 1 else 1 for t in trees], None)
        return seen

    near, far = explorations(1.6), explorations(4.0)         # plain ahead 1.07x, 2.7x (τ 1.5)
    assert [b for _, b in near[:4]] == [4, 8, 4, 8] and [b for _, b in far[:2]] == [4, 8]
    gaps = [b - a for (a, _), (b, _) in zip(near, near[1:])]
    assert all(g >= 64 for g in gaps) and max(gaps) < 2 * 64
    far_gaps = [b - a for (a, _), (b, _) in zip(far, far[1:])]
    assert far_gaps and all(4 * 64 <= g <= 8 * 64 + 1 for g in far_gaps)


# ------------------------------------------------------------------------------ the real model
NEW = 24
REAL_CONFIGS = {
    "tree16": DecodeConfig(tree=TreeSpec("accum_logp", 16, 7), max_new_tokens=NEW),
    "chain8": DecodeConfig(tree=TreeSpec("chain", 8), max_new_tokens=NEW),
    "plain": DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=NEW),
    "sampled": DecodeConfig(tree=TreeSpec("accum_logp", 8, 7), temperature=0.9, top_k=40, seed=11, max_new_tokens=NEW),
}


@pytest.fixture(scope="module")
def real(smollm):
    from jetflow.data import load_prompts
    from jetflow.decode import encode_prompt

    items = load_prompts("mtbench", limit=3) + load_prompts("humaneval", limit=3)
    prompts = [encode_prompt(smollm.tokenizer, it.chat) for it in items]
    ar = {tuple(p): Decoder(smollm).generate(p, DecodeConfig(max_new_tokens=NEW)).token_ids for p in prompts}
    torch.manual_seed(7)
    head = DraftHead(HeadConfig.for_target(smollm, block_size=8, copy_ngram=3, anchor_shortcut=True,
                                           depth_embedding=True, tap_norm=True))
    return prompts, ar, head, {}


@pytest.mark.slow
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "step", "cancel"]), st.integers(0, 5),
                              st.sampled_from(sorted(REAL_CONFIGS))), min_size=3, max_size=14))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_schedule_of_joins_finishes_and_cancels_gives_each_request_its_reference_tokens(smollm, real, ops):
    """Random arrival / step / cancel schedules on the real SmolLM2, three slots, chunked prefill, trees of
    several kinds and sampling side by side: each request that is not cancelled ends with exactly the tokens
    the reference decoder gives its prompt alone; each cancelled one ends with a cancel event."""
    prompts, ar, head, sampled_refs = real
    engine = OracleEngine(smollm, head, {tuple(p): p + ar[tuple(p)] for p in prompts},
                          EngineConfig(max_slots=3, prefill_chunk=24, prefill_tokens=48), seed=len(ops))
    meta, cancelled, ended = {}, set(), {}

    def run(events):
        for e in events:
            assert e.request_id not in ended, "a request ended twice"
            if e.finished:
                ended[e.request_id] = e

    for op, k, name in ops:
        if op == "add":
            meta[engine.add(prompts[k], REAL_CONFIGS[name])] = (k, name)
        elif op == "cancel" and meta:
            rid = sorted(meta)[k % len(meta)]
            if rid not in ended:
                engine.cancel(rid)
                cancelled.add(rid)
        else:
            run(engine.step())
    while engine.has_work():
        run(engine.step())
    assert set(ended) == set(meta)
    for rid, (k, name) in meta.items():
        event = ended[rid]
        if rid in cancelled:
            assert isinstance(event.error, RequestCancelledError) or event.error is None  # it may have finished first
            continue
        assert event.error is None
        cfg, ids = REAL_CONFIGS[name], prompts[k]
        if cfg.greedy:
            assert_greedy(smollm, ids, event.generation.token_ids, ar[tuple(ids)])
        else:
            key = (k, name)
            if key not in sampled_refs:
                sampled_refs[key] = Decoder(smollm).generate(ids, cfg).token_ids  # sampling: one draw per token
            assert event.generation.token_ids == sampled_refs[key]


def test_bf16_on_cpu_runs_and_every_engine_buffer_has_the_targets_device_and_dtype():
    from jetflow.target.placement import placement

    device, dtype = placement("cpu", "bf16")
    target = tiny_target("qwen3")
    target.model.to(dtype=dtype)
    target = type(target)(target.model, None, "tiny-qwen3", "random")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    engine = Engine(target, head, EngineConfig(max_slots=2))
    out = engine.generate(random_prompts(2, seed=9), DecodeConfig(tree=TreeSpec(budget=8, width=3), max_new_tokens=6))
    assert all(len(g.token_ids) == 6 for g in out)
    tensors = engine.kv.keys + engine.kv.values + engine.head_kv.keys + engine.head_kv.values + [engine.last_ctx]
    assert {(t.device.type, t.dtype) for t in tensors} == {(device.type, dtype)}
    assert {(p.device.type, p.dtype) for p in engine.head.parameters()} == {(device.type, dtype)}
    with pytest.raises(Exception, match="dtype must be one of"):
        placement("cpu", "int8")
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="no CUDA GPU"):
            placement("cuda")


def test_the_engine_benchmark_steps_its_closed_loops_in_turn_each_on_its_own_clock(monkeypatch, one_thread):
    """benchmarks/engine.py's lockstep: the modes' loops take one step each in turn (the order reversed every
    other round), each loop's clock is the sum of its own engine's steps, and every request is served."""
    import importlib.util
    import time
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).resolve().parents[1] / "benchmarks" / "engine.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    target = tiny_target("llama")
    head = DraftHead(HeadConfig.for_target(target, block_size=4))
    engines = [Engine(target, head, EngineConfig(max_slots=2, policy=p)) for p in ("plain", "fixed")]
    order, spent = [], {0: 0.0, 1: 0.0}
    step = Engine.step

    def timed(engine):
        t0 = time.perf_counter()
        events = step(engine)
        spent[engines.index(engine)] += time.perf_counter() - t0
        order.append(engines.index(engine))
        return events

    monkeypatch.setattr(Engine, "step", timed)
    cfg = DecodeConfig(tree=TreeSpec(budget=4, width=2), max_new_tokens=6)
    loops = [bench.ClosedLoop(e, [[1, 2, 3], [4, 5, 6, 7]], cfg, 2, 5) for e in engines]
    results = bench.lockstep(loops)
    both = len(order) - abs(order.count(0) - order.count(1))  # the steps taken while both loops ran
    assert order[:both] == ([0, 1, 1, 0] * both)[:both] and len(set(order[both:])) <= 1
    for k, r in enumerate(results):
        assert r["requests"] == 5 and r["tokens"] == 5 * 6
        assert r["seconds"] == pytest.approx(spent[k], rel=0.05)
        assert 0 < r["p50_s"] <= r["p99_s"] <= r["seconds"] and r["ttft_p50_s"] <= r["p50_s"]


@pytest.mark.slow
def test_the_engine_benchmark_runs_small_and_reports_what_it_claims(smollm, tmp_path):
    """benchmarks/engine.py end to end, tiny: every mode at two concurrency levels, the Decoder's decode-only
    and end-to-end rates, the prediction with and without prefill, and a replica's RSS from a fresh process."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from jetflow.paths import models_dir
    from jetflow.target.projection import choices_file

    root = Path(__file__).resolve().parents[1]
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models_dir(), target_is_directory=True)
    # the host's LM-head choices, where an earlier process timed them (tests/test_projection.py tests the timing)
    forms = choices_file()
    if forms.exists():
        (home / "cache").mkdir()
        shutil.copy(forms, home / "cache" / forms.name)
    # one OpenMP thread, as each pytest-xdist worker has (two wait on each other on a core the other worker uses)
    env = {**os.environ, "JETFLOW_HOME": str(home), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(root / "platform") + os.pathsep + str(root)}
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "engine.py"), "--head", "random", "--budget", "4",
                             "--concurrency", "1,2", "--requests", "2", "--prompts", "1", "--new-tokens", "4",
                             "--long-prompt", "32", "--one-stream-reps", "1", "--no-mlflow", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    plain = report["decoder"]["plain"]
    assert 0 < plain["e2e_tokens_per_s"] < plain["tokens_per_s"]
    for mode in ("plain", "speculative"):
        one = report["one_stream"][mode]
        assert one["ratios"] == [one["engine_tokens_per_s"][0] / one["decoder_tokens_per_s"][0]] and one["ratios"][0] > 0
    for mode in ("plain", "speculative", "auto"):
        for level in ("1", "2"):
            r = report["results"][mode][level]
            assert r["tokens"] == 4 * max(2, 2 * int(level))  # --requests, at least 2 per client
            assert r["decode_tokens_per_s"] >= r["tokens_per_s"] > 0
    assert report["step_curve"]["prefill_ms_per_token"] > 0
    assert {"measured", "predicted", "predicted_decode_only", "predicted_at_loop_rows"} <= set(report["prediction"]["2"])
    for mode in ("plain", "speculative"):                   # the rows each decode step ran: 1 or 2 at concurrency 2
        r = report["results"][mode]["2"]
        assert set(r["decode_rows"]) <= {"1", "2"} and 1 <= r["mean_rows"] <= 2
    rss = report["replica_rss"]
    assert rss["slots"] == 2 and rss["peak_bytes"] >= rss["warm_bytes"] >= rss["loaded_bytes"] > 100 * 2 ** 20
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Peak RSS of a replica" in md and "Concurrency 1 side by side" in md
