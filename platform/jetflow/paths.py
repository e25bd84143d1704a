"""Where JetFlow keeps what is not source: models, data, features, heads, the MLflow store."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def jetflow_home() -> Path:
    """`$JETFLOW_HOME`, default `~/.jetflow`; always absolute (Ray jobs run from a temp cwd)."""
    return Path(os.environ.get("JETFLOW_HOME", "~/.jetflow")).expanduser().resolve()


def models_dir() -> Path:
    return jetflow_home() / "models"


def heads_dir() -> Path:
    return jetflow_home() / "heads"


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read in 4 MiB chunks (weights and GGUF files are large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
