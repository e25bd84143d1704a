"""Live training runs: a training's MLflow run is opened when training starts and fills while it trains —
params (the whole `TrainConfig`, the head's architecture, the step schedule), a point per optimizer step
(loss, learning rate, epoch, drafted tokens/s; the held-out monitor's per-depth agreement and simulated
chain / tree τ whenever it runs), MLflow's system metrics, the data as dataset inputs — and it ends
FINISHED, KILLED or FAILED, so a killed training leaves a run that says so.

Who does what, for a training under Ray Train (a driver process and worker processes):
- the driver (the process that calls `train_on_ray`, or `train_in_process`) owns the run: it creates
  or continues it (`training_run`), logs the config and the datasets, writes the head folder's marker,
  prints progress on its console (`ConsoleProgress`), and ends the run;
- the rank-0 worker, which computes the steps, logs them (`StepLogger`) into the run whose id its loop
  config carries, with the system metrics of its node (on a multi-worker run every worker samples its
  own, as `system/rank<i>/…`). Ray Train's user callbacks would not do: they run in Ray Train's
  controller actor — neither the driver's console nor a step — and see one `ray.train.report` per
  checkpoint interval.

How it ends: FINISHED when training returns; KILLED on Ctrl-C (SIGINT), SIGTERM (turned into SystemExit
while the run is open, in the main thread) or Ray Train's controller stopping; FAILED on any other
exception. A hard kill (SIGKILL, a lost node) cannot be seen: that run stays RUNNING.

One head folder, one run — the marker `.mlflow_run.json` in the folder names it:
- training into a folder with checkpoints resumes from the newest one and continues the marker's run:
  same run id, RUNNING again, steps appended (steps redone since the checkpoint are logged again, with
  the same values: resume is exact), tag `jetflow.resumes` counting the resumptions;
- training into a folder without checkpoints starts at step 0, so it is a new run; the folder's previous
  run, if still RUNNING (hard-killed before its first checkpoint), is marked KILLED and tagged
  `jetflow.superseded_by`;
- a marker naming a run this store does not have (a copied folder, another store) is ignored.
`jetflow.tracking.log_training_run` completes the marker's run with the head files and final metrics.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Run, RunStatus
from mlflow.exceptions import MlflowException

from jetflow.tracking.datasets import log_training_inputs, training_datasets
from jetflow.tracking.runs import (KIND_TAG, _current_provenance, _head_params, _log_flat, _log_metrics,
                                   _log_new_params, _provenance_tags, ending, training_params)
from jetflow.tracking.store import client, experiment_for, tracking_uri

MARKER = ".mlflow_run.json"


@dataclass(frozen=True)
class LiveRun:
    """The open run of a training, as its driver holds it."""

    run_id: str
    experiment_id: str
    name: str
    resumed: bool          # continued from an earlier, interrupted training of the same folder

    def worker_config(self) -> dict[str, str]:
        """What a training worker needs to log into this run (JSON-able, for Ray Train's loop config): the
        tracking URI as a worker on another node reaches it (`jetflow.cluster.handed_tracking_uri`)."""
        from jetflow.cluster import handed_tracking_uri

        return {"run_id": self.run_id, "tracking_uri": handed_tracking_uri()}


def recorded_run(head_dir: str | Path) -> Run | None:
    """The run a head folder's marker names, when this store has it (not deleted); else None."""
    marker = Path(head_dir) / MARKER
    try:
        run_id = json.loads(marker.read_text())["run_id"]
    except (OSError, ValueError, KeyError):
        return None
    return _active_run(run_id)


def _active_run(run_id: str) -> Run | None:
    """Run `run_id` of this store, unless deleted; else None."""
    try:
        run = client().get_run(run_id)
    except MlflowException:
        return None
    return run if run.info.lifecycle_stage == "active" else None


def _features_meta(features: Any) -> dict:
    """A feature cache's features.json (folder given), or an `OnlineFeatures`' meta."""
    meta = getattr(features, "meta", None)
    return meta if meta is not None else json.loads((Path(features) / "features.json").read_text())


def _create(cfg, out: Path, features: Any, target_id: str, parent_run_id: str | None, run_name: str | None,
            tags: dict[str, str]) -> str:
    """A new training run: the tags and `data.*` params `log_training_run` gives a finished one, `train.*`."""
    meta = _features_meta(features)
    manifest = meta.get("data_manifest") or {}
    prov = _current_provenance()
    run_tags = {KIND_TAG: "train", "jetflow.target.id": target_id,
                "jetflow.target.revision": str(meta.get("target_revision", "unknown")),
                "jetflow.head.name": out.name, "jetflow.head.path": str(out), **_provenance_tags(prov), **tags}
    for tag, value in (("jetflow.data.manifest_sha256", manifest.get("content_sha256")),
                       ("jetflow.command", prov.get("command")), ("mlflow.parentRunId", parent_run_id)):
        if value:
            run_tags[tag] = value
    run_id = client().create_run(experiment_for(target_id), run_name=run_name or f"train {out.name}",
                                 tags=run_tags).info.run_id
    params = training_params(cfg.to_dict())
    params.update({"data.manifest_sha256": manifest.get("content_sha256", ""),
                   "data.tokens": manifest.get("response_tokens", ""),
                   "data.features": "online" if meta.get("online") else str(Path(features).resolve())})
    _log_flat(run_id, params={k: v for k, v in params.items() if v != ""})
    return run_id


def _raise_system_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def training_run(cfg, out: str | Path, features: Any, *, target_id: str | None = None,
                 parent_run_id: str | None = None, run_name: str | None = None, tags: dict[str, str] | None = None,
                 interruptions: tuple[type[BaseException], ...] = (), resuming: bool = False,
                 run_id: str | None = None) -> Iterator[LiveRun]:
    """Open (or continue, see the module doc) the live run of training `cfg` into head folder `out` on
    `features` (a feature-cache folder or an `OnlineFeatures`), in experiment `jetflow/<target>` (default:
    the target the features were computed with), nested under `parent_run_id` when given. The run ends
    when the block does: FINISHED, KILLED (KeyboardInterrupt, SystemExit — SIGTERM raises it while the
    block runs in the main thread — or one of `interruptions`) or FAILED (any other exception). `resuming`:
    the training will resume from checkpoints in `out` (its caller, which owns them, says so); `run_id`: the
    run those checkpoints belong to (a checkpoint in cluster storage names it), else the one `out` records."""
    out = Path(out).expanduser().resolve()
    target_id = target_id or _features_meta(features)["target_model_id"]
    c = client()
    previous = _active_run(run_id) if run_id else None
    previous = previous or recorded_run(out)
    resumed = previous is not None and resuming
    if resumed:
        run_id = previous.info.run_id
        c.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        c.set_tag(run_id, "jetflow.resumes", str(int(previous.data.tags.get("jetflow.resumes", "0")) + 1))
    else:
        run_id = _create(cfg, out, features, target_id, parent_run_id, run_name, tags or {})
        if previous is not None and previous.info.status == RunStatus.to_string(RunStatus.RUNNING):
            c.set_terminated(previous.info.run_id, RunStatus.to_string(RunStatus.KILLED))
            c.set_tag(previous.info.run_id, "jetflow.superseded_by", run_id)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{MARKER}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id, "tracking_uri": tracking_uri()}) + "\n")
    os.replace(tmp, out / MARKER)
    log_training_inputs(run_id, training_datasets(features))
    run = c.get_run(run_id)

    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    if main:
        signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        with ending(run_id, interruptions):
            yield LiveRun(run_id, run.info.experiment_id, run.info.run_name, resumed)
    finally:
        for sig, handler in saved.items():  # Ray Train's fit() leaves its own SIGINT handler installed
            signal.signal(sig, handler)


def check_reachable(run_id: str) -> None:
    """TrackingUnreachableError unless this process can read run `run_id` from its tracking store: a training
    worker that cannot log fails at once with the reason, instead of training with its metrics lost."""
    from jetflow.errors import TrackingUnreachableError

    try:
        client().get_run(run_id)
    except Exception as exc:  # noqa: BLE001 - any failure to reach the store is this error
        import socket

        raise TrackingUnreachableError(
            f"this worker ({socket.gethostname()}) cannot reach MLflow run {run_id} at {tracking_uri()}: "
            f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. On a cluster the tracking "
            "server must listen on an address every node reaches (mlflow server --host 0.0.0.0)") from None


class StepLogger:
    """The training process's side of a live run, given as `train(log=..., on_start=...)`: step metrics
    are buffered with their own timestamps and written in batches — at every `flush_every`-th step (the
    Ray Train report interval), with every held-out evaluation, at least every `flush_s` seconds, and at
    close — so a run's history holds a point per step while logging costs one request per batch. A
    failed write (a busy store) is kept and retried at the next flush: tracking never stops a training.
    `steps=False` (ranks > 0) only samples system metrics."""

    def __init__(self, run_id: str, *, steps: bool = True, flush_every: int = 0, flush_s: float = 5.0,
                 system_metrics: bool = True, node_id: str | None = None):
        self.run_id, self.steps, self.flush_every, self.flush_s = run_id, steps, flush_every, flush_s
        self._buffer: list[Metric] = []
        self._last: dict[str, tuple[int, float]] = {}  # key → (step, value) last buffered
        self._last_flush = time.monotonic()
        self._warned = False
        self._monitor = None
        check_reachable(run_id)
        if system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # resume_logging: a continued run's system metrics go on from its last step
            self._monitor = SystemMetricsMonitor(run_id, resume_logging=True, node_id=node_id,
                                                 tracking_uri=tracking_uri())
            self._monitor.start()

    def start(self, head, schedule: dict[str, int]) -> None:
        """`train`'s on_start: the head's architecture (`head.*`) and the schedule (`schedule.*`) as params."""
        if not self.steps:
            return
        fixed = {k: v for k, v in schedule.items() if k != "start_step"}  # the same on every resume
        self._guard(_log_new_params, self.run_id, {**_head_params(head.config.to_dict()),
                                                   **{f"schedule.{k}": str(v) for k, v in fixed.items()}})
        if schedule.get("start_step"):
            self._guard(_log_flat, self.run_id, tags={"jetflow.resumed_from_step": str(schedule["start_step"])})

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        if not self.steps:
            return
        now = int(time.time() * 1000)
        for key, value in metrics.items():
            # the final metrics repeat the last step's loss and lr: one point per step is enough
            if isinstance(value, (int, float)) and self._last.get(key) != (step, float(value)):
                self._buffer.append(Metric(key, float(value), now, step))
                self._last[key] = (step, float(value))
        due = (any(k.startswith("eval/") for k in metrics) or (self.flush_every and step % self.flush_every == 0)
               or time.monotonic() - self._last_flush >= self.flush_s)
        if due:
            self.flush()

    def flush(self) -> None:
        if self._buffer and self._guard(_log_metrics, self.run_id, self._buffer):
            self._buffer = []
        self._last_flush = time.monotonic()

    def _guard(self, fn, *args, **kwargs) -> bool:
        try:
            fn(*args, **kwargs)
            return True
        except Exception as exc:  # the store is down or busy: training goes on, the points wait
            if not self._warned:
                print(f"[mlflow] could not log to run {self.run_id} ({exc}); retrying at the next flush",
                      file=sys.stderr, flush=True)
                self._warned = True
            return False

    def close(self) -> None:
        self.flush()
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None

    def __enter__(self) -> "StepLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(label: str, step: int, total: int | None, loss: float | None, tokens_per_s: float | None,
                  elapsed_s: float, eta_s: float | None) -> str:
    """One console line: `[train demo] step 150/720 (21%) · loss 3.214 · 412 drafted tok/s · 2m05s · ETA 7m55s`."""
    parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} drafted tok/s")
    parts.append(_duration(elapsed_s))
    parts.append(f"ETA {_duration(eta_s)}" if eta_s is not None else "ETA –")
    return f"[train {label}] " + " · ".join(parts)


class ConsoleProgress:
    """Training progress on the driver's console while the workers train: a line every `every_s` seconds
    (step of total, loss, drafted tokens/s, elapsed, ETA from the step rate seen so far), and a closing
    line with the final loss and held-out τ. It reads the live run (which the rank-0 worker fills), so it
    prints what MLflow holds. `every_s=None` prints nothing (a Tune trial: Tune reports its trials)."""

    POLL_S = 5.0

    def __init__(self, run: LiveRun, label: str, every_s: float | None = 30.0):
        self.run, self.label, self.every_s = run, label, every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._seen: tuple[float, int] | None = None   # (time, step) first observed, for the step rate
        self.step = 0                                  # the latest step polled

    def _read(self) -> tuple[int, int | None, dict[str, float]]:
        run = client().get_run(self.run.run_id)
        p, m = run.data.params, run.data.metrics
        total = int(p["schedule.total_steps"]) if "schedule.total_steps" in p else None
        per_epoch = int(p.get("schedule.steps_per_epoch", 0))
        step = round(m.get("train/epoch", 0.0) * per_epoch)  # the step the latest point was logged at
        return step, total, m

    def poll(self) -> str | None:
        """The current progress line (None before the first step reaches the store)."""
        step, total, m = self._read()
        if "train/loss" not in m:
            return None
        now = time.monotonic()
        if self._seen is None or step < self._seen[1]:
            self._seen = (now, step)
        self.step = step
        t_seen, s_seen = self._seen
        eta = (total - step) * (now - t_seen) / (step - s_seen) if total and step > s_seen else None
        return progress_line(self.label, step, total, m.get("train/loss"), m.get("train/draft_tokens_per_s"),
                             now - self._t0, eta)

    def _loop(self) -> None:
        last_print, printed_step = time.monotonic(), -1
        while not self._stop.wait(min(self.POLL_S, self.every_s)):
            try:
                line = self.poll()
            except MlflowException:
                continue
            # a line when there is news: no repeats while the final evaluation or a checkpoint runs
            if line and self.step != printed_step and time.monotonic() - last_print >= self.every_s:
                print(line, flush=True)
                last_print, printed_step = time.monotonic(), self.step

    def __enter__(self) -> "ConsoleProgress":
        if self.every_s is not None:
            how = "resumed from its checkpoint" if self.run.resumed else "new run"
            print(f"[train {self.label}] MLflow run '{self.run.name}' ({self.run.run_id}, {how}); "
                  f"progress every {self.every_s:g} s", flush=True)
            self._thread = threading.Thread(target=self._loop, name="training-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if exc_type is not None:
            return
        _, total, m = self._read()
        taus = ", ".join(f"{k.removeprefix('eval/')} {m[k]:.2f}" for k in ("eval/tree_tau", "eval/chain_tau") if k in m)
        loss = f"loss {m['train/loss']:.3f}" if "train/loss" in m else "no steps"
        print(f"[train {self.label}] done: {total} steps · {loss}" + (f" · held-out {taus}" if taus else "")
              + f" · {_duration(time.monotonic() - self._t0)}", flush=True)
