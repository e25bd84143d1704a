"""A cluster whose workers cannot use the MLflow tracking server fails in seconds at the driver, with the address
tried, what answered and the fix; a trial that meets such a setup error is not retried by Tune's FailureConfig.

Real `mlflow server` processes, both on loopback addresses (nothing is exposed to the network):
- one bound to 127.0.0.1, the way `mlflow server` starts by default: right for a driver on its node, refused at
  the address a worker on another node is handed (`jetflow.cluster.worker_tracking_uri`);
- one bound to 127.0.0.2 with MLflow's default Host check, which trusts only localhost, 127.0.0.1 and the private
  ranges: 127.0.0.2 stands for a head whose address is outside them (HTTP 403 "Invalid Host header").
The drivers are the real entry points, run as a user runs them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from jetflow.cluster import worker_tracking_uri
from jetflow.errors import TrackingUnreachableError
from jetflow.tracking.probe import check_tracking_server

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 180  # a loaded 2-core machine; typically ~13 s
DRIVER_S = 120   # an entry point that fails at its probe: imports, then one HTTP request (~10 s here)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"loopback": url of a server bound to 127.0.0.1, "host_checked": url of one bound to 127.0.0.2}, started
    together; stopped (process group) at the end."""
    procs, urls = [], {}
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_SERVER_ALLOWED_HOSTS")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    try:
        for name, host in (("loopback", "127.0.0.1"), ("host_checked", "127.0.0.2")):
            folder = tmp_path_factory.mktemp(name)
            port = _free_port(host)
            with open(folder / "server.log", "wb") as log:
                procs.append((subprocess.Popen(
                    [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", "1",
                     "--backend-store-uri", f"sqlite:///{folder / 'db.sqlite'}",
                     "--artifacts-destination", str(folder / "art")],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), folder))
            urls[name] = f"http://{host}:{port}"
        deadline = time.monotonic() + STARTUP_S
        for (proc, folder), url in zip(procs, urls.values()):
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server at {url} did not start (exit {proc.poll()}):\n"
                                f"{(folder / 'server.log').read_text(errors='replace')[-2000:]}")
                time.sleep(0.5)
        yield urls
    finally:
        for proc, _ in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc, _ in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _driver(argv: list[str], tmp_path: Path, tracking_uri: str, **env) -> tuple[subprocess.CompletedProcess, float]:
    """(the finished process, its seconds): `python ARGV` with the tracking URI, a fresh JETFLOW_HOME, no Ray
    address unless given."""
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update(MLFLOW_TRACKING_URI=tracking_uri, JETFLOW_HOME=str(tmp_path / "home"),
                    PYTHONPATH=str(ROOT / "platform"), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **env)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=full_env, capture_output=True, text=True,
                         timeout=DRIVER_S)
    return out, time.monotonic() - t0


def _one_error_line(out: subprocess.CompletedProcess, prog: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith(f"{prog}: error:")]
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


def test_a_server_bound_to_loopback_is_refused_at_the_address_workers_are_handed(servers, tmp_path):
    uri = servers["loopback"]
    check_tracking_server(uri)  # right for the driver, on the server's own node
    handed = worker_tracking_uri(uri, "192.0.2.77:6379")  # a GCS on another host: this node's address
    if handed == uri:
        pytest.skip("this machine has no non-loopback route to hand out")
    with pytest.raises(TrackingUnreachableError) as caught:
        check_tracking_server(handed, who="the Ray workers")
    for part in (handed, "connection refused", "mlflow server --host 0.0.0.0"):
        assert part in str(caught.value)

    out, seconds = _driver(["sweeps/budget.py"], tmp_path, handed)
    line = _one_error_line(out, "budget sweep")
    for part in (handed, "connection refused", "--host 0.0.0.0"):
        assert part in line, line
    assert seconds < DRIVER_S / 2
    assert not (tmp_path / "home" / "ray_results").exists()  # no trial, no Tune experiment


@pytest.mark.parametrize("argv, extra_env", [
    (["sweeps/arch.py"], {}),
    (["jobs/train.py", "--preset", "smoke"], {"RAY_ADDRESS": "127.0.0.1:9"}),  # a Ray job: it hands workers the URI
], ids=["arch sweep", "training job"])
def test_a_server_whose_host_check_refuses_the_address_stops_the_job_at_the_driver(servers, tmp_path, argv,
                                                                                    extra_env):
    uri = servers["host_checked"]
    out, seconds = _driver(argv, tmp_path, uri, **extra_env)
    line = _one_error_line(out, "arch sweep" if "arch" in argv[0] else "train")
    for part in (uri, "HTTP 403 'Invalid Host header'", "--allowed-hosts '127.0.0.2:"):
        assert part in line, line
    assert seconds < DRIVER_S / 2


def _count_and_run(config: dict) -> None:
    """A trial that counts its attempts in a file, then fails: a setup error (the probe of an address nothing
    listens on) or a crash."""
    attempts = Path(config["dir"]) / f"{config['kind']}.attempts"
    attempts.write_text(str(int(attempts.read_text() or 0) + 1) if attempts.exists() else "1")
    if config["kind"] == "setup":
        check_tracking_server(config["uri"], who="this trial", timeout_s=2)
    raise RuntimeError("a worker crashed")


def test_a_trial_with_a_setup_error_runs_once_while_a_crashing_trial_is_retried(servers, tmp_path):
    import ray
    from ray import tune

    from jetflow.sweeps.cluster import trial_errors
    from jetflow.sweeps.setup_errors import SETUP_ERROR, SetupErrorsNotRetried, not_retried_on_setup_error

    refused = servers["loopback"].replace("127.0.0.1", "127.0.0.3")  # bound to 127.0.0.1 only: refused here
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        grid = tune.Tuner(
            not_retried_on_setup_error(_count_and_run),
            param_space={"kind": tune.grid_search(["setup", "crash"]), "dir": str(tmp_path), "uri": refused},
            tune_config=tune.TuneConfig(max_concurrent_trials=1),
            run_config=tune.RunConfig(name="retries", storage_path=str(tmp_path / "results"), verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=1),
                                      callbacks=[SetupErrorsNotRetried(1)])).fit()
    finally:
        ray.shutdown()
    assert (tmp_path / "setup.attempts").read_text() == "1"  # the deterministic error: one attempt
    assert (tmp_path / "crash.attempts").read_text() == "2"  # anything else: FailureConfig's retry
    errors = trial_errors(grid)
    assert len(errors) == 2
    setup = next(res for res in grid if res.config["kind"] == "setup")
    assert "connection refused" in setup.metrics[SETUP_ERROR] and "TrackingUnreachableError" in str(setup.error)
