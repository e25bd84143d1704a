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

from jetflow.errors import HeadNotFoundError, JetFlowError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="head folder, or a name under $JETFLOW_HOME/heads/")
    p.add_argument("--target", default=None, help="target id (default: the one in the head's config.json)")
    p.add_argument("--revision", default=None, help="target revision (default: the one in the head's config.json)")
    p.add_argument("--alias", default=None, choices=["challenger"],
                   help="also point this alias at the version (skipped if it is already the champion)")
    p.add_argument("--run-name", default=None, help="name of the training run (default: train <folder name>)")
    args = p.parse_args(argv)
    try:
        from jetflow.head.io import CONFIG, resolve_head_path
        from jetflow.tracking import CHAMPION, register_head_folder, registered_model_name, set_alias
        from jetflow.tracking.store import client

        head = resolve_head_path(args.head)
        try:
            recorded = json.loads((head / CONFIG).read_text()).get("jetflow", {})
        except (OSError, ValueError):
            raise HeadNotFoundError(f"{head} has no readable {CONFIG}; pass a folder written by jobs/train.py") from None
        target = args.target or recorded.get("target_model_id") or "smollm2-135m"
        revision = args.revision or recorded.get("target_revision") or "unknown"
        version, created = register_head_folder(head, target, revision, run_name=args.run_name)
        name = registered_model_name(target)
        note = ""
        if args.alias and str(client().get_registered_model(name).aliases.get(CHAMPION)) == version:
            note = f" (already the {CHAMPION}; alias {args.alias} not set)"
        elif args.alias:
            set_alias(name, args.alias, version)
            note = f" (alias {args.alias})"
    except JetFlowError as exc:
        print(f"register: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'registered' if created else 'already registered:'} {head} as models:/{name}/{version}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
