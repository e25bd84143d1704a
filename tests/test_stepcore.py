"""The step core (`jetflow.stepcore`) against the eager reference: one graph per role (verify, LM head, draft)
with dynamic shapes — `fullgraph=True` (a graph break fails), nothing recompiles after warm-up whatever the rows,
trees and key windows — the KV buffers stay where they are for a whole engine run, padding is masked both ways,
and the compiled engine gives the reference decoder's tokens: on tiny Llama / Qwen2 / Qwen3 targets and on the
real bundled SmolLM2 (greedy fp32 up to an fp32 tie, seeded sampling token for token).

Compiling goes through torch.compile's `eager` backend here (dynamo's full capture, seconds a graph) and, where
the graphs' in-place KV writes must survive AOT functionalization as inductor sees them, `aot_eager`; slow tests
run inductor with the settings users get (freezing, the C++ GEMM template), on one and on three rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetflow.decode import DecodeConfig, Decoder
from jetflow.engine import Engine, EngineConfig, SingleStream, decoder_for
from jetflow.engine.kv import StaticSlotKV, TargetKV
from jetflow.head import DraftHead, HeadConfig
from jetflow.stepcore.buckets import key_window
from jetflow.stepcore.modes import ENV, read_verdict, record_verdict, resolve_graphs, target_key
from jetflow.stepcore.runner import MIN_TOKENS, StepRunner, verify_arrays
from jetflow.tree import DraftTree, TreeSpec
from tests.conftest import OracleEngine, assert_greedy, random_prompts, seeded_sampling_case, tiny_target

BACKEND = "eager"
GRAPHS = {"verify", "lm_head", "draft top-8"}  # every graph of an engine with a head, at the default widths


def _compiled(target, head, slots: int, backend: str = BACKEND, **kw) -> Engine:
    return Engine(target, head, EngineConfig(max_slots=slots, graphs="compile", graphs_backend=backend, **kw))


# ------------------------------------------------------------------------------ the static KV and the layout
def test_the_static_kv_capacity_is_max_len_rounded_up_to_256():
    assert [key_window(n) for n in (1, 256, 257, 512, 513, 3000)] == [256, 256, 512, 512, 768, 3072]


@st.composite
def _rows(draw):
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 9))
        parents, depths = [-1], [0]
        for i in range(1, n):
            p = draw(st.integers(0, i - 1))
            parents.append(p)
            depths.append(depths[p] + 1)
        rows.append((draw(st.integers(0, 40)), DraftTree(list(range(n)), parents, depths)))
    return rows


@given(rows=_rows(), pad=st.integers(0, 3))
@settings(max_examples=200, deadline=None)
def test_the_verify_layout_pads_rows_and_masks_padding_both_ways(rows, pad):
    """Rows padded to the widest tree (+ pad), tokens row-major: a real node sees exactly its row's prefix and its
    ancestors-or-self at their write positions; a padding node writes to the scratch position (outside every
    window) and sees only key 0; so no real node ever reads a padding node's key."""
    pasts, trees = [p for p, _ in rows], [t for _, t in rows]
    nodes = max(t.size for t in trees) + pad
    host = verify_arrays(pasts, trees, nodes, scratch=999)
    window = max(p + t.size for p, t in rows)
    assert host["visible"].shape == (len(rows), nodes, window) and host["ids"].shape == (len(rows) * nodes,)
    assert host["row"].tolist() == [r for r in range(len(rows)) for _ in range(nodes)]
    for r, (p, tree) in enumerate(rows):
        anc = tree.ancestor_mask()
        for i in range(nodes):
            t = r * nodes + i
            seen = set(np.flatnonzero(host["visible"][r, i]))
            if i < tree.size:
                assert host["write"][t] == p + i and host["pos"][t] == p + tree.depths[i]
                assert seen == set(range(p)) | {p + j for j in range(tree.size) if anc[i, j]} | {0}
            else:
                assert host["write"][t] == 999 and seen == {0}


def _resident(tensors) -> int:
    """Resident bytes of the memory maps holding `tensors` (/proc/self/smaps `Rss`, each map counted once): the
    buffers' own pages, whatever else the process allocates meanwhile (the zero page is not counted)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    total, counted, rng = 0, set(), None
    for line in open("/proc/self/smaps"):
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            rng = (lo, hi) if any(lo < b and a < hi for a, b in spans) else None
        elif head == "Rss:" and rng is not None and rng not in counted:
            counted.add(rng)
            total += int(line.split()[1]) * 1024
    return total


def test_static_kv_is_reserved_once_resident_only_where_written_and_released_in_place():
    kv = StaticSlotKV(num_layers=4, slots=8, kv_heads=4, head_dim=64, dtype=torch.float32,
                      device=torch.device("cpu"), max_len=16_000)
    buffers = kv.keys + kv.values
    reserved = sum(t.numel() * t.element_size() for t in buffers)
    assert kv.capacity == 16_128 and kv.scratch == 16_128 and kv.keys[0].shape == (8, 4, 16_129, 64)
    assert reserved > 500e6 and _resident(buffers) < 1e6         # 528 MB reserved, next to nothing resident
    assert not any(t.any() for t in kv.keys)                     # it reads as zeros (the zero page)
    assert _resident(buffers) < 1e6
    ptrs = [t.data_ptr() for t in buffers]
    cache = TargetKV(kv)
    positions = torch.arange(100)[None].expand(8, -1)
    for layer in range(4):
        cache.plan(0, 8, positions, 100).layers[layer].update(torch.ones(8, 4, 100, 64), torch.ones(8, 4, 100, 64))
    # 8 buffers × 32 (slot, head) runs × 100 positions of 256 B: 25.6 kB a run, 7 or 8 pages where it falls
    runs = 8 * 8 * 4
    written = _resident(buffers)
    assert runs * 7 * 4096 <= written <= runs * 8 * 4096, written
    kv.release()
    assert _resident(buffers) < 1e6                               # those pages went back to the OS
    assert [t.data_ptr() for t in buffers] == ptrs and not any(t.any() for t in kv.keys)


# ------------------------------------------------------------------------------ the core, every family
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_target_step_is_one_graph_and_equals_the_hf_forward(arch):
    """fullgraph=True: any graph break raises. Hidden states, taps, argmaxes and written keys/values equal HF's
    forward of the same tree over the same prefix (Qwen2's q/k/v biases, Qwen3's q/k norms), rows of different
    trees padded to one width."""
    target = tiny_target(arch, layers=4)
    if arch == "qwen2":  # Qwen2 has q/k/v biases; make them matter
        for layer in target.model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
    cfg = target.config
    kv_heads, head_dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    static = StaticSlotKV(target.num_layers, 2, kv_heads, head_dim, torch.float32, target.device, 600)
    plain = StaticSlotKV(target.num_layers, 2, kv_heads, head_dim, torch.float32, target.device, 600)
    prompts = torch.randint(1, 120, (2, 30), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(30)[None].expand(2, -1)
    causal = torch.zeros(2, 1, 30, 30).masked_fill_(~(torch.arange(30)[None, None, :] <= pos[:, :, None])[:, None],
                                                      torch.finfo(torch.float32).min)
    for store in (static, plain):
        target.forward_rows(prompts, pos, TargetKV(store).plan(0, 2, pos, 30), causal, (1, 3))
    trees = [DraftTree([5, 7, 9, 11, 13], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2]), DraftTree([3, 4], [-1, 0], [0, 1])]
    runner = StepRunner(target, None, (1, 3), max_rows=2, compiled=True, backend="eager")
    out = runner.verify([30, 30], trees, static)
    assert set(runner.compile_log) == {"verify", "lm_head"} and out.hidden.shape[:2] == (2, 5)
    for r, tree in enumerate(trees):  # the reference: HF's forward of each tree over the same prefix, one row at a time
        n = tree.size
        mask = torch.zeros(1, 1, n, 30 + n)
        mask[0, 0, :, 30:] = torch.where(torch.from_numpy(tree.ancestor_mask()), 0.0, torch.finfo(torch.float32).min)
        ref = target.forward_rows(torch.tensor([tree.tokens]), 30 + torch.tensor([tree.depths]),
                                  TargetKV(plain).plan(r, r + 1, 30 + torch.arange(n)[None], 30 + n), mask, (1, 3))
        torch.testing.assert_close(out.hidden[r, :n], ref.hidden[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out.features[r, :n], ref.features[0], atol=2e-5, rtol=1e-5)
        assert out.best[r, :n].tolist() == target.logits(ref.hidden[0]).argmax(-1).tolist()
        for a, b in zip(static.keys + static.values, plain.keys + plain.values):
            torch.testing.assert_close(a[r, :, : 30 + n], b[r, :, : 30 + n], atol=2e-5, rtol=1e-5)
    # a one-token step runs as two tokens (its padding node writes only the scratch position)
    before = [t.clone() for t in static.keys]
    one = runner.verify([35], [DraftTree.root_only(9)], static)
    assert one.hidden.shape[:2] == (1, MIN_TOKENS) and one.best.shape == (1, MIN_TOKENS)
    for a, b in zip(static.keys, before):
        changed = (a != b).nonzero()[:, 2].unique().tolist()
        assert set(changed) <= {35, static.scratch}


def test_the_draft_step_is_one_graph_and_drafts_the_eager_engines_top_w():
    """Every head option the core runs (copy inputs, anchor shortcut, depth embedding, tap norms, a draft
    vocabulary) through one compiled graph: the same top-W as the eager engine's draft of the same rows."""
    target = tiny_target("qwen3")
    torch.manual_seed(3)
    head = DraftHead(HeadConfig.for_target(target, block_size=6, copy_ngram=2, anchor_shortcut=True,
                                           depth_embedding=True, tap_norm=True, draft_vocab_size=64))
    head.set_draft_vocab(torch.arange(0, 128, 2))
    for p in head.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    prompts = random_prompts(3, seed=9, lo=5, hi=30)
    eager = Engine(target, head, EngineConfig(max_slots=3, graphs="off"))
    core = _compiled(target, head, 3, backend="eager")
    for engine in (eager, core):
        for p in prompts:
            engine.add(p, DecodeConfig(tree=TreeSpec(budget=8, width=3), max_new_tokens=4))
        while engine.prefilling or engine.waiting:
            engine.step()
    with torch.inference_mode():  # as inside an engine step
        eager_rows = eager._draft([0, 1, 2], [TreeSpec(budget=8, width=3)] * 3)
        core_rows = core._draft([0, 1, 2], [TreeSpec(budget=8, width=3)] * 3)
        one_row = core._draft([1], [TreeSpec(budget=8, width=3)])
        ids = torch.full((3, 6), head.config.mask_token_id)
        ids[:, 0] = torch.tensor([s.anchor for s in eager.running])
        raw = eager._head_topk([0, 1, 2], ids, 3, first=1)  # the eager draft takes the top-3, not top-(past+block)
    assert [len(d) for v in raw[0] for d in v] == [3] * 15
    assert core_rows[1] == eager_rows[1] and one_row[1] == [core_rows[1][1]]
    np.testing.assert_allclose(np.array(core_rows[0]), np.array(eager_rows[0]), atol=1e-4)
    assert [k for k in core.runner.compile_log if k.startswith("draft")] == ["draft top-8"]


# ------------------------------------------------------------------------------ the compiled engine
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_compiled_engine_equals_the_reference_decoder_for_mixed_trees_under_slot_pressure(arch, one_thread):
    target = tiny_target(arch)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6, copy_ngram=2, anchor_shortcut=True,
                                           depth_embedding=True))
    configs = [DecodeConfig(tree=TreeSpec(a, b, 3), max_new_tokens=m) for a, b, m in (
        ("accum_logp", 8, 20), ("chain", 4, 9), ("top2gap", 16, 30), ("accum_logp", 1, 15), ("best_first", 6, 25))]
    prompts = random_prompts(len(configs), seed=1)
    reference = [Decoder(target, head).generate(p, c).token_ids for p, c in zip(prompts, configs)]
    engine = _compiled(target, head, 3, backend="aot_eager", prefill_chunk=7, prefill_tokens=16)
    assert [g.token_ids for g in engine.generate(prompts, configs)] == reference
    assert all(g.stats.graphs == "compile" for g in engine.generate(prompts[:1], configs[:1]))
    assert set(engine.compile_log) == GRAPHS


@pytest.mark.parametrize("argmax", ["every node", "the walk"])
def test_oracle_drafts_accepted_deep_off_spine_across_long_contexts_stay_greedy(argmax, one_thread):
    """Deep acceptance from every node's argmax or by the walk's LM-head work (the noisy oracle's paths leave the
    argmax spine), rows joining and leaving four slots, contexts growing past 256 positions: one graph each."""
    target = tiny_target("qwen3", max_positions=1024)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=8))
    prompts = random_prompts(6, seed=3, lo=190, hi=215)
    cfg = DecodeConfig(tree=TreeSpec("accum_logp", 24, 4), max_new_tokens=60)
    ar = [Decoder(target).generate(p, DecodeConfig(max_new_tokens=60)).token_ids for p in prompts]
    engine = OracleEngine(target, head, {tuple(p): p + a for p, a in zip(prompts, ar)},
                          EngineConfig(max_slots=4, prefill_chunk=64, prefill_tokens=128, graphs="compile",
                                       graphs_backend=BACKEND), seed=2)
    engine.runner.lm_head_all = 10**6 if argmax == "every node" else 0
    out = engine.generate(prompts, cfg)
    assert [g.token_ids for g in out] == ar
    assert sum(g.stats.tau for g in out) / len(out) > 2.0
    assert any(r > 0 for g in out for (_, r) in g.stats.accepted_ranks)
    assert set(engine.compile_log) == {"verify", "lm_head"}  # the oracle drafts on the host


def test_seeded_sampling_through_the_compiled_engine_gives_the_reference_tokens(one_thread):
    target, head, prompts, cfgs, reference = seeded_sampling_case()
    assert [g.token_ids for g in _compiled(target, head, 2).generate(prompts, cfgs)] == reference


def test_nothing_recompiles_after_warm_up_and_the_kv_never_moves(one_thread):
    """Warm the graphs, then decode with dynamo's error_on_recompile — 1 to 4 rows, plain steps and trees of
    several sizes, contexts from 10 to 300 positions: a recompile raises. Every step sees the same KV addresses,
    through requests joining, finishing, a release while idle, and a second run."""
    import torch._dynamo

    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    engine = _compiled(target, head, 4, backend="aot_eager")
    engine.warm_graphs(width=3)
    warmed = dict(engine.runner.compile_log)
    assert set(warmed) == GRAPHS
    ptrs = [t.data_ptr() for t in engine.kv.keys + engine.kv.values + engine.head_kv.keys + engine.head_kv.values]
    prompts = random_prompts(6, seed=6) + random_prompts(1, seed=7, lo=250, hi=260)
    cfgs = [DecodeConfig(tree=TreeSpec(budget=b, width=w), max_new_tokens=12)
            for b, w in ((8, 3), (1, 3), (5, 2), (8, 3), (1, 1), (3, 3), (16, 5))]
    seen = []
    old = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        for _ in range(2):
            for p, c in zip(prompts, cfgs):
                engine.add(p, c)
            while engine.has_work():
                engine.step()
                seen.append([t.data_ptr() for t in engine.kv.keys + engine.kv.values + engine.head_kv.keys
                             + engine.head_kv.values])
    finally:
        torch._dynamo.config.error_on_recompile = old
    assert engine.runner.compile_log == warmed
    assert all(s == ptrs for s in seen)


@pytest.mark.slow
def test_compiled_engine_on_smollm_is_greedy_ar_and_seeded_sampling(smollm, one_thread):
    """The real bundled target, fp32: plain steps, trees of two algorithms side by side in three slots, a prompt
    crossing 256 positions, and seeded sampling, against the reference decoder."""
    from jetflow.data import load_prompts
    from jetflow.decode import encode_prompt

    torch.manual_seed(7)
    head = DraftHead(HeadConfig.for_target(smollm, block_size=8, copy_ngram=3, anchor_shortcut=True,
                                           depth_embedding=True, tap_norm=True))
    items = load_prompts("mtbench", limit=2) + load_prompts("humaneval", limit=2)
    prompts = [encode_prompt(smollm.tokenizer, it.chat) for it in items]
    prompts.append(prompts[2] + prompts[3][:240 - len(prompts[2])] if len(prompts[2]) < 240 else prompts[2])
    new = 20
    cfgs = [DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=new),
            DecodeConfig(tree=TreeSpec("accum_logp", 16, 7), max_new_tokens=new),
            DecodeConfig(tree=TreeSpec("best_first", 8, 7), max_new_tokens=new),
            DecodeConfig(tree=TreeSpec("accum_logp", 8, 7), temperature=0.9, top_k=40, seed=11, max_new_tokens=new),
            DecodeConfig(tree=TreeSpec("chain", 8), max_new_tokens=40)]
    engine = _compiled(smollm, head, 3)
    got = engine.generate(prompts, cfgs)
    for p, c, g in zip(prompts, cfgs, got):
        if c.greedy:
            assert_greedy(smollm, p, g.token_ids, Decoder(smollm).generate(p, DecodeConfig(max_new_tokens=c.max_new_tokens)).token_ids)
        else:
            assert g.token_ids == Decoder(smollm, head).generate(p, c).token_ids
    assert max(len(p) for p in prompts) + new > 256


@pytest.mark.slow
def test_inductor_with_the_users_settings_is_greedy_on_one_row_and_on_three(smollm, tmp_path, monkeypatch):
    """The backend users get — inductor with frozen weights and the C++ GEMM template
    (`jetflow.stepcore.inductor`) — on the real target: single-stream AR and a budget-8 tree, then an engine of
    three slots with mixed trees (rows padded to the widest) and a plain row, its argmaxes from the LM-head graph
    and, in a second run, from the acceptance walk; every output greedy against the reference decoder."""
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))  # a cold inductor cache: this compiles for real
    torch.manual_seed(7)
    head = DraftHead(HeadConfig.for_target(smollm, block_size=8))
    prompt = Decoder(smollm).encode("Write a Python function that reverses a list.")
    cfg_ar = DecodeConfig(max_new_tokens=16)
    ar = Decoder(smollm).generate(prompt, cfg_ar).token_ids
    dec = decoder_for(smollm, head, "compile", graphs_backend="inductor")
    assert isinstance(dec, SingleStream)
    plain = dec.generate(prompt, cfg_ar)
    tree = dec.generate(prompt, DecodeConfig(tree=TreeSpec("accum_logp", 8, 7), max_new_tokens=16))
    assert_greedy(smollm, prompt, plain.token_ids, ar)
    assert_greedy(smollm, prompt, tree.token_ids, ar)
    assert plain.stats.graphs == "compile" and plain.stats.compile_s > 0 and dec.compile_s >= plain.stats.compile_s
    prompts = [Decoder(smollm).encode(t) for t in ("Name three colours.", "def add(a, b):", "Count to ten.")]
    cfgs = [DecodeConfig(tree=TreeSpec("best_first", 8, 7), max_new_tokens=14),
            DecodeConfig(tree=TreeSpec("accum_logp", 5, 3), max_new_tokens=14), DecodeConfig(max_new_tokens=14)]
    refs = [Decoder(smollm).generate(p, DecodeConfig(max_new_tokens=14)).token_ids for p in prompts]
    engine = Engine(smollm, head, EngineConfig(max_slots=3, graphs="compile", graphs_backend="inductor"))
    for lm_head_all in (10**6, 0):
        engine.runner.lm_head_all = lm_head_all
        for p, g, ref in zip(prompts, engine.generate(prompts, cfgs), refs):
            assert_greedy(smollm, p, g.token_ids, ref)
    # the decoder compiled every graph; the engine, over the same target and head, ran the same graphs (a flat
    # token axis: one row or three) and compiled none of its own
    assert set(dec.compile_log) == GRAPHS and engine.compile_log == {} and engine.runner.ready(8)


@pytest.mark.slow
def test_a_compiled_replicas_engine_compiles_its_graphs_before_its_first_request(smollm, monkeypatch):
    """A Serve replica's engine (graphs=compile) compiles, in its constructor, every graph its steps run — the
    verify, the LM head, the draft at its width — so requests, here two at once, compile nothing."""
    import asyncio

    from jetflow.decode import encode_prompt
    from jetflow.serving.config import ServeConfig
    from jetflow.serving.engine import EngineLoop, GenerationEngine
    from jetflow.serving.selection import choose_head

    monkeypatch.setenv("JETFLOW_GRAPHS_BACKEND", "eager")
    cfg = ServeConfig(head="random", graphs="compile", policy="fixed", budget=8, max_slots=2, max_prompt_tokens=100,
                      max_tokens=16, default_max_tokens=16)
    loop = EngineLoop(smollm.tokenizer)
    try:
        gen = GenerationEngine(smollm, choose_head(cfg, smollm), cfg, loop)
        warmed = dict(gen.engine.runner.compile_log)
        assert gen.engine.runner.ready(8) and "draft top-8" in warmed and set(warmed) <= GRAPHS  # (the target's
        info = gen.graphs_info()                                # graphs may have been compiled by an earlier engine)
        assert info["graphs"] == "compile" and info["compiled_graphs"] == len(warmed)
        assert info["compile_s"] == round(sum(warmed.values()), 2) and info["graphs_reason"] == "asked for"
        prompts = [encode_prompt(smollm.tokenizer, text) for text in ("Name a colour.", "Count to five.")]
        dc = gen.decode_config(16, 0.0, 1.0, 0, [], None)

        async def both():
            async def one(i, ids):
                return [e async for e in gen.events(f"r{i}", ids, dc)][-1].done

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        done = asyncio.run(both())
        assert all(g.stats.graphs == "compile" and g.stats.compile_s == 0 for g in done)
        assert gen.engine.runner.compile_log == warmed
        # a plain replica (`--head none`) warms its plain step too, and decodes greedy
        plain_cfg = cfg.model_copy(update={"head": "none"})
        plain = GenerationEngine(smollm, choose_head(plain_cfg, smollm), plain_cfg, loop)
        assert not plain.choice.speculative and plain.engine.runner.ready(0) and plain.graphs_info()["graphs_ready"]
        got = asyncio.run(_last(plain.events("p", prompts[0], dc)))
        assert got.token_ids == Decoder(smollm).generate(prompts[0], DecodeConfig(max_new_tokens=16)).token_ids
    finally:
        loop.close()


async def _last(events):
    return [e async for e in events][-1].done


# ------------------------------------------------------------------------------ the setting
def test_auto_compiles_on_a_gpu_and_follows_the_hosts_verdict_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_graphs("auto", "host-a")[0] == "calibrate"
    assert resolve_graphs("auto", "host-a", "cuda") == ("compile", "auto: a GPU compiles")
    record_verdict("host-a", {"ratio": 1.3, "lossless": True, "date": "2026-12-06"})
    record_verdict("host-b", {"ratio": 0.97, "lossless": True, "date": "2026-12-06"})
    record_verdict("host-c", {"ratio": 2.0, "lossless": False, "date": "2026-12-06"})
    assert [resolve_graphs("auto", h)[0] for h in ("host-a", "host-b", "host-c")] == ["compile", "off", "off"]
    assert "differed" in resolve_graphs("auto", "host-c")[1]
    assert resolve_graphs("off", "host-a")[0] == "off" and resolve_graphs("compile", "host-b")[0] == "compile"
    monkeypatch.setenv(ENV, "off")
    assert resolve_graphs("auto", "host-a") == ("off", f"{ENV}=off")
    with pytest.raises(ValueError, match="graphs must be one of auto, compile, off"):
        EngineConfig(graphs="fast")


@pytest.fixture
def unpinned_auto(tmp_path, monkeypatch):
    """`graphs=auto` as a user meets it (the suite's pin removed), verdicts kept in a fresh home, graphs compiled
    by the fast `eager` backend → (a tiny target, a head for it)."""
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("JETFLOW_GRAPHS_BACKEND", "eager")
    monkeypatch.delenv(ENV, raising=False)
    target = tiny_target("llama")
    torch.manual_seed(0)
    return target, DraftHead(HeadConfig.for_target(target, block_size=6))


def test_auto_calibrates_on_first_use_keeps_the_verdict_and_the_graphs(unpinned_auto, capsys, one_thread):
    """No verdict for this host: the first engine compiles its graphs, measures eager vs compiled plain steps at one
    row and at its slots side by side, prints as it goes, keeps the verdict (with its lossless check) — and keeps
    its compiled graphs when they pay. The next engine reads the verdict without measuring again."""
    target, head = unpinned_auto
    engine = Engine(target, head, EngineConfig(max_slots=3))
    verdict = read_verdict(target_key(target, 3))
    err = capsys.readouterr().err
    assert "[graphs=auto] no verdict for this host yet" in err and "verdict kept in" in err
    assert set(verdict["rows"]) == {"1", "3"} and verdict["lossless"] is True and verdict["by"] == "calibrate"
    assert verdict["ratio"] == min(verdict["rows"].values()) > 0
    expected = "compile" if verdict["ratio"] >= 1.05 else "off"
    assert engine.graphs == expected and (engine.runner is not None) == (expected == "compile")
    assert engine.graphs_reason.startswith("auto: measured compiled/eager")
    prompts = random_prompts(2, seed=5)
    cfg = DecodeConfig(tree=TreeSpec("accum_logp", 6, 3), max_new_tokens=8)
    assert [g.token_ids for g in engine.generate(prompts, cfg)] == [Decoder(target, head).generate(p, cfg).token_ids
                                                                   for p in prompts]
    again = Engine(target, head, EngineConfig(max_slots=3))
    assert again.graphs == expected and "no verdict" not in capsys.readouterr().err


def test_jetflow_graphs_measure_keeps_the_verdict_auto_follows(unpinned_auto):
    """The whole-decode measurement: AR and the tree setting in both modes side by side, outputs checked, its
    smallest ratio kept as this host's single-stream verdict."""
    from jetflow.eval.graphs import measure_and_record

    target, head = unpinned_auto
    result, key = measure_and_record(target, random_prompts(2, seed=11), head, TreeSpec("best_first", 4, 3),
                                     new_tokens=6)
    assert set(result["settings"]) == {"ar", "best_first-b4w3"}
    assert all(s["lossless"] and s["eager_tok_s"] > 0 and s["compiled_tok_s"] > 0 for s in result["settings"].values())
    assert set(result["buckets"]) == GRAPHS and result["lossless"] is True
    assert result["ratio"] == min(s["ratio"] for s in result["settings"].values())
    expected = "compile" if result["ratio"] >= 1.05 else "off"
    assert key == target_key(target, 1)
    assert resolve_graphs("auto", key)[0] == expected and Engine(target, None, EngineConfig(max_slots=1)).graphs == expected


def test_an_engine_that_resolves_to_off_is_the_reference_path():
    target = tiny_target("llama")
    engine = Engine(target, None, EngineConfig(max_slots=2))  # the suite pins JETFLOW_GRAPHS=off
    assert engine.graphs == "off" and engine.runner is None
    single = decoder_for(target, None, "auto")
    assert isinstance(single, Decoder) and single.graphs == "off" and single.warm(10, DecodeConfig()) == 0.0


def test_the_cpu_gemm_register_block_is_four_rows():
    """The fp32 AVX-512 micro-kernel's first register block is 4 × 48 (`jetflow.stepcore.inductor`: inductor's
    8 × 48 made 5-8 rows cost 2.5-3× 4 rows), and inductor's own stay behind it for other dtypes and ISAs."""
    from jetflow.stepcore.inductor import tune_cpu_gemm

    assert tune_cpu_gemm()
    from torch._inductor.codegen import cpp_micro_gemm as micro

    configs = micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec]
    fp32 = [tuple(c.register_blocking) for c in configs if c.input_dtype == torch.float
            and c.input2_dtype == torch.float and c.vec_isa_cls is micro.VecAVX512]
    assert fp32[0] == (4, 48, 1) and (8, 48, 1) not in fp32
    assert any(c.input_dtype == torch.bfloat16 for c in configs)


@pytest.mark.slow
def test_jetflow_generate_graphs_compile_prints_the_tokens_of_graphs_off(tmp_path):
    env = {**os.environ, "JETFLOW_GRAPHS_BACKEND": "eager", "OMP_NUM_THREADS": "1"}
    out, err = {}, {}
    for mode in ("off", "compile"):
        proc = subprocess.run([sys.executable, "-m", "jetflow.cli", "generate", "Name three colours.", "--json",
                               "--graphs", mode, "--max-new-tokens", "12"], capture_output=True, text=True, env=env,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[mode], err[mode] = json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
    assert out["compile"]["token_ids"] == out["off"]["token_ids"]
    assert out["compile"]["stats"]["graphs"] == "compile" and out["off"]["stats"]["graphs"] == "off"
    assert out["compile"]["stats"]["compile_s"] == 0 == out["off"]["stats"]["compile_s"]  # compiled before it ran
    assert "[graphs: compile (asked for): 2 step graphs compiled in" in err["compile"]
    assert "graphs:" not in err["off"]


def test_compiled_kernels_travel_through_cluster_storage_to_a_node_that_never_compiled(tmp_path, monkeypatch):
    """A node that compiled publishes its inductor cache under the key of torch, processor, device, target and
    dtype; a fresh node (another JETFLOW_HOME) restores it before compiling, once; without cluster storage both
    are no-ops."""
    from jetflow.stepcore import artifacts

    target = tiny_target("llama")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "node-a"))
    monkeypatch.delenv("JETFLOW_STORAGE", raising=False)
    assert not artifacts.publish(target) and not artifacts.restore(target)
    monkeypatch.setenv("JETFLOW_STORAGE", str(tmp_path / "storage"))
    cache_a = tmp_path / "node-a" / "cache" / "inductor"
    (cache_a / "ab").mkdir(parents=True)
    (cache_a / "ab" / "kernel.so").write_bytes(b"\x7fELF compiled")
    (cache_a / "autotune.json").write_text('{"mm": "cpp"}')
    assert artifacts.publish(target) and not artifacts.publish(target)   # once per key
    archive = tmp_path / "storage" / "compiled" / f"{artifacts.artifact_key(target)}.tar.gz"
    assert archive.is_file()
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "node-b"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert artifacts.restore(target) and not artifacts.restore(target)   # once per node
    cache_b = tmp_path / "node-b" / "cache" / "inductor"
    assert (cache_b / "ab" / "kernel.so").read_bytes() == b"\x7fELF compiled"
    assert (cache_b / "autotune.json").read_text() == '{"mm": "cpp"}'
    other = tiny_target("qwen3")
    assert artifacts.artifact_key(other) != artifacts.artifact_key(target) and not artifacts.restore(other)


def test_the_calibration_times_answers_not_prefills(smollm, one_thread):
    """The calibration's requests, on the real bundled target: every row's greedy answer runs the whole
    NEW_TOKENS (a request answered with EOS at once would time its prefill: the verdict that left `auto` off on
    an AMD host), and the rows are distinct prompts."""
    from jetflow.engine.calibrate import NEW_TOKENS, _prompts

    rows = 8
    prompts = _prompts(smollm, rows)
    assert len({tuple(p) for p in prompts}) == rows
    engine = Engine(smollm, None, EngineConfig(max_slots=rows, policy="plain", graphs="off"))
    gens = engine.generate(prompts, [DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=NEW_TOKENS)] * rows)
    assert [g.stats.new_tokens for g in gens] == [NEW_TOKENS] * rows, [g.finish_reason for g in gens]
