"""JetFlow's jobs on a multi-node Ray cluster whose nodes share no disk (`tests/cluster.py`: a zero-CPU head,
two worker nodes with their own JETFLOW_HOME, HF cache, /tmp and loopback, an S3 bucket as cluster storage and
an MLflow server on the head). This test process is the driver, on the head's network, configured as a user
would be: JETFLOW_STORAGE=s3://…, MLFLOW_TRACKING_URI=http://127.0.0.1:<port> (the server on its own node).

One cluster for the module, in order: the main job from an empty registry (regeneration on 2 actors on 2
nodes, Ray Train on 2 workers on 2 nodes, the budget sweep's trials on both nodes, runs on the server, the head
registered and promoted); the architecture sweep returning its finalists; Serve joining the cluster with a
replica on each worker node, answering the `openai` client with `jetflow generate`'s texts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.cluster import cluster_unavailable, start_cluster, wait_http

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m"
MODEL_HOME = os.environ.get("JETFLOW_HOME", str(Path.home() / ".jetflow"))  # `make model` converted the target here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The started cluster with this process as its driver: the driver's settings in the environment, joined
    through `jetflow.cluster.init_ray` (which hands the workers what they need)."""
    reason = cluster_unavailable()
    if reason:
        pytest.skip(f"local multi-node cluster unavailable: {reason}")
    import ray

    from jetflow.cluster import init_ray

    if ray.is_initialized():
        ray.shutdown()
    base = tmp_path_factory.mktemp("cluster")
    home = base / "driver-home"  # the driver's own disk: nothing of an earlier test's home
    c = start_cluster(base, home, workers=2)
    mp = pytest.MonkeyPatch()
    try:
        for key, value in c.driver_env().items():
            mp.setenv(key, value)
        init_ray(c.address)
        yield c
    finally:
        ray.shutdown()  # before the cluster stops: a driver whose raylet dies exits
        mp.undo()
        c.stop()


def _nodes_of(class_name: str) -> set[str]:
    """IPs of the nodes where actors of `class_name` ran, alive or dead (the GCS keeps dead actors' records)."""
    import ray._private.state as state

    actors = state.actors().values()
    found = {a["Address"]["IPAddress"] for a in actors if a["ActorClassName"] == class_name}
    assert found, f"no {class_name} actor ran; actor classes: {sorted({a['ActorClassName'] for a in actors})}"
    return found


def _handed_uri() -> tuple[str, str]:
    import ray

    return ray.util.get_node_ip_address(), os.environ.get("MLFLOW_TRACKING_URI", "")


def test_a_task_on_a_worker_node_is_handed_the_tracking_server_at_the_heads_address(cluster):
    import ray

    from jetflow.cluster import handed_tracking_uri

    assert urlparse(os.environ["MLFLOW_TRACKING_URI"]).hostname == "127.0.0.1"  # the driver's own, loopback
    for i in (1, 2):
        ip, uri = ray.get(ray.remote(_handed_uri).options(num_cpus=1, resources={f"worker{i}": 0.01}).remote())
        assert ip == cluster.worker(i).ip
        assert urlparse(uri).hostname == cluster.head_ip, f"worker{i} was handed {uri!r}, not the head's address"
    assert handed_tracking_uri() == cluster.mlflow_worker_uri


def test_the_main_job_trains_sweeps_registers_and_promotes_across_nodes(cluster):
    from jetflow.main_job import MainJobConfig, run_main_job
    from jetflow.storage import storage
    from jetflow.sweeps.budget import BudgetSweepConfig
    from jetflow.tracking import CHAMPION, registered_model_name
    from jetflow.tracking.store import client

    t0 = time.perf_counter()
    sweep = BudgetSweepConfig(target=TARGET, budgets=[2, 4], algorithms=["accum_logp"], sets=["humaneval"],
                              prompts_per_set=1, max_new_tokens=8, concurrency=[1], max_concurrent=2,
                              name="cluster-budget-sweep")
    out = run_main_job(MainJobConfig(preset="smoke", train_workers=2, regen_workers=2, sweep=sweep))
    print(f"[cluster] main job {time.perf_counter() - t0:.0f} s (training {out.train_seconds:.0f} s)")
    workers = {w.ip for w in cluster.workers}
    # regeneration: two actors, one per worker node; Ray Train: two workers, one per node
    assert _nodes_of("_ShardWorker") == workers
    assert _nodes_of("RayTrainWorker") == workers
    # the data, the feature cache, Ray Train's checkpoint and Tune's state are in the bucket
    st = storage()
    assert st.is_object_store
    regen = [k for k in st.files("data/regen") if k.endswith("manifest.json")]
    assert len(regen) == 1 and json.loads(st.read_bytes(f"data/regen/{regen[0]}"))["sequences"] == 8
    assert any(k.endswith("features.json") for k in st.files("features"))
    assert any(k.endswith("model.safetensors") for k in st.files("ray_results/train-smoke"))
    assert st.files("ray_results/cluster-budget-sweep")
    # the sweep: every trial ran on a worker node, logged to the server as a child run of one parent
    assert out.trained and not out.sweep.errors and len(out.sweep.rows) == 2
    assert all(r["lossless"] == 1.0 for r in out.sweep.rows)
    children = client().search_runs([client().get_run(out.sweep.parent_run_id).info.experiment_id],
                                    f"tags.mlflow.parentRunId = '{out.sweep.parent_run_id}'")
    assert len(children) == 2 and {r.data.tags["jetflow.node"] for r in children} <= workers
    # the training run, filled by rank 0 on a worker node, holds a point per step and both ranks' system metrics
    name = registered_model_name(TARGET)
    champion = client().get_model_version_by_alias(name, CHAMPION)
    train_run = client().get_run(champion.run_id)
    assert len(client().get_metric_history(train_run.info.run_id, "train/loss")) == 3
    assert out.stored and out.promotion and out.promotion.startswith("PROMOTED")
    assert champion.tags.get("jetflow.tree_config")


def test_the_arch_sweep_returns_its_finalists_across_nodes(cluster):
    from jetflow.sweeps.arch import ArchSearch, ArchSweepConfig, run_arch_sweep

    t0 = time.perf_counter()
    cfg = ArchSweepConfig(target=TARGET, preset="smoke", search=ArchSearch(num_hidden_layers=[1], causal=[True, False],
                                                                           lr=[]),
                          max_steps=4, eval_every=2, grace_steps=4, finalists=2, eval_prompts=1, eval_new_tokens=8,
                          name="cluster-arch-sweep")
    out = run_arch_sweep(cfg)
    print(f"[cluster] arch sweep {time.perf_counter() - t0:.0f} s")
    assert not out.errors and len(out.rows) == 2 and all(r["finished"] for r in out.rows)
    assert len(out.finalists) == 2, "both finished trials' heads came back from storage and were decoded"
    assert all(f["version"] and any(k.startswith("tau/") for k in f) for f in out.finalists)
    assert out.challenger == out.finalists[0]["version"]


def test_serve_joins_the_cluster_with_a_replica_on_each_worker_node(cluster, tmp_path):
    """`serve/app.py --address …` places its replicas on the worker nodes; each reads the champion through the
    registry on its own node; the `openai` client gets `jetflow generate`'s text."""
    from openai import OpenAI

    port = 18000 + os.getpid() % 1000
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve" / "app.py"), "--address", cluster.address,
                             "--host", cluster.head_ip, "--port", str(port), "--min-replicas", "2",
                             "--max-replicas", "2", "--replica-cpus", "1", "--policy", "fixed"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(cluster, f"http://{cluster.head_ip}:{port}/v1/models", "serve/app.py", proc, time.monotonic() + 300)
        assert _nodes_of("ServeReplica:jetflow:JetFlow") == {w.ip for w in cluster.workers}
        api = OpenAI(base_url=f"http://{cluster.head_ip}:{port}/v1", api_key="none")
        card = api.models.list().data[0]
        assert card.jetflow["speculative"] and card.jetflow["head"].startswith("models:/")
        prompts = ["Write a Python function that reverses a string.", "Name three colors."]
        served = [api.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": p}], max_tokens=16,
                                              temperature=0).choices[0].message.content for p in prompts]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    generated = []
    for p in prompts:  # the same champion, decoded on this machine by the CLI
        r = subprocess.run([sys.executable, "-m", "jetflow.cli", "generate", "--head", card.jetflow["head"],
                            "--max-new-tokens", "16", "--json", p],
                           env={**os.environ, "JETFLOW_HOME": MODEL_HOME}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        generated.append(json.loads(r.stdout.strip().splitlines()[-1])["text"])
    assert served == generated


def _driver(argv: list[str], **env_changes) -> subprocess.CompletedProcess:
    """A driver process on this (head) node with the user's settings, `env_changes` applied (None: unset)."""
    env = {**os.environ, **{k: v for k, v in env_changes.items() if v is not None}}
    for k in (k for k, v in env_changes.items() if v is None):
        env.pop(k, None)
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_a_cluster_without_storage_or_a_tracking_server_is_refused_with_what_to_do(cluster, tmp_path):
    sweep = [str(ROOT / "sweeps" / "budget.py"), "--head", "models:/smollm2-135m-jetflow-head@champion"]
    r = _driver(sweep, JETFLOW_STORAGE=None)
    assert r.returncode == 2 and "JETFLOW_STORAGE" in r.stderr and "share no disk" in r.stderr, r.stderr[-2000:]
    r = _driver(sweep, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert r.returncode == 2 and "mlflow server" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything was logged into a file of this node


def test_a_head_folder_only_the_driver_has_is_refused_with_what_to_do(cluster, tmp_path):
    """A folder of the driver's disk is no reference for trials on other nodes: register it or put it in storage.
    (A folder whose weights are a registered version is swept as that version.)"""
    import shutil

    from jetflow.paths import heads_dir

    trained = heads_dir() / "smoke"  # the main job's head: registered, so swept by its registry URI
    assert (trained / "model.safetensors").exists()
    mine = tmp_path / "unregistered-head"
    shutil.copytree(trained, mine, ignore=shutil.ignore_patterns("checkpoints", ".mlflow_run.json"))
    weights = bytearray((mine / "model.safetensors").read_bytes())
    weights[-4:] = b"\x00\x00\x80\x3f"  # one weight changed: other bytes, no registered version has them
    (mine / "model.safetensors").write_bytes(bytes(weights))
    r = _driver([str(ROOT / "sweeps" / "budget.py"), "--head", str(mine), "--budgets", "2", "--concurrency", "1"])
    assert r.returncode == 2 and "register it" in r.stderr and str(mine) in r.stderr, r.stderr[-2000:]
