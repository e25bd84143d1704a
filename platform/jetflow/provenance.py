"""The provenance record beside every trained artifact and on every run: the command, the git state and the
package versions (one definition, for the pipeline's provenance.json and the tracking tags alike)."""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path


def provenance(extra: dict) -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    versions = {}
    for pkg in ("jetflow", "torch", "transformers", "ray", "mlflow", "datasets", "pyarrow"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {"command": " ".join(sys.argv), "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain")), "python": platform.python_version(),
            "packages": versions, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
