"""The cluster path: a real `mlflow server` process on 127.0.0.1 (sqlite backend, proxied artifacts),
reached only over HTTP through `MLFLOW_TRACKING_URI`. Training run, registration, evaluation run, the
gate and a `models:/…@champion` download all go through our `jetflow.tracking` functions; the run is then
read back both over HTTP and from the server's own store. A live training run, its datasets and a sweep's
parent-run picture are read back through the endpoints the MLflow UI itself calls. The server is stopped
in the fixture's finally."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from jetflow.tracking import (CHAMPION, log_evaluation, log_training_run, promote, register_head,
                              registered_model_name, resolve_alias, resolve_head_uri, tracking_uri)
from tests.test_tracking import make_head, report

TARGET = "served-target"
STARTUP_S = 180  # a loaded 2-core machine; typically ~12 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """(url, folder) of a started `mlflow server`; its backend db is folder/db.sqlite, artifacts folder/art."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job-runner workers: faster start, fewer processes
    with open(folder / "server.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{folder / 'db.sqlite'}",
             "--artifacts-destination", str(folder / "art"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # own group: uvicorn child too
    try:
        deadline = time.monotonic() + STARTUP_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (folder / "server.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"mlflow server did not become healthy (exit {proc.poll()}):\n{tail}")
            time.sleep(0.5)
        yield url, folder
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of its process group (the uvicorn worker)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def test_runs_registry_and_gate_work_over_http_against_a_real_mlflow_server(mlflow_server, tmp_path, monkeypatch):
    url, folder = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "home"))
    assert tracking_uri() == url

    head = make_head(tmp_path / "head", TARGET, seed=7)
    train_run = log_training_run(head, TARGET, "random-r1")
    version = register_head(train_run, TARGET)
    uri = f"models:/{registered_model_name(TARGET)}/{version}"
    eval_run = log_evaluation(report(TARGET, uri=uri))
    assert promote(TARGET, version).promoted

    # Read back over HTTP with a fresh client.
    http = MlflowClient(tracking_uri=url, registry_uri=url)
    run = http.get_run(eval_run)
    assert run.info.status == "FINISHED" and run.data.tags["jetflow.head.version"] == version
    assert run.data.metrics["lossless"] == 1.0 and run.data.params["target.id"] == TARGET
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied by the server, not a local path
    assert "plots/tau_vs_budget.png" in {a.path for a in http.list_artifacts(eval_run, "plots")}
    assert http.get_registered_model(registered_model_name(TARGET)).aliases == {CHAMPION: version}

    # The server's own store and artifact folder hold them.
    local = MlflowClient(tracking_uri=f"sqlite:///{folder / 'db.sqlite'}")
    assert local.get_run(train_run).data.tags["jetflow.kind"] == "train"
    assert len(list((folder / "art").rglob("model.safetensors"))) == 1

    # The champion downloads through the server and is bit-identical.
    champ = resolve_alias(TARGET)
    assert champ.version == version and champ.path == resolve_head_uri(f"models:/{registered_model_name(TARGET)}@champion")
    original, loaded = load_file(str(head / "model.safetensors")), load_file(str(champ.path / "model.safetensors"))
    assert original.keys() == loaded.keys() and all(torch.equal(original[k], loaded[k]) for k in original)


def _ui_get(url: str, route: str, **query) -> bytes:
    with urllib.request.urlopen(f"{url}/{route}?{urllib.parse.urlencode(query)}", timeout=30) as resp:
        return resp.read()


def test_the_ui_shows_a_live_training_run_its_datasets_lineage_and_a_sweeps_picture(mlflow_server, tmp_path,
                                                                                     monkeypatch):
    """What the MLflow UI pages fetch: the run's metric chart (a point per step), its Dataset column (the
    regeneration's content hash), the version page's description (a link to the training run) and the
    sweep parent run's plot artifacts."""
    from jetflow.tracking import plots
    from jetflow.storage import TuneLocation
    from jetflow.tracking.runs import log_figures, sweep_parent_run
    from tests.conftest import tiny_target
    from tests.test_live_tracking import TARGET as TINY, small_config, sweep_rows, train_here, write_training_data

    url, _ = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "home"))
    tiny = tiny_target("qwen3", vocab=128)
    regen, features = write_training_data(tiny)
    out = tmp_path / "home" / "heads" / "ui"
    run_id = train_here(small_config("ui", 6), tiny, features, out)
    assert log_training_run(out) == run_id
    version = register_head(run_id, TINY)

    chart = json.loads(_ui_get(url, "ajax-api/2.0/mlflow/metrics/get-history-bulk-interval", run_ids=run_id,
                               metric_key="train/loss", max_results=320))
    assert sorted(m["step"] for m in chart["metrics"]) == [1, 2, 3, 4, 5, 6]
    run = json.loads(_ui_get(url, "ajax-api/2.0/mlflow/runs/get", run_id=run_id))["run"]
    assert run["info"]["status"] == "FINISHED"
    datasets = {d["dataset"]["name"]: d["dataset"]["digest"] for d in run["inputs"]["dataset_inputs"]}
    digest = json.loads((regen / "manifest.json").read_text())["content_sha256"][:16]
    assert datasets == {f"regen/{regen.name}": digest, f"features/{features.name}": features.name}
    mv = json.loads(_ui_get(url, "ajax-api/2.0/mlflow/model-versions/get", name=registered_model_name(TINY),
                            version=version))["model_version"]
    assert f"runs/{run_id})" in mv["description"] and digest in mv["description"]

    parent = sweep_parent_run(TINY, TuneLocation(str(tmp_path), None, "sweep"), "budget sweep ui", "budget_sweep", {})
    log_figures(parent, plots.budget_sweep_figures(sweep_rows()))
    png = _ui_get(url, "get-artifact", path="plots/speedup_vs_budget.png", run_uuid=parent)
    assert png.startswith(b"\x89PNG")
