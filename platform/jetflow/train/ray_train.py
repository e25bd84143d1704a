"""Head training as a Ray Train `TorchTrainer`: one CPU worker locally, N GPU workers on a cluster.
Each worker loads the frozen target and the shared feature cache; rank 0 checkpoints and saves."""

from __future__ import annotations

import dataclasses
from pathlib import Path


def _loop(config: dict) -> None:
    import ray.train

    from jetflow.data.features import FeatureCache
    from jetflow.target import TargetModel
    from jetflow.train.config import TrainConfig
    from jetflow.train.trainer import train

    ctx = ray.train.get_context()
    target = TargetModel.load(config["model"])
    data = FeatureCache(Path(config["features"]))
    every = max(1, config["train"]["checkpoint_every"])

    def log(metrics: dict, step: int) -> None:
        if step % every == 0 and not any(k.startswith("eval/") for k in metrics):
            ray.train.report({**metrics, "step": step})

    out = Path(config["out"])
    rank = ctx.get_world_rank()
    metrics = train(TrainConfig(**config["train"]), target, data, out, log=log, progress=False,
                    rank=rank, world=ctx.get_world_size())
    # the trained head folder is the run's Ray checkpoint (rank 0 owns it; every rank reports)
    checkpoint = ray.train.Checkpoint.from_directory(str(out)) if rank == 0 else None
    ray.train.report({**metrics, "step": metrics.get("train/steps", 0)}, checkpoint=checkpoint)


def train_on_ray(cfg, model: str, features: Path, out: Path, num_workers: int = 1, use_gpu: bool = False,
                 storage: Path | None = None) -> dict:
    """Run `jetflow.train.trainer.train` under Ray Train; returns the last reported metrics."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from jetflow.paths import jetflow_home

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    trainer = TorchTrainer(
        _loop,
        train_loop_config={"train": dataclasses.asdict(cfg), "model": model, "features": str(features),
                           "out": str(Path(out).resolve())},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(name=f"train-{cfg.name}",
                             storage_path=str((storage or jetflow_home() / "ray_results").resolve())),
    )
    result = trainer.fit()
    return dict(result.metrics or {})
