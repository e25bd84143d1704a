"""Heads in the MLflow model registry: one registered model per target, one version per trained head
(registered from the training run's plain `head/` artifacts, with lineage tags), aliases `champion`,
`challenger`, `previous-champion`, the best tree config as a version tag, and `models:/` URIs resolved to
a local head folder that `jetflow.head.load_head` reads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from mlflow.entities import Run
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_DOES_NOT_EXIST,
    ErrorCode,
)

from jetflow.errors import HeadMismatchError, HeadNotFoundError, InvalidSettingError
from jetflow.head.ref import parse_models_uri
from jetflow.paths import file_sha256
from jetflow.tree import PROFILE_FILE, AcceptanceProfile, TreeSpec
from jetflow.tracking.store import client, experiment_for, local_root, safe_name, tracking_uri

NAME_SUFFIX = "-jetflow-head"
CHAMPION, CHALLENGER, PREVIOUS_CHAMPION = "champion", "challenger", "previous-champion"
TREE_CONFIG_TAG = "jetflow.tree_config"
BUDGET_TABLE_TAG = "jetflow.budget_by_concurrency"   # {"concurrency": budget}: the budget sweep's best per level
TAU_TAG = "jetflow.tau_by_budget"                   # {"budget": τ}: the sweep's τ of the stored tree's kind
PROFILE_TAG = "jetflow.tree_profile"                # the head's per-(depth, rank) acceptance (tree_profile.json)
EVIDENCE_TAG = "jetflow.serving.evidence"           # the budget sweep's serving decision: setting, per-set timed
                                                    # speedups with their spread, prompts, tokens (what the gate reads)
WEIGHTS_TAG = "jetflow.weights_sha256"
HEAD_ARTIFACT = "head"
CACHE_DIR = "registry"  # downloaded versions: <local root>/registry/<store hash>/<name>/<version>/
# Lineage copied from the training run's tags onto the registered version.
_LINEAGE_TAGS = ("jetflow.target.id", "jetflow.target.revision", "jetflow.data.manifest_sha256",
                 "jetflow.git_commit", "jetflow.git_dirty", "jetflow.head.arch", "jetflow.head.name", WEIGHTS_TAG)


def _code(exc: MlflowException, code: int) -> bool:
    return exc.error_code == ErrorCode.Name(code)


def registered_model_name(target_id: str) -> str:
    """One registered model per target: "smollm2-135m" → "smollm2-135m-jetflow-head"."""
    return safe_name(target_id) + NAME_SUFFIX


# --------------------------------------------------------------------------- head folder facts
def weights_sha256(head_dir: str | Path) -> str:
    """sha256 of model.safetensors: identifies a head across folders, runs and registry copies."""
    return file_sha256(Path(head_dir) / "model.safetensors")


def _parameter_count(weights: Path) -> int:
    # The safetensors header (u64 length + JSON) lists every tensor's shape; no need to load weights.
    with open(weights, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def arch_summary(head_dir: str | Path) -> str:
    """One line, e.g. "causal 2L h576 block16 taps[1,8,14,20,27] tap_norm 8.7M params"."""
    from jetflow.head.config import HeadConfig

    head_dir = Path(head_dir)
    cfg = HeadConfig.from_dflash_dict(json.loads((head_dir / "config.json").read_text()))
    parts = ["causal" if cfg.causal else "bidirectional", f"{cfg.num_hidden_layers}L", f"h{cfg.hidden_size}",
             f"block{cfg.block_size}", "taps[" + ",".join(map(str, cfg.target_layer_ids)) + "]"]
    parts += [flag for flag in ("tap_norm", "anchor_shortcut", "depth_embedding") if getattr(cfg, flag)]
    if cfg.copy_ngram:
        parts.append(f"copy{cfg.copy_ngram}")
    parts.append(f"{_parameter_count(head_dir / 'model.safetensors') / 1e6:.1f}M params")
    return " ".join(parts)


# --------------------------------------------------------------------------- registering
def _ensure_registered_model(name: str, target_id: str) -> None:
    try:
        client().create_registered_model(name, tags={"jetflow.target.id": target_id},
                                         description=f"JetFlow draft heads for target {target_id}")
    except MlflowException as exc:
        if not _code(exc, RESOURCE_ALREADY_EXISTS):
            raise


def register_head(train_run_id: str, target_id: str, tags: dict[str, str] | None = None) -> str:
    """Register the `head/` artifacts of a training run (from `log_training_run`) as a new version of
    `registered_model_name(target_id)`; returns the version number as a string. The version's source is
    `runs:/<run>/head` (plain safetensors + config.json; no MLflow flavor), and it carries lineage tags:
    training run id, data manifest hash, git commit, architecture summary, target id/revision, weights sha256,
    the training run's datasets, and a description linking its training run, datasets and evaluation runs
    (`jetflow.tracking.lineage`)."""
    c = client()
    try:
        run = c.get_run(train_run_id)
    except MlflowException as exc:
        if _code(exc, RESOURCE_DOES_NOT_EXIST):
            raise HeadNotFoundError(f"no run {train_run_id!r} in {tracking_uri()}; log the head first "
                                    "(jobs/register.py does both)") from None
        raise
    have = {Path(a.path).name for a in c.list_artifacts(train_run_id, HEAD_ARTIFACT)}
    if not {"config.json", "model.safetensors"} <= have:
        raise HeadNotFoundError(f"run {train_run_id} has no head/config.json + head/model.safetensors artifacts; "
                                "log it with jetflow.tracking.log_training_run")
    run_target = run.data.tags.get("jetflow.target.id")
    if run_target and run_target != target_id:
        raise HeadMismatchError(f"run {train_run_id} trained a head for {run_target!r}, not {target_id!r}")
    name = registered_model_name(target_id)
    _ensure_registered_model(name, target_id)
    lineage = {k: run.data.tags[k] for k in _LINEAGE_TAGS if k in run.data.tags}
    lineage.update({"jetflow.train_run_id": train_run_id, "jetflow.target.id": target_id})
    lineage.update({k: str(v) for k, v in (tags or {}).items()})
    mv = c.create_model_version(name, source=f"runs:/{train_run_id}/{HEAD_ARTIFACT}", run_id=train_run_id,
                                tags=lineage, description=lineage.get("jetflow.head.arch"))
    from jetflow.tracking.lineage import refresh_lineage

    refresh_lineage(name, str(mv.version))
    return str(mv.version)


# --------------------------------------------------------------------------- looking versions up
def get_version(name: str, version_or_alias: str) -> ModelVersion:
    """A version by number ("3") or alias ("champion"); HeadNotFoundError saying what exists instead."""
    c = client()
    try:
        model = c.get_registered_model(name)
    except MlflowException as exc:
        if _code(exc, RESOURCE_DOES_NOT_EXIST):
            raise HeadNotFoundError(f"no registered model {name!r} in {tracking_uri()}; register a head first "
                                    "(jobs/register.py --head <folder>)") from None
        raise
    version = str(version_or_alias)
    if not version.isdigit():
        if version not in model.aliases:
            known = ", ".join(f"{a}→v{v}" for a, v in sorted(model.aliases.items())) or "none"
            raise HeadNotFoundError(f"{name} has no alias {version!r} (aliases: {known})")
        version = str(model.aliases[version])
    try:
        return c.get_model_version(name, version)
    except MlflowException as exc:
        if _code(exc, RESOURCE_DOES_NOT_EXIST):
            latest = max((int(v.version) for v in c.search_model_versions(f"name='{name}'")), default=0)
            raise HeadNotFoundError(f"{name} has no version {version} (latest is {latest})") from None
        raise


def find_version(target_id: str, uri: str | None = None, path: str | Path | None = None) -> ModelVersion | None:
    """The registered version a head came from: by its `models:/` URI, else by its weights' sha256
    (the newest version with those weights). None when it is not registered."""
    if uri:
        try:
            return get_version(*parse_models_uri(uri))
        except HeadNotFoundError:  # not in this store (say, another one's URI): try the weights
            pass
    if path and (Path(path) / "model.safetensors").exists():
        name, sha = registered_model_name(target_id), weights_sha256(path)
        found = client().search_model_versions(f"name='{name}' and tags.`{WEIGHTS_TAG}` = '{sha}'")
        return max(found, key=lambda v: int(v.version), default=None)
    return None


def resolve_head_uri(uri: str) -> Path:
    """`models:/NAME@ALIAS` or `models:/NAME/VERSION` → a local head folder (config.json +
    model.safetensors) under `registry/` of the store's local root (beside a sqlite db, else
    $JETFLOW_HOME), downloaded once per store and version (versions are immutable). HeadNotFoundError if the model, alias or version does not exist."""
    name, ref = parse_models_uri(uri)
    mv = get_version(name, ref)
    uri_hash = hashlib.sha1(tracking_uri().encode()).hexdigest()[:10]  # one cache per store
    dest = local_root() / CACHE_DIR / uri_hash / name / str(mv.version)
    if not ((dest / "config.json").exists() and (dest / "model.safetensors").exists()):
        _download_version(uri, name, mv, dest)
    _write_profile(mv, dest)
    return dest


def _write_profile(mv: ModelVersion, dest: Path) -> None:
    """The version's stored tree profile (tag, set after registration by the main job) as tree_profile.json
    beside the head, so `load_head` attaches it and a served head shapes trees from its own measurements."""
    text = mv.tags.get(PROFILE_TAG)
    path = dest / PROFILE_FILE
    if not text:
        return
    try:
        profile = AcceptanceProfile.from_dict(json.loads(text))
    except (ValueError, InvalidSettingError):  # unreadable: the head serves without a profile
        return
    if not path.exists() or json.loads(path.read_text()) != profile.to_dict():
        tmp = dest / f".{PROFILE_FILE}.{os.getpid()}"
        profile.save(tmp)
        os.replace(tmp, path)


def _download_version(uri: str, name: str, mv: ModelVersion, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{mv.version}-", dir=dest.parent))
    try:
        from mlflow.artifacts import download_artifacts

        src = client().get_model_version_download_uri(name, str(mv.version))
        got = Path(download_artifacts(artifact_uri=src, dst_path=str(tmp), tracking_uri=tracking_uri()))
        if not (got / "config.json").exists() or not (got / "model.safetensors").exists():
            raise HeadNotFoundError(f"{uri} (version {mv.version}, source {src}) holds no config.json + "
                                    "model.safetensors; register a head folder written by jobs/train.py")
        expected = mv.tags.get(WEIGHTS_TAG)
        if expected and weights_sha256(got) != expected:
            raise HeadMismatchError(f"{uri}: downloaded weights differ from the sha256 recorded at registration")
        try:  # publish atomically; a concurrent replica may have won the race
            os.rename(got, dest)
        except OSError:
            if not (dest / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- aliases, tree config
def set_alias(name: str, alias: str, version: str, *, bypass_gate: bool = False) -> None:
    """Point `alias` (e.g. "challenger") at `version`. `champion` moves only through the promotion gate
    (`jetflow.tracking.promote`, jobs/promote.py) unless `bypass_gate=True`."""
    if alias == CHAMPION and not bypass_gate:
        raise InvalidSettingError("the champion alias moves only through the promotion gate: run "
                                  "jobs/promote.py --version N (it checks losslessness and the margin)")
    mv = get_version(name, str(version))
    try:
        client().set_registered_model_alias(name, alias, str(mv.version))
    except MlflowException as exc:
        raise InvalidSettingError(f"cannot set alias {alias!r}: {exc.message}") from None


def set_tree_config(name: str, version: str, tree: TreeSpec) -> None:
    """Store the tree setting to serve this version with, as tag `jetflow.tree_config` (`TreeSpec.to_json`;
    the main job writes the budget sweep's best)."""
    if not isinstance(tree, TreeSpec):
        raise InvalidSettingError(f"a tree config is a TreeSpec, got {tree!r}")
    mv = get_version(name, str(version))
    client().set_model_version_tag(name, str(mv.version), TREE_CONFIG_TAG, tree.to_json())


def set_serving_profile(name: str, version: str, budget_table: dict[int, int],
                        tau_by_budget: dict[int, float]) -> None:
    """Store what the serving engine's load-aware policy starts from: the best budget per concurrency level
    (1 = plain decoding) and the τ measured per budget, as JSON tags."""
    if any(int(c) < 1 or int(b) < 1 for c, b in budget_table.items()):
        raise InvalidSettingError(f"budget table keys (concurrency) and values (budget) must be >= 1: {budget_table}")
    mv = get_version(name, str(version))
    c = client()
    c.set_model_version_tag(name, str(mv.version), BUDGET_TABLE_TAG,
                            json.dumps({str(k): int(v) for k, v in sorted(budget_table.items())}))
    c.set_model_version_tag(name, str(mv.version), TAU_TAG,
                            json.dumps({str(k): round(float(v), 4) for k, v in sorted(tau_by_budget.items())}))


def set_serving_evidence(name: str, version: str, decision: dict) -> None:
    """Store the budget sweep's serving decision with the version (tag `jetflow.serving.evidence`, JSON): the
    setting served ("plain" when every timed setting loses to AR on some set), per prompt set its timed
    speedup, spread and τ, and how many prompts, tokens and passes stand behind them. The gate scores it."""
    if not isinstance(decision, dict) or "setting" not in decision:
        raise InvalidSettingError(f"serving evidence is the sweep's decision dict, got {decision!r}")
    mv = get_version(name, str(version))
    client().set_model_version_tag(name, str(mv.version), EVIDENCE_TAG, json.dumps(decision, separators=(",", ":")))


def serving_evidence(name: str, version: str) -> dict | None:
    """The version's stored serving decision (`set_serving_evidence`), None when it has none."""
    text = get_version(name, str(version)).tags.get(EVIDENCE_TAG)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def set_tree_profile(name: str, version: str, profile: AcceptanceProfile) -> None:
    """Store the head's measured per-(depth, rank) acceptance with its version (tag `jetflow.tree_profile`,
    the profile's JSON), so every download of the version carries it as tree_profile.json."""
    if not isinstance(profile, AcceptanceProfile):
        raise InvalidSettingError(f"a tree profile is an AcceptanceProfile, got {profile!r}")
    mv = get_version(name, str(version))
    def rounded(table):
        return [[round(x, 4) for x in row] for row in table]

    data = profile.to_dict()
    data["depth_rank_accept"] = rounded(data["depth_rank_accept"])
    data["per_class_histograms"] = {k: rounded(t) for k, t in data["per_class_histograms"].items()}
    client().set_model_version_tag(name, str(mv.version), PROFILE_TAG, json.dumps(data, separators=(",", ":")))


def _int_map(text: str | None) -> dict[int, float] | None:
    try:
        return {int(k): v for k, v in json.loads(text).items()} if text else None
    except (ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------- champion lookup
def eval_runs(target_id: str, name: str, version: str, max_results: int = 20) -> list[Run]:
    """Finished evaluation runs of one registered version, newest first."""
    flt = (f"tags.`jetflow.kind` = 'eval' and tags.`jetflow.head.registered_name` = '{name}' "
           f"and tags.`jetflow.head.version` = '{version}' and attributes.status = 'FINISHED'")
    return list(client().search_runs([experiment_for(target_id)], flt, max_results=max_results,
                                     order_by=["attributes.start_time DESC"]))


@dataclass
class RegisteredHead:
    """A registered version resolved to a local folder. `metrics` are those of its latest evaluation run
    (τ, speedups, lossless), else of its training run; `tree_config` is the tag set by the main job (None
    when absent or unreadable: a stored setting this install cannot serve is reported, not served)."""
    name: str
    version: str
    path: Path
    tree_config: TreeSpec | None = None
    tree_config_error: str | None = None
    budget_table: dict[int, int] | None = None       # {concurrency: budget}, when the main job measured it
    tau_by_budget: dict[int, float] | None = None
    run_id: str | None = None
    metrics: dict = field(default_factory=dict)


def alias_version(target_id: str, alias: str = CHAMPION) -> str | None:
    """The version number `alias` points at for `target_id`'s heads, None when there is no such alias or
    registered model: one registry read, no download (what a Serve replica polls)."""
    try:
        version = client().get_registered_model(registered_model_name(target_id)).aliases.get(alias)
    except MlflowException as exc:
        if _code(exc, RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    return None if version is None else str(version)


def resolve_alias(target_id: str, alias: str = CHAMPION) -> RegisteredHead | None:
    """The head behind `alias` for `target_id`, downloaded; None if the target has no registered heads or
    no such alias (not an error: serving falls back to its configured head)."""
    name = registered_model_name(target_id)
    try:
        version = client().get_registered_model(name).aliases.get(alias)
    except MlflowException as exc:
        if _code(exc, RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    if version is None:
        return None
    mv = client().get_model_version(name, str(version))
    path = resolve_head_uri(f"models:/{name}/{mv.version}")
    runs = eval_runs(target_id, name, str(mv.version), max_results=1)
    if runs:
        metrics = dict(runs[0].data.metrics)
    elif mv.run_id:
        metrics = dict(client().get_run(mv.run_id).data.metrics)
    else:
        metrics = {}
    tree, error = None, None
    if mv.tags.get(TREE_CONFIG_TAG):
        try:
            tree = TreeSpec.from_json(mv.tags[TREE_CONFIG_TAG])
        except InvalidSettingError as exc:
            error = str(exc)
    return RegisteredHead(name=name, version=str(mv.version), path=path, tree_config=tree,
                          tree_config_error=error, run_id=mv.run_id, metrics=metrics,
                          budget_table=_int_map(mv.tags.get(BUDGET_TABLE_TAG)),
                          tau_by_budget=_int_map(mv.tags.get(TAU_TAG)))
