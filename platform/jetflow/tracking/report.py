"""The evaluation report contract (what `jetflow.eval.compare.evaluate` returns and
`log_evaluation` logs), checked when it crosses into tracking, and the metric-key grammar
`<kind>/<dataset>/<method>/b<budget>w<width>t<temperature>` that plots and the promotion gate read back."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from jetflow.errors import InvalidSettingError

# The methods that measure the head itself; the others are baselines on the same prompts.
HEAD_METHODS = ("chain", "tree")
BASELINE_METHODS = ("ar", "hf_generate", "hf_prompt_lookup")
# MLflow's own rule for metric/param keys (letters, digits, _ - . / and spaces), at most 250 chars.
_KEY = re.compile(r"^[A-Za-z0-9_\-./ ]{1,250}$")
_METRIC_KEY = re.compile(
    r"^(?P<kind>[^/]+)/(?P<dataset>.+)/(?P<method>[^/]+)/b(?P<budget>\d+)w(?P<width>\d+)t(?P<temp>\d+(?:\.\d+)?)$")


def metric_suffix(budget: int, width: int, temperature: float) -> str:
    """`b32w7t0`, `b8w1t0.7`: the setting part of every per-setting metric key."""
    return f"b{int(budget)}w{int(width)}t{float(temperature):g}"


@dataclass(frozen=True)
class MetricKey:
    kind: str            # tau, speedup_vs_ar, speedup_vs_hf, e2e_speedup, tokens_per_s, accept_by_depth, ...
    dataset: str
    method: str
    budget: int
    width: int
    temperature: float

    @property
    def setting(self) -> str:
        return metric_suffix(self.budget, self.width, self.temperature)


def parse_metric_key(key: str) -> MetricKey | None:
    """`tau/mtbench/tree/b32w7t0` → MetricKey; None for flat keys such as `lossless`.
    The dataset may itself contain slashes (everything between the first and the last two parts)."""
    m = _METRIC_KEY.match(key)
    if m is None:
        return None
    return MetricKey(m["kind"], m["dataset"], m["method"], int(m["budget"]), int(m["width"]), float(m["temp"]))


class _Strict(BaseModel):
    # Unknown fields are kept (a newer evaluator may add some); the documented ones must type-check.
    model_config = ConfigDict(extra="allow")


class ReportTarget(_Strict):
    id: str
    revision: str


class ReportHead(_Strict):
    path: str | None = None
    uri: str | None = None
    config: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None


class ReportRow(_Strict):
    """One (dataset, method, setting) measurement. Times in ms per round; speedups are ratios."""
    dataset: str
    method: str
    algorithm: str | None = None
    budget: int
    width: int
    temperature: float
    tau: float | None = None
    tokens_per_s: float | None = None
    speedup_vs_ar: float | None = None
    speedup_vs_hf: float | None = None
    e2e_speedup: float | None = None
    predicted_speedup: float | None = None
    lossless: bool | None = None
    draft_ms: float | None = None
    verify_ms: float | None = None
    other_ms: float | None = None


class CostModel(_Strict):
    """Verify cost t_ms[i] (ms) of feeding n[i] tree tokens against context_tokens cached tokens."""
    device: str
    context_tokens: int
    n: list[int]
    t_ms: list[float]


class EvalReport(_Strict):
    target: ReportTarget
    head: ReportHead | None = None
    params: dict[str, str | int | float | bool] = {}
    metrics: dict[str, float]
    step_metrics: dict[str, list[float]] = {}
    rows: list[ReportRow] = []
    cost_model: CostModel | None = None

    @field_validator("params", "metrics", "step_metrics")
    @classmethod
    def _mlflow_keys(cls, value: dict) -> dict:
        bad = [k for k in value if not _KEY.match(k)]
        if bad:
            raise ValueError(f"keys {bad[:3]} are not valid MLflow keys (letters, digits, _ - . / and spaces, "
                             "at most 250 characters; write temperatures as t0 / t0.7)")
        return value

    @property
    def datasets(self) -> list[str]:
        """Eval sets this report measured: from rows, else from per-setting metric keys."""
        names = {r.dataset for r in self.rows}
        names |= {k.dataset for k in map(parse_metric_key, self.metrics) if k is not None}
        return sorted(names)


def validate_report(report: dict | EvalReport) -> EvalReport:
    """The report as a typed object, or InvalidSettingError naming the first field that breaks the contract."""
    if isinstance(report, EvalReport):
        return report
    try:
        return EvalReport.model_validate(report)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "report"
        raise InvalidSettingError(
            f"evaluation report does not follow the contract (see jetflow.tracking.report): {where}: {err['msg']}"
        ) from None
