"""vLLM for real, on its CPU build (`make test-vllm`, in .venv-vllm; marker `vllm`): on the bundled target
(SmolLM2-135M, fp32, CPU)

- regeneration with backend="vllm" writes the HF backend's shard and manifest layout, and its greedy texts;
- a head trained here, exported, under vLLM's `dflash` method: vLLM AR's and JetFlow AR's tokens, and a mean
  acceptance length within 0.05 of JetFlow's chain τ for the same head on the same prompts;
- the vLLM rows of `jobs/evaluate.py` beside ours in one report;
- `benchmarks/vllm_device_check.py` on a CPU.

vLLM engines take about a minute each to start here, so the file builds two — AR and DFlash — in module
fixtures through `jetflow.vllm.engine`, whose per-process cache hands the same engines to the library's own
calls (regeneration, the evaluation's rows, the device check). The head is trained in the file (~30 s) on the HF
regeneration of the very prompts it is then decoded on: it has memorised them, so vLLM accepts drafts at many
depths and the τ comparison has something to compare (an untrained head's τ is ~1.0 everywhere).
Prints what it measured (run with -s): agreement rate, acceptance lengths, engine start times.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jetflow.vllm import vllm_available

if not vllm_available():
    if os.environ.get("JETFLOW_TEST_VLLM"):  # `make test-vllm`: missing vLLM is a failure, not a skip
        raise RuntimeError(f"vLLM is not importable by {sys.executable}: run `make setup-vllm`")
    pytest.skip("vLLM is not installed in this environment: `make setup-vllm`, then `make test-vllm`",
                allow_module_level=True)

pytestmark = pytest.mark.vllm

MODEL = "smollm2-135m"
REGEN = dict(model=MODEL, prompt_sets=["sharegpt", "gsm"], num_prompts=6, max_prompt_tokens=192,
             max_new_tokens=64, shard_size=3, batch_size=3)
K = 4                       # drafted tokens per step: the head's block is K + 1
NEW = 64                    # tokens decoded per prompt in the DFlash comparison
MAX_MODEL_LEN = 1024        # every engine of the file; later asks for less reuse it
TAU_TOLERANCE = 0.05
# Two engines' fp32 kernels (vLLM's oneDNN matmuls, torch's) sum in other orders: where the target's own top-2
# logits are closer than this, either token is greedy (jetflow.decode.lossless.TIE is 1e-4 within JetFlow).
CROSS_ENGINE_TIE = 1e-3


def _timed(label: str, fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    print(f"\n[test_vllm_cpu] {label}: {time.perf_counter() - t:.1f} s", flush=True)
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-cpu")


@pytest.fixture(scope="module")
def source() -> str:
    from jetflow.vllm.regenerate import model_source

    return model_source(MODEL)


@pytest.fixture(scope="module")
def ar_engine(source):
    """vLLM's AR engine for the file (regeneration, vLLM AR, the evaluation's vllm_ar row, the device check)."""
    from jetflow.vllm.engine import close_engines, engine

    yield _timed("vLLM AR engine start", engine, source, dtype="float32", max_model_len=MAX_MODEL_LEN)
    close_engines()


@pytest.fixture(scope="module")
def regen_hf(work):
    from jetflow.data.regenerate import RegenConfig, regenerate

    return _timed("HF regeneration", regenerate, RegenConfig(**REGEN), out=work / "regen-hf", progress=False)


@pytest.fixture(scope="module")
def regen_vllm(work, ar_engine):
    from jetflow.data.regenerate import RegenConfig, regenerate

    return _timed("vLLM regeneration", regenerate, RegenConfig(**REGEN, backend="vllm"), out=work / "regen-vllm",
                  progress=False)


@pytest.fixture(scope="module")
def head_dir(smollm, regen_hf, work) -> Path:
    """A head vLLM runs exactly (no JetFlow-only inputs; a 2,048-id draft vocabulary, so the export carries
    lm_head + d2t as the demo-vllm head's does), trained briefly on the HF regeneration."""
    from jetflow.data.features import FeatureCache, FeatureSpec, build_features
    from jetflow.train.config import TrainConfig
    from jetflow.train.trainer import train

    cfg = TrainConfig(name="vllm-cpu", num_hidden_layers=1, block_size=K + 1, num_taps=3, draft_vocab_size=2048,
                      max_steps=120, anchors_per_seq=32, seqs_per_step=4, lr=3e-3, eval_sequences=1,
                      checkpoint_every=10_000)
    spec = FeatureSpec.for_target(smollm, cfg.num_taps, REGEN["max_prompt_tokens"] + REGEN["max_new_tokens"])
    features = build_features(regen_hf, smollm, spec, out=work / "features", progress=False)
    _timed("head training (120 steps)", train, cfg, smollm, FeatureCache(features), work / "head", progress=False)
    return work / "head"


@pytest.fixture(scope="module")
def exported(smollm, head_dir, work) -> Path:
    """The head in vLLM's DFlash layout, where the device check's own export lands (so it finds the engine)."""
    from jetflow.vllm.export import export_vllm

    return export_vllm(head_dir, work / "check" / "head-vllm", lm_head_weight=smollm.lm_head_weight,
                       lm_head_bias=smollm.lm_head_bias, overwrite=True)


@pytest.fixture(scope="module")
def dflash_engine(source, exported, ar_engine):
    from jetflow.vllm.engine import engine
    from jetflow.vllm.generate import dflash_config

    return _timed("vLLM DFlash engine start", engine, source, dtype="float32", max_model_len=MAX_MODEL_LEN,
                  speculative_config=dflash_config(exported, K))


@pytest.fixture(scope="module")
def prompts(regen_hf) -> list[list[int]]:
    """The regenerated prompts (chat-templated token ids): what the head was trained on."""
    from jetflow.data.regenerate import load_regenerated

    return [list(p) for p in load_regenerated(regen_hf)["prompt_ids"]]


@pytest.fixture(scope="module")
def jetflow_runs(smollm, head_dir, prompts) -> dict:
    """JetFlow's reference decoder: AR (no head) and the chain of K drafts with the head, greedy."""
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.head import load_head
    from jetflow.tree import TreeSpec

    head = load_head(head_dir)
    ar, chain = Decoder(smollm), Decoder(smollm, head)
    t = time.perf_counter()
    runs = {"ar": [], "chain": [], "committed": [], "verifies": [], "first_round": []}
    for ids in prompts:
        runs["ar"].append(ar.generate(ids, DecodeConfig(max_new_tokens=NEW)).token_ids)
        g = chain.generate(ids, DecodeConfig(tree=TreeSpec("chain", budget=K + 1), max_new_tokens=NEW))
        runs["chain"].append(g.token_ids)
        runs["committed"] += g.stats.committed_per_round
        runs["verifies"].append(len(g.stats.committed_per_round))
        runs["first_round"].append(g.stats.committed_per_round[0])
    print(f"\n[test_vllm_cpu] JetFlow AR + chain on {len(prompts)} prompts: {time.perf_counter() - t:.1f} s")
    return runs


@pytest.fixture(scope="module")
def vllm_runs(source, prompts, smollm, exported, ar_engine, dflash_engine) -> dict:
    """vLLM greedy, prompt after prompt (`jetflow.vllm.generate`, the baseline rows' runner), AR and DFlash."""
    from jetflow.decode import stop_token_ids
    from jetflow.vllm.generate import dflash_config, generate_greedy

    stops = sorted(stop_token_ids(smollm))
    common = dict(dtype="float32", max_model_len=max(map(len, prompts)) + NEW + K + 1)
    ar = generate_greedy(source, prompts, NEW, stops, **common)
    spec = generate_greedy(source, prompts, NEW, stops, speculative_config=dflash_config(exported, K), **common)
    assert ar.startup_s < 1 and spec.startup_s < 1, "generate_greedy built an engine instead of reusing the fixture's"
    return {"ar": ar, "dflash": spec}


def _compare(target, prompt, got, expected) -> tuple[str | None, bool]:
    """(None, True) when two greedy outputs are identical; else (where they first differ, whether the target's
    top-2 logits tie there within CROSS_ENGINE_TIE — both tokens greedy, each output then its own greedy)."""
    from jetflow.decode.lossless import first_divergence

    d = first_divergence(target, prompt, got, expected)
    if d is None:
        return None, True
    return (f"first differs at generated position {d.index} (got {d.got}, expected {d.expected}; target top-2 "
            f"logit gap {d.gap:.3g})"), d.gap < CROSS_ENGINE_TIE


# ----------------------------------------------------------------------------- regeneration
def test_vllm_regeneration_writes_the_hf_layout_and_its_greedy_texts(regen_hf, regen_vllm, smollm):
    from jetflow.data.regenerate import MANIFEST, SCHEMA

    files = sorted(p.name for p in regen_hf.iterdir())
    assert files == sorted(p.name for p in regen_vllm.iterdir()) == [MANIFEST, "shard-00000.parquet",
                                                                     "shard-00001.parquet"]
    hf_m, v_m = (json.loads((d / MANIFEST).read_text()) for d in (regen_hf, regen_vllm))
    assert set(hf_m) == set(v_m)
    assert {k: v for k, v in v_m["settings"].items() if k != "backend"} == \
           {k: v for k, v in hf_m["settings"].items() if k != "backend"}
    assert (hf_m["settings"]["backend"], v_m["settings"]["backend"]) == ("hf", "vllm")
    assert v_m["settings"]["dtype"] == "fp32" and v_m["sequences"] == hf_m["sequences"] == REGEN["num_prompts"]
    for k in ("target_model_id", "target_revision", "chat_template_sha256", "shards"):
        assert v_m[k] == hf_m[k], k

    hf_rows, v_rows = [], []
    for name in ("shard-00000.parquet", "shard-00001.parquet"):
        a, b = pq.read_table(regen_hf / name), pq.read_table(regen_vllm / name)
        assert a.schema.equals(SCHEMA) and b.schema.equals(SCHEMA)
        assert a["prompt_id"].to_pylist() == b["prompt_id"].to_pylist()
        assert a["prompt_ids"].to_pylist() == b["prompt_ids"].to_pylist()  # same prompts, same chat template
        hf_rows += list(zip(a["prompt_ids"].to_pylist(), a["response_ids"].to_pylist(), a["finish_reason"].to_pylist()))
        v_rows += list(zip(b["prompt_ids"].to_pylist(), b["response_ids"].to_pylist(), b["finish_reason"].to_pylist()))

    same, report, untied = 0, [], []
    for i, ((prompt, hf, hf_finish), (_, v, v_finish)) in enumerate(zip(hf_rows, v_rows)):
        where, tie = _compare(smollm, prompt, v, hf)
        if where is None:
            assert v_finish == hf_finish
            same += 1
            continue
        report.append(f"prompt {i}: {where}")
        if not tie:
            untied.append(report[-1])
    print(f"\n[test_vllm_cpu] regeneration, vLLM vs HF backend (fp32, greedy, {REGEN['max_new_tokens']} new tokens): "
          f"{same}/{len(hf_rows)} responses token-identical; {hf_m['response_tokens']} response tokens in "
          f"{hf_m['seconds']:.1f} s (HF, batch {REGEN['batch_size']}) and {v_m['seconds']:.1f} s (vLLM, engine "
          "started)" + "".join(f"\n    {r}" for r in report))
    # Greedy on the same fp32 weights: a response may only part where the target's own two best tokens tie
    # (another engine's kernels sum in another order); anything else is a wrong token.
    assert not untied, "vLLM's greedy text left the HF backend's where the target has no tie:\n" + "\n".join(untied)


# ----------------------------------------------------------------------------- an exported head under dflash
def test_exported_head_under_vllm_dflash_decodes_vllm_ars_and_jetflow_ars_tokens(vllm_runs, jetflow_runs, prompts,
                                                                                  smollm):
    ar, spec = vllm_runs["ar"].token_ids, vllm_runs["dflash"].token_ids
    lines, wrong = [], []
    for i, prompt in enumerate(prompts):
        for name, got, expected in (("vLLM dflash vs vLLM AR", spec[i], ar[i]),
                                    ("vLLM AR vs JetFlow AR", ar[i], jetflow_runs["ar"][i]),
                                    ("JetFlow chain vs JetFlow AR", jetflow_runs["chain"][i], jetflow_runs["ar"][i])):
            where, tie = _compare(smollm, prompt, got, expected)
            if where is not None:
                lines.append(f"prompt {i}, {name}: {where}")
                if not tie:
                    wrong.append(lines[-1])
    print(f"\n[test_vllm_cpu] dflash vs AR on {len(prompts)} prompts: vLLM dflash == vLLM AR on "
          f"{sum(a == b for a, b in zip(spec, ar))}, vLLM AR == JetFlow AR on "
          f"{sum(a == b for a, b in zip(ar, jetflow_runs['ar']))}" + "".join(f"\n    {x}" for x in lines))
    assert not wrong, "greedy outputs that part where the target has no tie:\n" + "\n".join(wrong)
    assert vllm_runs["dflash"].drafts > 0  # vLLM really speculated with the exported head


def test_vllm_mean_acceptance_length_is_our_chain_tau_for_the_same_head(vllm_runs, jetflow_runs):
    """τ = tokens committed per target verify, pooled over the prompts. The two count one step differently:
    vLLM's prefill takes the whole prompt and samples the first token without drafts, JetFlow's round 1
    verifies the prompt's last token with drafts — so JetFlow has one verify more per prompt (printed), and
    its τ without each prompt's first round is printed beside it. The check is on τ as JetFlow reports it."""
    spec = vllm_runs["dflash"]
    ours = sum(jetflow_runs["committed"]) / len(jetflow_runs["committed"])
    n = len(jetflow_runs["verifies"])
    aligned = ((sum(jetflow_runs["committed"]) - sum(jetflow_runs["first_round"]))
               / (len(jetflow_runs["committed"]) - n))
    print(f"\n[test_vllm_cpu] same head, same {len(jetflow_runs['ar'])} prompts, {NEW} tokens, chain of {K}: vLLM "
          f"mean acceptance length {spec.mean_acceptance_length:.3f} ({spec.accepted} accepted / {spec.drafts} "
          f"steps), JetFlow chain τ {ours:.3f} ({sum(jetflow_runs['committed'])} tokens / "
          f"{len(jetflow_runs['committed'])} verifies; {aligned:.3f} without each prompt's first round); "
          f"vLLM AR {vllm_runs['ar'].tokens_per_s:.1f} tok/s, dflash {spec.tokens_per_s:.1f} tok/s (shared host); "
          f"steps per prompt, vLLM {spec.prompt_drafts}, JetFlow {jetflow_runs['verifies']}")
    assert ours > 1.2, f"the trained head accepts too little ({ours:.2f}) for the comparison to mean anything"
    assert abs(spec.mean_acceptance_length - ours) <= TAU_TOLERANCE


# ----------------------------------------------------------------------------- the evaluation's vLLM rows
def test_evaluate_reports_vllm_ar_and_dflash_rows_beside_ours(head_dir, exported, work, ar_engine, dflash_engine):
    from jetflow.eval.config import EvalConfig
    from jetflow.eval.job import EvaluateJob, run_evaluation_job
    from jetflow.tracking.report import validate_report

    out = work / "report.json"
    job = EvaluateJob(model=MODEL, head=str(head_dir), out=str(out), mlflow=False, eval=EvalConfig(
        sets=["mtbench", "humaneval"], prompts_per_set=1, timed_prompts=1, budgets=[K + 1],
        algorithms=["chain"], baselines=False, cost_model=False, graphs="off", vllm=True, vllm_head=str(exported),
        max_new_tokens=16))
    assert _timed("jobs/evaluate.py with --vllm", run_evaluation_job, job) == 0
    report = validate_report(json.loads(out.read_text()))
    by = {(r.dataset, r.method): r for r in report.rows}
    for ds in ("mtbench", "humaneval"):
        ours_ar, v_ar, v_spec = by[(ds, "ar")], by[(ds, "vllm_ar")], by[(ds, "vllm_dflash")]
        assert ours_ar.tokens_per_s > 0 and v_ar.tokens_per_s > 0 and v_spec.tokens_per_s > 0
        assert v_ar.tau == 1.0 and v_spec.tau >= 1.0 and v_spec.lossless is True
        assert v_spec.tree == {"algorithm": "chain", "budget": K + 1, "width": 1}
        assert v_spec.model_extra["vllm_version"] == "0.32.0"
        assert any(r.dataset == ds and r.method not in ("ar", "vllm_ar", "vllm_dflash") for r in report.rows)
    assert any(k.startswith("tokens_per_s") and "vllm_ar" in k for k in report.metrics)


# ----------------------------------------------------------------------------- the device check
def test_vllm_device_check_runs_on_a_cpu(head_dir, exported, work, ar_engine, dflash_engine):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_device_check.py"
    spec = importlib.util.spec_from_file_location("vllm_device_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    code = _timed("benchmarks/vllm_device_check.py --device cpu", check.main,
                  ["--device", "cpu", "--head", str(head_dir), "--prompts", "1", "--max-new-tokens", "16",
                   "--out", str(work / "check")])
    summary = json.loads((work / "check" / "summary.json").read_text())
    assert code == 0, summary
    assert summary["device"].startswith("CPU") and summary["pinned"] == summary["vllm_version"] == "0.32.0"
    assert summary["spec_equals_ar"] == summary["spec_equals_jetflow"] == summary["prompts"] == 2
    assert summary["startup_s"][0] < 1 and summary["startup_s"][1] < 1  # the file's engines, reused
    assert summary["mean_acceptance_length"] is not None and summary["mean_acceptance_length"] >= 1.0


# ----------------------------------------------------------------------------- the sweep's baseline and backends
def test_the_budget_sweep_names_vllm_ar_its_baseline_and_times_both_backends(head_dir, tmp_path, monkeypatch):
    """With vLLM importable, the budget sweep's timed trial runs vLLM AR on the same prompts right after ours (the
    baseline every figure names), and its backend pass runs the serving setting on JetFlow's engine beside vLLM AR
    and vLLM DFlash with the head exported, at each load; the decision, the parent run and its tables carry them."""
    import ray

    from jetflow.main_job import MainJobConfig, run_main_job
    from jetflow.paths import models_dir
    from jetflow.sweeps.budget import BudgetSweepConfig
    from jetflow.tracking.promotion import evidence_text
    from jetflow.tracking.store import client

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models_dir(), target_is_directory=True)
    monkeypatch.setenv("JETFLOW_HOME", str(home))  # Ray's workers inherit it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    sweep = BudgetSweepConfig(budgets=[K + 1], algorithms=["chain"], sets=["mtbench"], prompts_per_set=1,
                              max_new_tokens=16, finalists=1, timed_prompts=2, timed_repeats=1, concurrency=[1],
                              backend_concurrency=[1, 2], select="tau", graphs="off", storage=str(tmp_path / "tune"),
                              name="vllm-sweep")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = _timed("budget sweep with vLLM beside it", run_main_job,
                     MainJobConfig(head=str(head_dir), store_best=False, sweep=sweep)).sweep
    finally:
        ray.shutdown()
    assert out.errors == {} and out.complete
    d = out.decision
    assert (d["baseline"], d["baseline_label"], d["vllm_version"]) == ("vllm_ar", "vLLM AR", "0.32.0"), d
    ar = d["ar"]["mtbench"]
    assert ar["vllm_ar_tokens_per_s"] > 0 and ar["jetflow_ar_tokens_per_s"] > 0
    assert ar["jetflow_ar_vs_vllm_ar"] == pytest.approx(ar["jetflow_ar_tokens_per_s"] / ar["vllm_ar_tokens_per_s"])
    assert "vLLM AR" in evidence_text(d) and "JetFlow AR" in evidence_text(d)
    b = d["backends"]
    assert b["levels"] == [1, 2] and set(b["sets"]["mtbench"]) == {"c1", "c2"}
    assert set(b["score"]) == {"jetflow", "vllm_ar", "vllm_dflash"}, b["notes"]  # all three measured at each load
    assert d["backend"] == b["backend"] in ("jetflow", "vllm") and b["dflash_tau"] >= 1.0
    print(f"\n[test_vllm_cpu] sweep baseline: JetFlow AR {ar['jetflow_ar_tokens_per_s']:.1f} tok/s, vLLM AR "
          f"{ar['vllm_ar_tokens_per_s']:.1f}; backends (geometric mean tok/s over loads 1, 2): "
          + ", ".join(f"{k} {v:.1f}" for k, v in b["score"].items()) + f" -> {b['winner']}")
    parent = client().get_run(out.parent_run_id).data
    assert parent.tags["jetflow.baseline"] == "vLLM AR" and parent.tags["jetflow.serving.backend"] == d["backend"]
    assert parent.metrics["vllm_ar_tokens_per_s/mtbench"] == pytest.approx(ar["vllm_ar_tokens_per_s"])
    assert any(k.startswith("backend_tokens_per_s/mtbench/vllm_dflash/") for k in parent.metrics)


# ----------------------------------------------------------------------------- Serve with backend: vllm
SERVE_KEY = "vllm-backend-key"


@pytest.fixture(scope="module")
def vllm_served(head_dir, tmp_path_factory):
    """Our Serve app with `backend: vllm` on 127.0.0.1: the head above, exported by the replica itself, under
    vLLM's dflash method; an API key. (A Ray cluster of this file's own, stopped at the end.)"""
    import socket

    import ray
    from ray import serve

    from jetflow.paths import models_dir
    from jetflow.serving.app import build_app

    home = tmp_path_factory.mktemp("vllm-serve-home")
    (home / "models").symlink_to(models_dir(), target_is_directory=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JETFLOW_HOME", str(home))  # the replica's export lands in this home's vllm-heads/
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
        mp.setenv("RAY_raylet_start_wait_time_s", "120")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            t = time.perf_counter()
            serve.run(build_app({"backend": "vllm", "head": str(head_dir), "api_key": SERVE_KEY, "max_slots": 4,
                                 "max_prompt_tokens": 256, "max_tokens": NEW, "default_max_tokens": 16, "replica_cpus": 1,
                                 "graphs": "off"}),  # vLLM eager: starts in ~25 s (compiled ~100 s)
                      name="vllm", route_prefix="/vllm")
            print(f"\n[test_vllm_cpu] Serve app with backend vllm ready in {time.perf_counter() - t:.1f} s")
            yield f"http://127.0.0.1:{port}/vllm", home
        finally:
            serve.shutdown()
            ray.shutdown()


def test_serve_backend_vllm_answers_real_http_with_jetflow_ars_tokens_behind_the_api_key(vllm_served, prompts,
                                                                                        jetflow_runs, smollm):
    import requests

    url, home = vllm_served
    auth = {"Authorization": f"Bearer {SERVE_KEY}"}
    assert requests.get(f"{url}/v1/models", timeout=60).status_code == 401  # the key holds on this backend too
    health = requests.get(f"{url}/healthz", timeout=60).json()  # /healthz needs no key
    assert health["status"] == "ok" and health["backend"] == "vllm" and health["speculative"] is True
    assert "dflash" in health["runs"] and f"{K} speculative tokens" in health["runs"]
    assert list((home / "vllm-heads").iterdir()), "the replica exported the head into its home"
    wrong = []
    for i, ids in enumerate(prompts[:3]):  # token ids in, greedy: JetFlow AR's tokens out
        r = requests.post(f"{url}/v1/completions", headers=auth, timeout=300, json={
            "model": MODEL, "prompt": ids, "max_tokens": NEW, "temperature": 0, "logprobs": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        assert usage["jetflow"]["backend"] == "vllm" and usage["jetflow"]["tree"]["algorithm"] == "chain"
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == len(jetflow_runs["ar"][i])
        got = smollm.tokenizer.encode(body["choices"][0]["text"], add_special_tokens=False)
        expected = jetflow_runs["ar"][i]
        if smollm.tokenizer.decode(expected, skip_special_tokens=True) != body["choices"][0]["text"]:
            where, tie = _compare(smollm, ids, got, expected)
            if not tie:
                wrong.append(f"prompt {i}: {where}")
        assert len(body["choices"][0]["logprobs"]["tokens"]) == usage["completion_tokens"]
    assert not wrong, "backend vllm served other tokens than greedy AR:\n" + "\n".join(wrong)
    # a streamed chat completion ends with the same text as the unstreamed one
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name three primary colors."}],
            "max_tokens": 24, "temperature": 0}
    whole = requests.post(f"{url}/v1/chat/completions", headers=auth, json=chat, timeout=300).json()
    streamed = ""
    with requests.post(f"{url}/v1/chat/completions", headers=auth, json={**chat, "stream": True}, stream=True,
                       timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    assert streamed == whole["choices"][0]["message"]["content"] and streamed
    bad = requests.post(f"{url}/v1/completions", headers=auth, json={"model": MODEL, "prompt": "x", "max_tokens": 10**6},
                        timeout=60)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


def test_serve_backend_vllm_refuses_a_head_vllm_cannot_run_in_one_line_before_any_replica(smollm, tmp_path):
    from jetflow.errors import ExportUnsupportedError
    from jetflow.head import DraftHead, HeadConfig, save_head
    from jetflow.serving.app import build_app

    folder = save_head(DraftHead(HeadConfig.for_target(smollm, block_size=4, num_hidden_layers=1, copy_ngram=2)),
                       tmp_path / "copy-head")
    with pytest.raises(ExportUnsupportedError) as err:
        build_app({"backend": "vllm", "head": str(folder)})
    assert "\n" not in str(err.value) and "backend: jetflow" in str(err.value)
