"""Move the `champion` alias of a target's registered heads to a challenger, if the gate passes.

    python jobs/promote.py --target smollm2-135m --version 3
    python jobs/promote.py --version challenger --metric tau --margin 0.05
    python jobs/promote.py --version 3 --eval-sets mtbench,humaneval

The gate reads the latest evaluation runs of the challenger and the champion (jobs/evaluate.py logs them,
tagged with the registered version): the challenger must be lossless and beat the champion's speedup (or
τ) on the same eval sets by more than the relative margin. With no champion yet, a lossless challenger
becomes champion. The old champion stays reachable as alias `previous-champion`.

Running Serve replicas that follow the alias (serve/app.py, serve/config.yaml with no explicit head) re-read it
every `champion_poll_s` (30 s by default) and serve the new champion from their next request on; requests
already running finish on the head they started with. No redeploy.

Exit status: 0 promoted (or already the champion), 1 refused (the reason is printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from jetflow.config_cli import add_dataclass_args, build_config, parse_args
from jetflow.errors import JetFlowError


def main(argv: list[str] | None = None) -> int:
    from jetflow.tracking.jobs import PromoteJob

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p, PromoteJob, "promotion")
    args = parse_args(p, argv)
    try:
        from jetflow.tracking import promote

        job = build_config(PromoteJob, args)
        decision = promote(job.target, job.version, metric=job.metric, margin=job.margin,
                           eval_sets=job.eval_sets or None)
    except JetFlowError as exc:
        print(f"promote: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(decision), indent=2) if job.json else decision.summary())
    if decision.promoted and not job.json:
        print(f"serving: replicas following {decision.name}@champion serve v{decision.challenger_version} from "
              "their next request after their next registry read (every champion_poll_s, 30 s by default); "
              "running requests finish on the head they started with")
    return 0 if decision.promoted or decision.champion_version == decision.challenger_version else 1


if __name__ == "__main__":
    sys.exit(main())
