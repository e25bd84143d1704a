"""MLflow tracking for JetFlow: one experiment per target (`jetflow/<target id>`), training and evaluation
runs with lineage, heads registered as model versions with aliases, and the promotion gate.

Default store: absolute sqlite at `$JETFLOW_HOME/mlflow.db`; `MLFLOW_TRACKING_URI` overrides (an MLflow
server on a cluster)."""

from jetflow.exports import lazy_exports

# Imported on first use: `jetflow.tracking.jobs` alone (`jobs/promote.py --help`, `jobs/register.py --help`)
# imports no MLflow.
__getattr__, __dir__ = lazy_exports(__name__, {
    ".promotion": ("GATE_METRICS", "PromotionDecision", "promote"),
    ".registry": ("CHALLENGER", "CHAMPION", "PREVIOUS_CHAMPION", "RegisteredHead", "find_version", "register_head",
                  "registered_model_name", "resolve_alias", "resolve_head_uri", "set_alias", "set_serving_evidence",
                  "set_serving_profile", "set_tree_profile", "set_tree_config"),
    ".report": ("EvalReport", "validate_report"),
    ".runs": ("log_evaluation", "log_training_run", "register_head_folder"),
    ".store": ("experiment_for", "tracking_uri"),
})

__all__ = [
    "CHALLENGER", "CHAMPION", "GATE_METRICS", "PREVIOUS_CHAMPION", "EvalReport", "PromotionDecision",
    "RegisteredHead", "experiment_for", "find_version", "log_evaluation", "log_training_run", "promote", "register_head", "register_head_folder", "registered_model_name",
    "resolve_alias", "resolve_head_uri", "set_alias", "set_serving_evidence", "set_serving_profile", "set_tree_config", "set_tree_profile", "tracking_uri",
    "validate_report",
]
