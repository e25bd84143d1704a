"""Sweep head architectures and training settings with Ray Tune: each trial a Ray Train run on the shared
feature cache, ASHA stopping the weak ones early on held-out simulated tree τ; finalists decoded on
held-out prompts, registered, and the best aliased `challenger` (jobs/promote.py decides on champion).

    python sweeps/arch.py                                         # causal × layers × lr on the demo data
    python sweeps/arch.py --search causal=true,false block_size=8,16 loss=fkl,ce --max-steps 200
    python sweeps/arch.py --search max_sequences=64,128,256       # τ against data size
    ray job submit --working-dir . -- python sweeps/arch.py --use-gpu true --workers-per-trial 2

Searchable (NAME=v1,v2,...): num_layers, block_size, num_taps, causal, loss, gamma, lr, max_sequences,
draft_vocab, anchor_shortcut, depth_embedding. An interrupted sweep resumes when rerun with the same --name.
"""

from __future__ import annotations

import argparse
import sys

from jetflow.config_cli import add_dataclass_args, overrides
from jetflow.errors import JetFlowError
from jetflow.sweeps.arch import ArchSweepConfig, run_arch_sweep, summary_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    add_dataclass_args(p, ArchSweepConfig, "sweep")
    args = p.parse_args(argv)
    try:
        cfg = ArchSweepConfig(**overrides(args, ArchSweepConfig))
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
    print(f"{len(out.rows)} trials in {out.seconds / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
