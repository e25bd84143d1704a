"""JetFlow's jobs on a multi-node Ray cluster whose nodes share no disk (`tests/cluster.py`: a zero-CPU head,
two worker nodes with their own JETFLOW_HOME, HF cache, /tmp and loopback, an S3 bucket as cluster storage and
an MLflow server on the head). This test process is the driver, on the head's network, configured as a user
would be: JETFLOW_STORAGE=s3://…, MLFLOW_TRACKING_URI=http://127.0.0.1:<port> (the server on its own node).

One cluster for the module, in order: the main job from an empty registry (regeneration on 2 actors on 2
nodes, Ray Train on 2 workers on 2 nodes, the budget sweep's trials on both nodes, runs on the server, the head
registered and promoted); the architecture sweep returning its finalists; Serve joining the cluster with a
replica on each worker node, answering the `openai` client with `jetflow generate`'s texts."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
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
    # a killed node is marked dead in ~2 s (Ray's default: ~15 s of missed health checks)
    c = start_cluster(base, home, workers=2, ray_env={"RAY_health_check_period_ms": "500",
                                                      "RAY_health_check_failure_threshold": "4"})
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


UNDISTURBED: dict = {}  # results of the undisturbed runs, for the fault tests


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
    # select τ: a 3-step smoke head is slower than AR everywhere, and the speed rule would serve it plain
    sweep = BudgetSweepConfig(target=TARGET, budgets=[2, 4], algorithms=["accum_logp"], sets=["humaneval"],
                              prompts_per_set=1, max_new_tokens=8, concurrency=[1], max_concurrent=2, finalists=1,
                              timed_prompts=1, timed_repeats=1, select="tau", name="cluster-budget-sweep",
                              vllm_baseline="off")  # vLLM beside it: tests/test_vllm_cpu.py
    out = run_main_job(MainJobConfig(preset="smoke", train_workers=2, regen_workers=2, sweep=sweep))
    UNDISTURBED["sweep_rows"] = out.sweep.rows  # what the fault tests compare with
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
    assert len(children) == 3 and {r.data.tags["jetflow.node"] for r in children} <= workers  # 2 wide + 1 timed
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


# --------------------------------------------------------------------------- a node lost mid-work
def _wait_for(check, what: str, timeout: float = 300.0, every: float = 0.5):
    """`check()`'s first truthy value, polled until `timeout` (AssertionError naming `what` after that)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Killer(threading.Thread):
    """Kills worker node `index` once `when()` is true (polled in the background while the test's main thread
    drives the job); `killed_at` is the monotonic time of the kill, `seen` what `when()` returned then."""

    def __init__(self, cluster, index: int, when, timeout: float = 300.0):
        super().__init__(daemon=True)
        self.cluster, self.index, self.when, self.timeout = cluster, index, when, timeout
        self.killed_at: float | None = None
        self.seen = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.seen = _wait_for(self.when, f"the moment to kill worker{self.index}", self.timeout, every=0.2)
            self.cluster.kill_worker(self.index)
            self.killed_at = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _replace(cluster, index: int) -> None:
    """A new machine in place of the lost worker node (empty disk): what the next test expects to find."""
    if not cluster.worker(index).alive:
        cluster.restart_worker(index)


def _children(parent_run_id: str) -> list:
    from jetflow.tracking.store import client

    exp = client().get_run(parent_run_id).info.experiment_id
    return client().search_runs([exp], f"tags.mlflow.parentRunId = '{parent_run_id}'")


def _sweep_parent(name: str) -> str | None:
    from jetflow.tracking.store import client, experiment_for

    runs = client().search_runs([experiment_for(TARGET)], f"attributes.run_name = 'budget sweep {name}'")
    return runs[0].info.run_id if runs else None


def test_a_budget_sweep_that_lost_a_node_stores_nothing_and_its_rerun_runs_only_the_missing_trials(cluster):
    """Trials on both nodes, worker2 killed mid-grid with no reruns allowed (`max_failures=0`): the grid is
    incomplete, so nothing is stored; rerun (Tune restores from storage), only the missing trials run, the
    parent run holds every trial once, and the rows equal the undisturbed main job's."""
    from jetflow.main_job import MainJobConfig, run_main_job
    from jetflow.sweeps.budget import TRIAL_TAG, BudgetSweepConfig
    from jetflow.tracking import registered_model_name

    name = "fault-sweep"
    champion = f"models:/{registered_model_name(TARGET)}@champion"

    def job(max_failures: int):
        sweep = BudgetSweepConfig(target=TARGET, budgets=[2, 4, 8, 16], algorithms=["accum_logp"], sets=["humaneval"],
                                  prompts_per_set=1, max_new_tokens=8, concurrency=[1], max_concurrent=2, name=name,
                                  finalists=1, timed_prompts=1, timed_repeats=1, select="tau",
                                  max_failures=max_failures, vllm_baseline="off")
        return run_main_job(MainJobConfig(head=champion, sweep=sweep))

    def one_trial_done():
        parent = _sweep_parent(name)
        return parent and any(r.info.status == "FINISHED" for r in _children(parent))

    killer = Killer(cluster, 2, one_trial_done)
    killer.start()
    first = job(max_failures=0)
    killer.join(timeout=5)
    assert killer.killed_at is not None, killer.error
    assert first.sweep.missing and not first.sweep.complete, "worker2's trial was lost: the grid is incomplete"
    assert first.sweep.best is None and not first.stored, "nothing is stored from an incomplete grid"
    from jetflow.tracking.store import client

    parent = client().get_run(first.sweep.parent_run_id)
    assert parent.data.tags["jetflow.sweep.missing"] == ", ".join(first.sweep.missing)
    assert "jetflow.best.key" not in parent.data.tags and parent.info.status == "FAILED"
    ended = time.time() * 1000
    _replace(cluster, 2)
    second = job(max_failures=0)  # the same command again
    assert second.sweep.complete and second.stored and second.sweep.parent_run_id == first.sweep.parent_run_id
    children = [r for r in _children(second.sweep.parent_run_id)]
    keys = sorted(r.data.tags[TRIAL_TAG] for r in children)
    assert keys == sorted({*keys}) and len(keys) == 5, f"every trial once in the parent (4 wide, 1 timed): {keys}"
    rerun = sorted(r.data.tags[TRIAL_TAG] for r in children if r.info.start_time > ended)
    assert rerun == sorted(first.sweep.missing + ["timed humaneval"]), \
        "the rerun ran only the missing trials of the wide pass, then the timed pass"
    before = {r["key"]: r["tau"] for r in UNDISTURBED["sweep_rows"]}
    after = {r["key"]: r["tau"] for r in second.sweep.rows}
    assert before and all(after[k] == tau for k, tau in before.items()), (before, after)
    assert client().get_run(second.sweep.parent_run_id).data.tags["jetflow.sweep.missing"] == "none"


def test_a_two_node_training_resumes_from_its_checkpoint_in_storage_in_the_same_run(cluster):
    """Ray Train on both workers; worker2 killed after the first checkpoint reached storage, a replacement node
    joins: Ray Train (FailureConfig) restarts the worker group, every rank resumes from that checkpoint, rank 0
    keeps logging into the same MLflow run, and the job ends with the whole head."""
    from jetflow.paths import heads_dir
    from jetflow.storage import storage
    from jetflow.tracking.store import client, experiment_for

    st = storage()

    def checkpointed():  # registered: every rank reported it (Ray then writes its snapshot), not just uploaded
        return "checkpoint_manager_snapshot.json" in st.files("ray_results/train-fault")

    killer = Killer(cluster, 2, checkpointed)
    killer.start()
    proc = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "train.py"), "--preset", "smoke", "--name", "fault",
                             "--workers", "2", "--max-steps", "16", "--checkpoint-every", "4"],
                            env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    killer.join(timeout=400)
    if killer.killed_at is None:
        proc.kill()
        raise AssertionError(f"{killer.error}\n{proc.communicate()[0][-4000:]}")
    _replace(cluster, 2)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    runs = client().search_runs([experiment_for(TARGET)], "attributes.run_name = 'train fault'")
    assert len(runs) == 1, f"one training run, continued (not a second one): {[r.info.run_id for r in runs]}"
    run = runs[0]
    assert run.info.status == "FINISHED"
    resumed = int(run.data.tags["jetflow.resumed_from_step"])
    assert 4 <= resumed < 16 and resumed % 4 == 0, f"resumed from a checkpoint's step, not {resumed}"
    steps = {m.step for m in client().get_metric_history(run.info.run_id, "train/loss")}
    assert steps == set(range(1, 17)), steps
    assert (heads_dir() / "fault" / "model.safetensors").exists()


def test_a_two_actor_regeneration_that_lost_a_node_finishes_with_the_same_manifest(cluster):
    """The main job's data regenerated again on 2 actors on 2 nodes, worker2 killed while its actor answers a
    shard: the survivor answers it, the manifest (its content hash) equals the undisturbed one."""
    import ray._private.state as state

    from jetflow.data.regenerate import MANIFEST, regenerate
    from jetflow.storage import storage
    from jetflow.train.pipeline import PRESETS

    st = storage()
    [rel] = [f"data/regen/{k.rsplit('/', 1)[0]}" for k in st.files("data/regen") if k.endswith(MANIFEST)]
    undisturbed = st.read_json(f"{rel}/{MANIFEST}")
    for name in st.files(rel):  # a fresh start: no shard, no manifest
        st.delete(f"{rel}/{name}")
    worker2 = cluster.worker(2).ip

    def working_on_worker2():
        actors = state.actors().values()
        return any(a["ActorClassName"] == "_ShardWorker" and a["State"] == "ALIVE"
                   and a["Address"]["IPAddress"] == worker2 for a in actors)

    killer = Killer(cluster, 2, working_on_worker2)
    killer.start()
    cfg = dataclasses.replace(PRESETS["smoke"].regen, workers=2)
    out = regenerate(cfg, progress=False)
    killer.join(timeout=5)
    assert killer.killed_at is not None, killer.error
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["content_sha256"] == undisturbed["content_sha256"]
    assert st.read_json(f"{rel}/{MANIFEST}")["content_sha256"] == undisturbed["content_sha256"]
    assert len([n for n in st.files(rel) if n.endswith(".parquet")]) == undisturbed["shards"] == 2
    _replace(cluster, 2)


def _replica_on_each_worker(cluster) -> bool:
    """Serve reports two running replicas of the app, one alive on each worker node."""
    import ray._private.state as state
    from ray import serve

    try:
        status = serve.status().applications["jetflow"].deployments["JetFlow"]
    except KeyError:
        return False
    alive = {a["Address"]["IPAddress"] for a in state.actors().values()
             if a["ActorClassName"] == "ServeReplica:jetflow:JetFlow" and a["State"] == "ALIVE"}
    return status.replica_states.get("RUNNING", 0) == 2 and alive == {w.ip for w in cluster.workers}


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """`serve/app.py --address …` joined to the cluster, a replica on each worker node; (base URL, its process)."""
    port = 18000 + os.getpid() % 1000
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve" / "app.py"), "--address", cluster.address,
                             "--host", cluster.head_ip, "--port", str(port), "--min-replicas", "2",
                             "--max-replicas", "2", "--replica-cpus", "1", "--policy", "fixed"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(cluster, f"http://{cluster.head_ip}:{port}/v1/models", "serve/app.py", proc, time.monotonic() + 300)
        # the first replica answers before the second is up (a replacement node converts its target first)
        _wait_for(lambda: _replica_on_each_worker(cluster), "a running replica on each worker node", 300)
        yield f"http://{cluster.head_ip}:{port}/v1", proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_serve_joins_the_cluster_with_a_replica_on_each_worker_node(cluster, served, tmp_path):
    """`serve/app.py --address …` places its replicas on the worker nodes; each reads the champion through the
    registry on its own node; the `openai` client gets `jetflow generate`'s text."""
    from openai import OpenAI

    assert _nodes_of("ServeReplica:jetflow:JetFlow") == {w.ip for w in cluster.workers}
    api = OpenAI(base_url=served[0], api_key="none")
    card = api.models.list().data[0]
    assert card.jetflow["speculative"] and card.jetflow["head"].startswith("models:/")
    prompts = ["Write a Python function that reverses a string.", "Name three colors."]
    served_texts = [api.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": p}],
                                                max_tokens=16, temperature=0).choices[0].message.content
                    for p in prompts]
    jsonl = tmp_path / "prompts.jsonl"  # the same champion, decoded on this machine by the CLI (one target load)
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    r = subprocess.run([sys.executable, "-m", "jetflow.cli", "generate", "--head", card.jetflow["head"],
                        "--max-new-tokens", "16", "--json", "--prompts", str(jsonl)],
                       env={**os.environ, "JETFLOW_HOME": MODEL_HOME}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    generated = [json.loads(line)["text"] for line in r.stdout.strip().splitlines() if line.startswith("{")]
    assert served_texts == generated


def test_serving_survives_a_node_lost_mid_stream(cluster, served):
    """8 concurrent streams over the two replicas; worker2 killed mid-stream. Its streams end in an error (no
    hang); the other replica's streams finish with their undisturbed text; a new request is answered by the
    survivor; with a replacement node, Serve is back to two running replicas."""
    from openai import OpenAI

    api = OpenAI(base_url=served[0], api_key="none", timeout=120, max_retries=0)
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def ask(p: str) -> str:
        return api.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": p}], max_tokens=48,
                                           temperature=0).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        undisturbed = list(pool.map(ask, prompts))
    assert _nodes_of("ServeReplica:jetflow:JetFlow") == {w.ip for w in cluster.workers}
    lost_ip = cluster.worker(2).ip

    def node_of(out) -> str | None:
        """The node whose replica answered: its Serve replica log names the request id (the chunks' id) when the
        replica admits the request, before its first token."""
        rid = out["id"].removeprefix("chatcmpl-")
        for w in cluster.workers:
            for log in (w.temp_dir / "session_latest" / "logs" / "serve").glob("replica_*.log"):
                if f"chat {rid}:" in log.read_text(errors="replace"):
                    return w.ip
        return None

    def start_streams() -> tuple[list[dict], list[threading.Thread]]:
        streams = [{"text": "", "id": None, "error": None, "first": threading.Event()} for _ in prompts]

        def stream(i: int) -> None:
            out = streams[i]
            try:
                for chunk in api.chat.completions.create(model=TARGET, messages=[{"role": "user",
                                                                                  "content": prompts[i]}],
                                                         max_tokens=48, temperature=0, stream=True):
                    out["id"] = chunk.id
                    if chunk.choices and chunk.choices[0].delta.content:
                        out["text"] += chunk.choices[0].delta.content
                        out["first"].set()
            except Exception as exc:  # noqa: BLE001 - what the client saw is the result
                out["error"] = exc
            finally:
                out["first"].set()

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
            time.sleep(0.2)  # one at a time through the proxy's router, which counts what it sent each replica
        for out in streams:
            assert out["first"].wait(120), "a stream got no first token"
        return streams, threads

    # Serve's router spreads the streams by the replicas' queue lengths as it sees them; where it put every stream
    # on one replica (a probe answered late on a loaded host), that round is no test of a lost node: it finishes
    # undisturbed and the streams start again
    for attempt in range(3):
        streams, threads = start_streams()
        nodes = [node_of(o) if o["id"] else None for o in streams]
        assert all(nodes), f"every stream's replica found in the replica logs: {[o['id'] for o in streams]}"
        if len(set(nodes)) == 2:
            break
        for t in threads:
            t.join(timeout=180)
        assert [o["text"] for o in streams] == undisturbed and not any(o["error"] for o in streams)
        print(f"[cluster] round {attempt + 1}: every stream on {nodes[0]}; again")
    else:
        pytest.fail("three rounds of 8 streams, each all on one replica: Serve did not spread them")
    cluster.kill_worker(2)
    t_kill = time.monotonic()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica's node died"
    lost_ids = {i for i, node in enumerate(nodes) if node == lost_ip}
    on_lost = [streams[i] for i in sorted(lost_ids)]
    survived = [(streams[i], undisturbed[i]) for i in range(len(streams)) if i not in lost_ids]
    assert all(o["error"] is None and o["text"] == text for o, text in survived), [(o["error"], o["text"], text)
                                                                                   for o, text in survived]
    assert any(o["error"] is not None for o in on_lost), "the killed replica's streams ended in an error"
    print(f"[cluster] streams: {len(survived)} finished on the survivor, "
          f"{sum(o['error'] is not None for o in on_lost)} of {len(on_lost)} on the lost node ended in "
          f"{sorted({type(o['error']).__name__ for o in on_lost if o['error'] is not None})} "
          f"within {time.monotonic() - t_kill:.0f} s")
    _wait_for(lambda: not any(n["ip"] == lost_ip and n["alive"] for n in cluster.nodes()), "the node marked dead", 60)
    assert ask(prompts[0]) == undisturbed[0], "a new request is answered by the surviving replica"
    cluster.restart_worker(2)

    _wait_for(lambda: _replica_on_each_worker(cluster), "Serve back at two running replicas, one on the "
              "replacement node", 300)
    assert ask(prompts[1]) == undisturbed[1]


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
