"""The main job: sweep the tree settings (algorithm × budget × width) of a head with Ray Tune in two stages —
τ of every setting on held-out prompts (batched), then the finalists the step cost model predicts fastest,
timed against AR with their run-to-run spread — log every trial to MLflow (one parent run, a child run per
trial), print the tables, store the serving setting (the fastest finalist slower than AR on no prompt set,
else plain decoding) with its evidence on the head's registry version. With no head given and no champion
registered, the `demo` preset is trained and registered first, and goes through the promotion gate after
its sweep.

    python sweeps/budget.py                                   # the champion; trains the demo preset if none
    ray job submit --working-dir . -- python sweeps/budget.py # the same, as a job on a running Ray cluster
    python sweeps/budget.py --head ~/.jetflow/heads/demo --budgets 2,4,8 --sets humaneval

Lists are comma-separated. An interrupted sweep resumes (finished trials are kept) when rerun with the same
--name.
"""

from __future__ import annotations

import argparse
import sys

from jetflow.config_cli import add_dataclass_args, build_config, parse_args
from jetflow.errors import JetFlowError
from jetflow.main_job import MainJobConfig, run_main_job
from jetflow.sweeps.cluster import report_trial_errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    add_dataclass_args(p, MainJobConfig, "main job and sweep")
    args = parse_args(p, argv)
    try:
        cfg = build_config(MainJobConfig, args)
        out = run_main_job(cfg, ray_address=args.ray_address)
    except JetFlowError as exc:
        print(f"budget sweep: error: {exc}", file=sys.stderr)
        return 2
    from jetflow.sweeps.budget import summary_table, winners_table

    sweep = out.sweep
    print(summary_table(sweep.rows, sweep.best))
    report_trial_errors("budget sweep", sweep.errors)
    if sweep.missing:
        total = len(sweep.rows) + len(sweep.missing)
        print(f"budget sweep: incomplete, {len(sweep.missing)} trials missing ({', '.join(sweep.missing)}): nothing "
              f"stored or promoted. Rerun the same command: the sweep resumes from its state in storage and runs "
              f"only the missing trials.", file=sys.stderr)
        print(f"MLflow parent run {sweep.parent_run_id} ({total} settings)")
        return 1
    print()
    print(winners_table(sweep.rows, sweep.decision))
    stored = ("stored as its serving tree config" if out.stored else
              "not stored (the head is not registered: jobs/register.py registers it)" if not sweep.head.registered
              else "not stored (--store-best false)")
    d = sweep.decision
    vllm = d.get("baseline") == "vllm_ar"
    baseline = (f"vLLM AR = vLLM {d.get('vllm_version')}, eager, same prompts and {d.get('max_new_tokens')} tokens, "
                "timed in the same trials" if vllm else f"JetFlow AR: {d.get('baseline_note')}")
    if sweep.best is None:
        ar = d.get("speedup_vs_baseline")
        vs = f"; JetFlow's AR at {ar:.2f}x vLLM AR" if vllm and ar is not None else ""
        print(f"{sweep.head.label}: served with plain decoding{vs} (baseline {baseline}) — {stored}")
    else:
        b = sweep.best
        graphs = d.get("graphs", "unknown")
        headline = (f"{d['speedup_vs_vllm_ar']:.2f}x vLLM AR, {b['speedup']:.2f}x JetFlow AR"
                    if vllm and d.get("speedup_vs_vllm_ar") is not None else f"{b['speedup']:.2f}x JetFlow AR")
        print(f"serving setting for {sweep.head.label}: {sweep.best_tree.label()} at temperature {b['temperature']:g} "
              f"(τ {b['tau']:.2f}, timed speedup {headline}, JetFlow with graphs={graphs}; baseline {baseline}) "
              f"— {stored}")
    if d.get("backends"):
        from jetflow.sweeps.backends import backends_text

        print(f"backends (tokens/s, requests in flight): {backends_text(d['backends'])}")
    if sweep.budget_table:
        levels = ", ".join(f"{c} → {'plain' if b == 1 else b}" for c, b in sorted(sweep.budget_table.items()))
        print(f"best budget per concurrency, predicted from τ (requests in flight → budget): {levels}")
    if out.promotion:
        print(out.promotion)
    trained = f"; training before it {_took(out.train_seconds)}" if out.trained else ""
    print(f"MLflow parent run {sweep.parent_run_id}; {len(sweep.rows)} settings, {len(sweep.finalists)} of them timed, "
          f"in {_took(sweep.seconds)}"
          f"{trained}; {_took(out.seconds)} in all")
    return 1 if sweep.errors else 0


def _took(seconds: float) -> str:
    return f"{seconds / 60:.1f} min ({seconds:.0f} s)"


if __name__ == "__main__":
    sys.exit(main())
