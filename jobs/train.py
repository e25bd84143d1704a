"""Train a draft head: datagen → features → Ray Train → head in $JETFLOW_HOME/heads/<name>/.

    python jobs/train.py --preset demo                       # 23.4 min measured on 2 CPU cores
    python jobs/train.py --preset demo --name bidir --causal false
    python jobs/train.py --preset demo --features online     # no feature cache on disk
    python jobs/train.py --preset long --workers 4           # 4 Ray Train workers (a cluster)

Under Ray Train the training is a live MLflow run (experiment jetflow/<target>: a point per step, the
data as dataset inputs, system metrics) and a progress line shows here every 30 s; at the end the head
files and the held-out decoded τ are added to that run. A killed run is marked KILLED (FAILED after an
error) and resumes from its last checkpoint, in the same MLflow run, when rerun with the same options.
"""

from __future__ import annotations

import argparse
import sys

from jetflow.config_cli import add_dataclass_args, build_config, overrides, parse_args
from jetflow.errors import JetFlowError
from jetflow.train.config import TrainConfig
from jetflow.train.jobs import TrainJob


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, TrainJob, "job")
    add_dataclass_args(p, TrainConfig, "training (override the preset)")
    args = parse_args(p, argv)
    try:
        from jetflow.train.pipeline import run_pipeline

        job = build_config(TrainJob, args)
        out = run_pipeline(job.preset, name=args.name, model=job.model, use_ray=job.ray, workers=job.workers,
                           features=job.features, device=job.device, dtype=job.dtype,
                           train_overrides=overrides(args, TrainConfig, skip=("name",)))
        from jetflow.tracking import log_training_run

        run_id = log_training_run(out)  # completes the live run (or logs one, for a training in this process)
    except JetFlowError as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    print((out / "metrics.json").read_text())
    print(f"MLflow training run: {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
