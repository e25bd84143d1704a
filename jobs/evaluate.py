"""Evaluate a draft head against AR, HF `generate` and HF prompt lookup on held-out prompts, side by side.

    python jobs/evaluate.py --head demo                                  # defaults below
    python jobs/evaluate.py --head models:/smollm2-135m-jetflow-head@champion --budgets 4,8,16,32,64
    python jobs/evaluate.py --head demo --bidirectional-head bidir --algorithms accum_logp,chain
    python jobs/evaluate.py --no-mlflow --out report.json                 # baselines only (no head)

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
import json
import sys
from datetime import datetime
from pathlib import Path

from jetflow.errors import InvalidSettingError, JetFlowError

PROG = "evaluate"


class _OneLineParser(argparse.ArgumentParser):
    """Argument errors as one `evaluate: error: ...` line (exit 2), like every other bad input."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _list(text: str, kind: type, option: str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise InvalidSettingError(f"{option} needs at least one value (comma-separated)")
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise InvalidSettingError(f"{option} takes comma-separated {kind.__name__} values, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="target: bundled name, local HF folder or hub id "
                   "(default smollm2-135m)")
    p.add_argument("--head", help="causal head: folder, name under $JETFLOW_HOME/heads, models:/NAME@ALIAS, "
                   "models:/NAME/VERSION, or 'random'; omit to measure the baselines only")
    p.add_argument("--bidirectional-head", help="a second, bidirectional (DFlash) head, same forms "
                   "('random-bidirectional' for random init): its rows are chain_/tree_bidirectional")
    p.add_argument("--sets", default="mtbench,humaneval", help="comma-separated eval prompt sets or JSONL "
                   "files (default mtbench,humaneval)")
    p.add_argument("--prompts", type=int, default=5, help="prompts per set, N spread evenly over its eval split "
                   "(default 5)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--budgets", default="8,32", help="tree budgets, nodes per round with the root, 1..4096 "
                   "(default 8,32; a chain is capped at the head's block size)")
    p.add_argument("--widths", default="7", help="top-W draft tokens per depth for trees (default 7)")
    p.add_argument("--algorithms", default="accum_logp,chain", help="tree algorithms: accum_logp, chain, "
                   "top2gap (default accum_logp,chain)")
    p.add_argument("--temperatures", default="0", help="0 = greedy (lossless-checked); > 0 samples, seeded "
                   "(default 0)")
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="HF prompt-lookup candidate "
                   "tokens per step (default 10)")
    p.add_argument("--no-baselines", action="store_true", help="skip the HF generate / prompt-lookup rows")
    p.add_argument("--no-lossless-check", action="store_true", help="do not compare greedy outputs")
    p.add_argument("--no-cost-model", action="store_true", help="do not measure t(N) nor predict speedups")
    p.add_argument("--context-tokens", type=int, default=200, help="cached tokens behind the timed verify "
                   "forwards of the cost model (default 200)")
    p.add_argument("--curve-repeats", type=int, default=5, help="timed repetitions per tree size (default 5)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i: seed + i) and random-head "
                   "init (default 0)")
    p.add_argument("--out", help="report JSON path (default $JETFLOW_HOME/eval/<target>-<time>.json)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the report to MLflow")
    p.add_argument("--run-name", help="MLflow run name")
    p.add_argument("--parent-run-id", help="MLflow parent run (e.g. the sweep's run)")
    return p


def config_from_args(args: argparse.Namespace):
    from jetflow.eval import EvalConfig

    return EvalConfig(
        sets=_list(args.sets, str, "--sets"), prompts_per_set=args.prompts, max_new_tokens=args.max_new_tokens,
        budgets=_list(args.budgets, int, "--budgets"), widths=_list(args.widths, int, "--widths"),
        algorithms=_list(args.algorithms, str, "--algorithms"),
        temperatures=_list(args.temperatures, float, "--temperatures"), baselines=not args.no_baselines,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens, check_lossless=not args.no_lossless_check,
        seed=args.seed, cost_model=not args.no_cost_model, context_tokens=args.context_tokens,
        curve_repeats=args.curve_repeats)


def run(args: argparse.Namespace) -> int:
    from jetflow.eval import evaluate, load_eval_head
    from jetflow.eval.heads import spec_is_causal
    from jetflow.eval.table import report_markdown
    from jetflow.paths import jetflow_home
    from jetflow.target import TargetModel

    cfg = config_from_args(args)
    # A missing head, or a head in the wrong slot, fails before the target loads.
    if args.head and not spec_is_causal(args.head):
        raise InvalidSettingError(f"--head {args.head} is a bidirectional head; pass it as --bidirectional-head")
    if args.bidirectional_head and spec_is_causal(args.bidirectional_head):
        raise InvalidSettingError(f"--bidirectional-head {args.bidirectional_head} is a causal head; pass it as --head")
    target = TargetModel.load(args.model)
    heads = [load_eval_head(spec, target, cfg.seed) for spec in (args.head, args.bidirectional_head) if spec]
    report = evaluate(target, heads, cfg, progress=True)

    print(report_markdown(report))
    out = Path(args.out) if args.out else (
        jetflow_home() / "eval" / f"{target.model_id.replace('/', '--')}-{datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nreport: {out}")
    if not args.no_mlflow:
        from jetflow.tracking import log_evaluation

        run_id = log_evaluation(report, run_name=args.run_name, parent_run_id=args.parent_run_id)
        print(f"MLflow run: {run_id}")
    return 0 if report["metrics"].get("lossless", 1.0) == 1.0 else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except JetFlowError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
