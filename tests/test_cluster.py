"""The local multi-node cluster harness (`tests/cluster.py`) itself: before tests rely on it to show the platform
works when nodes share no disk, these show that its nodes really share none — a zero-CPU head and two
worker nodes, each with a private JETFLOW_HOME, Hugging Face cache and /tmp, its own loopback, no driver
settings in its environment, and its own credentials for the S3 bucket. The driver is this test process
(`ray.init(address=cluster.address)`, shut down before the cluster stops)."""

from __future__ import annotations

import os
import urllib.request
import uuid

import pytest

from jetflow.paths import jetflow_home
from tests.cluster import AWS_CREDENTIALS, cluster_unavailable, start_cluster

pytestmark = pytest.mark.cluster

WORKERS = 2
DRIVER_SETTINGS = ("MLFLOW_TRACKING_URI", "JETFLOW_STORAGE", "JETFLOW_STORAGE_ENDPOINT", "MLFLOW_S3_ENDPOINT_URL",
                   "RAY_ADDRESS")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A started LocalCluster (head + 2 worker nodes, S3, MLflow) with this process connected as its driver."""
    reason = cluster_unavailable()
    if reason:
        pytest.skip(f"local multi-node cluster unavailable: {reason}")
    import ray

    if ray.is_initialized():
        ray.shutdown()
    c = start_cluster(tmp_path_factory.mktemp("cluster"), jetflow_home(), workers=WORKERS)
    try:
        ray.init(address=c.address, log_to_driver=False)
        try:
            yield c
        finally:
            ray.shutdown()  # before the cluster stops: a driver whose raylet dies exits
    finally:
        c.stop()


def _s3_client(cluster):
    """The driver's S3 client for the cluster's bucket."""
    import boto3

    return boto3.client("s3", endpoint_url=cluster.s3_endpoint, aws_access_key_id=AWS_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=AWS_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                        region_name=AWS_CREDENTIALS["AWS_DEFAULT_REGION"])


def on(worker: int, fn, *args):
    """Runs `fn(*args)` as a Ray task pinned to worker node `worker` and returns its result."""
    import ray

    return ray.get(ray.remote(fn).options(num_cpus=1, resources={f"worker{worker}": 0.01}).remote(*args),
                   timeout=120)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def test_the_cluster_has_a_zero_cpu_head_and_two_worker_nodes(cluster):
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 1 + WORKERS, f"expected a head and {WORKERS} worker nodes alive, got {alive}"
    head = [n for n in alive if "node:__internal_head__" in n["Resources"]]
    assert len(head) == 1 and head[0]["NodeManagerAddress"] == cluster.head_ip, "the head runs on head_ip"
    assert head[0]["Resources"].get("CPU", 0) == 0, "the head takes no CPU work, like a real cluster's CPU head"
    for w in cluster.workers:
        node = [n for n in alive if n["NodeManagerAddress"] == w.ip]
        assert len(node) == 1, f"worker{w.index} is a node of its own at {w.ip}"
        res = node[0]["Resources"]
        assert res.get(w.resource) == 1 and res.get("jetflow_worker") == 1000, \
            f"worker{w.index} carries its pinning resource {w.resource!r}: {res}"
        assert res.get("CPU") == cluster.cpus_per_worker, f"worker{w.index} has its CPUs: {res}"
    assert on(1, _node_ip) == cluster.worker(1).ip and on(2, _node_ip) == cluster.worker(2).ip, \
        "a task pinned with resources={'worker<i>': ...} runs on that node"


def _write_marker(name: str) -> tuple[str, str, list[str]]:
    home = os.environ["JETFLOW_HOME"]
    path = os.path.join(home, name)
    with open(path, "w") as fh:
        fh.write("written on a worker node")
    import ray

    return ray.util.get_node_ip_address(), path, sorted(os.listdir(home))


def _look(paths: list[str]) -> tuple[str, dict[str, bool], list[str], list[str]]:
    import ray

    return (ray.util.get_node_ip_address(), {p: os.path.exists(p) for p in paths},
            sorted(os.listdir(os.environ["JETFLOW_HOME"])), sorted(os.listdir(os.environ["HF_HOME"])))


def test_worker_nodes_share_no_disk_with_the_driver(cluster, tmp_path):
    home = cluster.jetflow_home
    driver_file = home / f"driver-{uuid.uuid4().hex}"  # a file only the driver's disk has
    driver_tmp = tmp_path / "driver-tmp-file"
    driver_file.write_text("driver")
    driver_tmp.write_text("driver")
    name = f"worker1-{uuid.uuid4().hex}"
    try:
        ip, path, listing1 = on(1, _write_marker, name)
        assert ip == cluster.worker(1).ip, "the writing task ran on worker1"
        assert path == str(home / name), "worker1's JETFLOW_HOME is the driver's path (the same absolute path)"
        assert listing1 == [name], f"worker1's JETFLOW_HOME starts empty (no driver files): {listing1}"
        assert not (home / name).exists(), "the driver does not see a file worker1 wrote into JETFLOW_HOME"

        models = home / "models"
        ip2, seen, listing2, hf2 = on(2, _look, [path, str(driver_file), str(driver_tmp), str(models)])
        assert ip2 == cluster.worker(2).ip, "the looking task ran on worker2"
        assert seen == {path: False, str(driver_file): False, str(driver_tmp): False, str(models): False}, \
            f"worker2 sees neither worker1's file, nor the driver's JETFLOW_HOME, /tmp or models: {seen}"
        assert listing2 == [] and hf2 == [], \
            f"worker2's JETFLOW_HOME and HF cache are empty: {listing2}, {hf2}"
        ip1, seen1, _, hf1 = on(1, _look, [str(driver_file), str(models)])
        assert ip1 == cluster.worker(1).ip and not any(seen1.values()) and hf1 == [], \
            f"worker1 does not see the driver's JETFLOW_HOME files, converted models or HF cache: {seen1}, {hf1}"
    finally:
        driver_file.unlink(missing_ok=True)


def _http(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return f"{resp.status} {resp.read().decode()}"
    except OSError as e:
        return f"error: {e}"


def _http_both(a: str, b: str) -> tuple[str, str]:
    return _http(a), _http(b)


def test_a_worker_cannot_reach_the_drivers_loopback_but_reaches_the_head_ip(cluster):
    port = cluster.mlflow_port
    assert _http(f"{cluster.mlflow_uri}/health") == "200 OK", "the driver reaches MLflow at 127.0.0.1"
    loopback, head = on(1, _http_both, f"http://127.0.0.1:{port}/health", f"{cluster.mlflow_worker_uri}/health")
    assert loopback.startswith("error:") and "refused" in loopback.lower(), \
        f"a worker's 127.0.0.1 is its own: the driver's MLflow server is not there ({loopback})"
    assert head == "200 OK", f"a worker reaches the MLflow server at {cluster.mlflow_worker_uri} ({head})"


def _env() -> dict[str, str]:
    return dict(os.environ)


def test_worker_nodes_start_without_the_drivers_settings(cluster):
    for i in (1, 2):
        env = on(i, _env)
        leaked = {k: env[k] for k in DRIVER_SETTINGS if k in env}
        assert not leaked, f"worker{i} got driver settings from its node environment (must be handed over): {leaked}"
        assert env.get("AWS_ACCESS_KEY_ID") and env.get("JETFLOW_HOME") == str(cluster.jetflow_home), \
            f"worker{i} has its node's own credentials and JETFLOW_HOME"
    r = cluster.run_on(1, ["cat", "/proc/net/fib_trie"], capture_output=True, text=True, check=True)
    assert cluster.worker(1).ip in r.stdout and cluster.head_ip not in r.stdout.replace(cluster.worker(1).ip, ""), \
        "run_on runs inside worker1's network namespace (its only address is its own)"


def _s3_roundtrip(endpoint: str, bucket: str, key: str) -> tuple[str, bytes, list[str]]:
    from urllib.parse import urlparse

    import pyarrow.fs as pafs
    import ray

    ep = urlparse(endpoint)
    fs = pafs.S3FileSystem(endpoint_override=ep.netloc, scheme=ep.scheme,
                           region=os.environ["AWS_DEFAULT_REGION"])  # credentials: the node's environment
    with fs.open_output_stream(f"{bucket}/{key}") as out:
        out.write(b"from worker2")
    with fs.open_input_stream(f"{bucket}/{key}") as inp:
        data = inp.read()
    listing = [i.path for i in fs.get_file_info(pafs.FileSelector(f"{bucket}/{key.rsplit('/', 1)[0]}"))]
    return ray.util.get_node_ip_address(), data, listing


def test_workers_reach_the_object_store_with_their_own_credentials(cluster):
    key = f"jetflow/harness/{uuid.uuid4().hex}"
    ip, data, listing = on(2, _s3_roundtrip, cluster.s3_endpoint, cluster.bucket, key)
    assert ip == cluster.worker(2).ip and data == b"from worker2", \
        "worker2 wrote and read an object through the endpoint it was handed, with its node's credentials"
    assert f"{cluster.bucket}/{key}" in listing
    s3 = _s3_client(cluster)
    body = s3.get_object(Bucket=cluster.bucket, Key=key)["Body"].read()
    assert body == b"from worker2", "the driver reads the same object: the bucket is shared, the disks are not"
    assert cluster.storage_uri == f"s3://{cluster.bucket}/jetflow"
    assert cluster.driver_env()["JETFLOW_STORAGE"] == cluster.storage_uri


def _log_artifact(tracking_uri: str, name: str) -> tuple[str, str, str]:
    import mlflow
    import ray

    mlflow.set_tracking_uri(tracking_uri)  # handed over by the driver: the node has no MLFLOW_TRACKING_URI
    mlflow.set_experiment("cluster-harness")
    with mlflow.start_run() as run:
        mlflow.log_text("from worker1", name)
    return ray.util.get_node_ip_address(), run.info.run_id, run.info.artifact_uri


def test_a_worker_logs_to_the_mlflow_server_on_the_head_and_its_artifacts_land_in_the_bucket(cluster):
    from mlflow import MlflowClient

    ip, run_id, artifact_uri = on(1, _log_artifact, cluster.mlflow_worker_uri, "note.txt")
    assert ip == cluster.worker(1).ip and artifact_uri.startswith("mlflow-artifacts:"), \
        f"worker1 logged through the server's artifact proxy, not to a local path ({artifact_uri})"
    client = MlflowClient(cluster.mlflow_uri)
    assert client.get_run(run_id).info.status == "FINISHED", "the driver sees worker1's run on the head's server"
    s3 = _s3_client(cluster)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=cluster.bucket, Prefix="mlartifacts/").get("Contents", [])]
    assert any(k.endswith(f"{run_id}/artifacts/note.txt") for k in keys), \
        f"the server stored worker1's artifact in the bucket: {keys}"
