"""Train a draft head: datagen → features → Ray Train → head in $JETFLOW_HOME/heads/<name>/.

    python jobs/train.py --preset demo                       # 23.4 min measured on 2 CPU cores
    python jobs/train.py --preset demo --name bidir --causal false
    python jobs/train.py --preset demo --features online     # no feature cache on disk
    python jobs/train.py --preset long --workers 4           # 4 Ray Train workers (a cluster)

A killed run resumes from its last checkpoint when rerun with the same options.
"""

from __future__ import annotations

import argparse
import sys

from jetflow.config_cli import add_dataclass_args, overrides
from jetflow.errors import JetFlowError
from jetflow.train.config import TrainConfig
from jetflow.train.pipeline import PRESETS, run_pipeline


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="data + training sizes (default demo)")
    p.add_argument("--model", default="smollm2-135m", help="target: bundled name, local folder or hub id")
    p.add_argument("--workers", type=int, default=1, help="Ray Train workers")
    p.add_argument("--no-ray", action="store_true", help="train in this process instead of a Ray Train worker")
    p.add_argument("--features", default="cache", choices=("cache", "online"),
                   help="cache: tapped features stored once under $JETFLOW_HOME/features (shared by sweep trials); "
                        "online: computed on the fly each epoch (no feature disk; one target forward per sequence)")
    add_dataclass_args(p, TrainConfig, "training (override the preset)")
    args = p.parse_args(argv)
    try:
        out = run_pipeline(args.preset, name=args.name, model=args.model, use_ray=not args.no_ray,
                           workers=args.workers, features=args.features, train_overrides=overrides(args, TrainConfig, skip=("name",)))
    except JetFlowError as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    print((out / "metrics.json").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
