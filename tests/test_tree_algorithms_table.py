"""benchmarks/tree_algorithms.py joins pieces of one comparison: τ from the report that decoded the most
prompts, speed from the one that timed the most, a τ disagreement on equal prompts flagged (τ is
deterministic), a lossless failure anywhere kept."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_tree_algorithms", ROOT / "benchmarks" / "tree_algorithms.py")
ta = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ta)


def _row(algorithm, budget, tau, prompts, timed, speedup=None, lossless=True, dataset="humaneval"):
    return {"dataset": dataset, "method": "causal", "algorithm": algorithm, "budget": budget, "width": 7,
            "temperature": 0.0, "tree": {"algorithm": algorithm, "budget": budget, "width": 7}, "tau": tau,
            "tokens_per_s": None if speedup is None else 10 * speedup, "speedup_vs_ar": speedup,
            "lossless": lossless, "prompts": prompts, "timed_prompts": timed}


def _report(rows, prompts, timed):
    ar = {"dataset": "humaneval", "method": "ar", "algorithm": None, "budget": 1, "width": 1, "temperature": 0.0,
          "tree": None, "tau": 1.0, "tokens_per_s": 10.0 if timed else None, "speedup_vs_ar": 1.0 if timed else None,
          "lossless": None, "prompts": prompts, "timed_prompts": timed}
    return {"params": {"prompts_per_set": prompts, "timed_prompts": timed}, "rows": [ar, *rows]}


def test_tau_from_the_most_prompts_speed_from_the_most_timed():
    tau_only = _report([_row("best_first", 8, 2.61, 40, 0), _row("accum_logp", 8, 1.75, 40, 0)], 40, 0)
    timed = _report([_row("best_first", 8, 2.50, 2, 2, speedup=0.97), _row("accum_logp", 8, 1.60, 2, 2, 0.76)], 2, 2)
    rows, warnings = ta.merge([timed, tau_only])
    assert warnings == []
    by = {r["algorithm"]: r for r in rows if r["method"] == "causal"}
    assert (by["best_first"]["tau"], by["best_first"]["speedup_vs_ar"], by["best_first"]["timed_prompts"]) == (2.61, 0.97, 2)
    assert (by["accum_logp"]["tau"], by["accum_logp"]["speedup_vs_ar"]) == (1.75, 0.76)
    md = ta.table(rows)
    assert "| `best_first` | ours | 2.61 | 0.97× (b8) |" in md
    assert "| `accum_logp` | paper | 1.75 | 0.76× (b8) |" in md
    assert "lossless: every row" in md


def test_a_tau_disagreement_on_equal_prompts_warns_and_a_lossless_failure_is_kept(tmp_path):
    a = _report([_row("best_first", 8, 2.61, 40, 0)], 40, 0)
    b = _report([_row("best_first", 8, 2.60, 40, 2, speedup=0.9, lossless=False)], 40, 2)
    rows, warnings = ta.merge([a, b])
    assert len(warnings) == 1 and "2.6100 vs 2.6000" in warnings[0]
    row = next(r for r in rows if r["method"] == "causal")
    assert row["tau"] == 2.61 and row["lossless"] is False and row["speedup_vs_ar"] == 0.9
    assert "NOT every row" in ta.table(rows)
    # a failure in a report that gives neither the τ nor the speed still counts
    c = _report([_row("best_first", 8, 2.40, 10, 0, lossless=False)], 10, 0)
    rows, _ = ta.merge([a, c])
    assert next(r for r in rows if r["method"] == "causal")["lossless"] is False
    files = []
    for name, rep in (("a.json", a), ("b.json", b)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(rep))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_algorithms.py"), *map(str, files),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "warning:" in out.stderr, out.stderr
    assert (tmp_path / "out" / "tau_vs_budget.png").stat().st_size > 0
    missing = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_algorithms.py"), str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such report" in missing.stderr
