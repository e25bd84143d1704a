"""What a sweep says about the trials that ended in an error (joining Ray: `jetflow.cluster`)."""

from __future__ import annotations

import sys
from pathlib import Path


def trial_errors(grid) -> dict[str, str]:
    """The errored trials of a Tune `ResultGrid`: trial folder (where Tune keeps error.txt) -> the error,
    whole (Tune's wrapper text ends with the trial's own exception)."""
    return {str(res.path): f"{type(res.error).__name__}: {res.error}" for res in grid if res.error is not None}


def report_trial_errors(prog: str, errors: dict[str, str]) -> None:
    """On stderr, each errored trial with the last lines of its error and where the whole one is."""
    for path, error in errors.items():
        tail = "\n    ".join([ln for ln in error.splitlines() if ln.strip()][-3:])
        print(f"{prog}: trial {Path(path).name} failed (whole error: {path}/error.txt):\n    {tail}", file=sys.stderr)
