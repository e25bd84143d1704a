"""Evaluate a draft head against AR, HF `generate` and HF prompt lookup on held-out prompts, side by side.

    python jobs/evaluate.py --head demo                                  # defaults below
    python jobs/evaluate.py --head models:/smollm2-135m-jetflow-head@champion --budgets 4,8,16,32,64
    python jobs/evaluate.py --head demo --bidirectional-head bidir --algorithms accum_logp,chain,top2gap:margin=1
    python jobs/evaluate.py --no-mlflow --out report.json                 # baselines only (no head)

Lists are comma-separated; booleans take true/false (`--baselines false`, or `--no-baselines`).

For each prompt set, on the same prompts, every (algorithm, budget, width, temperature) of our decoder
is measured next to the baselines: τ, tokens/s, decode speedup vs our AR loop and vs HF `generate`,
end-to-end speedup, time split, per-depth and per-(depth, rank) acceptance, the lossless check, and
the cost model's predicted speedup (from t(N) measured on this device). Prints a markdown table,
writes the report JSON and logs it to MLflow (one evaluation run in the target's experiment).
Bad input prints one line and exits with code 2; exit code 1 means a greedy output of our decoder
differed from AR greedy (a lossless failure; the report says which row).
"""

from __future__ import annotations

import argparse
import sys

from jetflow.config_cli import add_dataclass_args, build_config, parse_args
from jetflow.errors import JetFlowError
from jetflow.eval.job import EvaluateJob, run_evaluation_job

PROG = "evaluate"


class _OneLineParser(argparse.ArgumentParser):
    """Argument errors as one `evaluate: error: ...` line (exit 2), like every other bad input."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, EvaluateJob, "evaluation")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    try:
        return run_evaluation_job(build_config(EvaluateJob, args))
    except JetFlowError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
