"""What does a head setting learn in a fixed number of steps? A quick, in-process check on a feature cache.

    python benchmarks/head_steps.py --features $JETFLOW_HOME/features/<key> --steps 120 \
        [--threads 1] [any training option, e.g. --gamma 7 --depth-embedding false]

Trains the `demo` preset's head (its TrainConfig, changed by the options given) for `--steps` optimizer
steps in this process — no Ray, no MLflow — into `--out` (default: a temporary folder), then prints one
JSON line: the settings changed, wall seconds, the last training loss, and the trainer's monitor (simulated
chain / tree τ and depth-1..3 agreement) on the held-out split and on as many training sequences.
Same seed, same cache, same steps → the same numbers, so two settings compare side by side; run two at
once with `--threads 1` each on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from jetflow.config_cli import add_dataclass_args, overrides, parse_args
from jetflow.train.config import TrainConfig


def monitor(head_dir: Path, data, target, cfg: TrainConfig) -> dict[str, dict[str, float]]:
    from jetflow.head import load_head
    from jetflow.train.trainer import held_out_and_training

    keep = ("chain_tau", "tree_tau", "agree_d1", "agree_d2", "agree_d3")
    return {name: {k.removeprefix("eval/"): round(v, 3) for k, v in result.as_metrics().items()
                   if k.removeprefix("eval/") in keep}
            for name, result in held_out_and_training(load_head(head_dir), target, data, cfg).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=Path, required=True, help="a feature cache folder (features.json + shards)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps (the preset's max_steps is replaced)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", type=Path, help="where the head goes (default: a temporary folder, removed)")
    add_dataclass_args(p, TrainConfig, "training options (default: the demo preset's)", skip=("max_steps",))
    args = parse_args(p, argv)

    import torch

    from jetflow.data.features import FeatureCache
    from jetflow.target import TargetModel
    from jetflow.train.pipeline import PRESETS
    from jetflow.train.trainer import train

    if args.threads:
        torch.set_num_threads(args.threads)
    changed = overrides(args, TrainConfig, skip=("max_steps",))
    cfg = TrainConfig.from_overrides(PRESETS["demo"].train, {**changed, "max_steps": args.steps,
                                                              "checkpoint_every": args.steps})
    data = FeatureCache(args.features)
    target = TargetModel.load(data.meta["target_model_id"])
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "head"
        t0 = time.perf_counter()
        metrics = train(cfg, target, data, out, progress=False)
        seconds = time.perf_counter() - t0
        print(json.dumps({"changed": changed, "steps": args.steps, "seconds": round(seconds),
                          "loss": round(metrics["train/loss"], 3), **monitor(out, data, target, cfg)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
