"""The main job: sweep tree budget × width × algorithm for a head with Ray Tune, log every trial to
MLflow (one parent run, a child run per trial), print the table, store the best setting as the head's
serving tree config in the registry.

    python sweeps/budget.py                                   # the champion; trains the demo preset if none
    ray job submit --working-dir . -- python sweeps/budget.py # the same, as a job on a running Ray cluster
    python sweeps/budget.py --head ~/.jetflow/heads/demo --budgets 2 4 8 --sets humaneval

An interrupted sweep resumes (finished trials are kept) when rerun with the same --name.
"""

from __future__ import annotations

import argparse
import sys

from jetflow.config_cli import add_dataclass_args, overrides
from jetflow.errors import JetFlowError
from jetflow.sweeps.budget import BudgetSweepConfig, run_budget_sweep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    add_dataclass_args(p, BudgetSweepConfig, "sweep")
    args = p.parse_args(argv)
    try:
        cfg = BudgetSweepConfig(**overrides(args, BudgetSweepConfig))
        out = run_budget_sweep(cfg, ray_address=args.ray_address)
    except JetFlowError as exc:
        print(f"budget sweep: error: {exc}", file=sys.stderr)
        return 2
    from jetflow.sweeps.budget import summary_table

    print(summary_table(out.rows, out.best))
    head = f"{out.registered[0]} v{out.registered[1]}" if out.registered else out.head_path
    if out.best is None:
        print(f"no lossless trial finished for {head}")
        return 1
    b = out.best
    print(f"best for {head}: {b['algorithm']} budget {b['budget']} width {b['width']} "
          f"(τ {b['tau']:.2f}, speedup {b['speedup']:.2f}x vs AR) — stored as its serving tree config")
    if out.promotion:
        print(out.promotion)
    print(f"MLflow parent run {out.parent_run_id}; {len(out.rows)} trials in {out.seconds / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
