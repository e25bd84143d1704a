"""Regenerate training responses with the target (resumable), then build the shared feature cache.

    python jobs/datagen.py --preset demo            # the demo's data
    python jobs/datagen.py --num-prompts 2000 --workers 4   # shards spread over 4 Ray actors
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jetflow.config_cli import add_dataclass_args, build_config, overrides, parse_args
from jetflow.data.features import FeatureSpec, build_features
from jetflow.data.regenerate import RegenConfig, regenerate
from jetflow.errors import InvalidSettingError, JetFlowError
from jetflow.train.pipeline import PRESETS, DatagenJob


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, DatagenJob, "job")
    add_dataclass_args(p, RegenConfig, "regeneration (override the preset)")
    args = parse_args(p, argv)
    try:
        job = build_config(DatagenJob, args)
        if job.preset not in PRESETS:
            raise InvalidSettingError(f"unknown preset {job.preset!r}; known: {', '.join(PRESETS)}")
        base = PRESETS[job.preset]
        cfg = RegenConfig(**{**dataclasses.asdict(base.regen), **overrides(args, RegenConfig)})
        out = regenerate(cfg)
        print(json.dumps(json.loads((out / "manifest.json").read_text()), indent=2))
        if job.features:
            from jetflow.target import TargetModel

            target = TargetModel.load(cfg.model)
            spec = FeatureSpec.for_target(target, base.train.num_taps, job.feature_max_len or base.features_max_len)
            print(build_features(out, target, spec))
    except JetFlowError as exc:
        print(f"datagen: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
