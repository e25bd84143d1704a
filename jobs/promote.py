"""Move the `champion` alias of a target's registered heads to a challenger, if the gate passes.

    python jobs/promote.py --target smollm2-135m --version 3
    python jobs/promote.py --version challenger --metric tau --margin 0.05
    python jobs/promote.py --version 3 --eval-sets mtbench,humaneval

The gate reads the latest evaluation runs of the challenger and the champion (jobs/evaluate.py logs them,
tagged with the registered version): the challenger must be lossless and beat the champion's speedup (or
τ) on the same eval sets by more than the relative margin. With no champion yet, a lossless challenger
becomes champion. The old champion stays reachable as alias `previous-champion`.

Exit status: 0 promoted (or already the champion), 1 refused (the reason is printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from jetflow.errors import JetFlowError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target id whose registered heads to promote among")
    p.add_argument("--version", required=True, help="challenger: a version number, or an alias (e.g. challenger)")
    p.add_argument("--metric", default="speedup", choices=["speedup", "tau"],
                   help="what the challenger must beat the champion on (default speedup vs AR)")
    p.add_argument("--margin", type=float, default=0.02, help="relative margin, 0.02 = 2%% better (default 0.02)")
    p.add_argument("--eval-sets", default="", help="comma-separated eval sets to compare on (default: all shared)")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    args = p.parse_args(argv)
    try:
        from jetflow.tracking import promote

        sets = [s.strip() for s in args.eval_sets.split(",") if s.strip()] or None
        decision = promote(args.target, args.version, metric=args.metric, margin=args.margin, eval_sets=sets)
    except JetFlowError as exc:
        print(f"promote: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(decision), indent=2) if args.json else decision.summary())
    return 0 if decision.promoted or decision.champion_version == decision.challenger_version else 1


if __name__ == "__main__":
    sys.exit(main())
