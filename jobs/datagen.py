"""Regenerate training responses with the target (resumable), then build the shared feature cache.

    python jobs/datagen.py --preset demo            # the demo's data
    python jobs/datagen.py --num-prompts 2000 --workers 4   # shards spread over 4 Ray actors
    ray job submit --working-dir . -- python jobs/datagen.py --workers 8   # on a cluster: into JETFLOW_STORAGE

On a multi-node cluster the target runs only on worker nodes (the actors, then a task building the features).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jetflow.config_cli import add_dataclass_args, build_config, overrides, parse_args
from jetflow.data.regen_config import RegenConfig
from jetflow.errors import InvalidSettingError, JetFlowError
from jetflow.train.jobs import DatagenJob


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, DatagenJob, "job")
    add_dataclass_args(p, RegenConfig, "regeneration (override the preset)")
    args = parse_args(p, argv)
    try:
        from jetflow.data.regenerate import regenerate
        from jetflow.train.pipeline import PRESETS, build_features_on_worker

        job = build_config(DatagenJob, args)
        if job.preset not in PRESETS:
            raise InvalidSettingError(f"unknown preset {job.preset!r}; known: {', '.join(PRESETS)}")
        base = PRESETS[job.preset]
        cfg = RegenConfig(**{**dataclasses.asdict(base.regen), **overrides(args, RegenConfig)})
        from jetflow.cluster import init_ray, on_worker, wants_gpu
        from jetflow.storage import storage

        if os.environ.get("RAY_ADDRESS"):  # a Ray job: join its cluster with what its workers need (no MLflow)
            init_ray(need_tracking=False)
        out = regenerate(cfg)
        print(json.dumps(json.loads((out / "manifest.json").read_text()), indent=2))
        if job.features:
            rel = on_worker(build_features_on_worker, storage().rel(out), cfg.model, cfg.device, cfg.dtype,
                            base.train.num_taps, job.feature_max_len or base.features_max_len,
                            num_gpus=1 if wants_gpu(cfg.device) else 0)
            print(storage().uri_for(rel))
    except JetFlowError as exc:
        print(f"datagen: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
