"""The step core (`jetflow.stepcore`) against the eager reference: it compiles as one graph per bucket
(`fullgraph=True`: a graph break fails), never recompiles inside a bucket, keeps the KV buffers where they are
for a whole engine run, accepts on the device exactly as the host's acceptance walk does, and the compiled
engine gives the reference decoder's tokens — on tiny Llama / Qwen2 / Qwen3 targets and on the real bundled
SmolLM2 (greedy fp32 up to an fp32 tie, seeded sampling token for token).

Compiling goes through torch.compile's `eager` backend here (dynamo's full capture, seconds a bucket) and, where
the graphs' in-place KV writes must survive AOT functionalization as inductor sees them, `aot_eager`; one slow
test runs inductor, the backend a user gets."""

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
from jetflow.stepcore.buckets import key_window, next_pow2
from jetflow.stepcore.modes import ENV, resolve_graphs
from jetflow.stepcore.runner import StepRunner
from jetflow.stepcore.target import greedy_accept
from jetflow.tree import DraftTree, TreeSpec, walk
from tests.conftest import OracleEngine, assert_greedy, random_prompts, seeded_sampling_case, tiny_target

BACKEND = "eager"


def _compiled(target, head, slots: int, backend: str = BACKEND, **kw) -> Engine:
    return Engine(target, head, EngineConfig(max_slots=slots, graphs="compile", graphs_backend=backend, **kw))


# ------------------------------------------------------------------------------ buckets and the static KV
def test_buckets_are_powers_of_two_and_key_windows_double_from_256():
    assert [next_pow2(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [key_window(n) for n in (1, 256, 257, 512, 513, 3000)] == [256, 256, 512, 512, 1024, 4096]


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
    assert kv.capacity == 16_384 and kv.scratch == 16_384 and kv.keys[0].shape == (8, 4, 16_385, 64)
    assert reserved > 500e6 and _resident(buffers) < 1e6         # 537 MB reserved, next to nothing resident
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


# ------------------------------------------------------------------------------ device acceptance
@st.composite
def _trees_and_choices(draw):
    n = draw(st.integers(1, 24))
    parents, depths, tokens = [-1], [0], [draw(st.integers(0, 5))]
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        parents.append(p)
        depths.append(depths[p] + 1)
        tokens.append(draw(st.integers(0, 5)))  # a small vocabulary: duplicate siblings happen
    best = [draw(st.integers(0, 5)) for _ in range(n)]
    return DraftTree(tokens, parents, depths), best


@given(cases=st.lists(_trees_and_choices(), min_size=1, max_size=4), pad=st.integers(0, 5))
@settings(max_examples=200, deadline=None)
def test_device_acceptance_is_the_host_walk_with_argmax_choices(cases, pad):
    """Rows padded to one node count (padding nodes never accepted), a duplicate sibling counted once: the
    (deepest node, bonus) of `greedy_accept` is where `walk` ends, with the same bonus."""
    from jetflow.stepcore.runner import verify_arrays

    nodes = max(t.size for t, _ in cases) + pad
    host = verify_arrays([10] * len(cases), [t for t, _ in cases], len(cases), nodes, scratch=99)
    best = np.zeros((len(cases), nodes), dtype=np.int64)
    for r, (_, b) in enumerate(cases):
        best[r, : len(b)] = b
        best[r, len(b):] = 7  # padding nodes' argmax: a token no real node carries
    got = greedy_accept(*(torch.from_numpy(host[k]) for k in ("ids",)), torch.from_numpy(best),
                        torch.from_numpy(host["pos"] - host["past"][:, None]), torch.from_numpy(host["anc"]),
                        torch.from_numpy(host["parent"]), torch.from_numpy(host["eligible"])).tolist()
    for (tree, b), (deepest, bonus) in zip(cases, got):
        acc = walk(tree, lambda node: b[node])
        assert (deepest, bonus) == (acc.path[-1], acc.bonus) and tree.path_to(deepest) == acc.path


# ------------------------------------------------------------------------------ the core, every family
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_target_core_is_one_graph_per_bucket_and_equals_the_hf_forward(arch):
    """fullgraph=True: any graph break raises. Hidden states, taps and written keys/values equal HF's forward
    of the same tree over the same prefix (Qwen2's q/k/v biases, Qwen3's q/k norms)."""
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
    runner = StepRunner(target, None, (1, 3), max_rows=2, compiled=True, backend="eager", accept="device")
    out = runner.verify([30, 30], trees, static)
    assert list(runner.compile_log) == ["verify 2×8@256"]
    # the reference: HF's forward of each tree over the same prefix, one row at a time
    for r, tree in enumerate(trees):
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


def test_the_head_core_is_one_graph_and_drafts_the_eager_engines_top_w():
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
    assert core_rows[1] == eager_rows[1]
    np.testing.assert_allclose(np.array(core_rows[0]), np.array(eager_rows[0]), atol=1e-4)
    assert [k for k in core.runner.compile_log if k.startswith("draft")] == ["draft 3×6@256 top-3"]  # 3 rows: the slots cap the bucket


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
    engine = _compiled(target, head, 3, backend="aot_eager", prefill_chunk=7, prefill_tokens=16,
                       graphs_accept="device")
    assert [g.token_ids for g in engine.generate(prompts, configs)] == reference
    assert all(g.stats.graphs == "compile" for g in engine.generate(prompts[:1], configs[:1]))


@pytest.mark.parametrize("accept", ["device", "walk"])
def test_oracle_drafts_accepted_deep_off_spine_and_across_a_key_window_stay_greedy(accept, one_thread):
    """Deep acceptance, on the device or by the walk (the noisy oracle's paths leave the argmax spine), rows
    joining and leaving four slots, prompts long enough that the rows cross from the 256-key window into the
    512 one."""
    target = tiny_target("qwen3", max_positions=1024)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=8))
    prompts = random_prompts(6, seed=3, lo=190, hi=215)  # past + 24 nodes starts below 256 and ends above
    cfg = DecodeConfig(tree=TreeSpec("accum_logp", 24, 4), max_new_tokens=60)
    ar = [Decoder(target).generate(p, DecodeConfig(max_new_tokens=60)).token_ids for p in prompts]
    engine = OracleEngine(target, head, {tuple(p): p + a for p, a in zip(prompts, ar)},
                          EngineConfig(max_slots=4, prefill_chunk=64, prefill_tokens=128, graphs="compile",
                                       graphs_backend=BACKEND, graphs_accept=accept), seed=2)
    out = engine.generate(prompts, cfg)
    assert [g.token_ids for g in out] == ar
    assert sum(g.stats.tau for g in out) / len(out) > 2.0
    assert any(r > 0 for g in out for (_, r) in g.stats.accepted_ranks)
    windows = {label.split("@")[1] for label in engine.runner.compile_log}
    assert windows == {"256", "512"}


def test_the_layer_unit_compiles_one_layer_graph_for_every_layer_and_decodes_the_same(one_thread):
    """unit=layer: per bucket one decoder-layer graph serves all six layers (no recompile from one layer's weights
    to the next's), beside the prologue and epilogue; the tokens are the reference decoder's."""
    import torch._dynamo

    target = tiny_target("qwen3")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    prompts = random_prompts(3, seed=8)
    cfg = DecodeConfig(tree=TreeSpec("accum_logp", 8, 3), max_new_tokens=12)
    reference = [Decoder(target, head).generate(p, cfg).token_ids for p in prompts]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = _compiled(target, head, 4, graphs_unit="layer")
    assert [g.token_ids for g in engine.generate(prompts, cfg)] == reference
    buckets = len([k for k in engine.runner.compile_log if k.startswith("verify")])
    drafts = len(engine.runner.compile_log) - buckets
    # per verify bucket: prologue, one layer graph, epilogue; per draft bucket: its one graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3 * buckets + drafts


def test_seeded_sampling_through_the_compiled_engine_gives_the_reference_tokens(one_thread):
    target, head, prompts, cfgs, reference = seeded_sampling_case()
    assert [g.token_ids for g in _compiled(target, head, 2).generate(prompts, cfgs)] == reference


def test_nothing_recompiles_inside_a_bucket_and_the_kv_never_moves(one_thread):
    """Warm the buckets, then decode with dynamo's error_on_recompile: a recompile raises. Every step sees the
    same KV addresses, through requests joining, finishing, a release while idle, and a second run."""
    import torch._dynamo

    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    engine = _compiled(target, head, 4)
    engine.warm_graphs(max_context=80, nodes=(1, 8), width=3)
    warmed = dict(engine.runner.compile_log)
    ptrs = [t.data_ptr() for t in engine.kv.keys + engine.kv.values + engine.head_kv.keys + engine.head_kv.values]
    prompts = random_prompts(7, seed=6)
    cfgs = [DecodeConfig(tree=TreeSpec(budget=b, width=3), max_new_tokens=12) for b in (8, 1, 5, 8, 1, 3, 8)]
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
    crossing into the 512-key window, and seeded sampling, against the reference decoder."""
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
    engine = _compiled(smollm, head, 3, graphs_accept="device")  # (the CPU default is the walk: see the docstring)
    got = engine.generate(prompts, cfgs)
    for p, c, g in zip(prompts, cfgs, got):
        if c.greedy:
            assert_greedy(smollm, p, g.token_ids, Decoder(smollm).generate(p, DecodeConfig(max_new_tokens=c.max_new_tokens)).token_ids)
        else:
            assert g.token_ids == Decoder(smollm, head).generate(p, c).token_ids
    assert any("@512" in label for label in engine.runner.compile_log)


@pytest.mark.slow
def test_inductor_compiled_ar_and_tree_decoding_on_smollm_are_greedy(smollm, tmp_path, one_thread):
    """The backend users get (inductor): AR and a budget-8 tree on the real target, against the reference."""
    torch.manual_seed(7)
    head = DraftHead(HeadConfig.for_target(smollm, block_size=8))
    prompt = Decoder(smollm).encode("Write a Python function that reverses a list.")
    cfg_ar = DecodeConfig(max_new_tokens=16)
    cfg_tree = DecodeConfig(tree=TreeSpec("accum_logp", 8, 7), max_new_tokens=16)
    ar = Decoder(smollm).generate(prompt, cfg_ar).token_ids
    dec = decoder_for(smollm, head, "compile", graphs_backend="inductor")
    plain = dec.generate(prompt, cfg_ar)
    tree = dec.generate(prompt, cfg_tree)
    assert isinstance(dec, SingleStream)
    assert_greedy(smollm, prompt, plain.token_ids, ar)
    assert_greedy(smollm, prompt, tree.token_ids, ar)
    assert plain.stats.graphs == "compile" and plain.stats.compile_s > 0 and dec.compile_s >= plain.stats.compile_s


@pytest.mark.slow
def test_a_compiled_replicas_engine_compiles_every_bucket_before_its_first_request(smollm, monkeypatch):
    """A Serve replica's engine (graphs=compile) compiles, in its constructor, every bucket its steps can meet —
    rows 1 and 2 (its slots) × a plain step and the 8-node tree × the one key window its 100 + 16 positions need,
    and the draft per row bucket — so requests, here two at once, compile nothing."""
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
        assert set(warmed) == {"verify 1×1@256", "verify 1×8@256", "verify 2×1@256", "verify 2×8@256",
                               "draft 1×16@256 top-7", "draft 2×16@256 top-7"}
        assert gen.graphs_info() == {"graphs": "compile", "compiled_buckets": 6,
                                     "compile_s": round(sum(warmed.values()), 2)}
        prompts = [encode_prompt(smollm.tokenizer, text) for text in ("Name a colour.", "Count to five.")]
        dc = gen.decode_config(16, 0.0, 1.0, 0, [], None)

        async def both():
            async def one(i, ids):
                return [e async for e in gen.events(f"r{i}", ids, dc)][-1].done

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        done = asyncio.run(both())
        assert all(g.stats.graphs == "compile" and g.stats.compile_s == 0 for g in done)
        assert gen.engine.runner.compile_log == warmed
    finally:
        loop.close()


# ------------------------------------------------------------------------------ the setting
def test_auto_is_off_without_a_measurement_and_follows_the_hosts_verdict(tmp_path, monkeypatch):
    from jetflow.stepcore.modes import record_verdict

    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_graphs("auto", "host-a")[0] == "off"
    record_verdict("host-a", {"ratio": 1.3, "date": "2026-12-06"})
    record_verdict("host-b", {"ratio": 0.97, "date": "2026-12-06"})
    assert resolve_graphs("auto", "host-a")[0] == "compile" and resolve_graphs("auto", "host-b")[0] == "off"
    assert resolve_graphs("off", "host-a")[0] == "off" and resolve_graphs("compile", "host-b")[0] == "compile"
    monkeypatch.setenv(ENV, "off")
    assert resolve_graphs("auto", "host-a") == ("off", f"{ENV}=off")
    with pytest.raises(ValueError, match="graphs must be one of auto, compile, off"):
        EngineConfig(graphs="fast")


def test_jetflow_graphs_measure_keeps_the_verdict_auto_follows(tmp_path, monkeypatch):
    """The calibration decodes AR and the tree setting in both modes side by side (AR in the plain one-node
    bucket), checks the outputs agree, and keeps its smallest ratio as this host's verdict."""
    from jetflow.eval.graphs import measure_and_record

    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("JETFLOW_GRAPHS_BACKEND", "eager")
    monkeypatch.delenv(ENV, raising=False)
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, block_size=6))
    result, key = measure_and_record(target, random_prompts(2, seed=11), head, TreeSpec("best_first", 4, 3),
                                     new_tokens=6)
    assert set(result["settings"]) == {"ar", "best_first-b4w3"}
    assert all(s["lossless"] and s["eager_tok_s"] > 0 and s["compiled_tok_s"] > 0 for s in result["settings"].values())
    assert set(result["buckets"]) == {"verify 1×1@256", "verify 1×4@256", "draft 1×6@256 top-3"}
    assert result["ratio"] == min(s["ratio"] for s in result["settings"].values())
    expected = "compile" if result["ratio"] >= 1.05 else "off"
    assert resolve_graphs("auto", key)[0] == expected and Engine(target, None, EngineConfig()).graphs == expected


def test_an_engine_that_resolves_to_off_is_the_reference_path():
    target = tiny_target("llama")
    engine = Engine(target, None, EngineConfig(max_slots=2))  # the suite pins JETFLOW_GRAPHS=off
    assert engine.graphs == "off" and engine.runner is None
    single = decoder_for(target, None, "auto")
    assert isinstance(single, Decoder) and single.graphs == "off" and single.warm(10, DecodeConfig()) == 0.0


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
    assert "[graphs: compile (compile): 1 step buckets compiled in" in err["compile"]
    assert "graphs:" not in err["off"]
