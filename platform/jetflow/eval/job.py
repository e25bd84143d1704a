"""`jobs/evaluate.py` as a typed job: which target and heads, the evaluation grid (`EvalConfig`), where the
report goes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from jetflow.errors import InvalidSettingError
from jetflow.eval.config import EvalConfig


@dataclass
class EvaluateJob:
    model: str = "smollm2-135m"              # target: bundled name, local HF folder or hub id
    device: str | None = None                # cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)
    dtype: str | None = None                 # fp32, bf16 or fp16 (default: bf16 on a GPU, fp32 on a CPU)
    head: str | None = None                  # causal head: folder, name under $JETFLOW_HOME/heads, models:/NAME@ALIAS,
                                             # models:/NAME/VERSION or 'random'; unset = the baselines only
    bidirectional_head: str | None = None    # a second, bidirectional (DFlash) head, same forms
                                             # ('random-bidirectional' for random init)
    eval: EvalConfig = field(default_factory=EvalConfig)
    out: str | None = None                   # report JSON path (default $JETFLOW_HOME/eval/<target>-<time>.json)
    mlflow: bool = True                      # log the report to MLflow as an evaluation run
    run_name: str | None = None              # MLflow run name
    parent_run_id: str | None = None         # MLflow parent run (e.g. the sweep's run)



def run_evaluation_job(job: EvaluateJob) -> int:
    """Evaluate, print the table, write the report, log it to MLflow. Exit status: 0, or 1 when a greedy
    output of our decoder differed from AR greedy (a lossless failure)."""
    from jetflow.eval import evaluate
    from jetflow.eval.table import report_markdown
    from jetflow.head import HeadRef
    from jetflow.paths import jetflow_home
    from jetflow.target import TargetModel
    from jetflow.target.placement import placement

    cfg = job.eval
    if cfg.vllm:  # vLLM installed (.venv-vllm on a CPU, the [vllm] extra on a GPU): say so before loading anything
        from jetflow.vllm import require_vllm

        require_vllm("the vLLM rows of an evaluation (--vllm)")
    refs = [HeadRef.parse(spec) for spec in (job.head, job.bidirectional_head) if spec]
    # A missing head, or a head in the wrong slot, fails before the target loads.
    if job.head and not HeadRef.parse(job.head).is_causal():
        raise InvalidSettingError(f"--head {job.head} is a bidirectional head; pass it as --bidirectional-head")
    if job.bidirectional_head and HeadRef.parse(job.bidirectional_head).is_causal():
        raise InvalidSettingError(f"--bidirectional-head {job.bidirectional_head} is a causal head; pass it as --head")
    device, dtype = placement(job.device, job.dtype)
    target = TargetModel.load(job.model, device=device, dtype=dtype)
    heads = [ref.load(target, cfg.seed) for ref in refs]
    report = evaluate(target, heads, cfg, progress=True)

    print(report_markdown(report))
    out = Path(job.out) if job.out else (
        jetflow_home() / "eval" / f"{target.model_id.replace('/', '--')}-{datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nreport: {out}")
    if job.mlflow:
        from jetflow.tracking import log_evaluation

        run_id = log_evaluation(report, run_name=job.run_name, parent_run_id=job.parent_run_id)
        print(f"MLflow run: {run_id}")
    return 0 if report["metrics"].get("lossless", 1.0) == 1.0 else 1
