"""Sweep head architectures and training settings with Ray Tune: each trial a Ray Train run on the shared
feature cache, ASHA stopping the weak ones early on held-out simulated tree τ; finalists decoded on
held-out prompts, registered, and the best aliased `challenger` (jobs/promote.py decides on champion).

    python sweeps/arch.py                                         # causal × layers × lr on the demo data
    python sweeps/arch.py --block-size 8,16 --loss fkl,ce --max-steps 200
    python sweeps/arch.py --max-sequences 64,128,256 --causal true --num-hidden-layers 1 --lr 1e-3
    ray job submit --working-dir . -- python sweeps/arch.py --use-gpu true --workers-per-trial 2

Each searched option takes comma-separated choices (the grid is their product); give one value to fix an
option the default search varies. An interrupted sweep resumes when rerun with the same --name.
"""

from __future__ import annotations

import argparse
import sys

from jetflow.config_cli import add_dataclass_args, build_config, parse_args
from jetflow.errors import JetFlowError
from jetflow.sweeps.arch import ArchSweepConfig, run_arch_sweep, summary_table
from jetflow.sweeps.cluster import report_trial_errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    add_dataclass_args(p, ArchSweepConfig, "sweep")
    args = parse_args(p, argv)
    try:
        cfg = build_config(ArchSweepConfig, args)
        out = run_arch_sweep(cfg, ray_address=args.ray_address)
    except JetFlowError as exc:
        print(f"arch sweep: error: {exc}", file=sys.stderr)
        return 2
    print(summary_table(out.rows, list(cfg.space)))
    for f in out.finalists:
        taus = ", ".join(f"{k.removeprefix('tau/')} {v:.2f}" for k, v in f.items() if k.startswith("tau/"))
        print(f"finalist v{f['version']} ({', '.join(f'{k}={f[k]}' for k in cfg.space)}): decoded τ {taus}, "
              f"lossless {bool(f['lossless'])}")
    print(f"challenger: v{out.challenger}" if out.challenger else "no finished lossless trial: challenger unchanged")
    print(f"{len(out.rows)} trials in {out.seconds / 60:.1f} min; MLflow parent run {out.parent_run_id} "
          "(its trials' training runs nest under it)")
    report_trial_errors("arch sweep", out.errors)
    return 1 if out.errors else 0


if __name__ == "__main__":
    sys.exit(main())
