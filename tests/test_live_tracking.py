"""Live training runs on a real MLflow store (sqlite under a temporary $JETFLOW_HOME): a training — under
Ray Train or in-process — is one run that fills while it trains (a point per step, params, dataset inputs
with the regeneration's content hash, system metrics), ends FINISHED / KILLED / FAILED, and is continued by
a resumed training; the registered version names its training run, datasets and evaluation runs; sweeps'
parent runs carry their picture. The target is a tiny random Qwen3 whose regenerated data is its own
greedy output (as in test_train), so nothing here needs the real model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetflow.data.features import FeatureCache, FeatureSpec, build_features
from jetflow.data.regenerate import MANIFEST, RegenConfig, default_output_dir
from jetflow.tracking import log_evaluation, log_training_run, plots, register_head, registered_model_name
from jetflow.tracking.datasets import run_datasets
from jetflow.storage import TuneLocation
from jetflow.tracking.live import ConsoleProgress, LiveRun, StepLogger, progress_line, recorded_run, training_run
from jetflow.tracking.runs import ending, log_figures, sweep_parent_run
from jetflow.tracking.store import client, experiment_for
from jetflow.train.config import TrainConfig
from jetflow.train.pipeline import train_in_process
from jetflow.train.trainer import train
from tests.conftest import tiny_target
from tests.test_tracking import store  # noqa: F401  (the fixture: the default sqlite store in a temporary home)
from tests.test_train import _write_regen

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tiny-qwen3"
PNG = b"\x89PNG\r\n\x1a\n"


def write_training_data(tiny) -> tuple[Path, Path]:
    """(regen folder, feature cache folder) where the pipeline puts them under $JETFLOW_HOME: the regenerated
    data at its default folder with a manifest as `jetflow.data.regenerate` writes it (settings, revision,
    content hash), the cache under features/<content key>."""
    settings = RegenConfig(model=TARGET, num_prompts=12, max_new_tokens=40)
    regen = default_output_dir(settings, tiny.revision)
    _write_regen(regen, tiny)
    shard = (regen / "shard-00000.parquet").read_bytes()
    manifest = json.loads((regen / MANIFEST).read_text())
    manifest.update(settings=dataclasses.asdict(settings), target_model_id=TARGET, target_revision=tiny.revision,
                    sequences=12, content_sha256=hashlib.sha256(shard).hexdigest())
    (regen / MANIFEST).write_text(json.dumps(manifest))
    features = build_features(regen, tiny, FeatureSpec(layer_ids=(1, 2, 3), max_len=128, teacher_topk=4,
                                                       shard_sequences=5), progress=False)
    return regen, features


def small_config(name: str, steps: int, **kw) -> TrainConfig:
    return TrainConfig(**{"name": name, "num_hidden_layers": 1, "block_size": 6, "max_steps": steps,
                          "anchors_per_seq": 4, "seqs_per_step": 2, "eval_sequences": 2, "checkpoint_every": 2, **kw})


def train_here(cfg: TrainConfig, tiny, features: Path, out: Path, **train_kw) -> str:
    """A training tracked live in this process (the pipeline without Ray); returns its run's id."""
    train_in_process(cfg, tiny, features, out, progress=False, **train_kw)
    return recorded_run(out).info.run_id


def history(run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((h.step, h.value) for h in client().get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("qwen3", vocab=128)


@pytest.fixture(scope="module")
def data(store, tiny):
    return write_training_data(tiny)


@pytest.fixture(scope="module")
def model_dir(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tiny.model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # system metrics sampled every half second, so that a few-second training has some
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _log_inputs_at_the_barrier(run_ids: list[str], features: str, barrier, results) -> None:
    """A training's first MLflow write of its data, in its own process: the same datasets for each run of
    `run_ids`, each started at `barrier` together with the other process."""
    from jetflow.tracking.datasets import log_training_inputs, training_datasets

    for run_id in run_ids:
        barrier.wait(timeout=60)
        try:
            log_training_inputs(run_id, training_datasets(Path(features)))
            results.put(("ok", run_id))
        except Exception as e:  # noqa: BLE001  (the parent asserts on what happened)
            results.put((f"{type(e).__name__}: {str(e)[:300]}", run_id))


def test_trainings_that_start_together_both_log_the_same_new_datasets(store, data):
    """Two arch-sweep trials begin their training runs at the same moment, with the same data: MLflow's
    store looks for a dataset and then inserts it, so one of the two meets the other's row. Each round here
    is a fresh experiment (datasets are rows per experiment), so each round is a new race."""
    import multiprocessing as mp

    _, features = data
    c = client()
    rounds = [[c.create_run(c.create_experiment(f"race-{os.getpid()}-{i}")).info.run_id,
               c.create_run(c.get_experiment_by_name(f"race-{os.getpid()}-{i}").experiment_id).info.run_id]
              for i in range(4)]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_log_inputs_at_the_barrier, args=([r[k] for r in rounds], str(features), barrier, results))
             for k in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in range(2 * len(rounds))]
    for p in procs:
        p.join(timeout=60)
    assert [o for o, _ in outcomes if o != "ok"] == []
    for pair in rounds:
        inputs = [sorted(run_datasets(c.get_run(run_id))) for run_id in pair]
        assert inputs[0] == inputs[1] and {ctx for ctx, _, _ in inputs[0]} == {"training", "features"}


# --------------------------------------------------------------------------- under Ray Train
def test_a_ray_train_training_is_one_live_run_with_a_point_per_step_its_datasets_and_system_metrics(
        store, data, model_dir, ray_cluster, tmp_path, capsys):
    from jetflow.train.ray_train import train_on_ray

    regen, features = data
    out = store / "heads" / "live"
    cfg = small_config("live", 8, eval_every=4)  # 4 report intervals (checkpoint_every 2), 2 held-out evals
    before = time.time()
    metrics = train_on_ray(cfg, str(model_dir), features, out, storage=tmp_path / "ray", progress_s=0.2)
    after = time.time()

    run = recorded_run(out)
    run_id = run.info.run_id
    assert (run.info.status, run.info.run_name) == ("FINISHED", "train live")
    assert [s for s, _ in history(run_id, "train/loss")] == list(range(1, 9))  # a point per step, none twice
    assert [s for s, _ in history(run_id, "eval/tree_tau")] == [4, 8]
    assert [s for s, _ in history(run_id, "eval/agree_d1")] == [4, 8]
    for key in ("train/lr", "train/epoch"):
        assert len(history(run_id, key)) == 8, key
    # drafted tokens/s at every step, and the whole training's rate at the end
    assert {s for s, _ in history(run_id, "train/draft_tokens_per_s")} == set(range(1, 9))
    assert history(run_id, "train/epoch")[-1][1] == pytest.approx(8 / int(run.data.params["schedule.steps_per_epoch"]))
    # the run spans the training: opened before the workers started, ended after they finished
    assert before * 1000 <= run.info.start_time and run.info.end_time <= after * 1000
    assert run.info.end_time - run.info.start_time >= metrics["train/seconds"] * 1000
    p = run.data.params
    assert (p["train.lr"], p["train.max_steps"], p["head.hidden_size"], p["head.block_size"]) == ("0.0003", "8", "64", "6")
    assert p["schedule.total_steps"] == "8" and p["data.features"] == str(features)
    assert any(k.startswith("system/cpu_utilization_percentage") for k in run.data.metrics)

    manifest = json.loads((regen / MANIFEST).read_text())
    inputs = {ctx: (name, digest) for ctx, name, digest in run_datasets(run)}
    assert inputs == {"training": (f"regen/{regen.name}", manifest["content_sha256"][:16]),
                      "features": (f"features/{features.name}", features.name)}
    regen_input = next(d.dataset for d in run.inputs.dataset_inputs if d.dataset.name.startswith("regen/"))
    assert json.loads(regen_input.source)["uri"] == str(regen)
    assert json.loads(regen_input.profile)["content_sha256"] == manifest["content_sha256"]
    assert "prompt_ids" in regen_input.schema

    console = capsys.readouterr().out
    assert f"[train live] MLflow run 'train live' ({run_id}, new run)" in console
    assert "[train live] done: 8 steps · loss " in console and "held-out tree_tau" in console

    # the head files and final metrics go onto the same run, which keeps its history and status
    assert log_training_run(out) == run_id
    run = client().get_run(run_id)
    assert run.info.status == "FINISHED" and len(history(run_id, "train/loss")) == 8
    assert {a.path for a in client().list_artifacts(run_id, "head")} >= {"head/config.json", "head/model.safetensors"}


def test_a_training_killed_by_sigterm_is_marked_killed_and_its_resume_continues_the_same_run(
        store, data, model_dir, ray_cluster, tmp_path):
    """The real thing: a driver process trains under Ray Train, printing progress, gets SIGTERM mid-training,
    and the rerun resumes from its checkpoint into the same run, steps continuing (the redone ones logged
    again with the same values: resume is exact)."""
    import threading

    from jetflow.train.ray_train import train_on_ray

    _, features = data
    out = store / "heads" / "killed"
    steps = 400  # tiny steps (~50/s here): long enough to be mid-training when the signal comes
    cfg = small_config("killed", steps, checkpoint_every=20)
    script = (
        "import ray, sys; from pathlib import Path; from jetflow.train.config import TrainConfig; "
        "from jetflow.train.ray_train import train_on_ray; "
        f"ray.init(address={ray_cluster!r}, log_to_driver=False); "
        f"train_on_ray(TrainConfig(**{cfg.to_dict()!r}), {str(model_dir)!r}, Path({str(features)!r}), "
        f"Path({str(out)!r}), storage=Path({str(tmp_path / 'ray')!r}), cpus_per_worker=1, progress_s=1)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform"), "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
    experiment_for(TARGET)  # the store exists before two processes open it (sqlite's first migration is not concurrent)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(map(bytes.decode, iter(proc.stdout.readline, b""))))
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while True:  # until the console showed progress and the run holds its first points
            run = recorded_run(out)
            if run is not None and any("[train killed] step " in line for line in lines) \
                    and len(history(run.info.run_id, "train/loss")) >= 20:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join()
    console = "".join(lines)
    run_id = run.info.run_id
    killed = client().get_run(run_id)
    assert killed.info.status == "KILLED", console[-3000:]
    assert proc.returncode != 0  # it stopped there (SystemExit; Ray's shutdown picks the exit code)
    line = next(line for line in console.splitlines() if line.startswith("[train killed] step "))
    assert f"/{steps} (" in line and " · loss " in line and "drafted tok/s" in line and "ETA" in line
    stopped_at = max(s for s, _ in history(run_id, "train/loss"))
    assert stopped_at < steps

    train_on_ray(cfg, str(model_dir), features, out, storage=tmp_path / "ray", progress_s=None)
    resumed = client().get_run(run_id)
    assert recorded_run(out).info.run_id == run_id
    assert resumed.info.status == "FINISHED" and resumed.info.start_time == killed.info.start_time
    assert resumed.data.tags["jetflow.resumes"] == "1"
    assert 0 < int(resumed.data.tags["jetflow.resumed_from_step"]) <= stopped_at
    points = history(run_id, "train/loss")
    assert {s for s, _ in points} == set(range(1, steps + 1))
    by_step: dict[int, list[float]] = {}
    for s, v in points:
        by_step.setdefault(s, []).append(v)
    assert all(v == pytest.approx(vs[0]) for vs in by_step.values() for v in vs)  # redone steps agree


def test_a_training_that_fails_leaves_a_failed_run(store, data, model_dir, ray_cluster, tmp_path):
    import shutil

    from ray.train import TrainingFailedError

    from jetflow.train.ray_train import train_on_ray

    _, features = data
    broken = tmp_path / "broken-cache"  # its meta and first shard, but not its other shards: the worker fails
    broken.mkdir()
    for name in ("features.json", "shard-00000.safetensors"):
        shutil.copy(features / name, broken / name)
    out = store / "heads" / "fails"
    with pytest.raises(TrainingFailedError):
        # max_failures=0: the failure is deterministic, so Ray Train's retries (2 by default) would only repeat it
        train_on_ray(small_config("fails", 4), str(model_dir), broken, out, storage=tmp_path / "ray", progress_s=None,
                     max_failures=0)
    assert recorded_run(out).info.status == "FAILED"


# --------------------------------------------------------------------------- in-process, run lifecycle
def test_sigterm_while_a_run_is_open_marks_it_killed_and_restores_the_handler(store, data, tmp_path):
    _, features = data
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        with training_run(small_config("sigterm", 4), tmp_path / "sigterm", features):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert recorded_run(tmp_path / "sigterm").info.status == "KILLED"
    assert signal.getsignal(signal.SIGTERM) is before


def test_after_a_hard_kill_a_resume_continues_the_run_and_a_fresh_training_supersedes_it(store, tiny, data, tmp_path):
    """A SIGKILLed training leaves its run RUNNING (simulated: set back to RUNNING, as the process never
    ended it). With its checkpoints there, the next training resumes them in the same run; without them it
    starts over, in a new run, and the old one is marked KILLED, pointing at its successor."""
    _, features = data
    out = tmp_path / "hard"
    cfg = small_config("hard", 6)  # checkpoints every 2 steps
    run_id = train_here(cfg, tiny, features, out, stop_after=3)
    client().update_run(run_id, status="RUNNING")
    assert train_here(cfg, tiny, features, out) == run_id  # resumed from the step-2 checkpoint
    assert [s for s, _ in history(run_id, "train/loss")] == [1, 2, 3, 3, 4, 5, 6]
    assert client().get_run(run_id).info.status == "FINISHED"

    first = train_here(cfg, tiny, features, tmp_path / "again", stop_after=1)  # killed before a checkpoint
    client().update_run(first, status="RUNNING")
    second = train_here(cfg, tiny, features, tmp_path / "again")  # no checkpoints: a new training
    assert second != first and client().get_run(second).info.status == "FINISHED"
    old = client().get_run(first)
    assert old.info.status == "KILLED" and old.data.tags["jetflow.superseded_by"] == second


def test_progress_line_shows_step_loss_tokens_per_second_and_eta(store, tiny, data, tmp_path):
    assert progress_line("demo", 150, 720, 3.2141, 412.4, 125, 475) == \
        "[train demo] step 150/720 (21%) · loss 3.214 · 412 drafted tok/s · 2m05s · ETA 7m55s"
    assert progress_line("demo", 3, None, None, None, 4, None) == "[train demo] step 3 · 4s · ETA –"
    _, features = data
    cfg = small_config("progress", 4)
    run_id = train_here(cfg, tiny, features, tmp_path / "progress")
    progress = ConsoleProgress(LiveRun(run_id, "0", "train progress", resumed=False), "progress")
    line = progress.poll()
    assert line.startswith("[train progress] step 4/4 (100%) · loss ") and "drafted tok/s" in line


# --------------------------------------------------------------------------- registry lineage
def test_a_registered_version_names_its_training_run_datasets_and_evaluation_runs(store, tiny, data, tmp_path):
    from tests.test_tracking import report

    regen, features = data
    out = store / "heads" / "lineage"
    run_id = train_here(small_config("lineage", 4), tiny, features, out)
    assert log_training_run(out, TARGET, tiny.revision) == run_id
    version = register_head(run_id, TARGET)
    name = registered_model_name(TARGET)
    mv = client().get_model_version(name, version)
    digest = json.loads((regen / MANIFEST).read_text())["content_sha256"][:16]
    assert mv.run_id == run_id
    experiment = client().get_experiment(client().get_run(run_id).info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's model training view
    assert mv.tags["jetflow.dataset.training"] == f"regen/{regen.name}@{digest}"
    assert mv.tags["jetflow.dataset.features"] == f"features/{features.name}@{features.name}"
    assert f"(#/experiments/{client().get_run(run_id).info.experiment_id}/runs/{run_id})" in mv.description
    assert digest in mv.description and "no finished evaluation run yet" in mv.description
    assert client().get_run(run_id).data.tags["jetflow.registered_version"] == f"{name}/{version}"

    rep = report(TARGET, uri=f"models:/{name}/{version}")
    rep["target"]["revision"] = tiny.revision
    eval_id = log_evaluation(rep)
    mv = client().get_model_version(name, version)
    assert mv.tags["jetflow.eval_run_ids"] == eval_id
    assert f"runs/{eval_id})" in mv.description and "**Evaluated** in 1 run(s)" in mv.description


# --------------------------------------------------------------------------- sweeps' pictures
def sweep_rows(concurrency=(1,)) -> list[dict]:
    """Per-set rows of a budget sweep as the main job hands them over: chain and accum_logp over budgets."""
    rows = []
    for dataset in ("mtbench", "humaneval"):
        for algorithm, width in (("accum_logp", 7), ("chain", 1)):
            for budget in (2, 4, 8):
                for c in concurrency:
                    tree = {"algorithm": algorithm, "budget": budget, "width": width}
                    rows.append({"tree": tree, **tree, "temperature": 0.0, "tau": 1 + budget / 8,
                                 "speedup": 1.1 / c, "predicted_speedup": 1.2 if c == 1 else None,
                                 "dataset": dataset, "concurrency": c})
    return rows


def _panels(fig):
    return sorted((ax for ax in fig.axes if ax.get_visible()), key=lambda ax: ax.get_title())


def test_budget_sweep_figures_draw_a_panel_per_set_a_line_per_algorithm_ar_and_the_prediction():
    figures = plots.budget_sweep_figures(sweep_rows())
    assert set(figures) == {"plots/tau_vs_budget.png", "plots/speedup_vs_budget.png"}  # one concurrency level
    panels = _panels(figures["plots/speedup_vs_budget.png"])
    assert [ax.get_title() for ax in panels] == ["humaneval", "mtbench"]
    lines = {line.get_label(): line for line in panels[0].get_lines()}
    assert list(lines["accum_logp w7 t0"].get_xdata()) == [2, 4, 8]
    assert lines["accum_logp w7 t0 (predicted)"].get_linestyle() == "--"
    assert "chain t0" in lines and "chain t0 (predicted)" in lines
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in panels[0].get_lines())  # AR = 1
    tau = {line.get_label() for line in _panels(figures["plots/tau_vs_budget.png"])[0].get_lines()}
    assert "accum_logp w7 t0" in tau and not any("predicted" in label for label in tau)


def test_budget_sweep_figures_add_speedup_vs_concurrency_when_several_levels_were_measured():
    figures = plots.budget_sweep_figures(sweep_rows(concurrency=(1, 4)))
    assert "plots/speedup_vs_concurrency.png" in figures
    panel = _panels(figures["plots/speedup_vs_concurrency.png"])[0]
    labels = {line.get_label() for line in panel.get_lines()}
    assert {"accum_logp w7 t0 b2", "accum_logp w7 t0 b8", "chain t0 b4"} <= labels
    line = next(line for line in panel.get_lines() if line.get_label() == "chain t0 b4")
    assert list(line.get_xdata()) == [1, 4] and list(line.get_ydata()) == pytest.approx([1.1, 1.1 / 4])
    # the vs-budget figures stay at one stream
    speed = _panels(figures["plots/speedup_vs_budget.png"])[0]
    assert list(next(l for l in speed.get_lines() if l.get_label() == "chain t0").get_ydata()) == pytest.approx([1.1] * 3)
    assert plots.budget_sweep_figures([]) == {}


def test_the_arch_sweep_parent_run_has_its_table_and_picture_and_a_stopped_trial_is_killed(store, tiny, data, tmp_path):
    from jetflow.sweeps.arch import ArchSearch, ArchSweepConfig, _log_parent, _settle_trial_runs

    _, features = data
    cfg = ArchSweepConfig(target=TARGET, preset="smoke", search=ArchSearch(num_hidden_layers=[1, 2], causal=[],
                                                                           lr=[]))
    parent = sweep_parent_run(TARGET, TuneLocation(str(tmp_path), None, "sweep"), "arch sweep t", "arch_sweep",
                              {"max_steps": 4, "search": cfg.space})
    assert sweep_parent_run(TARGET, TuneLocation(str(tmp_path), None, "sweep"), "arch sweep t", "arch_sweep",
                            {}) == parent  # a resumed sweep continues its parent run
    rows, histories = [], []
    for layers, steps in ((1, 4), (2, 2)):  # the 2-layer trial "stopped by ASHA" at step 2
        head = tmp_path / f"trial-{layers}"
        tcfg = small_config(head.name, 4, num_hidden_layers=layers, eval_every=2)
        with training_run(tcfg, head, features, parent_run_id=parent) as run, StepLogger(run.run_id) as log:
            train(tcfg, tiny, FeatureCache(features), head, log=log, on_start=log.start, progress=False,
                  stop_after=steps)
        rows.append({"num_hidden_layers": layers, "tree_tau": 1.5 + layers, "chain_tau": 1.2, "step": steps,
                     "finished": steps == 4, "head_dir": str(head)})
        histories.append({"label": f"num_hidden_layers={layers}", "steps": [2, 4][: steps // 2],
                          "tree_tau": [1.2, 1.5][: steps // 2], "stopped": steps < 4})
    # Tune stopped the finished trial's actor right after its final report: its run ended KILLED
    done = recorded_run(tmp_path / "trial-1").info
    client().set_terminated(done.run_id, "KILLED", end_time=done.end_time)
    with ending(parent):
        _settle_trial_runs(rows)
        _log_parent(parent, cfg, rows, histories)

    stopped = recorded_run(tmp_path / "trial-2")
    assert stopped.info.status == "KILLED" and stopped.data.tags["jetflow.stopped_by"] == "ASHA at step 2"
    assert stopped.data.tags["mlflow.parentRunId"] == parent and len(history(stopped.info.run_id, "train/loss")) == 2
    settled = recorded_run(tmp_path / "trial-1").info
    assert (settled.status, settled.end_time) == ("FINISHED", done.end_time)
    run = client().get_run(parent)
    assert run.info.status == "FINISHED" and run.data.tags["jetflow.kind"] == "arch_sweep"
    assert run.data.metrics["best_tree_tau"] == 3.5 and run.data.metrics["trials_stopped_early"] == 1
    assert run.data.params["search.num_hidden_layers"] == "[1, 2]"
    files = {a.path for a in client().list_artifacts(parent)} | {a.path for a in client().list_artifacts(parent, "plots")}
    assert {"sweep_table.md", "sweep_table.json", "plots/simulated_tau_over_steps.png",
            "plots/final_tau_by_setting.png"} <= files
    png = client().download_artifacts(parent, "plots/simulated_tau_over_steps.png", str(tmp_path))
    assert Path(png).read_bytes().startswith(PNG)


def test_a_budget_sweep_parent_run_gets_the_figures_and_a_trial_run_no_single_point_curve(store, tmp_path):
    from tests.test_tracking import report

    parent = sweep_parent_run(TARGET, TuneLocation(str(tmp_path), None, "budget"), "budget sweep t",
                              "budget_sweep", {"budgets": [2, 4, 8]})
    log_figures(parent, plots.budget_sweep_figures(sweep_rows()))
    assert {a.path for a in client().list_artifacts(parent, "plots")} == \
        {"plots/tau_vs_budget.png", "plots/speedup_vs_budget.png"}
    trial = report(TARGET)
    trial["rows"] = [r for r in trial["rows"] if r["budget"] in (1, 8)]  # AR + the trial's one budget
    trial_run = log_evaluation(trial, parent_run_id=parent)
    plots_logged = {a.path for a in client().list_artifacts(trial_run, "plots")}
    assert "plots/tau_vs_budget.png" not in plots_logged and "plots/acceptance_by_depth.png" in plots_logged
