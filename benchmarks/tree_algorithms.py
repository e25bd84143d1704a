"""One table and one plot of tree algorithms from several `jobs/evaluate.py` reports: a comparison run in
pieces (the 40 + 40 one in benchmarks/HISTORY.md "Tree algorithms" takes ~5 h on 2 cores, more than one sitting).

    python benchmarks/tree_algorithms.py part1.json part2a.json part2b-tau.json part2b-speed.json \\
        --out ~/.jetflow/bench/algos40/all

A row is one (dataset, head method, tree setting). When several reports hold the same row, τ comes from
the one that decoded the most prompts, and the speed columns (tokens/s, speedup vs our AR) from the one
that timed the most (a τ-only piece plus a short timed piece of the same settings make one row). τ is
deterministic (greedy, lossless), so two reports with the same prompts must agree on it: a difference is
printed as a warning. Speedups are ratios measured side by side within their own report.

Prints the markdown table (τ per set and budget, the best speedup vs AR per set, each algorithm's source
from the registry) and writes table.md, merged.json and tau_vs_budget.png to --out. Nothing is decoded.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib
from cycler import cycler

from jetflow.metrics import BASELINE_METHODS
from jetflow.tracking.plots import _series_label, _versus_budget
from jetflow.tracking.report import ReportRow
from jetflow.tree import TreeSpec
from jetflow.tree.spec import setting_key
from jetflow.tree.build import TREE_BUILDERS

SPEED_FIELDS = ("tokens_per_s", "speedup_vs_ar", "speedup_vs_hf", "e2e_speedup", "draft_ms", "verify_ms",
                "other_ms")


def row_key(row: dict) -> tuple:
    spec = TreeSpec.from_dict(row["tree"]) if row.get("tree") else None
    return row["dataset"], row["method"], setting_key(spec, row["temperature"])


def merge(reports: list[dict]) -> tuple[list[dict], list[str]]:
    """The merged rows (first-seen order) and warnings (τ disagreements between equal prompt counts)."""
    tau_src: dict[tuple, dict] = {}
    speed_src: dict[tuple, dict] = {}
    lossless: dict[tuple, list[bool]] = defaultdict(list)  # every report's flag: a failure anywhere is kept
    warnings: list[str] = []
    for rep in reports:
        for row in rep["rows"]:
            k = row_key(row)
            if row.get("lossless") is not None:
                lossless[k].append(bool(row["lossless"]))
            old = tau_src.get(k)
            if row.get("tau") is not None:
                if old is None or old.get("tau") is None or row["prompts"] > old["prompts"]:
                    tau_src[k] = row
                elif (row["prompts"] == old["prompts"] and old.get("tau") is not None
                      and abs(row["tau"] - old["tau"]) > 1e-9):
                    warnings.append(f"{k}: τ {old['tau']:.4f} vs {row['tau']:.4f} on {row['prompts']} prompts")
            elif old is None:
                tau_src[k] = row
            if row.get("timed_prompts") and (k not in speed_src
                                             or row["timed_prompts"] > speed_src[k]["timed_prompts"]):
                speed_src[k] = row
    merged = []
    for k, row in tau_src.items():
        out = dict(row)
        speed = speed_src.get(k)
        for f in SPEED_FIELDS:
            out[f] = speed.get(f) if speed else None
        out["timed_prompts"] = speed["timed_prompts"] if speed else 0
        out["lossless"] = all(lossless[k]) if lossless[k] else None
        merged.append(out)
    return merged, warnings


def table(rows: list[dict]) -> str:
    heads = [r for r in rows if r["method"] not in BASELINE_METHODS and r.get("tree")]
    datasets = list(dict.fromkeys(r["dataset"] for r in heads))
    budgets = sorted({r["budget"] for r in heads})
    methods = list(dict.fromkeys(r["method"] for r in heads))
    cells: dict[tuple, dict] = defaultdict(dict)
    for r in heads:
        cells[(r["method"], TreeSpec.from_dict(r["tree"]).algorithm_option)][(r["dataset"], r["budget"])] = r
    bud = " / ".join(str(b) for b in budgets)
    head = (["head"] if len(methods) > 1 else []) + ["algorithm", "source"]
    head += [f"τ {ds} b{bud}" for ds in datasets] + [f"best vs AR, {ds}" for ds in datasets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (method, label), by in cells.items():
        algo = TREE_BUILDERS[label.split(":")[0]]
        taus = [" / ".join(f"{by[(ds, b)]['tau']:.2f}" if (ds, b) in by and by[(ds, b)]["tau"] is not None
                           else "–" for b in budgets) for ds in datasets]
        best = []
        for ds in datasets:
            timed = [r for (d, _), r in by.items() if d == ds and r.get("speedup_vs_ar") is not None]
            top = max(timed, key=lambda r: r["speedup_vs_ar"], default=None)
            best.append(f"{top['speedup_vs_ar']:.2f}× (b{top['budget']})" if top else "–")
        lead = [method] if len(methods) > 1 else []
        lines.append("| " + " | ".join(lead + [f"`{label}`", algo.source] + taus + best) + " |")
    lossless = [r["lossless"] for r in heads if r.get("lossless") is not None]
    tail = [f"lossless: {'every row' if lossless and all(lossless) else 'NOT every row' if lossless else 'not checked'}"
            f" ({len(lossless)} of {len(heads)} rows checked)"]
    return "\n".join(lines + [""] + tail)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="evaluate.py report JSON files")
    p.add_argument("--out", type=Path, help="folder for table.md, merged.json, tau_vs_budget.png")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.reports if not f.is_file()]
    if missing:
        print(f"error: no such report: {', '.join(missing)}", file=sys.stderr)
        return 2
    reports = [json.loads(f.read_text()) for f in args.reports]
    rows, warnings = merge(reports)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    md = table(rows)
    for f, rep in zip(args.reports, reports):  # each report's speedups are against its own AR
        ar = [f"{r['dataset']} {r['tokens_per_s']:.1f}" for r in rep["rows"]
              if r["method"] == "ar" and r.get("tokens_per_s")]
        md += f"\n{f.name}: {rep['params'].get('prompts_per_set')} prompts a set, " + (
            f"AR {', '.join(ar)} tok/s" if ar else "not timed")
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(md + "\n")
        (args.out / "merged.json").write_text(json.dumps({"reports": [str(f) for f in args.reports],
                                                          "rows": rows}, indent=1))
        several_heads = len({r["method"] for r in rows if r.get("tree")}) > 1
        tab20 = matplotlib.colormaps["tab20"].colors  # 10 dark hues solid, then their light ones dashed
        cycle = cycler(color=tab20[0::2] + tab20[1::2], linestyle=["-"] * 10 + ["--"] * 10)
        with matplotlib.rc_context({"axes.prop_cycle": cycle}):
            fig = _versus_budget([ReportRow.model_validate({k: v for k, v in r.items()
                                                            if k in ReportRow.model_fields}) for r in rows],
                                 "tau", "τ (tokens / verify)", "acceptance length vs budget", reference=1.0,
                                 series_label=lambda r: _series_label(r, method=several_heads))
        if fig is not None:
            fig.savefig(args.out / "tau_vs_budget.png", dpi=110)
        print(f"wrote {args.out}/table.md, merged.json, tau_vs_budget.png")
    return 1 if warnings else 0


if __name__ == "__main__":
    sys.exit(main())
