"""Log an existing head folder as a training run and register it as a model version — once: a folder
whose weights are already registered keeps its version, so reruns do not pile up duplicates.

    python jobs/register.py --head demo                        # $JETFLOW_HOME/heads/demo
    python jobs/register.py --head ~/.jetflow/heads/demo --alias challenger

The target id and revision default to those recorded in the head's config.json. The version gets
lineage tags (training run, data manifest hash, git commit, architecture, target). `champion` is not
settable here: evaluate the version (jobs/evaluate.py) and run jobs/promote.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from jetflow.config_cli import add_dataclass_args, build_config, parse_args

from jetflow.errors import HeadNotFoundError, JetFlowError


def main(argv: list[str] | None = None) -> int:
    from jetflow.tracking.jobs import RegisterJob

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, RegisterJob, "registration")
    args = parse_args(p, argv)
    try:
        from jetflow.head.io import CONFIG
        from jetflow.head.ref import HeadRef
        from jetflow.tracking import CHAMPION, register_head_folder, registered_model_name, set_alias
        from jetflow.tracking.store import client

        job = build_config(RegisterJob, args)
        head = HeadRef.parse(job.head).resolve()
        try:
            recorded = json.loads((head / CONFIG).read_text()).get("jetflow", {})
        except (OSError, ValueError):
            raise HeadNotFoundError(f"{head} has no readable {CONFIG}; pass a folder written by jobs/train.py") from None
        target = job.target or recorded.get("target_model_id") or "smollm2-135m"
        revision = job.revision or recorded.get("target_revision") or "unknown"
        version, created = register_head_folder(head, target, revision, run_name=job.run_name)
        name = registered_model_name(target)
        note = ""
        if job.alias and str(client().get_registered_model(name).aliases.get(CHAMPION)) == version:
            note = f" (already the {CHAMPION}; alias {job.alias} not set)"
        elif job.alias:
            set_alias(name, job.alias, version)
            note = f" (alias {job.alias})"
    except JetFlowError as exc:
        print(f"register: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'registered' if created else 'already registered:'} {head} as models:/{name}/{version}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
