"""Runs lm-evaluation-harness (`lm_eval.simple_evaluate`) for tests/test_lm_eval.py, in a process of its own:

    python tests/lm_eval_runs.py RUNS.json OUT.json

RUNS.json: {"include_path": DIR, "runs": {name: {"model", "model_args", "tasks", "apply_chat_template"}}}. Only the
tasks under DIR are indexed (not lm-eval's ~10k bundled ones). OUT.json: per run lm-eval's score table (as its CLI
prints it), the metrics, and per task each document's responses (log-likelihood and is-greedy per choice, or the
generated text).
"""

from __future__ import annotations

import json
import sys


def main(runs_path: str, out_path: str) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    spec = json.loads(open(runs_path).read())
    tasks = TaskManager(include_path=spec["include_path"], include_defaults=False)
    out = {}
    for name, run in spec["runs"].items():
        res = lm_eval.simple_evaluate(model=run["model"], model_args=run["model_args"], tasks=run["tasks"],
                                      task_manager=tasks, log_samples=True, device="cpu",
                                      apply_chat_template=run.get("apply_chat_template", False))
        out[name] = {
            "table": make_table(res),
            "metrics": {task: {k: v for k, v in m.items() if isinstance(v, (int, float))}
                        for task, m in res["results"].items()},
            "items": {task: {str(s["doc_id"]): s["resps"] for s in samples}
                      for task, samples in res["samples"].items()},
        }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
