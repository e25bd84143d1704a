"""A real multi-node Ray cluster on one Linux machine whose nodes share no disk and no loopback network, with
an S3-compatible object store and an MLflow tracking server: the harness for tests that check the platform
works when nodes share no disk (the main job across nodes, Serve across nodes, losing a node).

What each piece simulates:

* **The head** (`ray start --head --num-cpus 0`) is a real cluster's CPU head: it runs the GCS and takes no
  CPU work, in the machine's root network namespace, where the driver (the test process or a subprocess
  with `driver_env()`) runs too. It listens on the bridge address `head_ip` (10.213.X.1).
* **Each worker node** is a GPU worker machine with private disks: its own network namespace (its own
  loopback: 127.0.0.1 there is not the driver's) with address 10.213.X.(i+1) on a bridge, and its own mount
  namespace where `$JETFLOW_HOME` (the same absolute path as the driver's), the Hugging Face cache
  (`$HF_HOME`, root's `~/.cache/huggingface` by default) and `/tmp` are fresh tmpfs mounts: the node sees
  none of the driver's converted models, heads, features or MLflow sqlite store there, and nothing a driver
  left in /tmp. The code (the repository and its virtual environment) is visible, as on a cluster where
  every node runs the same install. A node carries the custom resources `worker<i>: 1` (to pin work to it)
  and `jetflow_worker: 1000`.
* **Node-level credentials**: worker raylets start from a clean environment (PATH, HOME, JETFLOW_HOME,
  HF_HOME and the AWS credential variables, as an instance role would give) and without any of the driver's
  settings (MLFLOW_TRACKING_URI, JETFLOW_STORAGE, JETFLOW_STORAGE_ENDPOINT, MLFLOW_S3_ENDPOINT_URL): the
  driver must hand those to its tasks itself.
* **An S3 bucket**: a moto server bound to `head_ip`, reachable from the driver and from every node.
* **An MLflow server on the head**: `mlflow server` bound to 0.0.0.0 (sqlite backend, artifacts proxied
  into the bucket): the driver reaches it at http://127.0.0.1:PORT, nodes at http://<head_ip>:PORT.

Needs root, iproute2 (`ip netns`), util-linux (`unshare`, `nsenter`, `mount`). `cluster_unavailable()` says
why a machine cannot run it. Everything is torn down by `LocalCluster.stop()` (also on a failed start, and
at interpreter exit): processes by PID, by the temp folders their command lines name, and by network
namespace; then namespaces, veths and the bridge. Ray is never stopped with `ray stop` (that would stop every
Ray instance of the user on the machine).

    with start_cluster(tmp_path / "c", jetflow_home()) as cluster:
        ray.init(address=cluster.address)
        ray.get(f.options(resources={"worker1": 0.01}).remote())
        ray.shutdown()          # before the cluster stops: a driver whose raylet dies exits
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

AWS_CREDENTIALS = {  # a node's own credentials (moto accepts any)
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
SUBNET_PREFIX = "10.213"
STARTUP_S = 180  # a loaded 2-core machine; typically ~20 s for the whole cluster
TAG_RE = re.compile(r"^jf(\d+)(?:x\d+)?b$")  # bridge names: jf<pid>[x<seq>]b
_seq = itertools.count()
_BIN = Path(sys.executable).parent  # the virtual environment's bin (not resolved: that would leave the venv)


class ClusterError(RuntimeError):
    """The cluster could not start (the message carries the tail of the relevant logs)."""


@dataclass
class Worker:
    """One worker node: `ip` on the bridge, network namespace `netns`, custom resource `resource`
    ("worker<i>"), `pid` of its raylet (the handle of its namespaces), `temp_dir` its Ray temp folder."""

    index: int
    ip: str
    netns: str
    resource: str
    pid: int = 0
    temp_dir: Path | None = None
    veth: str = ""
    alive: bool = False
    restarts: int = 0       # replacements started by `LocalCluster.restart_worker`


@dataclass
class LocalCluster:
    """A started cluster (see the module docstring). `address` is what a driver passes to `ray.init`."""

    base: Path
    jetflow_home: Path
    hf_home: Path
    tag: str
    head_ip: str
    bridge: str
    cpus_per_worker: int = 1
    object_store_mb: int = 1024
    ray_env: dict[str, str] = field(default_factory=dict)
    gcs_port: int = 0
    dashboard_port: int = 0
    workers: list[Worker] = field(default_factory=list)
    s3_endpoint: str = ""
    bucket: str = ""
    mlflow_port: int = 0
    head_temp_dir: Path | None = None
    short_dir: Path | None = None  # Ray's temp folders (/tmp/<tag>: Unix socket paths must stay < 108 bytes)
    _procs: list = field(default_factory=list)  # Popen of servers, each in its own session
    _stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ addresses
    @property
    def address(self) -> str:
        """The GCS address, "10.213.X.1:PORT", for `ray.init(address=...)` / RAY_ADDRESS."""
        return f"{self.head_ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        """The head's dashboard (Ray's state and jobs APIs: `ray job submit --address …`)."""
        return f"http://{self.head_ip}:{self.dashboard_port}"

    @property
    def storage_uri(self) -> str:
        """JETFLOW_STORAGE: "s3://<bucket>/jetflow" ("" without the object store)."""
        return f"s3://{self.bucket}/jetflow" if self.bucket else ""

    @property
    def mlflow_uri(self) -> str:
        """The tracking URI the driver uses (the server binds 0.0.0.0): "http://127.0.0.1:PORT"."""
        return f"http://127.0.0.1:{self.mlflow_port}" if self.mlflow_port else ""

    @property
    def mlflow_worker_uri(self) -> str:
        """The tracking URI as nodes reach it: "http://<head_ip>:PORT" (their 127.0.0.1 is their own)."""
        return f"http://{self.head_ip}:{self.mlflow_port}" if self.mlflow_port else ""

    def worker(self, index: int) -> Worker:
        """Worker node `index` (1-based, as in its resource name)."""
        return self.workers[index - 1]

    # ------------------------------------------------------------------ environments
    def node_env(self) -> dict[str, str]:
        """The whole, clean environment a node's raylet (so every task and actor on it) starts with."""
        path = os.pathsep.join([str(_BIN), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin",
                                "/sbin", "/bin"])
        # the suite's pin of `graphs=auto` (tests/conftest.py: the eager reference) reaches every node: without it
        # each worker node would calibrate and compile the step core on first use (minutes per node on 2 cores),
        # which the cluster tests are not about (tests/test_stepcore.py carries compiled kernels through storage)
        pinned = {k: os.environ[k] for k in ("JETFLOW_GRAPHS",) if k in os.environ}
        return {"PATH": path, "HOME": str(Path.home()), "LANG": "C.UTF-8",
                "JETFLOW_HOME": str(self.jetflow_home), "HF_HOME": str(self.hf_home),
                "TOKENIZERS_PARALLELISM": "false", **pinned, **RAY_ENV, **AWS_CREDENTIALS, **self.ray_env}

    def driver_env(self) -> dict[str, str]:
        """What a driver process needs on top of `os.environ`: `env={**os.environ, **cluster.driver_env()}`."""
        env = {"RAY_ADDRESS": self.address, "JETFLOW_HOME": str(self.jetflow_home), **RAY_ENV,
               **AWS_CREDENTIALS}
        if self.bucket:
            env.update(JETFLOW_STORAGE=self.storage_uri, JETFLOW_STORAGE_ENDPOINT=self.s3_endpoint,
                       MLFLOW_S3_ENDPOINT_URL=self.s3_endpoint)
        if self.mlflow_port:
            env["MLFLOW_TRACKING_URI"] = self.mlflow_uri
        return env

    # ------------------------------------------------------------------ acting on nodes
    def run_on(self, worker_index: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Runs `argv` on worker node `worker_index` (inside its network and mount namespaces, with the node's
        environment unless `env=` is given); `kwargs` go to `subprocess.run`."""
        w = self.worker(worker_index)
        if not w.alive:
            raise ClusterError(f"worker{worker_index} is not running")
        kwargs.setdefault("env", self.node_env())
        return subprocess.run(["nsenter", "-t", str(w.pid), "-n", "-m", "--", *argv], **kwargs)

    def kill_worker(self, index: int) -> list[int]:
        """SIGKILLs worker node `index`: its raylet and every process in its network namespace (Ray workers,
        agents), as when a machine dies. Returns the killed PIDs. The node's namespaces stay (a dead machine
        keeps its address); Ray marks the node dead once its health checks fail."""
        w = self.worker(index)
        pids = set(_netns_pids(w.netns))
        if w.pid:
            pids.add(w.pid)
        _kill(pids)
        w.alive = False
        return sorted(pids)

    def restart_worker(self, index: int, timeout_s: float = STARTUP_S) -> Worker:
        """Starts a replacement for killed worker node `index`, as a cloud replaces a lost machine: the same
        address, resources and CPUs, but a new Ray node with an empty private disk (fresh mount namespace, so
        an empty JETFLOW_HOME, HF cache and /tmp). Returns once Ray reports it alive."""
        w = self.worker(index)
        if w.alive:
            raise ClusterError(f"worker{index} is running: kill_worker({index}) first")
        deadline = time.monotonic() + timeout_s
        while any(n["ip"] == w.ip and n["alive"] for n in self.nodes()):  # the lost node marked dead first
            if time.monotonic() > deadline:
                raise ClusterError(f"Ray still reports the killed worker{index} alive\n{self.logs_tail()}")
            time.sleep(0.25)
        w.restarts += 1
        w.temp_dir = self.short_dir / f"w{index}r{w.restarts}"
        proc = _launch_worker(self, w, self.object_store_mb)
        _finish_worker(self, w, proc, deadline)
        _wait_nodes(self, 1 + sum(x.alive for x in self.workers), deadline)
        return w

    def nodes(self) -> list[dict]:
        """The GCS's node table (alive and dead): dicts with node_id, ip, alive, resources."""
        return _gcs_nodes(self.address)

    def logs_tail(self, chars: int = 3000) -> str:
        """The last `chars` of each node's raylet/GCS logs and of the servers' logs (for failure messages)."""
        out = []
        candidates = [self.base / f"{n}.log" for n in ("s3", "mlflow", "ray-head.start")]
        candidates += [self.base / f"ray-{w.temp_dir.name}.start.log" for w in self.workers]
        for d in [self.head_temp_dir] + [w.temp_dir for w in self.workers]:
            if d is not None:
                logs = d / "session_latest" / "logs"
                candidates += [logs / "gcs_server.out", logs / "raylet.out", logs / "raylet.err"]
        for p in candidates:
            try:
                text = p.read_text(errors="replace")
            except OSError:
                continue
            if text.strip():
                out.append(f"--- {p}\n{text[-chars:]}")
        return "\n".join(out)

    # ------------------------------------------------------------------ teardown
    def stop(self) -> None:
        """Kills everything this cluster started and removes its network devices. Idempotent; safe after a
        partial start. Stop drivers first (`ray.shutdown()`): a driver whose raylet dies exits."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        _GCS_CLIENTS.pop(self.address, None)
        try:
            pids: set[int] = set()
            for w in self.workers:
                pids.update(_netns_pids(w.netns))
                if w.pid and w.alive:  # a killed node's PID may belong to another process by now
                    pids.add(w.pid)
                w.alive = False
            markers = [f"{p}/" for p in (self.short_dir, self.base) if p is not None]
            pids.update(_pids_naming(markers))
            for proc in self._procs:
                pids.update(_group(proc))
            _kill(pids)
            for proc in self._procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            _net_down(self.tag, [w.netns for w in self.workers], [w.veth for w in self.workers], self.bridge)
            self._keep_logs()

    def _keep_logs(self) -> None:
        """Moves Ray's temp folders from /tmp/<tag> into `base` (ray-head, ray-w<i>), where the symlinks were."""
        if self.short_dir is None or not self.short_dir.exists():
            return
        for src in sorted(self.short_dir.iterdir()):
            dst = self.base / ("ray-head" if src.name == "head" else f"ray-{src.name}")
            try:
                if dst.is_symlink():
                    dst.unlink()
                shutil.move(str(src), str(dst))
                latest = dst / "session_latest"  # Ray's link is absolute: point it at the moved session
                if latest.is_symlink():
                    target = os.path.basename(os.readlink(latest))
                    latest.unlink()
                    latest.symlink_to(target)
            except OSError:
                pass
        shutil.rmtree(self.short_dir, ignore_errors=True)
        self.head_temp_dir = self.base / "ray-head"
        for w in self.workers:
            w.temp_dir = self.base / f"ray-{w.temp_dir.name}"

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------- start
def cluster_unavailable() -> str | None:
    """Why this machine cannot run a LocalCluster (None: it can)."""
    if sys.platform != "linux":
        return "needs Linux network and mount namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, tmpfs mounts)"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return f"needs `{tool}` (apt-get install iproute2 util-linux)"
    probe = f"jf{os.getpid()}probe"[:15]
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if not (_BIN / "ray").exists():
        return f"no `ray` next to {sys.executable}"
    return None


def start_cluster(base: Path, jetflow_home: Path, workers: int = 2, cpus_per_worker: int = 1,
                  mlflow: bool = True, s3: bool = True, object_store_mb: int = 1024,
                  ray_env: dict[str, str] | None = None, timeout_s: float = STARTUP_S) -> LocalCluster:
    """Starts the head, `workers` worker nodes with `cpus_per_worker` CPUs each, and (optionally) the S3
    server with a bucket and the MLflow server; returns once Ray reports 1 + `workers` alive nodes and the
    servers answer. `base` receives logs and the MLflow store; `jetflow_home` is the driver's JETFLOW_HOME
    (each node gets a private, empty one at the same path). `ray_env`: extra variables for every node's Ray
    processes, e.g. Ray settings such as {"RAY_health_check_period_ms": "500",
    "RAY_health_check_failure_threshold": "3"} (a killed node is then marked dead in ~5 s instead of ~15 s).
    Tears down what it started if a step fails (and raises ClusterError with the logs' tails)."""
    reason = cluster_unavailable()
    if reason:
        raise ClusterError(f"cannot start a local cluster: {reason}")
    if not 1 <= workers <= 200:
        raise ValueError("workers must be 1..200")
    cleanup_stale()
    base = Path(base).resolve()
    base.mkdir(parents=True, exist_ok=True)
    jetflow_home = Path(jetflow_home).expanduser().resolve()
    hf_home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").resolve()
    seq = next(_seq)
    tag = f"jf{os.getpid()}" + (f"x{seq}" if seq else "")
    subnet = _free_subnet()
    c = LocalCluster(base=base, jetflow_home=jetflow_home, hf_home=hf_home, tag=tag,
                     head_ip=f"{SUBNET_PREFIX}.{subnet}.1", bridge=f"{tag}b", cpus_per_worker=cpus_per_worker,
                     object_store_mb=object_store_mb,
                     ray_env={k: str(v) for k, v in (ray_env or {}).items()})
    atexit.register(c.stop)
    try:
        deadline = time.monotonic() + timeout_s
        for d in (jetflow_home, hf_home):
            d.mkdir(parents=True, exist_ok=True)  # mount points on the driver's disk
        c.short_dir = Path("/tmp") / tag
        shutil.rmtree(c.short_dir, ignore_errors=True)
        c.short_dir.mkdir(parents=True)
        _net_up(c, subnet, workers)
        if s3:
            _start_s3(c)
        tracking = _start_mlflow(c) if mlflow else None
        _start_head(c, object_store_mb, deadline)
        launchers = [_launch_worker(c, w, object_store_mb) for w in c.workers]
        if s3:
            _create_bucket(c, deadline)
        for w, proc in zip(c.workers, launchers):
            _finish_worker(c, w, proc, deadline)
        _wait_nodes(c, 1 + workers, deadline)
        if tracking is not None:
            wait_http(c, f"{c.mlflow_uri}/health", "mlflow server", tracking, deadline)
        return c
    except BaseException:
        c.stop()
        raise


def _free_subnet() -> int:
    """A 10.213.X.0/24 no interface of this machine uses; X starts from the PID (concurrent runs differ)."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    start = os.getpid() % 250
    for k in range(250):
        x = 1 + (start + k) % 250
        if f" {SUBNET_PREFIX}.{x}." not in used:
            return x
    raise ClusterError(f"no free {SUBNET_PREFIX}.X.0/24 subnet")


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")
    return r


def _net_up(c: LocalCluster, subnet: int, workers: int) -> None:
    """The bridge (head_ip on it, in the root namespace) and one namespace + veth pair per worker."""
    _ip("link", "add", c.bridge, "type", "bridge")
    _ip("link", "set", c.bridge, "alias", str(c.base))  # lets cleanup_stale() find a dead run's processes
    _ip("addr", "add", f"{c.head_ip}/24", "dev", c.bridge)
    _ip("link", "set", c.bridge, "up")
    for i in range(1, workers + 1):
        w = Worker(index=i, ip=f"{SUBNET_PREFIX}.{subnet}.{i + 1}", netns=f"{c.tag}w{i}", resource=f"worker{i}",
                   veth=f"{c.tag}v{i}", temp_dir=c.short_dir / f"w{i}")
        c.workers.append(w)
        _ip("netns", "add", w.netns)
        peer = f"{c.tag}p{i}"
        _ip("link", "add", w.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", w.netns)
        _ip("link", "set", w.veth, "master", c.bridge)
        _ip("link", "set", w.veth, "up")
        _ip("link", "set", peer, "name", "eth0", ns=w.netns)
        _ip("addr", "add", f"{w.ip}/24", "dev", "eth0", ns=w.netns)
        _ip("link", "set", "eth0", "up", ns=w.netns)
        _ip("link", "set", "lo", "up", ns=w.netns)


def _net_down(tag: str, netns: list[str], veths: list[str], bridge: str) -> None:
    for ns in netns:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for v in veths:  # gone with their namespace's peer, unless the start stopped in between
        subprocess.run(["ip", "link", "del", v], capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("0.0.0.0", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _server_env(c: LocalCluster) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "JETFLOW_STORAGE", "AWS_", "RAY_ADDRESS"))}
    env.update(AWS_CREDENTIALS)
    env["PATH"] = os.pathsep.join([str(_BIN), env.get("PATH", "")])
    return env


def _popen_server(c: LocalCluster, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    with open(c.base / f"{name}.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=c.base, start_new_session=True)  # own group: its children go with it
    c._procs.append(proc)
    return proc


def _start_s3(c: LocalCluster) -> None:
    """The object store: moto bound to head_ip (reachable from the root namespace and every node)."""
    (port,) = _free_ports(1)
    c.s3_endpoint = f"http://{c.head_ip}:{port}"
    c.bucket = f"jetflow-{c.tag}"
    _popen_server(c, "s3", [str(_BIN / "moto_server"), "-H", c.head_ip, "-p", str(port)], _server_env(c))


def _create_bucket(c: LocalCluster, deadline: float) -> None:
    import boto3

    proc = next(p for p in c._procs if "moto_server" in p.args[0])
    wait_http(c, f"{c.s3_endpoint}/moto-api/", "S3 server", proc, deadline)
    s3 = boto3.client("s3", endpoint_url=c.s3_endpoint, aws_access_key_id=AWS_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=AWS_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                      region_name=AWS_CREDENTIALS["AWS_DEFAULT_REGION"])
    s3.create_bucket(Bucket=c.bucket)


def _start_mlflow(c: LocalCluster) -> subprocess.Popen:
    """The tracking server on the head: 0.0.0.0, sqlite under base, artifacts proxied into the bucket."""
    (c.mlflow_port,) = _free_ports(1)
    env = _server_env(c)
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job-runner workers: faster start, fewer processes
    if c.s3_endpoint:
        env["MLFLOW_S3_ENDPOINT_URL"] = c.s3_endpoint
        artifacts = f"s3://{c.bucket}/mlartifacts"
    else:
        artifacts = str(c.base / "mlartifacts")
    argv = [str(_BIN / "python"), "-m", "mlflow", "server", "--host", "0.0.0.0", "--port", str(c.mlflow_port),
            "--workers", "1", "--backend-store-uri", f"sqlite:///{c.base / 'mlflow.db'}",
            "--serve-artifacts", "--artifacts-destination", artifacts]
    return _popen_server(c, "mlflow", argv, env)


def _start_head(c: LocalCluster, object_store_mb: int, deadline: float) -> None:
    """`ray start --head --num-cpus 0` in the root namespace, every port chosen free (another Ray may run)."""
    c.head_temp_dir = c.short_dir / "head"
    _link(c.base / "ray-head", c.head_temp_dir)
    gcs, nm, om, client, agent, agent_grpc, metrics, renv, dash = _free_ports(9)
    c.gcs_port, c.dashboard_port = gcs, dash
    argv = [str(_BIN / "ray"), "start", "--head", "--num-cpus", "0", "--node-ip-address", c.head_ip,
            "--port", str(gcs), "--node-manager-port", str(nm), "--object-manager-port", str(om),
            "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
            "--dashboard-agent-grpc-port", str(agent_grpc), "--metrics-export-port", str(metrics),
            "--runtime-env-agent-port", str(renv), "--min-worker-port", "0", "--max-worker-port", "0",
            # the dashboard, as on a real head: Ray's state API (and Ray Train's placement-group cleaner, which
            # polls it) and the jobs API need it
            "--include-dashboard", "true", "--dashboard-host", c.head_ip, "--dashboard-port", str(dash),
            "--disable-usage-stats", "--temp-dir", str(c.head_temp_dir),
            "--object-store-memory", str(object_store_mb << 20)]
    log = c.base / "ray-head.start.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=c.node_env(), cwd=c.base)
    _wait_returned(c, proc, "`ray start --head`", deadline)


# Runs inside the worker's fresh network namespace, as a fresh mount namespace: keeps the node's Ray temp
# folder (on the machine's disk, so the harness can read its logs) through a descriptor, replaces /tmp,
# JETFLOW_HOME and HF_HOME with empty tmpfs mounts, puts the temp folder back, then starts the node.
_WORKER_SCRIPT = r"""
set -euo pipefail
raydir=$1 jfhome=$2 hfhome=$3; shift 3
exec 3< "$raydir"
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p "$raydir" "$jfhome" "$hfhome"
mount --no-canonicalize --bind /proc/self/fd/3 "$raydir"
exec 3<&-
mount -t tmpfs tmpfs "$jfhome"
mount -t tmpfs tmpfs "$hfhome"
exec "$@"
"""


def _launch_worker(c: LocalCluster, w: Worker, object_store_mb: int) -> subprocess.Popen:
    w.temp_dir.mkdir(parents=True, exist_ok=True)
    _link(c.base / f"ray-{w.temp_dir.name}", w.temp_dir)  # ray-w<i>, a replacement's ray-w<i>r<n>
    resources = json.dumps({w.resource: 1, "jetflow_worker": 1000})
    ray_argv = [str(_BIN / "ray"), "start", "--address", c.address, "--node-ip-address", w.ip,
                "--num-cpus", str(c.cpus_per_worker), "--resources", resources, "--disable-usage-stats",
                "--temp-dir", str(w.temp_dir), "--object-store-memory", str(object_store_mb << 20)]
    argv = ["ip", "netns", "exec", w.netns, "unshare", "--mount", "--propagation", "private", "--",
            "bash", "-c", _WORKER_SCRIPT, "bash", str(w.temp_dir), str(c.jetflow_home), str(c.hf_home),
            *ray_argv]
    with open(c.base / f"ray-{w.temp_dir.name}.start.log", "wb") as fh:
        # Every node here shares the machine's hostname, which resolves to a loopback address: gloo (Ray Train's
        # CPU collectives) would advertise that to its peers. A real node's hostname resolves to its own address;
        # here the node names its interface instead.
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**c.node_env(), "GLOO_SOCKET_IFNAME": "eth0"}, cwd="/")


def _wait_returned(c: LocalCluster, proc: subprocess.Popen, what: str, deadline: float) -> None:
    """`what` (a `ray start`, which daemonizes and returns) returned 0 before `deadline`, or ClusterError."""
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise ClusterError(f"{what} did not return in time\n{c.logs_tail()}")
    if rc != 0:
        raise ClusterError(f"{what} failed (exit {rc})\n{c.logs_tail()}")


def _finish_worker(c: LocalCluster, w: Worker, proc: subprocess.Popen, deadline: float) -> None:
    _wait_returned(c, proc, f"`ray start` of worker{w.index}", deadline)
    raylets = [p for p in _netns_pids(w.netns) if _exe_name(p) == "raylet"]
    if len(raylets) != 1:
        raise ClusterError(f"worker{w.index}: expected one raylet in {w.netns}, found {raylets}\n{c.logs_tail()}")
    w.pid, w.alive = raylets[0], True


def _wait_nodes(c: LocalCluster, n: int, deadline: float) -> None:
    alive: list = []
    while time.monotonic() < deadline:
        try:
            alive = [x for x in _gcs_nodes(c.address) if x["alive"]]
        except Exception:  # the GCS is still starting
            alive = []
        if len(alive) >= n:
            return
        time.sleep(0.25)
    raise ClusterError(f"Ray reports {len(alive)} alive nodes, expected {n}: "
                       f"{[x['ip'] for x in alive]}\n{c.logs_tail()}")


def wait_http(c: LocalCluster, url: str, what: str, proc: subprocess.Popen, deadline: float) -> None:
    """Until `url` answers 200; ClusterError when `proc` (the server `what`) exits or `deadline` passes."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise ClusterError(f"{what} exited ({proc.returncode}) before answering {url}\n{c.logs_tail()}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} did not answer {url} in time\n{c.logs_tail()}")
        time.sleep(0.25)


_GCS_CLIENTS: dict[str, object] = {}


def _gcs_nodes(address: str) -> list[dict]:
    """The GCS node table through Ray's own GCS client (no driver, no `ray status` process)."""
    from ray._raylet import GcsClient

    client = _GCS_CLIENTS.get(address)
    if client is None:
        client = _GCS_CLIENTS[address] = GcsClient(address=address)
    out = []
    for node_id, info in client.get_all_node_info(timeout=5).items():
        out.append({"node_id": node_id.hex(), "ip": info.node_manager_address,
                    "alive": info.state == 0,  # GcsNodeInfo.ALIVE
                    "resources": dict(info.resources_total)})
    return out


# ---------------------------------------------------------------------------------------------- processes
def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        else:
            link.unlink()
    link.symlink_to(target)


def _exe_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv0 = fh.read().split(b"\0", 1)[0].decode(errors="replace")
        return os.path.basename(argv0)
    except OSError:
        return ""


def _netns_pids(netns: str) -> list[int]:
    """PIDs of the processes in network namespace `netns` (every process of that node)."""
    try:
        st = os.stat(f"/run/netns/{netns}")
    except OSError:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                s = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                out.append(int(entry))
    return out


def _pids_naming(markers: list[str]) -> set[int]:
    """Processes whose command line names one of `markers` (folders ending in "/") or whose working folder
    is in one (the servers run in `base`), with all their descendants (Ray workers rename themselves to
    ray::<Task>, so they are found as the raylet's children)."""
    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found: set[int] = set()
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmd = " ".join(p.info["cmdline"] or [])
        cwd = (p.info["cwd"] or "").removesuffix(" (deleted)") + "/"
        if p.info["pid"] not in me and any(m in cmd or cwd.startswith(m) for m in markers):
            found.add(p.info["pid"])
            try:
                found.update(ch.pid for ch in p.children(recursive=True))
            except psutil.Error:
                pass
    return found - me


def _group(proc: subprocess.Popen) -> set[int]:
    """A server's process group (it was started in its own session) with descendants."""
    pid = proc.pid
    if proc.returncode is not None and psutil.pid_exists(pid):
        return set()  # reaped, and its PID is some other process's now (a PGID in use is never reused)
    found = {pid}
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.info["pid"]) == pid:
                found.add(p.info["pid"])
        except (OSError, psutil.Error):
            continue
    try:
        found.update(ch.pid for ch in psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        pass
    return found


def _kill(pids: set[int] | list[int], timeout: float = 10.0) -> None:
    """SIGKILL each PID, then wait until none is running (zombies count as gone)."""
    me = os.getpid()
    procs = []
    for pid in set(pids) - {me}:
        try:
            p = psutil.Process(pid)
            p.send_signal(signal.SIGKILL)
            procs.append(p)
        except psutil.Error:
            continue
    end = time.monotonic() + timeout
    while procs and time.monotonic() < end:
        procs = [p for p in procs if _running(p)]
        if procs:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return _running(psutil.Process(pid))
    except psutil.Error:
        return False


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cleanup_stale() -> list[str]:
    """Removes what a killed earlier run left (its test process gone without `stop()`): for each bridge
    jf<pid>…b whose PID is dead, the processes in its worker namespaces and those naming its base folder
    (kept in the bridge's alias), then the namespaces, veths and the bridge. Returns the bridges removed."""
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    removed = []
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        m = TAG_RE.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        tag = name[:-1]
        detail = subprocess.run(["ip", "-d", "link", "show", name], capture_output=True, text=True).stdout
        alias = re.search(r"^\s+alias (.+)$", detail, re.M)
        netns = [n.split()[0] for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                       text=True).stdout.splitlines()
                 if re.match(rf"^{tag}w\d+\b", n)]
        pids: set[int] = set()
        for ns in netns:
            pids.update(_netns_pids(ns))
        markers = [f"/tmp/{tag}/"] + ([alias.group(1).strip() + "/"] if alias else [])
        pids.update(_pids_naming(markers))
        _kill(pids)
        veths = [f"{tag}v{ns[len(tag) + 1:]}" for ns in netns]
        _net_down(tag, netns, veths, name)
        shutil.rmtree(f"/tmp/{tag}", ignore_errors=True)
        removed.append(name)
    return removed
