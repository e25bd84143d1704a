"""Training: anchors and the block-causal mask, train/infer parity, losses, feature cache, exact resume.
Fast tests use a tiny random Qwen3 whose 'regenerated' data is its own greedy output."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from jetflow.tree import TreeSpec
from jetflow.data.features import FeatureCache, FeatureSpec, OnlineFeatures, build_features
from jetflow.data.regenerate import MANIFEST, SCHEMA
from jetflow.decode import DecodeConfig, Decoder
from jetflow.head import DraftHead, load_head
from jetflow.head.copy import copy_block_inputs
from jetflow.train.blocks import sample_anchors, training_mask
from jetflow.train.config import TrainConfig
from jetflow.metrics import simulated_tau_chain
from jetflow.train.losses import draft_loss
from jetflow.train.trainer import block_forward, build_head, evaluate, train
from tests.conftest import tiny_target


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("qwen3", vocab=128)


def _write_regen(folder: Path, target, n: int = 12, new_tokens: int = 40) -> Path:
    """A regenerated dataset in the real on-disk format: random prompts, the target's greedy answers."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    rows = {k: [] for k in SCHEMA.names}
    for i in range(n):
        prompt = torch.randint(1, 120, (int(torch.randint(8, 20, (1,), generator=gen)),), generator=gen).tolist()
        out = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        rows["prompt_id"].append(f"p{i}")
        rows["prompt_ids"].append(prompt)
        rows["response_ids"].append(out)
        rows["finish_reason"].append("length")
    pq.write_table(pa.table(rows, schema=SCHEMA), folder / "shard-00000.parquet")
    (folder / MANIFEST).write_text(json.dumps({"shards": 1, "content_sha256": "test", "chat_template_sha256": "-",
                                               "response_tokens": sum(map(len, rows["response_ids"]))}))
    return folder


@pytest.fixture(scope="module")
def features(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("tinydata")
    regen = _write_regen(root / "regen", tiny)
    return build_features(regen, tiny, FeatureSpec(layer_ids=(1, 2, 3), max_len=128, teacher_topk=4,
                                                   shard_sequences=5), out=root / "features", progress=False)


def test_anchors_stay_in_the_response_region_with_room_for_a_full_block():
    anchors = sample_anchors(response_start=10, length=50, block_size=8, max_anchors=512)
    assert anchors.tolist() == list(range(9, 43))
    some = sample_anchors(10, 50, 8, 5, torch.Generator().manual_seed(0))
    assert len(some) == 5 and len(set(some.tolist())) == 5 and all(9 <= a <= 42 for a in some.tolist())
    assert sample_anchors(10, 12, 8, 5).numel() == 0


@pytest.mark.parametrize("causal", [True, False])
def test_training_mask_sees_context_before_the_anchor_and_only_its_own_block(causal):
    anchors = torch.tensor([3, 7])
    m = training_mask(anchors, context_len=10, block_size=4, causal=causal)[0, 0]
    assert m.shape == (8, 18)
    for q in range(8):
        b, i = divmod(q, 4)
        assert m[q, :10].tolist() == [j < anchors[b] for j in range(10)]
        for k in range(8):
            b2, i2 = divmod(k, 4)
            assert bool(m[q, 10 + k]) == (b2 == b and (i2 <= i or not causal))


@pytest.mark.parametrize("causal,shortcut,vocab,depth,copy", [
    (True, False, 0, False, 0), (True, True, 0, False, 0), (False, False, 0, False, 0), (False, True, 0, False, 0),
    (True, False, 64, False, 0), (True, True, 0, True, 0), (False, False, 0, True, 0),
    (True, True, 0, True, 3), (False, False, 64, False, 2)])
def test_block_logits_in_the_batched_training_forward_equal_the_inference_forward(tiny, features, causal, shortcut,
                                                                                 vocab, depth, copy):
    """The bug class behind 'great validation numbers, nothing accepted': train and infer must agree."""
    data = FeatureCache(features)
    cfg = TrainConfig(num_hidden_layers=2, block_size=6, causal=causal, anchor_shortcut=shortcut, depth_embedding=depth,
                      copy_ngram=copy, zero_init=False)
    head = build_head(cfg, tiny, data.meta["spec"]["layer_ids"])
    if copy:  # random copy weights, so that a copy input the two forwards place differently shows
        torch.nn.init.normal_(head.copy_len_embed, std=0.5)
    if vocab:  # a draft vocabulary (the tiny target has no tokenizer to count a corpus with)
        sub = DraftHead(dataclasses.replace(head.config, draft_vocab_size=vocab))
        sub.load_state_dict(head.state_dict(), strict=False)
        sub.set_draft_vocab(torch.arange(0, 2 * vocab, 2))
        head = sub
    head = head.eval()
    seq = data[3]
    anchors = sample_anchors(seq["response_start"], len(seq["tokens"]), 6, 8, torch.Generator().manual_seed(1))
    with torch.no_grad():
        train_logits, _ = block_forward(head, tiny, seq, anchors)
    if copy:  # the case under test: some blocks carry copy candidates, of more than one match length
        lens = copy_block_inputs(seq["tokens"], anchors.tolist(), 6, copy)[1]
        assert (lens == 0).any() and len(set(lens[lens > 0].tolist())) > 1
    decoder = Decoder(tiny, head)
    for n, a in enumerate(anchors.tolist()):
        tokens = seq["tokens"][: a + 1].tolist()
        with torch.inference_mode():
            state = decoder._prefill(tokens, DecodeConfig(tree=TreeSpec(budget=8), max_new_tokens=1))
            state.ctx[:a] = head.project_context(seq["features"][:a].float())  # the cached (fp16) features
            infer_logits = decoder.draft_logits(state)
        torch.testing.assert_close(train_logits[n], infer_logits, atol=1e-4, rtol=1e-4)


def test_feature_cache_holds_taps_and_the_teachers_greedy_tokens(tiny, features):
    data = FeatureCache(features)
    assert len(data) == 12
    seq = data[0]
    s = len(seq["tokens"])
    assert seq["features"].shape == (s, 3 * tiny.hidden_size) and seq["features"].dtype == torch.float16
    # the response is the target's own greedy output, so the teacher's top-1 predicts it
    rs = seq["response_start"]
    assert torch.equal(seq["teacher_ids"][rs - 1 : s - 1, 0], seq["tokens"][rs:])
    assert data.meta["bytes_per_token"] == 2 * 3 * tiny.hidden_size + 4 + 6 * 4


def test_losses_are_zero_or_minimal_for_a_perfect_draft_and_grow_when_wrong():
    labels = torch.tensor([[1, 2, 3]])
    t_ids = torch.tensor([[[1, 0], [2, 0], [3, 0]]])
    t_logp = torch.tensor([[[0.0, -30.0]] * 3])
    good = torch.full((1, 3, 5), -20.0)
    good[0, torch.arange(3), labels[0]] = 20.0
    bad = good.flip(-1)
    for kind in ("ce", "fkl", "rkl"):
        assert draft_loss(good, labels, t_ids, t_logp, kind) < 1e-3
        assert draft_loss(bad, labels, t_ids, t_logp, kind) > 1.0
    assert simulated_tau_chain(torch.tensor([[True, True, False], [False, True, True]])) == 2.0


def test_training_reduces_the_loss_and_reports_simulated_tau(tiny, features, tmp_path):
    cfg = TrainConfig(name="t", num_hidden_layers=1, block_size=6, max_steps=30, anchors_per_seq=8, seqs_per_step=2,
                      lr=3e-3, eval_sequences=2, checkpoint_every=10)
    losses = []
    metrics = train(cfg, tiny, FeatureCache(features), tmp_path / "head",
                    log=lambda m, s: losses.append(m.get("train/loss")), progress=False)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert 1.0 <= metrics["eval/chain_tau"] <= 6.0 and metrics["eval/tree_tau"] >= metrics["eval/chain_tau"] - 1e-9
    assert (tmp_path / "head" / "config.json").exists() and (tmp_path / "head" / "model.safetensors").exists()


@pytest.mark.parametrize("feature_noise", [0.0, 0.3])
def test_training_interrupted_and_resumed_equals_an_uninterrupted_run(tiny, features, tmp_path, feature_noise):
    cfg = TrainConfig(name="r", num_hidden_layers=1, block_size=6, max_steps=8, anchors_per_seq=4, seqs_per_step=2,
                      lr=1e-3, eval_sequences=2, checkpoint_every=2, feature_noise=feature_noise)
    data = FeatureCache(features)
    train(cfg, tiny, data, tmp_path / "full", progress=False)
    assert train(cfg, tiny, data, tmp_path / "resumed", progress=False, stop_after=5) == {"stopped_at": 5}
    train(cfg, tiny, data, tmp_path / "resumed", progress=False)  # restarts from the step-4 checkpoint
    from safetensors.torch import load_file

    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert full.keys() == resumed.keys()
    for k in full:
        torch.testing.assert_close(full[k], resumed[k], atol=0, rtol=0)


def test_feature_noise_perturbs_only_training_forwards(tiny, features, tmp_path):
    from jetflow.errors import InvalidSettingError

    data = FeatureCache(features)
    base = dict(name="n", num_hidden_layers=1, block_size=6, max_steps=3, anchors_per_seq=4, seqs_per_step=2, lr=1e-3,
                eval_sequences=2, checkpoint_every=10)
    noisy_cfg = TrainConfig(**base, feature_noise=0.5)
    quiet = train(TrainConfig(**base), tiny, data, tmp_path / "quiet", progress=False)
    noisy = train(noisy_cfg, tiny, data, tmp_path / "noisy", progress=False)
    assert quiet["train/loss"] != noisy["train/loss"]
    head = load_head(tmp_path / "noisy")
    # the held-out monitor of a noisy run draws no noise: the same numbers every time
    assert evaluate(head, tiny, data, [0, 1], noisy_cfg) == evaluate(head, tiny, data, [0, 1], noisy_cfg)
    feats = data[0]["features"].float()
    plain = head.project_context(feats)
    a = head.project_context(feats, noise=0.5, generator=torch.Generator().manual_seed(1))
    b = head.project_context(feats, noise=0.5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, plain)
    with pytest.raises(InvalidSettingError, match="feature_noise"):
        TrainConfig(feature_noise=-0.1)


def test_online_features_equal_the_cache_and_train_the_same_head(tiny, features, tmp_path):
    """The no-disk mode computes, item by item, exactly what the cache stores, so training is unchanged."""
    from safetensors.torch import load_file

    cached = FeatureCache(features)
    online = OnlineFeatures(features.parent / "regen", tiny, FeatureSpec.from_dict(cached.meta["spec"]))
    assert len(online) == len(cached) and online.tokens == cached.tokens
    for i in (0, 5, len(cached) - 1):
        a, b = cached[i], online[i]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k
    cfg = TrainConfig(name="o", num_hidden_layers=1, block_size=6, max_steps=4, anchors_per_seq=4, seqs_per_step=2,
                      lr=1e-3, eval_sequences=2, checkpoint_every=10)
    m_cache = train(cfg, tiny, cached, tmp_path / "cache", progress=False)
    m_online = train(cfg, tiny, online, tmp_path / "online", progress=False)
    assert m_cache["eval/chain_tau"] == m_online["eval/chain_tau"]
    w_cache, w_online = load_file(str(tmp_path / "cache" / "model.safetensors")), load_file(str(tmp_path / "online" / "model.safetensors"))
    for k in w_cache:
        assert torch.equal(w_cache[k], w_online[k]), k


def test_a_bf16_target_taps_its_own_cache_and_trains_an_fp32_head(tiny, tmp_path, monkeypatch):
    """The GPU recipe on a CPU: the frozen target in bf16, the head's master weights in fp32."""
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "home"))  # the content-keyed caches: built here, not reused
    bf16 = type(tiny)(_bf16_copy(tiny), None, "tiny-qwen3", "random")
    regen = _write_regen(tmp_path / "regen", tiny, n=6, new_tokens=24)
    spec = FeatureSpec(layer_ids=(1, 2, 3), max_len=64, teacher_topk=4, shard_sequences=3)
    fp32_cache = build_features(regen, tiny, spec, progress=False)
    bf16_cache = build_features(regen, bf16, spec, progress=False)
    assert fp32_cache != bf16_cache  # other numbers, another content key
    cfg = TrainConfig(name="b", num_hidden_layers=1, block_size=6, max_steps=3, anchors_per_seq=4, seqs_per_step=2,
                      lr=1e-3, eval_sequences=2, checkpoint_every=10)
    metrics = train(cfg, bf16, FeatureCache(bf16_cache), tmp_path / "head", progress=False)
    assert torch.isfinite(torch.tensor(metrics["train/loss"])) and metrics["eval/chain_tau"] >= 1.0
    head = load_head(tmp_path / "head")
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    logits = head.output_logits(bf16, torch.zeros(2, head.config.hidden_size))  # hidden cast to the LM head's
    assert logits.dtype == torch.bfloat16


def _bf16_copy(target):
    import copy

    return copy.deepcopy(target.model).to(torch.bfloat16)


def test_regeneration_in_another_dtype_gets_its_own_folder():
    from jetflow.data.regenerate import RegenConfig
    from jetflow.errors import InvalidSettingError

    plain = RegenConfig(device="cpu")
    assert RegenConfig(device="cpu", dtype="fp32").key("r") == plain.key("r")
    assert RegenConfig(device="cpu", dtype="bf16").key("r") != plain.key("r")
    assert RegenConfig(device="cuda").target_dtype() == "bf16"  # the GPU default, named without a GPU
    with pytest.raises(InvalidSettingError, match="dtype must be one of"):
        RegenConfig(dtype="int8")


def test_unknown_training_options_are_rejected():
    from jetflow.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError, match="unknown training options"):
        TrainConfig.from_overrides(TrainConfig(), {"lrr": 1e-3})
    with pytest.raises(InvalidSettingError, match="loss"):
        TrainConfig(loss="mse")


def test_regeneration_prompts_interleave_the_sets_and_take_each_text_once():
    from jetflow.data.prompts import load_prompts, normalize_text
    from jetflow.data.regenerate import RegenConfig, select_prompts

    mix = select_prompts(RegenConfig(num_prompts=400, prompt_sets=["sharegpt", "gsm"]))
    assert [i.source for i in mix[:4]] == ["sharegpt", "gsm", "sharegpt", "gsm"]
    # sharegpt-code is part of sharegpt: the code prompt sharegpt already gave is not taken twice
    both = select_prompts(RegenConfig(num_prompts=400, prompt_sets=["sharegpt", "sharegpt-code"]))
    texts = [normalize_text(i.text) for i in both]
    assert len(both) == 400 and len(set(texts)) == 400
    assert sum(i.source == "sharegpt-code" for i in both) > 150 and sum(i.source == "sharegpt" for i in both) > 150
    # ... and the overlap is real among the first 200 of each (else this test would not test the dedup)
    code = load_prompts("sharegpt-code", "train")
    assert {i.id for i in code[:200]} & {i.id for i in load_prompts("sharegpt", "train")[:200]}


@pytest.mark.slow
def test_regeneration_interrupted_and_rerun_equals_an_uninterrupted_run(smollm, tmp_path):
    from jetflow.data.regenerate import RegenConfig, load_regenerated, regenerate

    cfg = RegenConfig(num_prompts=6, max_new_tokens=12, batch_size=2, shard_size=2)
    full = regenerate(cfg, out=tmp_path / "full", progress=False)
    part = regenerate(cfg, out=tmp_path / "part", progress=False, max_shards=1)  # "killed" after one shard
    assert not (part / MANIFEST).exists() and len(list(part.glob("shard-*.parquet"))) == 1
    (part / "shard-00001.tmp").write_bytes(b"half-written by the killed run")
    regenerate(cfg, out=tmp_path / "part", progress=False)
    a, b = json.loads((full / MANIFEST).read_text()), json.loads((part / MANIFEST).read_text())
    assert a["content_sha256"] == b["content_sha256"] and a["sequences"] == b["sequences"] == 6
    assert load_regenerated(full)["response_ids"] == load_regenerated(part)["response_ids"]
    assert a["target_revision"] == smollm.revision and a["settings"]["max_new_tokens"] == 12


@pytest.mark.slow
def test_regeneration_on_two_ray_workers_equals_one_process_and_resumes(smollm, tmp_path):
    """Shards spread over two real Ray actors give the one-process result; a run stopped after one
    shard and resumed on the actors neither loses nor duplicates a sequence."""
    import ray

    from jetflow.data.regenerate import RegenConfig, load_regenerated, regenerate

    cfg = RegenConfig(num_prompts=6, max_new_tokens=12, batch_size=2, shard_size=2)
    one = regenerate(cfg, out=tmp_path / "one", progress=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        two = dataclasses.replace(cfg, workers=2)
        regenerate(two, out=tmp_path / "two", progress=False, max_shards=1)
        assert len(list((tmp_path / "two").glob("shard-*.parquet"))) == 1
        regenerate(two, out=tmp_path / "two", progress=False)
    finally:
        ray.shutdown()
    a, b = json.loads((one / MANIFEST).read_text()), json.loads((tmp_path / "two" / MANIFEST).read_text())
    assert a["content_sha256"] == b["content_sha256"] and b["sequences"] == 6 and b["shards"] == 3
    assert load_regenerated(one)["prompt_id"] == load_regenerated(tmp_path / "two")["prompt_id"]
    assert cfg.key(smollm.revision) == two.key(smollm.revision)  # worker count is not part of the data key


@pytest.mark.slow
def test_batched_regeneration_equals_hf_generate_and_each_prompt_alone(smollm):
    """Our loop (rows leave the batch when they stop, buffered KV) gives HF `generate`'s greedy tokens
    for a left-padded batch, and each row equals decoding its prompt on its own."""
    from jetflow.data.batchgen import generate_batch
    from jetflow.decode.prompt import encode_prompt, stop_token_ids

    tok = smollm.tokenizer
    prompts = [encode_prompt(tok, [{"role": "user", "content": text}]) for text in
               ["Say hi.", "List three prime numbers and explain why each is prime.", "What is 2+2? Answer briefly."]]
    stops, pad = stop_token_ids(smollm), tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ours = generate_batch(smollm, prompts, 24, stops, pad)
    assert any(len(r) < 24 for r in ours) and any(len(r) == 24 for r in ours)  # rows really leave early
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        ref = smollm.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=24, do_sample=False,
                                    pad_token_id=pad)[:, width:].tolist()
    for row, hf in zip(ours, ref):
        assert row == hf[: len(row)] and (len(row) == 24 or row[-1] in stops)
    for p, row in zip(prompts, ours):
        assert generate_batch(smollm, [p], 24, stops, pad) == [row]
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampled = generate_batch(smollm, prompts, 16, stops, pad, temperature=0.8, generator=g1)
    assert sampled == generate_batch(smollm, prompts, 16, stops, pad, temperature=0.8, generator=g2)
    assert sampled != [r[:16] for r in ours]  # really sampled, not greedy


def test_training_runs_as_a_ray_train_job_and_saves_the_head(tiny, features, tmp_path, monkeypatch):
    """A real Ray Train TorchTrainer (one CPU worker) loads the target by path and trains on the cache,
    with the threads of all the (local, 2-CPU) cluster's cores, not Ray Train's default single CPU."""
    import ray

    from jetflow.train.ray_train import train_on_ray

    # each training is a live MLflow run (tests/test_live_tracking.py): keep them out of the real store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    model_dir = tmp_path / "tiny-qwen3"
    tiny.model.save_pretrained(model_dir)
    cfg = TrainConfig(name="ray", num_hidden_layers=1, block_size=6, max_steps=3, anchors_per_seq=4, seqs_per_step=2,
                      eval_sequences=2, checkpoint_every=1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        metrics = train_on_ray(cfg, str(model_dir), features, tmp_path / "head", storage=tmp_path / "ray")
        # the online mode: the workers get the regenerated data and the spec, not a cache folder
        cached = FeatureCache(features)
        spec = FeatureSpec.from_dict(cached.meta["spec"])
        online = train_on_ray(cfg, str(model_dir), OnlineFeatures(features.parent / "regen", tiny, spec),
                              tmp_path / "online", storage=tmp_path / "ray")
    finally:
        ray.shutdown()
    assert metrics["step"] == 3 and "eval/chain_tau" in metrics
    assert metrics["train/threads"] == online["train/threads"] == 2
    assert online["eval/chain_tau"] == metrics["eval/chain_tau"]
    head = load_head(tmp_path / "head")
    assert head.config.block_size == 6 and head.config.target_layer_ids == [1, 2, 3]
    assert (tmp_path / "head" / "checkpoints").exists()


ENTRY_POINTS = [  # (script argv, its typed options class): the one config surface of every entry point
    (["jobs/train.py"], "jetflow.train.config:TrainConfig"),
    (["jobs/datagen.py"], "jetflow.data.regenerate:RegenConfig"),
    (["jobs/evaluate.py"], "jetflow.eval.job:EvaluateJob"),
    (["sweeps/budget.py"], "jetflow.main_job:MainJobConfig"),
    (["sweeps/arch.py"], "jetflow.sweeps.arch:ArchSweepConfig"),
    (["-m", "jetflow.cli", "generate"], "jetflow.cli:GenerateOptions"),
    (["-m", "jetflow.cli", "demo"], "jetflow.cli:DemoOptions"),
    (["-m", "jetflow.cli", "export"], "jetflow.cli:ExportOptions"),
    (["jobs/promote.py"], "jetflow.tracking.promotion:PromoteJob"),
    (["jobs/register.py"], "jetflow.tracking.runs:RegisterJob"),
    (["jobs/train.py"], "jetflow.train.pipeline:TrainJob"),
    (["jobs/datagen.py"], "jetflow.train.pipeline:DatagenJob"),
]


def _leaf_fields(cls) -> list[tuple[type, dataclasses.Field]]:
    """Every option a dataclass contributes: its own fields, and those of nested dataclass fields."""
    import typing

    from jetflow.config_cli import _fields

    out = []
    for f, _, nested in _fields(cls):
        out += _leaf_fields(nested) if nested is not None else [(cls, f)]
    return out


@functools.lru_cache(maxsize=None)
def _help(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    """`python ARGV --help` run as a user runs it; once per script (jobs/train.py and jobs/datagen.py each
    document two config classes, checked against the same output)."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True,
                          cwd=root, timeout=120, env={**os.environ, "PYTHONPATH": str(root / "platform")})


@pytest.mark.parametrize("argv,config", ENTRY_POINTS, ids=[" ".join(a) for a, _ in ENTRY_POINTS])
def test_help_documents_every_option_with_its_comment_and_default(argv, config):
    import importlib
    import re

    from jetflow.config_cli import field_comments

    module, _, name = config.partition(":")
    cls = getattr(importlib.import_module(module), name)
    leaves = _leaf_fields(cls)
    undocumented = [f.name for owner, f in leaves if not field_comments(owner).get(f.name)]
    assert not undocumented, f"{config} fields without a comment to show in --help: {undocumented}"
    out = _help(tuple(argv))
    assert out.returncode == 0, out.stderr
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=--)", out.stdout)]  # one per option, unwrapped
    for owner, f in leaves:
        flag = "--" + f.name.replace("_", "-")
        entry = next((e for e in entries if e.startswith(flag + " ") or e.startswith(flag + ",")), "")
        comment = field_comments(owner)[f.name]
        assert " ".join(comment.split()[:3]) in entry, (flag, entry)
        assert "(default" in entry or "(required" in entry, (flag, entry)
    if cls is TrainConfig:  # a continuation line joins its field's help; a section title does not
        comments = field_comments(TrainConfig)
        assert comments["copy_ngram"].endswith("0 = off") and "initialisation" not in comments["draft_vocab_size"]
