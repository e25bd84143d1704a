"""The verify cost model on this device: t(N) of the real tree-masked target forward, the speedup it
predicts for a grid of τ, and — given an evaluation report — its prediction per measured row and the
budget it would pick. Greedy τ does not depend on the device, so τ measured on a CPU plus a curve
measured on a GPU projects the GPU's best budget (and a GPU evaluation checks the projection).

    python benchmarks/cost_model.py                                  # measure here, print t(N) and predictions
    python benchmarks/cost_model.py --save ~/h100.json               # keep the curve (e.g. run on an H100)
    python benchmarks/cost_model.py --curve ~/h100.json --report ~/.jetflow/eval/<report>.json
                                                                     # project a CPU report onto that H100

Prints markdown and writes it (plus the curve JSON) under $JETFLOW_HOME/bench/cost_model.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from datetime import date
from pathlib import Path

from jetflow.errors import JetFlowError
from jetflow.eval.cost_model import CostCurve, measure_verify_curve
from jetflow.eval.table import curve_table


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def prediction_grid(curve: CostCurve, taus: list[float], budgets: list[int]) -> str:
    lines = ["| τ \\ budget | " + " | ".join(str(b) for b in budgets) + " | best |",
             "|" + "---|" * (len(budgets) + 2)]
    for tau in taus:
        # a τ above budget is impossible (τ <= nodes on one path + bonus <= budget)
        preds = {b: curve.predict_speedup(tau, b) for b in budgets if tau <= b}
        best = max(preds, key=preds.get) if preds else None
        cells = [f"{preds[b]:.2f}x" if b in preds else "–" for b in budgets]
        lines.append(f"| {tau:g} | " + " | ".join(cells) + f" | {best} |")
    return "\n".join(lines)


def project_report(curve: CostCurve, report: dict) -> str:
    """Each (set, method, algorithm, width, T) group of the report's speculative rows: measured τ and
    speedup per budget (on the report's device) next to this curve's prediction, and the best budget."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in report["rows"]:
        if r["method"] in ("ar", "hf_generate", "hf_prompt_lookup") or r.get("tau") is None:
            continue
        groups[(r["dataset"], r["method"], r["algorithm"], r["width"], r["temperature"])].append(r)
    src = (report.get("cost_model") or {}).get("device", "the report's device")
    lines = [f"Measured on {src}; predicted for {curve.device}"
             + ("" if curve.draft_ms is not None else " (draft cost: the report's own, per round)") + ":", "",
             "| set | method | algorithm | W | T | budget | τ | measured | predicted | best budget (predicted) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (ds, method, alg, w, t), rows in groups.items():
        taus, draft = {}, {}
        for r in rows:
            taus[r["budget"]] = r["tau"]
            draft[r["budget"]] = r["draft_ms"] * r["tau"] if r.get("draft_ms") is not None else 0.0
        preds = {b: curve.predict_speedup(taus[b], b, draft_ms=None if curve.draft_ms is not None else draft[b])
                 for b in taus}
        best = max(preds, key=preds.get)
        for r in sorted(rows, key=lambda r: r["budget"]):
            b = r["budget"]
            measured = f"{r['speedup_vs_ar']:.2f}x" if r.get("speedup_vs_ar") is not None else "–"
            lines.append(f"| {ds} | {method} | {alg} | {w} | {t:g} | {b} | {taus[b]:.2f} | {measured} | "
                         f"{preds[b]:.2f}x | {best if b == best else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="target to time (default smollm2-135m)")
    p.add_argument("--device", default="cpu", help="torch device to time on, e.g. cuda (default cpu)")
    p.add_argument("--budgets", default="1,2,4,8,16,32,64,128,256", help="tree sizes N to time")
    p.add_argument("--context-tokens", type=int, default=200, help="cached tokens behind each verify (default 200)")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions per N, median (default 7)")
    p.add_argument("--head", default="random", help="head whose draft cost is timed: folder/name, 'random' "
                   "(same cost as a trained head of that shape) or 'none' (default random)")
    p.add_argument("--curve", help="load this curve JSON (or an evaluation report's curve) instead of "
                   "measuring, e.g. one saved on an H100")
    p.add_argument("--save", help="also write the curve JSON here")
    p.add_argument("--taus", default="1.5,2,3,4,6,8", help="τ values for the prediction grid")
    p.add_argument("--report", help="an evaluation report JSON (jobs/evaluate.py): predict its rows")
    args = p.parse_args(argv)
    try:
        budgets = sorted(set(_ints(args.budgets)) | {1})
        if args.curve:
            data = json.loads(Path(args.curve).expanduser().read_text())
            # an evaluation report carries the curve of the machine it ran on
            curve = CostCurve.from_dict(data["cost_model"] if "rows" in data else data)
        else:
            import torch

            from jetflow.head import HeadRef
            from jetflow.target import TargetModel

            target = TargetModel.load(args.model, device=args.device)
            loaded = HeadRef.parse(args.head).load(target)
            head = loaded.head if loaded is not None else None
            curve = measure_verify_curve(target, budgets, args.context_tokens, args.repeats, head=head)
        report = json.loads(Path(args.report).expanduser().read_text()) if args.report else None
    except (JetFlowError, OSError, ValueError) as exc:
        print(f"cost_model: error: {exc}", file=sys.stderr)
        return 2

    parts = [f"### Cost model ({date.today().isoformat()}, {curve.device})", "", curve_table(curve.to_dict()), "",
             "Predicted speedup τ·t(1) / (t(N) + draft)" + (f", draft {curve.draft_ms:.1f} ms" if curve.draft_ms
                                                            else ", no draft cost") + ":", "",
             prediction_grid(curve, _floats(args.taus), [b for b in budgets if b > 1])]
    if report is not None:
        parts += ["", project_report(curve, report)]
    text = "\n".join(parts)
    print(text)
    from jetflow.paths import jetflow_home

    out = jetflow_home() / "bench"
    out.mkdir(parents=True, exist_ok=True)
    curve.save(out / "cost_model.json")
    (out / "cost_model.md").write_text(text + "\n")
    if args.save:
        print(f"\ncurve: {curve.save(Path(args.save).expanduser())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
