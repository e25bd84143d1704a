"""The data a head is trained on, as MLflow datasets (`mlflow.data`): the regenerated answers (Parquet
shards + manifest.json under $JETFLOW_HOME/data/regen/) and the feature cache (safetensors shards +
features.json under $JETFLOW_HOME/features/<content key>/). Both are logged by reference: the folder is
the source, the content hash the digest, the manifest the profile, the on-disk layout the schema. They
are attached to the training run as inputs with the contexts "training" (the regenerated data) and
"features" (the cache built from it), which fills the run's Dataset column in the MLflow UI.

This module reads the data folders' files; it never writes them (they belong to `jetflow.data`)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag
from mlflow.exceptions import MlflowException
from mlflow.types.schema import Array, ColSpec, DataType, Schema, TensorSpec
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from jetflow.tracking.store import client

REGEN_CONTEXT, FEATURES_CONTEXT = "training", "features"
# MLflow stores at most 36 characters of a digest; the full content hash stays in the profile.
DIGEST_CHARS = 16
FEATURES_META = "features.json"


class FolderDataset(MetaDataset):
    """A dataset kept in a folder on disk, logged by reference: `MetaDataset` (source, name, digest,
    schema) plus a profile, the folder's manifest (what the MLflow UI's dataset view shows)."""

    def __init__(self, source: str | Path, name: str, digest: str, schema: Schema | None,
                 profile: Mapping[str, Any]):
        from mlflow.data.sources import LocalArtifactDatasetSource

        self._profile = dict(profile)
        super().__init__(LocalArtifactDatasetSource(str(source)), name=name, digest=digest[:DIGEST_CHARS],
                         schema=schema)

    @property
    def profile(self) -> dict[str, Any]:
        return self._profile

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "profile": json.dumps(self._profile, default=str)}


def _arrow_to_mlflow(arrow_type) -> DataType | Array:
    import pyarrow as pa

    if pa.types.is_list(arrow_type):
        return Array(_arrow_to_mlflow(arrow_type.value_type))
    if pa.types.is_int64(arrow_type):
        return DataType.long
    if pa.types.is_integer(arrow_type):
        return DataType.integer
    if pa.types.is_floating(arrow_type):
        return DataType.double
    return DataType.string


def find_regen_dir(manifest: Mapping[str, Any]) -> Path | None:
    """The regeneration folder a manifest describes, where `jetflow.data.regenerate` puts it by default
    (its settings + target revision name it), if it is there and holds the same content; else None."""
    from jetflow.data.regenerate import MANIFEST, RegenConfig, default_output_dir
    from jetflow.errors import JetFlowError

    try:
        folder = default_output_dir(RegenConfig(**manifest["settings"]), manifest["target_revision"])
        found = json.loads((folder / MANIFEST).read_text())
    except (KeyError, TypeError, OSError, ValueError, JetFlowError):
        return None
    return folder if found.get("content_sha256") == manifest.get("content_sha256") else None


def regen_dataset(manifest: Mapping[str, Any], folder: Path | None, recorded_in: Path | None = None) -> FolderDataset:
    """The regenerated data as a dataset: digest = its manifest's content_sha256, profile = the manifest,
    schema = the Parquet shards' columns. Without its folder (moved, or on another node) the source is
    the file that recorded the manifest (`recorded_in`, a feature cache's features.json)."""
    from jetflow.data.shards import SCHEMA

    digest = str(manifest.get("content_sha256", "unknown"))
    name = f"regen/{folder.name}" if folder else f"regen/{manifest.get('target_model_id', 'target')}-{digest[:8]}"
    schema = Schema([ColSpec(_arrow_to_mlflow(f.type), f.name) for f in SCHEMA])
    return FolderDataset(folder or recorded_in or "unknown", name, digest, schema, manifest)


def _tensor_schema(shard: Path) -> Schema | None:
    """The tensors of one cache shard (dtype, shape with the token axis variable), from its header only."""
    import numpy as np
    from safetensors import safe_open

    if not shard.exists():
        return None
    dtypes = {"F16": "float16", "F32": "float32", "I32": "int32", "I64": "int64"}
    specs = []
    with safe_open(str(shard), "np") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            if sl.get_dtype() in dtypes:
                specs.append(TensorSpec(np.dtype(dtypes[sl.get_dtype()]), (-1, *sl.get_shape()[1:]), key))
    return Schema(specs) if specs else None


def feature_dataset(folder: Path) -> FolderDataset:
    """The feature cache as a dataset: digest = its content key (the folder's name: target, revision,
    taps, template, length, top-K and the data's hash), profile = features.json, schema = the tensors."""
    folder = Path(folder)
    meta = json.loads((folder / FEATURES_META).read_text())
    return FolderDataset(folder, f"features/{folder.name}", folder.name, _tensor_schema(folder / "shard-00000.safetensors"),
                         meta)


def training_datasets(features: Any) -> list[tuple[FolderDataset, str]]:
    """(dataset, context) pairs for what a training reads: a feature-cache folder (the cache, and the
    regenerated data it was built from), or an `OnlineFeatures` (the regenerated data only: its features
    are computed during training and never stored)."""
    regen_dir = getattr(features, "regen_dir", None)
    if regen_dir is not None:
        return [(regen_dataset(features.meta["data_manifest"], Path(regen_dir)), REGEN_CONTEXT)]
    folder = Path(features)
    cache = feature_dataset(folder)
    manifest = cache.profile.get("data_manifest") or {}
    regen = regen_dataset(manifest, find_regen_dir(manifest), recorded_in=folder / FEATURES_META)
    return [(regen, REGEN_CONTEXT), (cache, FEATURES_CONTEXT)]


def log_training_inputs(run_id: str, datasets: list[tuple[FolderDataset, str]], attempts: int = 4) -> None:
    """Attach datasets to a run as inputs with their context (`mlflow.data.context`), as `mlflow.log_input`
    does; logging the same dataset again (a resumed training) adds nothing.

    Trainings that start together (the trials of an arch sweep) log the same new dataset at once, and
    MLflow's store looks for the dataset, then inserts it: the slower one meets the other's row (sqlite
    "UNIQUE constraint failed: datasets...", a duplicate key on other databases) and its `log_inputs` fails
    as a whole. The retry finds the row and links this run to it, so the race costs a retry, not a trial."""
    inputs = [DatasetInput(ds._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])
              for ds, context in datasets]
    for attempt in range(attempts if inputs else 0):
        try:
            client().log_inputs(run_id, datasets=inputs)
            return
        except MlflowException:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def run_datasets(run) -> list[tuple[str, str, str]]:
    """(context, name, digest) of each dataset input of an MLflow run."""
    out = []
    for di in run.inputs.dataset_inputs if run.inputs else []:
        context = next((t.value for t in di.tags if t.key == MLFLOW_DATASET_CONTEXT), "")
        out.append((context, di.dataset.name, di.dataset.digest))
    return out
