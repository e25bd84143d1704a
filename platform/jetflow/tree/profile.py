"""`AcceptanceProfile`: a head's measured per-(depth, rank) acceptance — what the profile-guided tree algorithms
(`depth_rank_histogram`, `class_histogram`, `online_warmup`'s fallback) shape trees from — and the cap rules
that turn such a table into per-depth fanout caps.

A table has one row per draft depth (row i: the children at depth i + 1) and one entry per rank:
row[i][r] = P(the target's token after an accepted depth-i node is the rank-r draft token of depth i + 1),
the paper's `depth_rank_accept`. A row with no data is empty. It comes from an evaluation report
(`from_report`, whose `rank_acceptance` counts rounds) and is stored as JSON in the paper's schema
(`depth_rank_accept`, `per_class_histograms`, `meta`) beside the head (`PROFILE_FILE`), so a served head shapes
trees from its own measurements:

    python -m jetflow.tree.profile REPORT.json --method causal --out HEAD_DIR/tree_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from jetflow.errors import InvalidSettingError, JetFlowError
from jetflow.tree.spec import TreeSpec
from jetflow.tree.templates import ShapeTemplates

PROFILE_FILE = "tree_profile.json"   # the profile's name beside a head's config.json and in its registry version
Table = tuple[tuple[float, ...], ...]


# ------------------------------------------------------------------------------------ cap rules
def histogram_caps(rows: Sequence[Sequence[float]], threshold: float, width: int, depths: int) -> list[int]:
    """The paper's depth_rank_histogram rule: cap_d = how many of the first `width` ranks have acceptance >=
    `threshold` (a count, not the deepest such rank), clamped to 1..width. No table, `threshold` <= 0, or a
    depth without data: the full `width` (nothing to prune on) — accum_logp."""
    if threshold <= 0 or not rows:
        return [width] * depths
    caps = []
    for d in range(depths):
        row = rows[d] if d < len(rows) else ()
        if not row:
            caps.append(width)
            continue
        keep = sum(1 for r in range(min(width, len(row))) if row[r] >= threshold)
        caps.append(min(width, max(1, keep)))
    return caps


def support_caps(rows: Sequence[Sequence[float]], width: int, depths: int) -> list[int]:
    """The paper's class_histogram rule for a measured table: cap_d = 1 + the deepest of the first `width`
    ranks with any acceptance (> 0), at least 1; a depth without data: 1."""
    caps = []
    for d in range(depths):
        row = rows[d] if d < len(rows) else ()
        deepest = max((r + 1 for r in range(min(width, len(row))) if row[r] > 0.0), default=1)
        caps.append(min(deepest, width))
    return caps


def acceptance_rates(offered: Sequence[Sequence[int]], accepted: Sequence[Sequence[int]]) -> Table:
    """Counts → a table: accepted[d][r] / offered[d][r] (0.0 where rank r was never offered); a depth
    never offered gives an empty row."""
    return tuple(tuple(a / o if o else 0.0 for o, a in zip(off, acc)) if any(off) else ()
                 for off, acc in zip(offered, accepted))


def conditional_table(rounds_fraction: Mapping[tuple[int, int], float]) -> Table:
    """An evaluation report's per-(depth, rank) acceptance — the fraction of rounds whose accepted path takes
    rank r at depth d (1-based), `metrics.per_rank_acceptance` — conditioned on the path reaching depth
    d - 1: row[d-1][r] = f(d, r) / Σ_r' f(d-1, r') (depth 0: every round). A depth never reached: empty."""
    if not rounds_fraction:
        return ()
    depth = max(d for d, _ in rounds_fraction)
    width = max(r for _, r in rounds_fraction) + 1
    rows, reach = [], 1.0
    for d in range(1, depth + 1):
        row = [rounds_fraction.get((d, r), 0.0) for r in range(width)]
        rows.append(tuple(f / reach for f in row) if reach > 0 else ())
        reach = sum(row)
    return tuple(rows)


# ------------------------------------------------------------------------------------ the profile
PROFILE_ALGORITHMS = {"accum_logp": 0, "best_first": 1}  # the settings a profile is read from, in preference


def profile_preference(spec: TreeSpec) -> tuple[int, int, int]:
    """Sort key of the setting to read a head's profile from (smallest first): the widest `accum_logp`, else
    the widest `best_first` — the trees least shaped by a profile of their own — else anything."""
    return PROFILE_ALGORITHMS.get(spec.algorithm, len(PROFILE_ALGORITHMS)), -spec.budget, -spec.width


def _table(where: str, value: Any) -> Table:
    try:
        return tuple(tuple(float(x) for x in row) for row in value)
    except (TypeError, ValueError):
        raise InvalidSettingError(f"tree profile: {where} must be a list of rows of numbers") from None


@dataclass(frozen=True, eq=False)
class AcceptanceProfile:
    """depth_rank: the head's table over all measured prompts; classes: the same per router class
    (`ShapeTemplates` class names), for class_histogram; meta: where and how it was measured."""

    depth_rank: Table
    classes: Mapping[str, Table] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"depth_rank_accept": [list(r) for r in self.depth_rank],
                "per_class_histograms": {k: [list(r) for r in t] for k, t in self.classes.items()},
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AcceptanceProfile":
        if not isinstance(d, Mapping) or "depth_rank_accept" not in d:
            raise InvalidSettingError("a tree profile is a JSON object with depth_rank_accept (rows of per-rank "
                                      "acceptance), optional per_class_histograms and meta")
        classes = d.get("per_class_histograms") or {}
        if not isinstance(classes, Mapping):
            raise InvalidSettingError("tree profile: per_class_histograms must map a class to a table")
        return cls(_table("depth_rank_accept", d["depth_rank_accept"]),
                   {str(k): _table(f"per_class_histograms.{k}", t) for k, t in classes.items()},
                   dict(d.get("meta") or {}))

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceProfile":
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / PROFILE_FILE
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise InvalidSettingError(f"no tree profile at {path}: write one with `python -m "
                                      "jetflow.tree.profile REPORT.json --out PATH`") from None
        except json.JSONDecodeError as exc:
            raise InvalidSettingError(f"tree profile {path} is not JSON ({exc.msg})") from None

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON at `path` (its folder created); → the path."""
        out = Path(path).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return out

    @classmethod
    def from_report(cls, report: Mapping[str, Any], method: str = "causal", setting: str | None = None,
                    templates: ShapeTemplates | None = None) -> "AcceptanceProfile":
        """From an evaluation report's `rank_acceptance` for one head `method` (causal / bidirectional) and one
        greedy tree `setting` (a TreeSpec key; default: the widest accum_logp, else best_first, setting
        measured — the least shaped by its own tree). Prompt sets weigh equally; a set whose name the
        templates alias to a router class also enters that class's table."""
        templates = templates or ShapeTemplates.shipped()
        entries: dict[str, dict[str, Mapping[str, float]]] = defaultdict(dict)  # tree key → set → fractions
        for key, fractions in (report.get("rank_acceptance") or {}).items():
            dataset, meth, measured = key.rsplit("/", 2)
            tree_key, _, temperature = measured.rpartition("-t")
            if tree_key and meth == method and float(temperature) == 0.0:
                entries[tree_key][dataset] = fractions
        if not entries:
            raise InvalidSettingError(f"the report has no greedy per-(depth, rank) acceptance for the {method} "
                                      "head: evaluate it with a tree setting at temperature 0 first")
        if setting is None:
            setting = min((TreeSpec.from_key(k) for k in entries), key=profile_preference).key
        if setting not in entries:
            raise InvalidSettingError(f"the report measured no {method} setting {setting!r}; it has "
                                      f"{', '.join(sorted(entries))}")
        per_set = entries[setting]

        def mean_table(sets: list[str]) -> Table:
            total: dict[tuple[int, int], float] = defaultdict(float)
            for s in sets:
                for dr, f in per_set[s].items():
                    d, r = (int(x) for x in dr.split(","))
                    total[(d, r)] += f / len(sets)
            return conditional_table(total)

        by_class: dict[str, list[str]] = defaultdict(list)
        for s in sorted(per_set):
            if s.lower() in templates.task_aliases:
                by_class[templates.class_of(s)].append(s)
        meta = {"source": "evaluation report", "method": method, "setting": setting, "sets": sorted(per_set),
                "head": (report.get("head") or {}).get("uri") or (report.get("head") or {}).get("path"),
                "report_created_at": report.get("created_at"),
                "definition": "row d, rank r: P(target takes the rank-r draft token of depth d+1 | the accepted "
                              "path reached depth d)"}
        return cls(mean_table(sorted(per_set)), {c: mean_table(sets) for c, sets in by_class.items()}, meta)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jetflow.tree.profile",
                                description="Write a head's tree profile (per-(depth, rank) acceptance) from an "
                                            "evaluation report, for depth_rank_histogram and class_histogram.")
    p.add_argument("report", help="evaluation report JSON (jobs/evaluate.py --out)")
    p.add_argument("--method", default="causal", help="the head measured: causal or bidirectional")
    p.add_argument("--setting", default=None, help="tree setting key to read (default: the widest accum_logp)")
    p.add_argument("--out", required=True, help=f"profile JSON path (a head folder: {PROFILE_FILE} in it)")
    args = p.parse_args(argv)
    try:
        report = json.loads(Path(args.report).expanduser().read_text())
        profile = AcceptanceProfile.from_report(report, args.method, args.setting)
    except (OSError, json.JSONDecodeError, JetFlowError) as exc:
        print(f"profile: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser()
    path = profile.save(out / PROFILE_FILE if out.is_dir() else out)
    print(f"{path}  ({profile.meta['setting']}, sets {', '.join(profile.meta['sets'])})")
    for d, row in enumerate(profile.depth_rank, start=1):
        print(f"  depth {d:2d}: " + " ".join(f"{x:.3f}" for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
