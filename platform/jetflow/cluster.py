"""Joining Ray the same way from every job, and what work on another node needs from the driver.

One machine (a local Ray, or `ray start --head` on this machine): workers share the driver's disk, so they get
its `$JETFLOW_HOME` and MLflow store as they are, and every stage may run in the driver's process.

A multi-node cluster (more than one node, or a head with no CPUs: `cluster.yaml`'s CPU head, whose GPU workers
join later) shares no disk. There:
- what a second node reads lives in cluster storage (`JETFLOW_STORAGE`, `jetflow.storage`); unset, the job
  stops with that error instead of writing files no other node can see;
- MLflow is one tracking server: a `sqlite:`/file store would split into one file per node, so it is refused;
  a loopback URI (`http://127.0.0.1:5000`, right on the head) is handed to workers as the address of the
  driver's node, the one address of the head they can reach; the driver asks the server at that address
  before any work starts (`jetflow.tracking.probe`: refused, a Host it refuses, no answer), so a
  misconfigured server fails the job in seconds;
- each node keeps its own `$JETFLOW_HOME` (models, downloaded heads, step-cost curves of its device);
- work that loads the target (regeneration, features, decoding, step-cost curves) runs on worker nodes
  (`on_worker`), never on the driver's node, and decides its device there.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any, Callable
from urllib.parse import urlparse, urlunparse

from jetflow.errors import InvalidSettingError, JetFlowError

def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_ip_towards(host: str, port: int) -> str | None:
    """This machine's address on the route to `host` (what the cluster's nodes know this node by)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return None


def worker_tracking_uri(uri: str, gcs: str | None) -> str:
    """The MLflow URI as a worker on another node reaches it: a loopback host becomes this driver node's address
    on the route to the cluster's GCS at `gcs` (host:port; the server then has to listen on that address:
    `mlflow server --host 0.0.0.0`). Unchanged without a GCS or when the GCS itself is on loopback."""
    parsed = urlparse(uri)
    if not gcs or parsed.scheme not in ("http", "https") or not _is_loopback(parsed.hostname):
        return uri
    host, _, port = gcs.rpartition(":")
    if _is_loopback(host):
        return uri
    ip = _local_ip_towards(host, int(port or 6379))
    if not ip or _is_loopback(ip):
        return uri
    netloc = f"{ip}:{parsed.port}" if parsed.port else ip
    return urlunparse(parsed._replace(netloc=netloc))


def reachable_from_workers(uri: str) -> str:
    """`worker_tracking_uri` for the multi-node cluster this process is connected to (unchanged without Ray or
    on one node, where the workers share this machine's loopback)."""
    import ray

    if not ray.is_initialized() or not is_multi_node():
        return uri
    try:
        gcs = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001
        return uri
    return worker_tracking_uri(uri, gcs)


def init_ray(address: str | None = None, *, need_storage: bool = True, need_tracking: bool = True,
             **init_kwargs) -> None:
    """ray.init once per driver, with the environment every worker needs (see the module doc). A no-op when Ray
    is already up (a test, a caller). On a multi-node cluster, InvalidSettingError when cluster storage
    (unless `need_storage` is False: serving reads heads through the registry) or a tracking server is
    missing. A tracking server (unless `need_tracking` is False: the job logs nothing) that does not answer,
    here or at the address the workers are handed, is TrackingUnreachableError within seconds, before any work
    starts. `init_kwargs` go to ray.init."""
    import ray

    from jetflow.paths import jetflow_home
    from jetflow.storage import is_configured, storage_env
    from jetflow.tracking.probe import check_tracking_server
    from jetflow.tracking.store import tracking_uri

    if ray.is_initialized():
        return
    uri = tracking_uri()
    if need_tracking:  # before Ray starts: a server this driver cannot reach fails in seconds
        check_tracking_server(uri, who="this job and its Ray workers")
    env = {"TOKENIZERS_PARALLELISM": "false", "MLFLOW_TRACKING_URI": uri, **storage_env()}
    for name in ("MLFLOW_S3_ENDPOINT_URL",):  # artifacts straight to an object store: its endpoint too
        if os.environ.get(name):
            env[name] = os.environ[name]
    if not is_configured():  # one machine, one disk: the workers use the driver's home
        env["JETFLOW_HOME"] = str(jetflow_home())
    kwargs = {"include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True, **init_kwargs}
    ray.init(address=address, runtime_env={"env_vars": env}, **kwargs)
    handed = reachable_from_workers(uri)
    if handed != uri:  # a multi-node cluster: join again, handing the workers the address they reach
        ray.shutdown()
        env["MLFLOW_TRACKING_URI"] = handed
        ray.init(address=address, runtime_env={"env_vars": env}, **kwargs)
    try:
        check_cluster_ready(need_storage)
        if need_tracking and handed != uri:  # the address other nodes are handed, asked the way they will ask it
            check_tracking_server(handed, who=f"Ray workers on other nodes, handed {uri} as this node's address,")
    except JetFlowError:
        ray.shutdown()
        raise


def handed_tracking_uri() -> str:
    """The tracking URI as workers of the Ray this process is connected to reach it (what a trial or Train worker
    is told to log to): decided from the current connection, so a later Ray (a test's next) is never handed an
    earlier one's."""
    from jetflow.tracking.store import tracking_uri

    return reachable_from_workers(tracking_uri())


def is_multi_node() -> bool:
    """Whether the Ray this process is connected to spans more than one node, or has a head with no CPUs (whose
    workers join later): then no node may count on another's disk. False without Ray."""
    import ray

    if not ray.is_initialized():
        return False
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1:
        return True
    return bool(nodes) and nodes[0].get("Resources", {}).get("CPU", 0) == 0


def check_cluster_ready(need_storage: bool = True) -> None:
    """On a multi-node cluster: cluster storage and a tracking server every node reaches, or a clear error."""
    from jetflow.storage import STORAGE_ENV, is_configured
    from jetflow.tracking.store import tracking_uri

    if not is_multi_node():
        return
    if need_storage and not is_configured():
        raise InvalidSettingError(
            f"this Ray cluster has several nodes (or a head with no CPUs) and they share no disk: set {STORAGE_ENV} "
            "to storage every node reaches — s3://bucket/prefix (JETFLOW_STORAGE_ENDPOINT for MinIO/Ceph) or a "
            "path every node mounts (/mnt/cluster_storage) — for data, features, results and heads")
    uri = tracking_uri()
    if urlparse(uri).scheme in ("", "file", "sqlite"):
        raise InvalidSettingError(
            f"MLflow store {uri} is a file on this node: on a multi-node cluster every node would log into a file "
            "of its own. Run one `mlflow server --host 0.0.0.0 --serve-artifacts` (cluster.yaml starts one on the "
            "head) and set MLFLOW_TRACKING_URI=http://<head>:5000")


def cluster_gpus() -> float:
    """GPUs the connected Ray cluster has (0 without Ray): where `device` is left to default, work asks for a
    GPU when the cluster has any — decided from the cluster, not from the driver's node."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def wants_gpu(device: str | None) -> bool:
    """Whether work placed with `device` (cpu, cuda, cuda:N, None = default) needs a GPU where it runs."""
    if device is None:
        return cluster_gpus() > 0 if is_multi_node() else _local_gpu()
    return device.startswith("cuda")


def _local_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def on_worker(fn: Callable[..., Any], *args, num_cpus: float = 1.0, num_gpus: float = 0.0, **kwargs) -> Any:
    """`fn(*args, **kwargs)` where work that loads the target belongs: in this process on one machine; on a
    multi-node cluster as a Ray task on a worker node (it asks for CPUs, which a cluster's head does not
    offer, and `num_gpus`), its result returned. `fn` must be importable (a module-level function)."""
    if not is_multi_node():
        return fn(*args, **kwargs)
    import ray

    task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0)(fn)
    return ray.get(task.remote(*args, **kwargs))


def node_address() -> str:
    """This process's node, as the cluster knows it (for error messages)."""
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return socket.gethostname()
