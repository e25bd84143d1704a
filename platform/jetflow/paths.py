"""Where JetFlow keeps what is not source: models, data, features, heads, the MLflow store."""

from __future__ import annotations

import os
from pathlib import Path


def jetflow_home() -> Path:
    """`$JETFLOW_HOME`, default `~/.jetflow`; always absolute (Ray jobs run from a temp cwd)."""
    return Path(os.environ.get("JETFLOW_HOME", "~/.jetflow")).expanduser().resolve()


def models_dir() -> Path:
    return jetflow_home() / "models"


def heads_dir() -> Path:
    return jetflow_home() / "heads"
