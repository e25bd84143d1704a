"""Joining Ray the same way from every job: a local cluster, or the one at `address` (`RAY_ADDRESS`, a
`ray job submit`), with the environment every worker needs to find what the driver uses."""

from __future__ import annotations


def init_ray(address: str | None = None) -> None:
    """ray.init once per driver: workers get the driver's $JETFLOW_HOME and MLflow store (absolute, since
    `ray job submit` runs from a temporary directory). A no-op when Ray is already up (a test, a caller)."""
    import ray

    from jetflow.paths import jetflow_home
    from jetflow.tracking.store import tracking_uri

    if ray.is_initialized():
        return
    env = {"JETFLOW_HOME": str(jetflow_home()), "MLFLOW_TRACKING_URI": tracking_uri(),
           "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address=address, runtime_env={"env_vars": env}, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
