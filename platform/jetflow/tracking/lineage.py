"""What a registered head came from and what measured it, kept on its registry version: the training run
(the version's source run), the datasets that run took as inputs (`jetflow.tracking.datasets`) and the
version's evaluation runs — as version tags (`jetflow.dataset.<context>` = name@digest,
`jetflow.eval_run_ids`) and as the version's description, whose links the MLflow UI follows from the
model-version page. Refreshed when a version is registered and after each evaluation run of it."""

from __future__ import annotations

from mlflow.entities import Run

from jetflow.tracking.datasets import run_datasets
from jetflow.tracking.store import client

MAX_LINKED_EVALS = 10  # links in the description; the tag lists every evaluation run found


def run_link(run: Run) -> str:
    """A markdown link to a run's page in the MLflow UI (its routes live after '#')."""
    return f"[{run.info.run_name or run.info.run_id}](#/experiments/{run.info.experiment_id}/runs/{run.info.run_id})"


def refresh_lineage(name: str, version: str) -> None:
    """Rewrite version `version` of registered model `name`'s lineage tags and description from the
    store: its training run, that run's dataset inputs, its finished evaluation runs (newest first)."""
    from jetflow.tracking.registry import WEIGHTS_TAG, eval_runs

    c = client()
    mv = c.get_model_version(name, version)
    tags: dict[str, str] = {}
    parts = [mv.tags.get("jetflow.head.arch") or f"{name} v{version}"]
    if mv.run_id:
        run = c.get_run(mv.run_id)
        steps = run.data.metrics.get("train/steps")
        parts.append(f"**Trained** in run {run_link(run)} ({run.info.status.lower()}"
                     + (f", {int(steps)} steps)" if steps else ")"))
        data = run_datasets(run)
        for context, dataset, digest in data:
            tags[f"jetflow.dataset.{context or 'input'}"] = f"{dataset}@{digest}"
        if data:
            parts.append("**Data**: " + "; ".join(f"{context or 'input'} `{dataset}` (digest `{digest}`)"
                                                  for context, dataset, digest in data))
        c.set_tag(mv.run_id, "jetflow.registered_version", f"{name}/{version}")
    target_id = mv.tags.get("jetflow.target.id")
    evals = eval_runs(target_id, name, str(version), max_results=100) if target_id else []
    tags["jetflow.eval_run_ids"] = ",".join(r.info.run_id for r in evals)
    if evals:
        more = f" and {len(evals) - MAX_LINKED_EVALS} more" if len(evals) > MAX_LINKED_EVALS else ""
        parts.append(f"**Evaluated** in {len(evals)} run(s), newest first: "
                     + ", ".join(run_link(r) for r in evals[:MAX_LINKED_EVALS]) + more)
    else:
        parts.append("**Evaluated**: no finished evaluation run yet")
    if mv.tags.get(WEIGHTS_TAG):
        parts.append(f"Weights sha256 `{mv.tags[WEIGHTS_TAG]}`")
    for key, value in tags.items():
        c.set_model_version_tag(name, str(version), key, value)
    c.update_model_version(name, str(version), description="\n\n".join(parts))
