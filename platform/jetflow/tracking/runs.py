"""Training and evaluation runs: params, metrics (per-depth ones step-indexed, step = depth), lineage
tags, head files and plots as artifacts; sweeps' parent runs. Everything goes through an explicit
`MlflowClient`, never the fluent active-run state, so logging works the same inside Ray Tune trials that
hold their own run. A training tracked live (`jetflow.tracking.live`) is completed here, not logged twice."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.utils.validation import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from matplotlib.figure import Figure
from mlflow.exceptions import MlflowException

from jetflow.errors import HeadMismatchError, HeadNotFoundError, InvalidSettingError
from jetflow.tracking.jobs import RegisterJob  # noqa: F401  (its old import path)
from jetflow.tracking import plots, registry
from jetflow.metrics import BASELINE_METHODS
from jetflow.tracking.report import EvalReport, validate_report
from jetflow.tracking.store import client, experiment_for

KIND_TAG = "jetflow.kind"
AGREEMENT_BY_DEPTH = "eval/agreement_by_depth"
_AGREE_KEY = re.compile(r"^eval/agree_d(\d+)$")


# --------------------------------------------------------------------------- run plumbing
@contextmanager
def ending(run_id: str, interruptions: tuple[type[BaseException], ...] = ()) -> Iterator[str]:
    """The run ends when the block does: FINISHED; KILLED on KeyboardInterrupt, SystemExit (a signal) or
    one of `interruptions`; FAILED on any other exception."""
    status = RunStatus.FAILED
    try:
        yield run_id
        status = RunStatus.FINISHED
    except (KeyboardInterrupt, SystemExit, *interruptions):
        status = RunStatus.KILLED
        raise
    finally:
        client().set_terminated(run_id, RunStatus.to_string(status))


@contextmanager
def _run(target_id: str, run_name: str | None, tags: dict[str, str], parent_run_id: str | None) -> Iterator[str]:
    """A run in the target's experiment that always ends (`ending`)."""
    tags = dict(tags)
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id  # how MLflow nests runs (sweep parent → trials)
    with ending(client().create_run(experiment_for(target_id), run_name=run_name, tags=tags).info.run_id) as run_id:
        yield run_id


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    """Nested dicts → dotted param keys; lists and scalars → their JSON / str form."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = json.dumps(list(value))
    elif value is not None:
        out[prefix] = str(value)
    return out


def _log_metrics(run_id: str, metrics: list[Metric]) -> None:
    """Metrics (each with its own timestamp and step) in log_batch chunks under MLflow's limit."""
    c = client()
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        c.log_batch(run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])


def _log_flat(run_id: str, params: Mapping[str, str] = {}, metrics: Mapping[str, float] = {},
              steps: Mapping[str, list[float]] = {}, tags: Mapping[str, str] = {}, step: int = 0) -> None:
    """log_batch in chunks under MLflow's per-request limits. `metrics` are logged at `step`;
    `steps[key][i]` at step i + 1 (step = depth for per-depth series). Over-long param values are cut,
    since a param is a label."""
    c, now = client(), int(time.time() * 1000)
    plist = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()]
    tlist = [RunTag(k, str(v)) for k, v in tags.items()]
    for i in range(0, len(plist), MAX_PARAMS_TAGS_PER_BATCH):
        c.log_batch(run_id, params=plist[i:i + MAX_PARAMS_TAGS_PER_BATCH])
    for i in range(0, len(tlist), MAX_PARAMS_TAGS_PER_BATCH):
        c.log_batch(run_id, tags=tlist[i:i + MAX_PARAMS_TAGS_PER_BATCH])
    _log_metrics(run_id, [Metric(k, float(v), now, step) for k, v in metrics.items()] +
                 [Metric(k, float(v), now, i + 1) for k, vs in steps.items() for i, v in enumerate(vs)])


def _log_new_params(run_id: str, params: Mapping[str, str]) -> None:
    """Params the run does not hold yet (MLflow refuses to change a logged param; a continued run
    already holds the ones it was opened with)."""
    held = client().get_run(run_id).data.params
    _log_flat(run_id, params={k: v for k, v in params.items() if k not in held})


def log_figures(run_id: str, figures: Mapping[str, Figure | None]) -> None:
    """PNG artifacts of a run, one per {artifact path: figure}; None entries (nothing to draw) are skipped."""
    c = client()
    for path, fig in figures.items():
        if fig is not None:
            c.log_figure(run_id, fig, path)


def _current_provenance() -> dict:
    from jetflow.provenance import provenance  # the one definition of git state + package versions

    return provenance({})


def _provenance_tags(prov: Mapping[str, Any]) -> dict[str, str]:
    tags = {}
    if prov.get("git_commit"):
        tags["jetflow.git_commit"] = prov["git_commit"]
        tags["mlflow.source.git.commit"] = prov["git_commit"]  # the UI shows this one
    if "git_dirty" in prov:
        tags["jetflow.git_dirty"] = str(bool(prov["git_dirty"])).lower()
    if prov.get("python"):
        tags["jetflow.python"] = prov["python"]
    for pkg, version in (prov.get("packages") or {}).items():
        tags[f"jetflow.pkg.{pkg}"] = str(version)
    return tags


def _head_params(config: Mapping[str, Any] | None) -> dict[str, str]:
    """Head architecture as `head.*` params from a HeadConfig dict or a DFlash-layout config.json."""
    if not config:
        return {}
    if "dflash_config" in config:
        from jetflow.head.config import HeadConfig

        config = HeadConfig.from_dflash_dict(dict(config)).to_dict()
    config = {k: v for k, v in config.items() if not (k == "extra" and not v)}
    return _flatten("head", config, {})


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


# --------------------------------------------------------------------------- training runs
def training_params(train_cfg: Mapping[str, Any]) -> dict[str, str]:
    """A training config (`TrainConfig.to_dict()`) as the training run's `train.*` params."""
    return _flatten("train", train_cfg, {})


def log_training_run(head_dir: str | Path, target_id: str | None = None, target_revision: str | None = None,
                     parent_run_id: str | None = None, run_name: str | None = None) -> str:
    """Log a trained head folder (config.json, model.safetensors, and when present metrics.json,
    provenance.json, train_config.json) as a run of experiment `jetflow/<target_id>`; returns the run id.
    The target id and revision default to those in the head's config.json.

    params: `head.*` (architecture), `train.*` (training config), `data.*` (manifest hash, tokens);
    metrics: metrics.json numbers, plus `eval/agree_dK` again as the series `eval/agreement_by_depth`
    (step = depth K); tags: `jetflow.kind=train`, target id/revision, git commit, package versions,
    weights sha256; artifacts: the folder's top-level files under `head/` (what `register_head`
    registers; checkpoints/ is left out) and a plot of agreement by depth.

    When the folder's training was tracked live (`jetflow.tracking.live`: its marker names a run of this
    store), that run is completed instead of a second one made: it gets the head files, the tags, and
    the params and metrics it does not hold yet (e.g. the pipeline's decoded τ, at the final training
    step); what training logged stays as it is, and so does the run's status (its duration is the
    training's). `run_name` renames it, `parent_run_id` nests it if it is not nested yet.
    """
    from jetflow.tracking.live import recorded_run

    head_dir = Path(head_dir).expanduser().resolve()
    if not (head_dir / "config.json").exists() or not (head_dir / "model.safetensors").exists():
        raise HeadNotFoundError(f"{head_dir} is not a head folder: it needs config.json and model.safetensors "
                                "(jobs/train.py writes them)")
    try:
        config = json.loads((head_dir / "config.json").read_text())
    except ValueError as exc:
        raise HeadNotFoundError(f"{head_dir / 'config.json'} is not valid JSON ({exc})") from None
    recorded = config.get("jetflow") or {}
    trained_for = recorded.get("target_model_id")
    target_id = target_id or trained_for
    target_revision = target_revision or recorded.get("target_revision") or "unknown"
    if not target_id:
        raise InvalidSettingError(f"{head_dir / 'config.json'} names no target: pass the target id")
    if trained_for and trained_for != target_id:
        raise HeadMismatchError(f"{head_dir} was trained for target {trained_for!r}, not {target_id!r}; "
                                f"log it under --target {trained_for}")
    metrics_file = _read_json(head_dir / "metrics.json")
    prov = _read_json(head_dir / "provenance.json") or _current_provenance()
    train_cfg = _read_json(head_dir / "train_config.json") or prov.get("train_config") or {}

    metrics = {k: float(v) for k, v in metrics_file.items() if isinstance(v, (int, float))}  # bools → 0/1
    agreement = sorted((int(m[1]), v) for k, v in metrics.items() if (m := _AGREE_KEY.match(k)))
    steps = {AGREEMENT_BY_DEPTH: [v for _, v in agreement]} if agreement else {}
    params = {**_head_params(config), **training_params(train_cfg)}
    for key in ("data_manifest_sha256", "data_tokens", "preset", "data_dir", "features"):
        if key in prov:
            params[f"data.{key.removeprefix('data_')}"] = str(prov[key])
    sha = registry.weights_sha256(head_dir)
    tags = {KIND_TAG: "train", "jetflow.target.id": target_id, "jetflow.target.revision": target_revision,
            "jetflow.head.name": head_dir.name, "jetflow.head.path": str(head_dir),
            "jetflow.head.arch": registry.arch_summary(head_dir), registry.WEIGHTS_TAG: sha,
            **_provenance_tags(prov)}
    if prov.get("data_manifest_sha256"):
        tags["jetflow.data.manifest_sha256"] = prov["data_manifest_sha256"]
    if prov.get("command"):
        tags["jetflow.command"] = prov["command"]

    def attach(run_id: str, held: Any = None) -> None:
        held_params, held_metrics = (held.params, held.metrics) if held is not None else ({}, {})
        _log_flat(run_id, {k: v for k, v in params.items() if k not in held_params},
                  {k: v for k, v in metrics.items() if k not in held_metrics},
                  {k: v for k, v in steps.items() if k not in held_metrics},
                  tags=tags if held is not None else {},
                  step=int(metrics.get("train/steps", 0)) if held is not None else 0)
        c = client()
        for f in sorted(head_dir.iterdir()):  # top-level files only: checkpoints/ is resumable trainer state
            if f.is_file() and not f.name.startswith("."):
                c.log_artifact(run_id, str(f), registry.HEAD_ARTIFACT)
        if agreement:
            log_figures(run_id, {"plots/agreement_by_depth.png": plots.depth_curve(
                steps[AGREEMENT_BY_DEPTH], "top-1 agreement with target", "held-out agreement by depth")})

    live = recorded_run(head_dir)
    if live is None:
        with _run(target_id, run_name or f"train {head_dir.name}", tags, parent_run_id) as run_id:
            attach(run_id)
        return run_id
    run_id = live.info.run_id
    if run_name and run_name != live.info.run_name:
        client().update_run(run_id, name=run_name)
    if parent_run_id and "mlflow.parentRunId" not in live.data.tags:
        tags["mlflow.parentRunId"] = parent_run_id
    attach(run_id, live.data)
    return run_id


# --------------------------------------------------------------------------- evaluation runs
def _eval_lineage(report: EvalReport) -> dict[str, str]:
    """Tags linking an eval run to the head it measured: path / URI, and when the head is registered,
    its registered name, version and training run (found by URI, else by the weights' sha256)."""
    head = report.head
    if head is None or (head.path is None and head.uri is None):
        return {"jetflow.head.name": "none (baselines only)"}
    tags = {}
    if head.path:
        tags["jetflow.head.path"] = head.path
        tags["jetflow.head.name"] = Path(head.path).name
    if head.uri:
        tags["jetflow.head.uri"] = head.uri
    mv = registry.find_version(report.target.id, uri=head.uri, path=head.path)
    if mv is not None:
        tags.update({"jetflow.head.registered_name": mv.name, "jetflow.head.version": str(mv.version)})
        if mv.run_id:
            tags["jetflow.train_run_id"] = mv.run_id
        # A registry download sits in a folder named after the version number: name it by its origin.
        tags["jetflow.head.name"] = f"{mv.tags.get('jetflow.head.name', mv.name)} v{mv.version}"
    return tags


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    from jetflow.eval.table import markdown_table

    return markdown_table(rows, list(rows[0])) if rows else "(no rows)\n"


def log_evaluation(report: dict | EvalReport, run_name: str | None = None, parent_run_id: str | None = None,
                   tags: dict[str, str] | None = None) -> str:
    """Log an evaluation report (contract: `jetflow.tracking.report.EvalReport`) as a run of
    `jetflow/<target id>`; returns the run id.

    params: the report's params + `target.*`, `head.path`, `head.uri`, `head.*` architecture; metrics: the
    report's flat metrics; step metrics: `report["step_metrics"][key][i]` at step i + 1 (= depth);
    tags: `jetflow.kind=eval`, target id/revision, `jetflow.eval_sets`, git / package versions, head
    lineage (registered name + version + training run when the head is registered), and `tags`; artifacts:
    `report.json`, `eval_table.json` (MLflow table) + `eval_table.md`, `plots/*.png`.
    Raises InvalidSettingError when the report breaks the contract (nothing is logged then).
    """
    rep = validate_report(report)
    extra_tags = dict(tags or {})  # the caller's, set when the run is created
    head = rep.head
    params: dict[str, str] = {"target.id": rep.target.id, "target.revision": rep.target.revision}
    if head is not None:
        params.update({k: v for k, v in {"head.path": head.path, "head.uri": head.uri}.items() if v})
        params.update(_head_params(head.config))
        if head.provenance and head.provenance.get("data_manifest_sha256"):
            params["head.data_manifest_sha256"] = head.provenance["data_manifest_sha256"]
    params.update({k: str(v) for k, v in rep.params.items()})  # the evaluator's own settings win
    tags = {KIND_TAG: "eval", "jetflow.target.id": rep.target.id, "jetflow.target.revision": rep.target.revision,
            "jetflow.eval_sets": ",".join(rep.datasets), **_provenance_tags(_current_provenance()),
            **_eval_lineage(rep)}
    if head is not None and head.provenance and head.provenance.get("data_manifest_sha256"):
        tags["jetflow.data.manifest_sha256"] = head.provenance["data_manifest_sha256"]
    tags.update(extra_tags)
    name = run_name or f"eval {tags.get('jetflow.head.name', 'head')}"

    with _run(rep.target.id, name, tags, parent_run_id) as run_id:
        _log_flat(run_id, params, rep.metrics, rep.step_metrics)
        c = client()
        c.log_dict(run_id, rep.model_dump(mode="json"), "report.json")
        rows = [r.model_dump() for r in rep.rows]
        if rows:
            import pandas as pd  # an MLflow dependency; log_table wants a frame for mixed-type columns

            c.log_table(run_id, pd.DataFrame(rows), "eval_table.json")
            c.log_text(run_id, _markdown_table(rows), "eval_table.md")
        # A sweep trial measures one budget: a curve over budget is drawn on the sweep's parent run instead.
        over_budget = len({r.budget for r in rep.rows if r.method not in BASELINE_METHODS}) > 1
        log_figures(run_id, {
            "plots/tau_vs_budget.png": plots.tau_vs_budget(rep.rows) if over_budget else None,
            "plots/speedup_vs_budget.png": plots.speedup_vs_budget(rep.rows) if over_budget else None,
            "plots/acceptance_by_depth.png": plots.acceptance_by_depth(rep.step_metrics),
            "plots/verify_cost.png": plots.verify_cost(rep.cost_model) if rep.cost_model else None,
        })
    if "jetflow.head.version" in tags:  # the registered version lists its evaluation runs
        from jetflow.tracking.lineage import refresh_lineage

        refresh_lineage(tags["jetflow.head.registered_name"], tags["jetflow.head.version"])
    return run_id


# --------------------------------------------------------------------------- sweeps' parent runs
PARENT_MARKER = "mlflow_parent_run.json"


def sweep_parent_run(target_id: str, location, run_name: str, kind: str, params: Mapping[str, Any],
                     tags: Mapping[str, str] = {}) -> str:
    """The parent run of a sweep (its trials' runs nest under it through `parent_run_id`), continued when
    the sweep resumes: its id is kept in `mlflow_parent_run.json` beside Ray Tune's state (`location`: a
    `jetflow.storage.TuneLocation`, so in cluster storage on a cluster). A marker naming a run this store
    does not have (another store) is replaced. The caller ends the run (`ending`)."""
    c = client()
    marker = location.read_json(PARENT_MARKER)
    if marker:
        try:
            run_id = marker["run_id"]
            c.update_run(run_id, status="RUNNING")
            return run_id
        except (MlflowException, KeyError, TypeError):
            pass
    created = c.create_run(experiment_for(target_id), run_name=run_name,
                           tags={KIND_TAG: kind, "jetflow.target.id": target_id, **tags})
    _log_flat(created.info.run_id, params=_flatten("", params, {}))
    location.write_json(PARENT_MARKER, {"run_id": created.info.run_id})
    return created.info.run_id


# --------------------------------------------------------------------------- folder → registered version
def register_head_folder(head_dir: str | Path, target_id: str, target_revision: str,
                         run_name: str | None = None) -> tuple[str, bool]:
    """(version, created): the registered version holding exactly these weights, logging a training run
    and registering it only if none does yet, so reruns (`make demo`) do not pile up duplicate versions."""
    head_dir = Path(head_dir).expanduser().resolve()
    if not (head_dir / "model.safetensors").exists():
        raise HeadNotFoundError(f"{head_dir} has no model.safetensors; pass a folder written by jobs/train.py")
    existing = registry.find_version(target_id, path=head_dir)
    if existing is not None:
        return str(existing.version), False
    run_id = log_training_run(head_dir, target_id, target_revision, run_name=run_name)
    return registry.register_head(run_id, target_id), True
