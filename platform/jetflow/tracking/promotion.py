"""The promotion gate: `champion` moves to a challenger version only if the challenger is lossless, is not
slower than AR on any eval set with the setting it would be served with, and beats the champion on the same
eval sets by a relative margin; otherwise it says why.

Score of a head on one eval set: with the budget sweep's serving evidence on the version (tag
`jetflow.serving.evidence`, written by the main job), the timed speedup (or τ) of its serving setting on that
set, with the prompts, tokens, passes and run-to-run spread behind it — a head whose every timed setting loses to
AR somewhere is served plain and not promoted. Without it, the best value of the chosen metric over the head's
own rows (every tree setting, at temperature 0) in its latest evaluation run. The gate compares the mean of the
per-set scores over the eval sets both heads measured.

The speedups it scores are against JetFlow's own AR (what a head buys on the engine that runs it; evidence of
every age has them). Where the sweep timed vLLM AR too — the fastest plain decoding installed — the evidence also
carries each set's speedup against it and names its baseline; the summary shows both, each with its baseline."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field

from mlflow.entities import Run

from jetflow.errors import InvalidSettingError
from jetflow.tracking.jobs import PromoteJob  # noqa: F401  (its old import path)
from jetflow.metrics import HEAD_METHODS, parse_metric_key
from jetflow.tracking.registry import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    eval_runs,
    get_version,
    registered_model_name,
    serving_evidence,
)
from jetflow.tracking.store import client

# Gate metric → the metric-key kind it reads in evaluation runs.
GATE_METRICS = {"speedup": "speedup_vs_ar", "tau": "tau"}
LOSSLESS = "lossless"
GATE_TAG = "jetflow.last_gate"
_EVAL_HINT = "evaluate it first (jobs/evaluate.py, which logs an eval run tagged with the version)"


@dataclass
class PromotionDecision:
    promoted: bool
    reason: str
    name: str
    challenger_version: str
    champion_version: str | None = None       # the champion before this decision
    metric: str = "speedup"
    margin: float = 0.02
    eval_sets: list[str] = field(default_factory=list)
    challenger_score: float | None = None     # mean over eval_sets of the per-set best
    champion_score: float | None = None
    per_set: dict[str, dict[str, float | None]] = field(default_factory=dict)
    challenger_run_id: str | None = None
    champion_run_id: str | None = None
    evidence: dict | None = None              # the challenger's serving evidence, when the sweep stored it

    def summary(self) -> str:
        verdict = "PROMOTED" if self.promoted else "REFUSED"
        before = f"v{self.champion_version}" if self.champion_version else "none"
        lines = [f"{verdict}: {self.name} v{self.challenger_version} (champion before: {before})",
                 f"reason: {self.reason}"]
        sets = (self.evidence or {}).get("sets", {})
        for name, s in sorted(self.per_set.items()):
            champ = "-" if s.get("champion") is None else f"{s['champion']:.3f}"
            ev = sets.get(name)
            behind = f" ± {_num(ev.get('spread'))} (τ {_num(ev.get('tau'))})" if ev and self.metric == "speedup" else ""
            if ev and self.metric == "speedup":
                vs = f", {_num(ev['speedup_vs_vllm_ar'])}x vLLM AR" if ev.get("speedup_vs_vllm_ar") is not None else ""
                behind = f" (x JetFlow AR){behind}{vs}"
            lines.append(f"  {name}: {self.metric} challenger {s['challenger']:.3f}{behind} champion {champ}")
        if self.evidence:
            lines.append(f"evidence: {evidence_text(self.evidence)}")
        return "\n".join(lines)


def _num(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}"


def evidence_text(d: dict) -> str:
    """A serving decision of the budget sweep (`jetflow.sweeps.budget.decide`) in words: the setting, its
    number with the run-to-run spread, whether its lead over the runner-up exceeds that spread, which finalists
    were passed over for losing to AR where, and how many prompts, tokens and passes stand behind it."""
    vllm = d.get("baseline") == "vllm_ar"
    behind = (f"τ on {d['tau_prompts']} prompts per set; speedups timed interleaved with JetFlow AR on "
              f"{d['timed_prompts']} prompts per set × {d['max_new_tokens']} tokens, {d['timed_repeats']} passes")
    behind += (f"; vLLM AR (vLLM {d.get('vllm_version')}) timed on the same prompts in the same trials" if vllm else
               f"; baseline JetFlow AR ({d['baseline_note']})" if d.get("baseline_note") else "")
    losing = "; ".join(f"{k} on {', '.join(v)}" for k, v in (d.get("losing") or {}).items())
    if d["setting"] == "plain":
        why = (f"every timed setting is slower than JetFlow AR on some set ({losing})" if losing
               else "no lossless setting to time")
        ar = f" (JetFlow AR at {_num(d.get('speedup_vs_baseline'))}x vLLM AR)" if vllm else ""
        return f"serving plain decoding{ar}: {why}; {behind}"
    text = f"serving {d['setting']}: {d['select']} {_num(d.get(d['select']))}"
    if d["select"] == "speedup":
        text += f"x JetFlow AR ± {_num(d.get('spread'))}"
    if vllm:
        text += f", {_num(d.get('speedup_vs_vllm_ar'))}x vLLM AR (the fastest plain decoding installed)"
    if d.get("runner_up"):
        verdict = "exceeds" if d.get("decisive") else "does not exceed"
        text += (f"; its lead over {d['runner_up']} ({d['lead']:+.2f}) {verdict} the run-to-run spread "
                 f"({_num(d.get('lead_spread'))})")
    own = (d.get("losing") or {}).get(d["setting"])
    if own:  # (select=tau: τ decides, speed is reported)
        text += f"; slower than JetFlow AR on {', '.join(own)}"
    others = "; ".join(f"{k} on {', '.join(v)}" for k, v in (d.get("losing") or {}).items() if k != d["setting"])
    if others:
        text += f"; passed over for losing to JetFlow AR: {others}" if d["select"] == "speedup" else \
            f"; other finalists slower than JetFlow AR: {others}"
    return f"{text}; {behind}"


def evidence_scores(d: dict, metric: str) -> dict[str, float]:
    """Per eval set, the serving setting's score in a stored serving decision (plain decoding: 1.0, AR itself)."""
    if d["setting"] == "plain":
        return {ds: 1.0 for ds in d.get("sets") or {}} or {}
    return {ds: float(v[metric]) for ds, v in d.get("sets", {}).items() if v.get(metric) is not None}


def set_scores(run: Run, metric: str) -> dict[str, float]:
    """Per eval set, the best `metric` of the run's head at temperature 0, over all its tree settings. The
    head's rows are those of its method (`params.head_method`: causal or bidirectional), else any head's."""
    kind, best = GATE_METRICS[metric], {}
    own = run.data.params.get("head_method")
    methods = (own,) if own in HEAD_METHODS else HEAD_METHODS
    for key, value in run.data.metrics.items():
        k = parse_metric_key(key)
        if k is None or k.kind != kind or k.method not in methods or k.temperature != 0 or math.isnan(value):
            continue
        best[k.dataset] = max(value, best.get(k.dataset, -math.inf))
    return best


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _record(decision: PromotionDecision) -> PromotionDecision:
    # The verdict stays on the version, so the registry UI shows why a challenger did or did not move.
    summary = {k: v for k, v in asdict(decision).items() if k not in ("per_set", "name")}
    summary["at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    client().set_model_version_tag(decision.name, decision.challenger_version, GATE_TAG, json.dumps(summary))
    return decision


def promote(target_id: str, challenger_version: str, metric: str = "speedup", margin: float = 0.02,
            eval_sets: list[str] | None = None) -> PromotionDecision:
    """Move `champion` to `challenger_version` (a number or an alias such as "challenger") if the gate
    passes; the old champion stays reachable as `previous-champion`. `margin` is relative (0.02 = the
    challenger must be more than 2 % better). `eval_sets` restricts the comparison to those sets.
    Raises HeadNotFoundError / InvalidSettingError for bad input; a refusal is a decision, not an error."""
    if metric not in GATE_METRICS:
        raise InvalidSettingError(f"gate metric must be one of {', '.join(GATE_METRICS)}, got {metric!r}")
    if not margin >= 0:
        raise InvalidSettingError(f"margin must be >= 0 (relative, 0.02 = 2 %), got {margin}")
    name = registered_model_name(target_id)
    mv = get_version(name, str(challenger_version))
    version = str(mv.version)
    aliases = client().get_registered_model(name).aliases
    champion = str(aliases[CHAMPION]) if CHAMPION in aliases else None
    d = PromotionDecision(False, "", name, version, champion, metric, margin)

    if champion == version:
        d.reason = f"v{version} is already the champion"
        return d
    d.evidence = serving_evidence(name, version)
    if d.evidence is not None:  # the budget sweep's decision: its serving setting, timed against AR
        if d.evidence["setting"] == "plain":
            d.reason = (f"v{version} would be served with plain decoding: every setting its budget sweep timed is "
                        "slower than AR on some eval set (evidence below)")
            return _record(d)
        mine = evidence_scores(d.evidence, metric)
    else:
        runs = eval_runs(target_id, name, version, max_results=1)
        if not runs:
            d.reason = f"v{version} has no finished evaluation run; {_EVAL_HINT}"
            return _record(d)
        run = runs[0]
        d.challenger_run_id = run.info.run_id
        lossless = run.data.metrics.get(LOSSLESS)
        if lossless is None:
            d.reason = f"its latest evaluation (run {run.info.run_id}) did not check losslessness; {_EVAL_HINT}"
            return _record(d)
        if lossless < 1.0:
            d.reason = (f"v{version} is not lossless: its latest evaluation (run {run.info.run_id}) found outputs "
                        "that differ from greedy AR decoding")
            return _record(d)
        mine = set_scores(run, metric)
    if eval_sets:
        missing = sorted(set(eval_sets) - set(mine))
        if missing:
            d.reason = f"the challenger's latest evaluation has no {metric} on eval sets {missing}"
            return _record(d)
        mine = {s: mine[s] for s in eval_sets}
    if not mine:
        d.reason = f"the challenger's evaluation has no {metric} of the head at temperature 0"
        return _record(d)
    d.per_set = {s: {"challenger": v, "champion": None} for s, v in mine.items()}
    slower = sorted(s for s, v in mine.items() if metric == "speedup" and v < 1.0)
    if slower:  # served there it would cost every such request time: not promoted
        d.reason = (f"v{version} is slower than AR on {', '.join(f'{s} ({mine[s]:.2f}x)' for s in slower)}: a head "
                    "is promoted only when the setting it is served with loses to AR on no eval set")
        return _record(d)

    if champion is None:
        d.eval_sets, d.challenger_score = sorted(mine), _mean(mine.values())
        d.promoted, d.reason = True, f"no champion yet; v{version} is lossless and not slower than AR on " \
                                     f"{', '.join(d.eval_sets)}"
        return _move(d)

    found = _champion_scores(target_id, name, champion, metric, set(mine))
    if found is None:
        d.reason = (f"champion v{champion} has no evaluation on the same eval sets as the challenger "
                    f"({', '.join(sorted(mine))}); evaluate both on the same sets")
        return _record(d)
    theirs, d.champion_run_id = found
    common = sorted(set(mine) & set(theirs))
    d.eval_sets = common
    d.challenger_score = _mean(mine[s] for s in common)
    d.champion_score = _mean(theirs[s] for s in common)
    d.per_set = {s: {"challenger": mine[s], "champion": theirs[s]} for s in common}
    gain = d.challenger_score / d.champion_score - 1 if d.champion_score > 0 else math.inf
    if gain > margin:
        d.promoted = True
        d.reason = (f"lossless and {metric} {d.challenger_score:.3f} vs champion's {d.champion_score:.3f} "
                    f"({gain:+.1%} > margin {margin:.1%}) on {', '.join(common)}")
        return _move(d)
    d.reason = (f"{metric} {d.challenger_score:.3f} vs champion v{champion}'s {d.champion_score:.3f} "
                f"({gain:+.1%}) does not beat it by the margin {margin:.1%} on {', '.join(common)}")
    return _record(d)


def _champion_scores(target_id: str, name: str, champion: str, metric: str,
                     sets: set[str]) -> tuple[dict[str, float], str | None] | None:
    """The champion's per-set scores on some of `sets`: from its serving evidence when the sweep stored it,
    else from its latest evaluation run on shared sets (→ scores, that run's id); None when it has neither."""
    evidence = serving_evidence(name, champion)
    if evidence is not None:
        theirs = evidence_scores(evidence, metric)
        if set(theirs) & sets:
            return theirs, None
    for run in eval_runs(target_id, name, champion):  # newest first: the latest one on shared sets
        theirs = set_scores(run, metric)
        if set(theirs) & sets:
            return theirs, run.info.run_id
    return None


def _move(d: PromotionDecision) -> PromotionDecision:
    """previous-champion first, then champion: a crash in between leaves the old champion serving."""
    c = client()
    if d.champion_version is not None:
        c.set_registered_model_alias(d.name, PREVIOUS_CHAMPION, d.champion_version)
    c.set_registered_model_alias(d.name, CHAMPION, d.challenger_version)
    if str(c.get_registered_model(d.name).aliases.get(CHALLENGER)) == d.challenger_version:
        c.delete_registered_model_alias(d.name, CHALLENGER)  # it is the champion now
    return _record(d)
