"""Markdown tables of an evaluation report: the comparison rows and the cost curve."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from jetflow.tree import TreeSpec

COLUMNS = (  # (header, row key, format)
    ("set", "dataset", "{}"),
    ("method", "method", "{}"),
    ("algorithm", "algorithm", "{}"),
    ("budget", "budget", "{}"),
    ("W", "width", "{}"),
    ("T", "temperature", "{:g}"),
    ("τ", "tau", "{:.2f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("vs AR", "speedup_vs_ar", "{:.2f}x"),
    ("vs HF", "speedup_vs_hf", "{:.2f}x"),
    ("e2e", "e2e_speedup", "{:.2f}x"),
    ("predicted", "predicted_speedup", "{:.2f}x"),
    ("lossless", "lossless", "{}"),
    ("draft ms/tok", "draft_ms", "{:.1f}"),
    ("verify ms/tok", "verify_ms", "{:.1f}"),
    ("other ms/tok", "other_ms", "{:.1f}"),
)


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return fmt.format(value)


def markdown_table(rows: Sequence[Mapping], columns: Sequence[str | tuple[str, str, str]],
                   suffix: Sequence[str] | None = None) -> str:
    """The one markdown renderer: a column is a row key (floats shown with 3 significant digits) or
    (header, key, format); `suffix[i]` is appended after row i's closing bar (e.g. a **best** mark)."""
    cols = [c if isinstance(c, tuple) else (c, c, "") for c in columns]
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
    for i, r in enumerate(rows):
        cells = [_cell(r.get(k), f or ("{:.3g}" if isinstance(r.get(k), float) else "{}")) for _, k, f in cols]
        lines.append("| " + " | ".join(cells) + " |" + (suffix[i] if suffix else ""))
    return "\n".join(lines) + "\n"


def rows_table(rows: Sequence[Mapping]) -> str:
    """One markdown line per report row (speedups decode-only; e2e includes prefill); an algorithm run with
    parameters shows them as on the command line (`top2gap:margin=1.5`)."""
    def named(r: Mapping) -> Mapping:
        spec = TreeSpec.from_dict(r["tree"]) if r.get("tree") else None
        return {**r, "algorithm": spec.algorithm_option} if spec is not None and spec.params else r

    return markdown_table([named(r) for r in rows], COLUMNS).rstrip("\n")


def curve_table(curve: Mapping) -> str:
    """The cost model's t(N) as a markdown table (the report's `cost_model` entry)."""
    t1 = curve["t_ms"][0]
    lines = [f"Verify cost t(N) on {curve['device']}, {curve['context_tokens']} cached tokens"
             + (f"; draft {curve['draft_ms']:.1f} ms/round" if curve.get("draft_ms") is not None else "") + ":",
             "", "| N | t(N) ms | t(N)/t(1) |", "|---|---|---|"]
    lines += [f"| {n} | {t:.1f} | {t / t1:.2f} |" for n, t in zip(curve["n"], curve["t_ms"])]
    return "\n".join(lines)


def report_markdown(report: Mapping) -> str:
    """Header line (target, head, prompts), the comparison table and the cost curve."""
    head = report.get("head") or {}
    origin = head.get("uri") or head.get("path") or ("random init" if head.get("config") else "none (baselines)")
    p = report.get("params", {})
    lossless = report.get("metrics", {}).get("lossless")
    parts = [f"Target {report['target']['id']} ({report['target']['revision']}); head: {origin}; "
             f"{p.get('prompts_per_set')} prompts per set ({p.get('sets')}), {p.get('max_new_tokens')} new tokens; "
             f"lossless: {'n/a' if lossless is None else ('yes' if lossless == 1.0 else 'NO')}", "",
             rows_table(report["rows"])]
    if report.get("cost_model"):
        parts += ["", curve_table(report["cost_model"])]
    return "\n".join(parts)
