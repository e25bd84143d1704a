"""The evaluation report contract (what `jetflow.eval.compare.evaluate` returns and
`log_evaluation` logs), checked when it crosses into tracking. Its metric keys follow the grammar of
`jetflow.metrics.metric_key`."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from jetflow.errors import InvalidSettingError
from jetflow.metrics import parse_metric_key
from jetflow.tree import TreeSpec

# MLflow's own rule for metric/param keys (letters, digits, _ - . / and spaces), at most 250 chars.
_KEY = re.compile(r"^[A-Za-z0-9_\-./ ]{1,250}$")


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
    """One (dataset, method, setting) measurement. Times in ms per generated token; speedups are ratios.
    `tree` is the head rows' TreeSpec as a dict (None for the baselines)."""
    dataset: str
    method: str
    algorithm: str | None = None
    budget: int
    width: int
    temperature: float
    tree: dict[str, Any] | None = None

    @property
    def spec(self) -> TreeSpec | None:
        return TreeSpec.from_dict(self.tree) if self.tree else None
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
    work_digest: int | None = None  # `DecodeStats.work_digest` of the batched pass: equal digests, equal work


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
