"""Joining Ray the same way from every job: a local cluster, or the one at `address` (`RAY_ADDRESS`, a
`ray job submit`), with the environment every worker needs to find what the driver uses; and what a
sweep says about the trials that ended in an error."""

from __future__ import annotations

import sys
from pathlib import Path


def init_ray(address: str | None = None) -> None:
    """ray.init once per driver: workers get the driver's $JETFLOW_HOME and MLflow store (absolute, since
    `ray job submit` runs from a temporary directory). A no-op when Ray is already up (a test, a caller)."""
    import ray

    from jetflow.paths import jetflow_home
    from jetflow.tracking.store import tracking_uri

    if ray.is_initialized():
        return
    env = {"JETFLOW_HOME": str(jetflow_home()), "MLFLOW_TRACKING_URI": tracking_uri(),
           "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address=address, runtime_env={"env_vars": env}, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)


def trial_errors(grid) -> dict[str, str]:
    """The errored trials of a Tune `ResultGrid`: trial folder (where Tune keeps error.txt) -> the error,
    whole (Tune's wrapper text ends with the trial's own exception)."""
    return {str(res.path): f"{type(res.error).__name__}: {res.error}" for res in grid if res.error is not None}


def report_trial_errors(prog: str, errors: dict[str, str]) -> None:
    """On stderr, each errored trial with the last lines of its error and where the whole one is."""
    for path, error in errors.items():
        tail = "\n    ".join([ln for ln in error.splitlines() if ln.strip()][-3:])
        print(f"{prog}: trial {Path(path).name} failed (whole error: {path}/error.txt):\n    {tail}", file=sys.stderr)
