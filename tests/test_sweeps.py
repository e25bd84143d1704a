"""Sweeps on Ray: a real Tune budget sweep into a temporary MLflow store (child runs, best config on
the registry version, resume without redoing trials), `ray job submit` of the sweep against a local
`ray start --head` this test starts and stops, and cluster.yaml through Ray's own validator."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from jetflow.errors import InvalidSettingError
from jetflow.main_job import MainJobConfig, run_main_job
from jetflow.sweeps.budget import (BudgetSweepConfig, budget_by_concurrency, choose_finalists, decide, merge_timed, predict,
                                   same_work, tau_by_budget, timed_metrics, trial_metrics)
from jetflow.tree import TreeSpec

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_passes_rays_own_cluster_config_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
    validate_config(config)
    assert config["head_node_type"] == "head"
    workers = config["available_node_types"]["h100"]
    assert workers["node_config"]["InstanceType"].startswith("p5.")  # H100 instances
    assert workers["min_workers"] == 0 and workers["max_workers"] >= 1
    assert any("[vllm]" in cmd for cmd in config["setup_commands"])
    assert any("mlflow server" in cmd for cmd in config["head_start_ray_commands"])


def test_sweep_config_is_validated_and_chains_ignore_width():
    cfg = BudgetSweepConfig(budgets=[8, 2], widths=[3, 7], algorithms=["accum_logp", "chain", "top2gap:margin=1"])
    trees = [TreeSpec.from_dict(s["tree"]) for s in cfg.settings()]
    assert [t for t in trees if t.is_chain] == [TreeSpec("chain", b, 1) for b in (2, 8)]
    assert len([t for t in trees if t.algorithm == "accum_logp"]) == 4
    assert {t.params for t in trees if t.algorithm == "top2gap"} == {(("margin", 1.0),)}  # parameters travel
    # a chain of a block-16 head has at most 16 nodes: budgets 32 and 64 would repeat budget 16
    wide = BudgetSweepConfig(budgets=[8, 16, 32, 64], algorithms=["accum_logp", "chain"]).settings(block_size=16)
    assert [s["tree"]["budget"] for s in wide if s["tree"]["algorithm"] == "chain"] == [8, 16]
    assert [s["tree"]["budget"] for s in wide if s["tree"]["algorithm"] == "accum_logp"] == [8, 16, 32, 64]
    for bad in (dict(budgets=[0]), dict(budgets=[5000]), dict(select="latency"), dict(storage="relative/dir"),
                dict(algorithms=["beam"]), dict(sets=["sharegpt"]), dict(vllm_baseline="always"),
                dict(backend_concurrency=[]), dict(backend_concurrency=[0])):
        with pytest.raises(InvalidSettingError):
            BudgetSweepConfig(**bad)
    with pytest.raises(InvalidSettingError, match="preset"):
        MainJobConfig(preset="huge")


def _wide(spec: TreeSpec, lossless: float = 1.0, **tau_at) -> dict:
    """A wide-pass row as the sweep builds it from a trial's metrics."""
    return {"tree": spec.to_dict(), "key": spec.key, "trial": f"{spec.key} t0", "algorithm": spec.algorithm,
            "budget": spec.budget, "width": spec.width, "temperature": 0.0, "lossless": lossless,
            "tau": sum(tau_at.values()) / len(tau_at), **{f"tau@{ds}": t for ds, t in tau_at.items()}}


def test_the_step_cost_model_turns_tau_into_predictions_and_picks_each_sets_winner_among_the_finalists():
    from jetflow.engine.cost import StepCostCurve

    # plain steps cost 10 ms; budget 4 costs 12.5, 8 costs 20 (batch 1); at batch 8 trees cost much more
    curve = StepCostCurve("test", 100, (1, 8), (1, 4, 8), ((10.0, 12.5, 20.0), (40.0, 80.0, 160.0)))
    rows = [_wide(TreeSpec("best_first", 4), mtbench=1.5, humaneval=2.0),
            _wide(TreeSpec("best_first", 8), mtbench=1.6, humaneval=3.6),
            _wide(TreeSpec("accum_logp", 8), mtbench=1.3, humaneval=1.6),
            _wide(TreeSpec("chain", 4), lossless=0.0, mtbench=9.0, humaneval=9.0)]  # lossy: never a finalist
    predict(rows, curve, [1, 8])
    # speedup = τ · T(B, 1) / T(B, N)  (StepCostCurve.speedup)
    assert rows[0]["predicted@mtbench"] == pytest.approx(1.5 * 10 / 12.5)
    assert rows[1]["predicted@humaneval"] == pytest.approx(3.6 * 10 / 20)
    assert rows[0]["predicted_c8"] == pytest.approx((1.5 + 2.0) / 2 * 40 / 80)
    # mtbench's predicted winner is b4 (1.20 vs 0.80), humaneval's b8 (1.80 vs 1.60): both go on, past `count`
    assert [r["key"] for r in choose_finalists(rows, 1)] == [rows[1]["key"], rows[0]["key"]]
    assert rows[3] not in choose_finalists(rows, 4) and len(choose_finalists(rows, 3)) == 3
    assert [r["key"] for r in choose_finalists(rows, 1, select="tau")][:1] == [rows[1]["key"]]  # highest τ


def test_finalists_skip_a_setting_that_did_the_same_work_as_one_already_chosen():
    # at budget 2 every algorithm drafts the same single node: equal τ and equal work digests on every set
    same = {"work@mtbench": 11.0, "work@humaneval": 12.0}
    rows = [{**_wide(TreeSpec("accum_logp", 2), mtbench=1.3, humaneval=1.6), **same},
            {**_wide(TreeSpec("best_first", 2), mtbench=1.3, humaneval=1.6), **same},
            {**_wide(TreeSpec("chain", 2, width=1), mtbench=1.3, humaneval=1.6), **same},
            {**_wide(TreeSpec("best_first", 4), mtbench=1.2, humaneval=1.5), "work@mtbench": 13.0,
             "work@humaneval": 14.0},
            _wide(TreeSpec("best_first", 8), mtbench=1.1, humaneval=1.4)]  # no digest: never "the same"
    picked = choose_finalists(rows, 3, select="tau")
    assert [r["key"] for r in picked] == [rows[0]["key"], rows[3]["key"], rows[4]["key"]]
    assert not same_work(rows[0], {**rows[1], "work@humaneval": 15.0}), "one set differing is different work"
    assert not same_work(rows[0], {**rows[1], "temperature": 0.7})
    assert not same_work(rows[4], rows[4]), "without digests nothing is the same work"


def test_timed_runs_give_each_finalist_its_speedup_per_set_and_the_spread_of_its_passes():
    rows = [_wide(TreeSpec("best_first", 4), mtbench=1.5, humaneval=2.0),
            _wide(TreeSpec("best_first", 8), mtbench=1.6, humaneval=3.0)]
    k4, k8 = rows[0]["trial"], rows[1]["trial"]
    timed = {"mtbench": {f"speedup@{k4}": 1.10, f"run0@{k4}": 1.05, f"run1@{k4}": 1.15, f"lossless@{k4}": 1.0,
                         f"speedup@{k8}": 0.95, f"run0@{k8}": 0.90, f"run1@{k8}": 1.00, f"lossless@{k8}": 1.0,
                         "ar_tokens_per_s": 18.0},
             "humaneval": {f"speedup@{k4}": 1.30, f"run0@{k4}": 1.28, f"run1@{k4}": 1.32, f"lossless@{k4}": 1.0,
                           f"speedup@{k8}": 1.60, f"run0@{k8}": 1.50, f"run1@{k8}": 1.70, f"lossless@{k8}": 1.0,
                           "ar_tokens_per_s": 19.0}}
    merge_timed(rows, timed)
    assert rows[0]["spread@mtbench"] == pytest.approx(0.10) and rows[0]["spread@humaneval"] == pytest.approx(0.04)
    assert rows[0]["speedup"] == pytest.approx(1.20)
    # the spread of the mean over sets, pass by pass: (1.05+1.28)/2 = 1.165 and (1.15+1.32)/2 = 1.235
    assert rows[0]["spread"] == pytest.approx(0.07)
    # b8 is faster on average (1.275) but slower than AR on mtbench: the serving setting is b4
    best, d = decide(rows, "speedup", BudgetSweepConfig())
    assert best is rows[0] and d["setting"] == k4 and d["losing"] == {k8: ["mtbench"]}
    assert d["sets"]["mtbench"] == {"speedup": pytest.approx(1.10), "spread": pytest.approx(0.10), "tau": 1.5}
    assert (d["timed_prompts"], d["timed_repeats"], d["tau_prompts"]) == (6, 2, 8)
    assert d["runner_up"] == k8 and d["lead"] == pytest.approx(1.20 - 1.275) and d["decisive"] is False
    # every finalist slower than AR somewhere: plain decoding, and the evidence says why
    rows[0]["speedup@humaneval"] = 0.99
    best, d = decide(rows, "speedup", BudgetSweepConfig())
    assert best is None and d["setting"] == "plain" and d["tree"]["budget"] == 1
    assert set(d["losing"]) == {k4, k8}
    from jetflow.tracking.promotion import evidence_text

    assert evidence_text(d).startswith("serving plain decoding: every timed setting is slower than JetFlow AR on some "
                                       "set")
    assert d["baseline"] == "jetflow_ar" and d["speedup_vs_baseline"] == 1.0  # no vLLM timed: our AR, said


def test_with_vllm_timed_beside_every_figure_names_its_baseline_and_the_evidence_carries_both():
    from jetflow.sweeps.backends import baseline_of
    from jetflow.sweeps.budget import summary_table, winners_table
    from jetflow.tracking.promotion import evidence_text

    rows = [_wide(TreeSpec("best_first", 4), mtbench=1.5, humaneval=2.0),
            _wide(TreeSpec("best_first", 8), mtbench=1.6, humaneval=3.0)]
    k4, k8 = rows[0]["trial"], rows[1]["trial"]

    def timed_set(s4, s8, ours, ar, vllm):
        return {f"speedup@{k4}": s4, f"run0@{k4}": s4, f"run1@{k4}": s4, f"lossless@{k4}": 1.0,
                f"tokens_per_s@{k4}": ours, f"speedup@{k8}": s8, f"lossless@{k8}": 1.0, f"tokens_per_s@{k8}": ours * 0.9,
                "ar_tokens_per_s": ar, "vllm_ar_tokens_per_s": vllm, "vllm_version": "0.32.0",
                "vllm_note": "vLLM 0.32.0 AR, eager, in a child process of .venv-vllm/bin/python"}

    timed = {"mtbench": timed_set(1.2, 1.1, 24.0, 20.0, 40.0), "humaneval": timed_set(1.5, 1.4, 30.0, 20.0, 40.0)}
    merge_timed(rows, timed)
    assert rows[0]["speedup_vs_vllm_ar@mtbench"] == pytest.approx(0.6)
    assert rows[0]["speedup_vs_vllm_ar"] == pytest.approx((0.6 + 0.75) / 2)
    base = baseline_of(timed, BudgetSweepConfig())
    assert (base["name"], base["label"], base["vllm_version"]) == ("vllm_ar", "vLLM AR", "0.32.0")
    assert base["sets"]["mtbench"]["jetflow_ar_vs_vllm_ar"] == pytest.approx(0.5)
    best, d = decide(rows, "speedup", BudgetSweepConfig(), base)
    assert best is rows[0] and d["baseline"] == "vllm_ar" and d["baseline_label"] == "vLLM AR"
    assert d["speedup"] == pytest.approx(1.35)                              # what the tree buys: vs our AR
    assert d["speedup_vs_vllm_ar"] == d["speedup_vs_baseline"] == pytest.approx(0.675)  # the headline
    assert d["sets"]["humaneval"]["speedup_vs_vllm_ar"] == pytest.approx(0.75)
    text = evidence_text(d)
    assert "1.35x JetFlow AR" in text and "0.68x vLLM AR" in text and "vLLM 0.32.0" in text
    assert "× vLLM AR" in summary_table(rows, best) and "× JetFlow AR" in summary_table(rows, best)
    winners = winners_table(rows, d)
    assert "1.50x JetFlow AR ± 0.00, 0.75x vLLM AR" in winners  # the serving setting on humaneval, both baselines
    # a set without vLLM's number: the figures fall back to JetFlow AR, saying why
    timed["humaneval"].pop("vllm_ar_tokens_per_s")
    timed["humaneval"]["vllm_note"] = "vLLM failed in this process (RuntimeError: boom)"
    base = baseline_of(timed, BudgetSweepConfig())
    assert base["name"] == "jetflow_ar" and "humaneval" in base["note"] and "boom" in base["note"]
    _, d = decide(rows, "speedup", BudgetSweepConfig(), base)
    assert d["baseline"] == "jetflow_ar" and "speedup_vs_vllm_ar" not in d["sets"]["mtbench"]
    assert "boom" in evidence_text(d)


def test_the_backend_comparison_scores_each_backend_over_sets_and_loads_and_records_the_winner():
    from jetflow.sweeps.backends import backends_of, backends_text

    cfg = BudgetSweepConfig(backend_concurrency=[1, 8])
    timed = {"mtbench": {"vllm_ar_c1": 40.0, "vllm_ar_c8": 170.0}, "humaneval": {"vllm_ar_c1": 42.0, "vllm_ar_c8": 160.0}}
    backend = {"jetflow_c1@mtbench": 30.0, "jetflow_c8@mtbench": 120.0, "jetflow_c1@humaneval": 45.0,
               "jetflow_c8@humaneval": 130.0, "jetflow_budget_c1": 8.0, "jetflow_budget_c8": 1.0,
               "dflash_note": "vLLM DFlash skipped: the head cannot export (tap_norm=True ...)"}
    b = backends_of(backend, timed, cfg)
    assert b["winner"] == "vllm_ar" and b["backend"] == "vllm" and b["vllm_mode"] == "ar"
    assert set(b["score"]) == {"jetflow", "vllm_ar"}  # DFlash skipped: not scored
    assert b["sets"]["humaneval"]["c1"] == {"jetflow": 45.0, "vllm_ar": 42.0}
    assert "cannot export" in backends_text(b) and "serving backend: vllm" in backends_text(b)
    backend.update({f"vllm_dflash_c{c}@{ds}": 500.0 for c in (1, 8) for ds in ("mtbench", "humaneval")})
    assert backends_of(backend, timed, cfg)["vllm_mode"] == "dflash"
    slow = {k: 1.0 for k in timed["mtbench"]}
    assert backends_of({**backend, **{k: 1.0 for k in backend if k.startswith("vllm_dflash")}},
                       {"mtbench": slow, "humaneval": slow}, cfg)["backend"] == "jetflow"


def test_without_vllm_anywhere_the_timing_says_why_and_raises_nothing(tmp_path, monkeypatch):
    from jetflow.vllm.timing import TimingRequest, run_timing, vllm_runner

    monkeypatch.delenv("JETFLOW_VLLM_PYTHON", raising=False)
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    runner, why = vllm_runner(missing)
    assert runner is None and "make setup-vllm" in why and missing in why
    out = run_timing(TimingRequest(model="x", prompts={"s": [[1, 2]]}, max_new_tokens=2, stop_ids=[]), missing)
    assert out["runner"] is None and "make setup-vllm" in out["error"]
    # a Python that is not a vLLM venv: the child fails, the reason comes back as one line
    out = run_timing(TimingRequest(model="x", prompts={"s": [[1, 2]]}, max_new_tokens=2, stop_ids=[]), sys.executable)
    assert out["runner"] == sys.executable and "exited" in out["error"] and "\n" not in out["error"]
    # a Python without this project (an interrupted `make setup-vllm`): the line says what to run
    bare = next(p for p in (Path(sys.base_prefix) / "bin" / n for n in ("python3", "python")) if p.is_file())
    out = run_timing(TimingRequest(model="x", prompts={"s": [[1, 2]]}, max_new_tokens=2, stop_ids=[]), str(bare))
    assert "No module named 'jetflow'" in out["error"] and "make setup-vllm" in out["error"], out


def test_the_best_budget_per_concurrency_is_predicted_and_falls_back_to_plain_where_none_beats_it():
    def row(spec, tau, p1, p8):
        return dict(tree=spec.to_dict(), budget=spec.budget, temperature=0.0, lossless=1.0, tau=tau,
                    predicted_c1=p1, predicted_c8=p8)

    rows = [row(TreeSpec("accum_logp", 4), 1.5, 1.2, 0.9), row(TreeSpec("accum_logp", 8), 1.7, 1.3, 0.8),
            row(TreeSpec("chain", 8), 1.4, 2.0, 1.5)]  # another kind: not the best's
    assert budget_by_concurrency(rows, rows[1]) == {1: 8, 8: 1}
    assert tau_by_budget(rows, rows[1]) == {4: 1.5, 8: 1.7}


def test_the_tau_pass_runs_eager_steps_and_the_timed_pass_the_steps_a_replica_runs():
    """τ does not depend on how a step runs: the wide pass never calibrates or compiles; the timed pass (speed,
    and the losslessness of those very steps) runs `graphs` as a replica will."""
    setting = {"tree": TreeSpec("chain", 4).to_dict(), "temperature": 0.0}
    for graphs in ("auto", "compile", "off"):
        cfg = BudgetSweepConfig(budgets=[4], algorithms=["chain"], sets=["mtbench"], graphs=graphs)
        assert cfg.eval_config(setting).graphs == "off"
        assert cfg.timed_config([setting], "mtbench").graphs == graphs


def test_trial_metrics_of_both_passes():
    row = dict(method="causal", dataset="mtbench", tau=2.0, speedup_vs_ar=1.5, tokens_per_s=10.0, lossless=True,
               tree=TreeSpec("best_first", 4).to_dict(), temperature=0.0)
    report = {"rows": [row, {**row, "dataset": "humaneval", "tau": 3.0, "lossless": False},
                       {"method": "ar", "tokens_per_s": 8.0}]}
    m = trial_metrics(report)
    assert (m["tau"], m["lossless"], m["tau@mtbench"], m["tau@humaneval"]) == (2.5, 0.0, 2.0, 3.0)
    timed = timed_metrics({"rows": [{**row, "speedup_runs": [1.4, 1.6]}, {"method": "ar", "tokens_per_s": 8.0}],
                           "params": {"graphs_resolved": "compile"}})
    key = "best_first-b4w7 t0"
    assert (timed[f"speedup@{key}"], timed[f"run0@{key}"], timed[f"run1@{key}"]) == (1.5, 1.4, 1.6)
    assert (timed[f"lossless@{key}"], timed["ar_tokens_per_s"], timed["compiled"]) == (1.0, 8.0, 1.0)


# --------------------------------------------------------------------------- real Ray Tune + MLflow
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A temporary MLflow store and JETFLOW_HOME (the step cost curve is cached there), the converted target
    reused."""
    from jetflow.paths import models_dir

    root = tmp_path_factory.mktemp("sweep")
    home = root / "home"
    home.mkdir()
    (home / "models").symlink_to(models_dir(), target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.setenv("JETFLOW_HOME", str(home))
        yield root


@pytest.fixture(scope="module")
def registered_head(smollm, store):
    """A random 1-layer SmolLM2 head, logged as a training run and registered (version, folder)."""
    from jetflow.head import DraftHead, HeadConfig, save_head
    from jetflow.tracking import log_training_run, register_head, registered_model_name

    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(smollm, num_hidden_layers=1, block_size=4))
    folder = save_head(head, store / "head")
    (folder / "metrics.json").write_text(json.dumps({"train/steps": 0}))
    version = register_head(log_training_run(folder, smollm.model_id, smollm.revision), smollm.model_id)
    return registered_model_name(smollm.model_id), version, folder


@pytest.mark.slow
def test_budget_sweep_runs_both_stages_as_tune_trials_logs_child_runs_and_stores_the_serving_setting(registered_head,
                                                                                                     store):
    import ray

    from jetflow.tracking.registry import EVIDENCE_TAG, TREE_CONFIG_TAG
    from jetflow.tracking.store import client

    name, version, _ = registered_head
    cfg = MainJobConfig(head=f"models:/{name}/{version}", sweep=BudgetSweepConfig(
        budgets=[2, 3], widths=[2], algorithms=["accum_logp", "chain"], sets=["mtbench"], prompts_per_set=2,
        max_new_tokens=4, finalists=2, timed_prompts=1, timed_repeats=2, concurrency=[1, 2],
        storage=str(store / "tune"), name="budget-test", vllm_baseline="off"))  # with vLLM: tests/test_vllm_cpu.py
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        job = run_main_job(cfg)
        out = job.sweep
        assert out.errors == {} and out.complete
        assert len(out.rows) == 4 and job.stored and not job.trained  # 2 tree + 2 chain settings
        parent = client().get_run(out.parent_run_id)
        children = client().search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{out.parent_run_id}'")
        wide = [r for r in children if r.data.tags["jetflow.sweep.stage"] == "wide"]
        timed = [r for r in children if r.data.tags["jetflow.sweep.stage"] == "timed"]
        assert len(wide) == 4 and [r.data.tags["jetflow.trial"] for r in timed] == ["timed mtbench"]
        for run in children:
            assert run.data.tags["jetflow.kind"] == "eval"
            assert run.data.tags["jetflow.head.version"] == version  # lineage back to the registry
            taus = [k for k in run.data.metrics if k.startswith("tau/mtbench/")]
            assert taus and all(run.data.metrics[k] >= 1.0 for k in taus) and run.data.metrics["lossless"] == 1.0
        for run in wide:  # the wide pass: one setting each, batched on 2 prompts, untimed
            assert run.data.params["budgets"] in ("2", "3") and run.data.params["timed_prompts"] == "0"
            assert not any(k.startswith("speedup_vs_ar/") for k in run.data.metrics)
        # the timed pass: the two finalists and AR, interleaved, two passes: a speedup and its spread each
        assert len(out.finalists) == 2 and timed[0].data.params["timed_repeats"] == "2"
        speedups = [k for k in timed[0].data.metrics if k.startswith("speedup_vs_ar/mtbench/causal/")]
        spreads = [k for k in timed[0].data.metrics if k.startswith("speedup_spread/mtbench/causal/")]
        assert len(speedups) == len(spreads) == 2
        finalists = [r for r in out.rows if r["trial"] in out.finalists]
        assert all(r["speedup@mtbench"] > 0 and r["spread@mtbench"] >= 0 for r in finalists)
        # the serving setting: the fastest finalist not slower than AR (a random head: likely none, so plain)
        serving = out.best_tree or TreeSpec(budget=1)
        if out.best is not None:
            assert out.best["speedup@mtbench"] >= 1.0
        else:
            assert all(r["speedup@mtbench"] < 1.0 for r in finalists) and out.plain
        tags = client().get_model_version(name, version).tags
        assert TreeSpec.from_json(tags[TREE_CONFIG_TAG]) == serving
        evidence = json.loads(tags[EVIDENCE_TAG])
        assert evidence == out.decision and evidence["tree"] == serving.to_dict()
        assert (evidence["timed_prompts"], evidence["timed_repeats"], evidence["tau_prompts"]) == (1, 2, 2)
        table = {int(k): v for k, v in json.loads(tags["jetflow.budget_by_concurrency"]).items()}
        assert set(table) == {1, 2} and table == out.budget_table and all(b >= 1 for b in table.values())
        assert all(f"predicted_c{c}" in r for r in out.rows for c in (1, 2))  # the step cost model's, from τ
        # the head's per-(depth, rank) acceptance, from the widest greedy accum_logp trial, goes with the
        # version: a download of it carries tree_profile.json and the loaded head shapes trees from it
        from jetflow.head import load_head
        from jetflow.tracking import resolve_head_uri
        from jetflow.tree import AcceptanceProfile

        profile = AcceptanceProfile.from_dict(json.loads(tags["jetflow.tree_profile"]))
        assert profile.meta["setting"] == TreeSpec("accum_logp", 3, 2).key  # (a random head: rows may be empty)
        assert all(0.0 <= x <= 1.0 for row in profile.depth_rank for x in row)
        loaded = load_head(resolve_head_uri(f"models:/{name}/{version}"))
        assert loaded.tree_profile is not None and loaded.tree_profile.depth_rank == profile.depth_rank
        plots = {a.path for a in client().list_artifacts(out.parent_run_id, "plots")}
        assert {"plots/tau_vs_budget.png", "plots/speedup_vs_budget.png"} <= plots
        assert {"sweep_table.md", "sweep_winners.md", "serving_decision.json"} <= \
            {a.path for a in client().list_artifacts(out.parent_run_id)}
        assert parent.data.tags["jetflow.serving.setting"] == evidence["setting"]
        # vLLM off: every figure is against JetFlow's AR, and the evidence and the parent run say so and why
        assert (evidence["baseline"], evidence["baseline_label"]) == ("jetflow_ar", "JetFlow AR")
        assert evidence["baseline_note"] == "vLLM not timed (vllm_baseline off)" and "backends" not in evidence
        assert parent.data.tags["jetflow.baseline"] == "JetFlow AR"
        assert parent.data.tags["jetflow.serving.backend"] == "jetflow"

        # rerun with the same name: Tune restores both finished experiments, no trial runs again
        again = run_main_job(cfg).sweep
        assert again.parent_run_id == out.parent_run_id and again.decision == out.decision
        assert len(client().search_runs([parent.info.experiment_id],
                                        f"tags.`mlflow.parentRunId` = '{out.parent_run_id}'")) == 5
    finally:
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_job_submit_runs_the_budget_sweep_on_a_local_cluster_it_starts_and_stops(registered_head, store):
    """`ray start --head --block` in its own process group, with its own temp dir and ports; the job is the
    real `sweeps/budget.py` (smoke sized); only that process group is stopped (never `ray stop`)."""
    _, _, folder = registered_head
    bindir = Path(sys.executable).parent
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's unix socket paths have a length limit
    gcs, dash = _free_port(), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    head = subprocess.Popen([str(bindir / "ray"), "start", "--head", "--block", f"--port={gcs}",
                             f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--num-cpus=2",
                             f"--temp-dir={temp}", "--include-dashboard=true", "--disable-usage-stats",
                             f"--ray-client-server-port={_free_port()}", f"--metrics-export-port={_free_port()}",
                             f"--dashboard-agent-listen-port={_free_port()}"],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while subprocess.run([str(bindir / "ray"), "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None, head.stdout.read().decode()[-2000:]
            assert time.time() < deadline, "the local Ray head did not come up in 120 s"
            time.sleep(2)
        job = subprocess.run(
            [str(bindir / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
             "python", "sweeps/budget.py", "--head", str(folder), "--budgets", "2", "--algorithms", "chain",
             "--sets", "mtbench", "--prompts-per-set", "1", "--max-new-tokens", "4",
             "--finalists", "1", "--timed-prompts", "1", "--timed-repeats", "1", "--concurrency", "1", "--storage", str(store / "job-tune"), "--name", "job",
             "--vllm-baseline", "off"],
            env=env, capture_output=True, text=True, timeout=600)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-2000:]
        assert "stored as its serving tree config" in job.stdout and "serving" in job.stdout
        assert "JetFlow AR" in job.stdout and "vllm_baseline off" in job.stdout  # the verdict names its baseline
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
            try:
                head.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


# --------------------------------------------------------------------------- architecture sweep
def test_arch_search_options_are_typed_and_validated():
    from jetflow.sweeps.arch import ArchSearch, ArchSweepConfig

    assert ArchSweepConfig().space == {"num_hidden_layers": [1, 2], "causal": [True, False], "lr": [6e-4, 2e-3]}
    one = ArchSweepConfig(search=ArchSearch(num_hidden_layers=[], lr=[], causal=[True, False, True]))
    assert one.space == {"causal": [True, False]}
    with pytest.raises(InvalidSettingError, match="num_hidden_layers"):  # a choice TrainConfig rejects
        ArchSweepConfig(search=ArchSearch(num_hidden_layers=[2, 99]))
    with pytest.raises(InvalidSettingError, match="at least one searched option"):
        ArchSweepConfig(search=ArchSearch(num_hidden_layers=[], causal=[], lr=[]))
    with pytest.raises(InvalidSettingError, match="preset"):
        ArchSweepConfig(preset="huge")


def test_arch_sweep_command_line_takes_comma_separated_choices_per_option():
    import argparse

    from jetflow.config_cli import add_dataclass_args, build_config, parse_args
    from jetflow.sweeps.arch import ArchSweepConfig

    p = argparse.ArgumentParser()
    add_dataclass_args(p, ArchSweepConfig, "sweep")
    cfg = build_config(ArchSweepConfig, parse_args(p, ["--causal", "true", "--block-size", "8,16", "--lr", "1e-3"]))
    assert cfg.space == {"num_hidden_layers": [1, 2], "block_size": [8, 16], "causal": [True], "lr": [1e-3]}
    with pytest.raises(InvalidSettingError, match="--causal takes comma-separated bool values"):
        build_config(ArchSweepConfig, parse_args(p, ["--causal", "maybe"]))


@pytest.mark.slow
def test_arch_sweep_trains_trials_under_asha_and_registers_the_best_finalist_as_challenger(tmp_path, monkeypatch):
    """Two Ray Train trials (causal vs bidirectional) on the smoke data in a temporary $JETFLOW_HOME."""
    import ray

    from jetflow.paths import models_dir
    from jetflow.sweeps.arch import ArchSearch, ArchSweepConfig, run_arch_sweep
    from jetflow.tracking import CHALLENGER, registered_model_name
    from jetflow.tracking.store import client

    real_models = models_dir()
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "models").symlink_to(real_models)  # the converted target, not a second copy
    cfg = ArchSweepConfig(preset="smoke", search=ArchSearch(num_hidden_layers=[], lr=[]), max_steps=4, eval_every=2,
                          grace_steps=2,
                          finalists=1, eval_prompts=1, eval_new_tokens=8, name="arch-test")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JETFLOW_HOME": str(tmp_path)}})
    try:
        out = run_arch_sweep(cfg)
    finally:
        ray.shutdown()
    assert out.errors == {}
    assert sorted(r["causal"] for r in out.rows) == [False, True]
    assert all(r["tree_tau"] >= 1.0 and r["step"] >= 2 for r in out.rows)
    assert len(out.finalists) == 1 and out.finalists[0]["lossless"] == 1.0
    name = registered_model_name("smollm2-135m")
    assert str(client().get_registered_model(name).aliases[CHALLENGER]) == out.challenger == out.finalists[0]["version"]
    assert Path(out.finalists[0]["head_dir"]).parent == tmp_path / "heads"
    assert (Path(out.finalists[0]["head_dir"]) / "model.safetensors").exists()


def _a_trial_that_fails_for_x_2(config: dict) -> None:
    from ray import tune

    if config["x"] == 2:
        raise ValueError("budget 2 is out of range for this head")
    tune.report({"score": float(config["x"])})


def test_a_sweep_names_each_errored_trial_with_its_own_exception_and_where_tune_kept_it(tmp_path, capsys):
    """Real Tune trials, one of which raises: the sweep's outcome keeps that trial's error (the trial's own
    exception at its end) and the script prints it with the path of Tune's error.txt."""
    import ray
    from ray import tune

    from jetflow.sweeps.cluster import report_trial_errors, trial_errors

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        grid = tune.Tuner(_a_trial_that_fails_for_x_2, param_space={"x": tune.grid_search([1, 2])},
                          run_config=tune.RunConfig(name="errors", storage_path=str(tmp_path), verbose=0)).fit()
    finally:
        ray.shutdown()
    errors = trial_errors(grid)
    assert len(errors) == 1
    (path, error), = errors.items()
    assert "x=2" in Path(path).name and (Path(path) / "error.txt").exists()
    assert error.splitlines()[-1] == "ValueError: budget 2 is out of range for this head"
    report_trial_errors("budget sweep", errors)
    err = capsys.readouterr().err
    assert f"budget sweep: trial {Path(path).name} failed (whole error: {path}/error.txt)" in err
    assert err.rstrip().endswith("ValueError: budget 2 is out of range for this head")


def test_the_sweeps_picture_rows_carry_each_set_with_the_timed_speedup_and_the_cost_models_prediction():
    from jetflow.sweeps.budget import set_rows
    from jetflow.tracking.plots import budget_sweep_figures

    tree = TreeSpec("accum_logp", 4).to_dict()
    rows = [{"tree": tree, "temperature": 0.0, "tau@mtbench": 2.0, "predicted@mtbench": 1.6, "speedup@mtbench": 1.2,
             "tau@humaneval": 3.0, "predicted@humaneval": 2.4, "speedup@humaneval": 1.5},
            {"tree": TreeSpec("accum_logp", 8).to_dict(), "temperature": 0.0, "tau@mtbench": 2.2,
             "predicted@mtbench": 1.1, "tau@humaneval": 3.5, "predicted@humaneval": 1.7}]  # not a finalist
    out = set_rows(rows)
    assert sorted((r["dataset"], r["budget"], r["speedup"], r["predicted_speedup"]) for r in out) == [
        ("humaneval", 4, 1.5, 2.4), ("humaneval", 8, None, 1.7), ("mtbench", 4, 1.2, 1.6), ("mtbench", 8, None, 1.1)]
    figures = budget_sweep_figures(out)
    assert {"plots/tau_vs_budget.png", "plots/speedup_vs_budget.png"} <= set(figures)
