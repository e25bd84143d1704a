"""Evaluation: the cost model's arithmetic and curve files, EvalConfig validation, the report contract on a
real small comparison (our decoder, AR, HF generate and HF prompt lookup on the same prompts), and
jobs/evaluate.py as a user runs it: one-line errors with exit code 2, and a run logged to MLflow."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jetflow.errors import InvalidSettingError
from jetflow.eval import CostCurve, EvalConfig, evaluate, measure_verify_curve
from jetflow.eval.compare import Setting, settings_for
from jetflow.eval.cost_model import time_verify
from jetflow.eval.table import report_markdown, rows_table
from jetflow.head import DraftHead, HeadConfig, HeadRef, LoadedHead, save_head
from tests.conftest import tiny_target

ROOT = Path(__file__).resolve().parents[1]
ROW_KEYS = {"dataset", "method", "algorithm", "budget", "width", "temperature", "tree", "tau", "tokens_per_s",
            "speedup_vs_ar", "speedup_vs_hf", "e2e_speedup", "predicted_speedup", "lossless", "draft_ms",
            "verify_ms", "other_ms"}
# One intra-op thread: on a small shared machine OpenMP threads spinning against other work make short
# generations several times slower; no output checked here depends on the thread count.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------------ cost model
def test_predicted_speedup_is_tau_times_t1_over_verify_plus_draft():
    curve = CostCurve("test", 200, (1, 8, 32), (10.0, 20.0, 40.0))
    assert curve.predict_speedup(2.0, 8, draft_ms=5.0) == pytest.approx(2 * 10 / (20 + 5))
    assert curve.predict_speedup(2.0, 8, draft_ms=5.0, overhead_ms=5.0) == pytest.approx(20 / 30)
    assert curve.t(16) == pytest.approx(20 + 20 * 8 / 24)            # linear between 8 and 32
    assert curve.predict_speedup(3.0, 16, draft_ms=0.0) == pytest.approx(30 / (20 + 20 * 8 / 24))
    assert curve.t(64) == pytest.approx(40 + 20 * 32 / 24)            # the last segment, extended
    assert curve.t(0.5) == 10.0 and curve.t(8) == 20.0
    assert curve.predict_speedup(1.0, 1, draft_ms=7.0) == 1.0         # budget 1 is AR: no draft
    with_draft = CostCurve("test", 200, (1, 8, 32), (10.0, 20.0, 40.0), draft_ms=10.0)
    assert with_draft.predict_speedup(2.0, 8) == pytest.approx(20 / 30)  # the curve's own draft cost
    assert with_draft.predict_speedup(2.0, 8, draft_ms=0.0) == pytest.approx(1.0)


def test_best_budget_follows_the_device_curve():
    taus = {8: 2.0, 32: 3.0}
    cpu = CostCurve("cpu", 200, (1, 8, 32), (10.0, 20.0, 40.0))      # verify cost grows with N
    gpu = CostCurve("gpu", 200, (1, 8, 32), (10.0, 10.5, 11.0))      # nearly flat
    assert cpu.best_budget(taus) == (8, pytest.approx(1.0))
    assert gpu.best_budget(taus) == (32, pytest.approx(30 / 11))
    with pytest.raises(InvalidSettingError):
        cpu.best_budget({})


def test_cost_curve_json_round_trip(tmp_path):
    curve = CostCurve("NVIDIA H100", 300, (1, 16, 128), (12.5, 13.0, 15.25), draft_ms=1.5)
    path = curve.save(tmp_path / "sub" / "h100.json")
    assert CostCurve.load(path) == curve
    assert json.loads(path.read_text()) == {"device": "NVIDIA H100", "context_tokens": 300, "n": [1, 16, 128],
                                            "t_ms": [12.5, 13.0, 15.25], "draft_ms": 1.5}
    assert CostCurve.from_dict({k: v for k, v in curve.to_dict().items() if k != "draft_ms"}).draft_ms is None


@pytest.mark.parametrize("n, t_ms, fragment", [
    ((2, 8), (1.0, 2.0), "start at 1"),
    ((1, 8, 4), (1.0, 2.0, 3.0), "strictly increase"),
    ((1, 8), (1.0,), "as many t_ms"),
    ((1, 8), (1.0, 0.0), "positive"),
    ((1, 8), (1.0, math.nan), "positive"),
])
def test_malformed_cost_curve_is_refused(n, t_ms, fragment):
    with pytest.raises(InvalidSettingError, match=fragment):
        CostCurve("x", 10, n, t_ms)


def test_unreadable_cost_curve_files_are_refused(tmp_path):
    with pytest.raises(InvalidSettingError, match="no cost curve"):
        CostCurve.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InvalidSettingError, match="not valid JSON"):
        CostCurve.load(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text('{"device": "cpu", "n": [1]}')
    with pytest.raises(InvalidSettingError, match="not a cost curve"):
        CostCurve.load(tmp_path / "partial.json")


def test_verify_curve_times_every_size_with_the_real_tree_masked_forward(one_thread):
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, num_hidden_layers=1, block_size=8))
    curve = measure_verify_curve(target, [16, 4, 4], context_tokens=32, repeats=2, head=head)
    assert curve.n == (1, 4, 16) and curve.context_tokens == 32
    assert all(t > 0 for t in curve.t_ms) and curve.draft_ms > 0
    assert curve.device.startswith("cpu")
    rows = time_verify(target, [1, 8], context_tokens=16, repeats=1)
    assert [r.n for r in rows] == [1, 8]
    assert all(r.body_ms > 0 and r.verify_ms > 0 and r.naive_ms > 0 for r in rows)


def test_hf_baselines_run_on_our_prompt_ids_and_count_their_forwards(one_thread):
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.eval.baselines import hf_generate

    target = tiny_target("llama")
    ids = [5, 17, 3, 99, 5, 17, 3, 42, 7]
    ours = Decoder(target).generate(ids, DecodeConfig(max_new_tokens=10)).token_ids
    plain = hf_generate(target, ids, 10)
    assert plain.token_ids == ours                              # same greedy tokens as our AR loop
    assert plain.forwards == len(plain.token_ids)              # one forward per token, the prefill's included
    assert plain.decode_tokens == len(plain.token_ids) - 1
    assert plain.prefill_s > 0 and plain.decode_s >= plain.forward_s > 0
    lookup = hf_generate(target, ids, 10, prompt_lookup_num_tokens=3)
    assert lookup.token_ids == ours and lookup.forwards <= len(lookup.token_ids)
    sampled = [hf_generate(target, ids, 10, temperature=1.0, seed=s).token_ids for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]                            # seeded
    assert hf_generate(target, ids, 10, temperature=1.0, seed=1, prompt_lookup_num_tokens=3).forwards >= 1


# ------------------------------------------------------------------------------------ EvalConfig
@pytest.mark.parametrize("kwargs, fragment", [
    ({"sets": ["no-such-set"]}, "unknown prompt set 'no-such-set'"),
    ({"sets": ["sharegpt"]}, "no held-out eval split"),
    ({"sets": []}, "sets"),
    ({"budgets": [0]}, "budget must be an integer in 1..4096"),
    ({"budgets": [8, 5000]}, "1..4096"),
    ({"budgets": [8.5]}, "budget must be"),
    ({"widths": [0]}, "width must be"),
    ({"algorithms": ["beam"]}, "unknown tree algorithm"),
    ({"algorithms": ["top2gap:gap=1"]}, "no parameter"),
    ({"temperatures": [-0.5]}, "temperature"),
    ({"temperatures": [math.inf]}, "temperature"),
    ({"prompts_per_set": 0}, "prompts_per_set"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens"),
])
def test_eval_config_refuses_bad_settings_with_a_clear_message(kwargs, fragment):
    with pytest.raises(InvalidSettingError, match=fragment):
        EvalConfig(**kwargs)


def test_eval_config_normalizes_lists_and_accepts_jsonl_files(tmp_path):
    prompts = tmp_path / "my prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    cfg = EvalConfig(sets=["mtbench", str(prompts), "mtbench"], budgets=[32, 8, 8], temperatures=[0.7, 0])
    assert cfg.sets == ["mtbench", str(prompts)]
    assert cfg.budgets == [8, 32] and cfg.temperatures == [0.0, 0.7]
    assert cfg.params()["budgets"] == "8,32" and cfg.params()["temperatures"] == "0,0.7"


def test_settings_name_the_head_kind_carry_tree_specs_and_cap_chains_at_the_block_size():
    from jetflow.metrics import parse_metric_key
    from jetflow.tree import TreeSpec

    target = tiny_target("llama")
    causal = LoadedHead(DraftHead(HeadConfig.for_target(target, num_hidden_layers=1, block_size=8)), HeadRef.parse("random"))
    bidir = LoadedHead(DraftHead(HeadConfig.for_target(target, num_hidden_layers=1, block_size=8, causal=False)),
                       HeadRef.parse("random-bidirectional"))
    cfg = EvalConfig(budgets=[4, 32, 64], widths=[3, 7], algorithms=["chain", "top2gap:margin=1.5"],
                     temperatures=[0, 0.7])
    settings = settings_for(cfg, [causal, bidir])
    assert len(settings) == len(set(settings))
    chains = [s for s in settings if s.method == "causal" and s.tree.is_chain and s.temperature == 0]
    assert [(s.tree.budget, s.tree.width) for s in chains] == [(4, 1), (8, 1)]  # 32 and 64 collapse onto the block
    assert {s.method for s in settings} == {"ar", "hf_generate", "hf_prompt_lookup", "causal", "bidirectional"}
    spec = TreeSpec("top2gap", 32, 7, {"margin": 1.5})
    setting = next(s for s in settings if s.method == "bidirectional" and s.tree == spec and s.temperature == 0.7)
    key = setting.key("tau", "mtbench")
    assert key == "tau/mtbench/bidirectional/top2gap.margin1.5-b32w7-t0.7"
    parsed = parse_metric_key(key)  # the tracking side reads our keys back, the algorithm's parameters too
    assert (parsed.dataset, parsed.method, parsed.tree, parsed.temperature) == ("mtbench", "bidirectional", spec, 0.7)
    assert settings[0].key("speedup_vs_ar", "humaneval") == "speedup_vs_ar/humaneval/ar/t0"
    with pytest.raises(InvalidSettingError, match="at most one causal"):
        evaluate(target, [causal, causal], cfg)


# ------------------------------------------------------------------------------ the real report
@pytest.mark.slow
def test_evaluate_report_follows_the_contract_and_is_lossless(smollm, one_thread):
    from jetflow.metrics import parse_metric_key
    from jetflow.tracking import validate_report

    torch.manual_seed(0)
    head = LoadedHead(DraftHead(HeadConfig.for_target(smollm)), HeadRef.parse("random"))
    cfg = EvalConfig(prompts_per_set=1, max_new_tokens=12, budgets=[4], curve_repeats=1, context_tokens=32,
                     concurrency=[2])
    report = evaluate(smollm, [head], cfg)

    validate_report(report)  # the tracking side's own check of the contract
    assert json.loads(json.dumps(report, allow_nan=False)) == report  # strict JSON, no NaN
    assert report["target"] == {"id": "smollm2-135m", "revision": smollm.revision}
    assert report["head"]["config"]["causal"] is True and report["head"]["path"] is None

    rows = report["rows"]
    assert {(r["dataset"], r["method"]) for r in rows} == {
        (ds, m) for ds in ("mtbench", "humaneval") for m in ("ar", "hf_generate", "hf_prompt_lookup", "causal")}
    for r in rows:
        assert ROW_KEYS <= r.keys(), ROW_KEYS - r.keys()
        assert r["lossless"] is True, r                     # every greedy output equals our AR's (AR: HF's)
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and r["e2e_speedup"] > 0
        assert r["prompts"] == 1 and 1 <= r["tokens"] <= 12
        assert (r["work_digest"] is None) == (r["method"] != "causal")  # the head's rows only
        if r["method"] == "ar":
            assert r["speedup_vs_ar"] == 1.0 and r["tau"] == 1.0
            assert r["draft_ms"] < 0.1 * r["verify_ms"]        # no head: only the root-only tree
        if r["method"] == "hf_generate":
            assert r["speedup_vs_hf"] == 1.0 and r["tau"] == 1.0
        if r["method"] == "causal":
            assert r["budget"] == 4 and r["predicted_speedup"] > 0 and r["draft_ms"] > 0
            assert r["algorithm"] in ("chain", "accum_logp") and r["tree"]["budget"] == 4
    assert report["metrics"]["lossless"] == 1.0
    ours = [r for r in rows if r["method"] in ("ar", "causal")]
    assert all(r["throughput"]["2"] > 0 and r["speedup_at"]["2"] > 0 for r in ours)  # two requests in flight
    assert [r["speedup_at"]["2"] for r in ours if r["method"] == "ar"] == [1.0, 1.0]
    assert report["metrics"]["tokens_per_s_c2/humaneval/causal/accum_logp-b4w7-t0"] > 0
    assert report["metrics"]["speedup_vs_ar/mtbench/ar/t0"] == 1.0
    assert "tau/humaneval/causal/accum_logp-b4w7-t0" in report["metrics"]
    assert "tau/humaneval/causal/chain-b4w1-t0" in report["metrics"]
    flat = {k for k in report["metrics"] if parse_metric_key(k) is None}  # the run's own, not a row's
    assert flat == {"lossless", "compile_s"} and report["metrics"]["compile_s"] == 0.0  # graphs off: nothing compiled

    depth = head.head.config.depth
    accept = report["step_metrics"]["accept_by_depth/mtbench/causal/accum_logp-b4w7-t0"]
    assert len(accept) == depth and all(0.0 <= a <= 1.0 for a in accept)
    assert accept == sorted(accept, reverse=True)           # reaching depth d+1 implies reaching d
    assert "mtbench/causal/chain-b4w1-t0" in report["rank_acceptance"]
    assert report["cost_model"]["n"] == [1, 4] and report["cost_model"]["context_tokens"] == 32

    table = rows_table(rows)
    assert len(table.splitlines()) == 2 + len(rows)
    assert "lossless: yes" in report_markdown(report)


# ---------------------------------------------------------------------------- jobs/evaluate.py
def evaluate_job(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "evaluate.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env or ENV, cwd=ROOT)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, last_line_only: bool = False) -> None:
    """Exit 2, no traceback, and ONE `evaluate: error:` line naming `fragments` (last_line_only: other
    libraries' log lines may come before it, e.g. MLflow creating a fresh store)."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert last_line_only or len(lines) == 1, result.stderr
    assert lines[-1].startswith("evaluate: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])


def load_job():
    """jobs/evaluate.py as a module (its main(argv) is what the script runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("evaluate_job", ROOT / "jobs" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_work_digest_tells_equal_decodes_from_different_ones():
    from collections import Counter

    from jetflow.decode.stats import DecodeStats

    def stats(committed, nodes, ranks):
        return DecodeStats(rounds=len(committed), committed_per_round=committed, tree_nodes=nodes,
                           accepted_ranks=Counter(ranks))

    a = stats([2, 1, 3], [4, 4, 4], {(1, 0): 2, (2, 0): 1})
    assert a.work_digest() == stats([2, 1, 3], [4, 4, 4], {(2, 0): 1, (1, 0): 2}).work_digest() < 2 ** 52
    assert float(a.work_digest()) == a.work_digest(), "exact as a float metric"
    assert a.work_digest() != stats([2, 1, 3], [4, 4, 2], {(1, 0): 2, (2, 0): 1}).work_digest()  # nodes verified
    assert a.work_digest() != stats([1, 2, 3], [4, 4, 4], {(1, 0): 2, (2, 0): 1}).work_digest()  # round order
    assert a.work_digest() != stats([2, 1, 3], [4, 4, 4], {(1, 1): 2, (2, 0): 1}).work_digest()  # ranks accepted


@pytest.mark.slow
def test_every_algorithm_at_budget_2_does_the_same_work_on_the_real_target(smollm, one_thread):
    """Budget 2 is one drafted node, the head's top token, whatever the algorithm: the evaluation's work
    digests say so (what lets the budget sweep time it once); budget 4 differs."""
    torch.manual_seed(0)
    head = LoadedHead(DraftHead(HeadConfig.for_target(smollm)), HeadRef.parse("random"))
    cfg = EvalConfig(prompts_per_set=2, timed_prompts=0, max_new_tokens=12, budgets=[2, 4], baselines=False,
                     cost_model=False, algorithms=["accum_logp", "best_first", "chain"])
    rows = [r for r in evaluate(smollm, [head], cfg)["rows"] if r["method"] == "causal"]
    assert all(r["lossless"] is True for r in rows)
    for ds in cfg.sets:
        digests = {(r["algorithm"], r["budget"]): r["work_digest"] for r in rows if r["dataset"] == ds}
        b2 = {d for (_, b), d in digests.items() if b == 2}
        assert len(b2) == 1 and None not in b2, digests
        assert digests[("accum_logp", 4)] not in b2 and digests[("best_first", 4)] not in b2


def test_evaluate_job_missing_head_exits_2_in_one_line_before_loading_the_target():
    result = evaluate_job("--head", "/no/such/head")  # a real process: the exit code a shell sees
    assert_one_line_error(result, "/no/such/head")
    assert "Loading weights" not in result.stderr


@pytest.mark.parametrize("args, fragments", [
    (["--head", "no-such-head-name"], ["no-such-head-name"]),
    (["--sets", "mtbench,nope"], ["unknown prompt set 'nope'"]),
    (["--budgets", "0"], ["budget must be an integer in 1..4096"]),
    (["--budgets", "8,5000"], ["budget must be an integer in 1..4096"]),
    (["--budgets", "eight"], ["--budgets", "'eight'"]),
    (["--widths", "0"], ["width must be"]),
    (["--algorithms", "beam"], ["unknown tree algorithm"]),
    (["--temperatures", "-1"], ["temperature"]),
    (["--baselines", "maybe"], ["true/false"]),
    (["--head", "random", "--vllm"], ["needs vLLM", "make setup-vllm"]),  # no vLLM: refused up front
    (["--prompts", "x"], ["--prompts"]),
    (["--no-such-option"], ["--no-such-option"]),
    (["--head", "random-bidirectional"], ["pass it as --bidirectional-head"]),
    (["--bidirectional-head", "random"], ["pass it as --head"]),
])
def test_evaluate_job_bad_input_is_one_line_and_exit_2(args, fragments, capsys, monkeypatch):
    from jetflow.target import TargetModel

    monkeypatch.setitem(sys.modules, "vllm", None)  # a machine without vLLM, whether or not this one has it

    def no_load(*_a, **_k):
        raise AssertionError("bad input must be refused before the target loads")

    monkeypatch.setattr(TargetModel, "load", no_load)
    try:
        code = load_job().main(args)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert_one_line_error(subprocess.CompletedProcess(args, code, "", err), *fragments)


def test_evaluate_job_unknown_registry_uri_is_one_line_and_exit_2(tmp_path):
    env = {**ENV, "JETFLOW_HOME": str(tmp_path), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    result = evaluate_job("--head", "models:/nope-jetflow-head@champion", env=env, timeout=120)
    assert_one_line_error(result, "nope-jetflow-head", last_line_only=True)


def test_evaluate_job_help_documents_every_option():
    result = evaluate_job("--help")
    assert result.returncode == 0
    for option in ("--model", "--head", "--bidirectional-head", "--sets", "--prompts", "--max-new-tokens",
                   "--budgets", "--widths", "--algorithms", "--temperatures", "--prompt-lookup-num-tokens",
                   "--no-baselines", "--no-lossless-check", "--no-cost-model", "--context-tokens",
                   "--curve-repeats", "--seed", "--out", "--no-mlflow", "--run-name", "--parent-run-id"):
        assert option in result.stdout, option


@pytest.mark.slow
def test_evaluate_job_writes_the_report_and_logs_it_to_mlflow(smollm, tmp_path):
    from mlflow import MlflowClient

    from jetflow.paths import models_dir

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models_dir(), target_is_directory=True)  # the converted target, reused
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**ENV, "JETFLOW_HOME": str(home), "MLFLOW_TRACKING_URI": uri}
    out = tmp_path / "report.json"
    torch.manual_seed(0)
    folder = save_head(DraftHead(HeadConfig.for_target(smollm, causal=False)), tmp_path / "bidir")
    (folder / "provenance.json").write_text('{"command": "test"}')
    result = evaluate_job("--bidirectional-head", str(folder), "--sets", "humaneval", "--prompts", "1",
                          "--max-new-tokens", "8", "--budgets", "4", "--algorithms", "accum_logp",
                          "--no-baselines", "--no-cost-model", "--out", str(out), "--run-name", "eval-test",
                          env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "| humaneval | bidirectional | accum_logp | 4 |" in result.stdout
    report = json.loads(out.read_text())
    assert {r["method"] for r in report["rows"]} == {"ar", "bidirectional"}
    assert report["cost_model"] is None and report["metrics"]["lossless"] == 1.0
    assert report["head"]["path"] == str(folder) and report["head"]["provenance"] == {"command": "test"}
    assert report["head"]["config"]["causal"] is False
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="attributes.run_name = 'eval-test'")
    assert len(runs) == 1
    logged = runs[0].data.metrics
    assert logged["tau/humaneval/bidirectional/accum_logp-b4w7-t0"] == pytest.approx(
        report["metrics"]["tau/humaneval/bidirectional/accum_logp-b4w7-t0"])
    assert logged["lossless"] == 1.0
    assert runs[0].data.params["budgets"] == "4"
