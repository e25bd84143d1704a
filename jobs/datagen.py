"""Regenerate training responses with the target (resumable), then build the shared feature cache.

    python jobs/datagen.py --preset demo            # the demo's data
    python jobs/datagen.py --num-prompts 2000 --workers 4   # shards spread over 4 Ray actors
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jetflow.config_cli import add_dataclass_args, overrides
from jetflow.data.features import FeatureSpec, build_features
from jetflow.data.regenerate import RegenConfig, regenerate
from jetflow.errors import JetFlowError
from jetflow.train.pipeline import PRESETS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="base settings (default demo)")
    p.add_argument("--no-features", action="store_true", help="only regenerate; skip the feature cache")
    p.add_argument("--feature-max-len", type=int, default=None, help="tokens per sequence in the feature cache")
    add_dataclass_args(p, RegenConfig, "regeneration")
    args = p.parse_args(argv)
    try:
        base = PRESETS[args.preset]
        cfg = RegenConfig(**{**dataclasses.asdict(base.regen), **overrides(args, RegenConfig)})
        out = regenerate(cfg)
        print(json.dumps(json.loads((out / "manifest.json").read_text()), indent=2))
        if not args.no_features:
            from jetflow.target import TargetModel

            target = TargetModel.load(cfg.model)
            spec = FeatureSpec.for_target(target, base.train.num_taps, args.feature_max_len or base.features_max_len)
            print(build_features(out, target, spec))
    except JetFlowError as exc:
        print(f"datagen: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
