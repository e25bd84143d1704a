"""Where runs go: the tracking URI (absolute sqlite under $JETFLOW_HOME unless MLFLOW_TRACKING_URI says
otherwise), one MLflow client per URI, and one experiment per target."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from jetflow.paths import jetflow_home

DB_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
EXPERIMENT_PREFIX = "jetflow/"
# The MLflow UI shows an experiment of this kind as model training (runs, metric charts), not GenAI traces.
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
# Stores that own their artifact root (an `mlflow server` proxies artifacts; Databricks manages its own).
_REMOTE_SCHEMES = ("http", "https", "databricks", "databricks-uc")


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set (e.g. an `mlflow server` on the cluster head), else
    `sqlite:////abs/$JETFLOW_HOME/mlflow.db`. Absolute, because `ray job submit` runs from a temp cwd.
    The model registry uses the same URI."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    home = jetflow_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / DB_FILE}"  # home is absolute, so this has four slashes


def is_remote(uri: str | None = None) -> bool:
    """True when the store is a server that keeps artifacts itself (no local artifact folder needed)."""
    return urlparse(uri or tracking_uri()).scheme in _REMOTE_SCHEMES


@lru_cache(maxsize=8)
def _client_for(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def client() -> MlflowClient:
    """The client for the current tracking URI (cached per URI; MLflow clients are thread-safe)."""
    return _client_for(tracking_uri())


def safe_name(target_id: str) -> str:
    """A target id as a name fragment without slashes or spaces: "Qwen/Qwen3-8B" → "Qwen--Qwen3-8B"."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", target_id.replace("/", "--")).strip("-.") or "target"


def local_root(uri: str | None = None) -> Path:
    """Where files that belong to a store live on this machine (artifacts of local stores, downloaded
    registry versions): beside the database for sqlite — so a test's or a team's sqlite file keeps its
    artifacts with it — else $JETFLOW_HOME."""
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).expanduser().resolve().parent
    return jetflow_home()


def experiment_name(target_id: str) -> str:
    return f"{EXPERIMENT_PREFIX}{target_id}"


def experiment_for(target_id: str) -> str:
    """Experiment id of `jetflow/<target_id>`, created on first use. For local stores (sqlite, a
    database without a server) artifacts go to an absolute folder `mlartifacts/<target>` under
    `local_root()` ($JETFLOW_HOME for the default store); MLflow's default would be ./mlruns relative to
    whatever the cwd happens to be."""
    c, name = client(), experiment_name(target_id)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if EXPERIMENT_KIND_TAG not in exp.tags:  # made before experiments carried their kind
            c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        return exp.experiment_id
    location = None
    if not is_remote():
        folder = local_root() / ARTIFACTS_DIR / safe_name(target_id)
        folder.mkdir(parents=True, exist_ok=True)
        location = folder.as_uri()  # MLflow appends <run_id>/artifacts per run
    try:
        return c.create_experiment(name, artifact_location=location,
                                   tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
    except MlflowException as exc:  # a concurrent trial created it first
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
        return c.get_experiment_by_name(name).experiment_id
