"""Decoded τ of several heads on the same held-out prompts, in one run: every head × tree setting decoded
batched on the engine (greedy, fp32), each output checked against greedy AR. What vLLM compatibility costs
is the first use: the `demo-vllm` head (what vLLM's DFlash model can run) beside the full `demo` head.

    python benchmarks/heads_tau.py --heads demo,demo-vllm --prompts 40 \\
        --settings accum_logp:8,accum_logp:16,accum_logp:32,chain:8,chain:16,chain:32

A setting is ALGORITHM:BUDGET (width --width; a chain is capped at the head's block size). Prints a
markdown table (τ per set, lossless) and writes it with the raw numbers as JSON to --out. Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

from jetflow.data import spread_prompts
from jetflow.decode import DecodeConfig, DecodeStats, encode_prompt
from jetflow.decode.lossless import greedy_equal
from jetflow.errors import JetFlowError
from jetflow.eval.batched import decode_all
from jetflow.head import HeadRef
from jetflow.target import TargetModel
from jetflow.tree import TreeSpec


def parse_settings(text: str, width: int) -> list[TreeSpec]:
    """ALGORITHM:BUDGET items; the algorithm may carry its parameters as on the command line
    (`top2gap:margin=1.5:16`)."""
    out = []
    for item in text.split(","):
        algorithm, _, budget = item.strip().rpartition(":")
        out.append(TreeSpec.from_options(algorithm or "accum_logp", int(budget), width))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", default="demo,demo-vllm", help="comma-separated head references")
    p.add_argument("--sets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=40, help="prompts per set, spread over its eval split")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--settings", default="accum_logp:8,accum_logp:16,accum_logp:32,chain:8,chain:16,chain:32")
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=8, help="requests the engine decodes at once")
    p.add_argument("--out", default=str(Path.home() / ".jetflow" / "bench" / "heads_tau.json"))
    args = p.parse_args(argv)
    try:
        target = TargetModel.load(args.model)
        heads = {ref: HeadRef.parse(ref).load(target) for ref in args.heads.split(",")}
        specs = parse_settings(args.settings, args.width)
    except (JetFlowError, ValueError) as exc:
        print(f"heads_tau: error: {exc}", file=sys.stderr)
        return 2
    sets = args.sets.split(",")
    prompts = {s: [encode_prompt(target.tokenizer, it.chat) for it in spread_prompts(s, args.prompts)] for s in sets}
    ar_cfg = DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=args.new_tokens)
    reference = {s: [g.token_ids for g in decode_all(target, None, ids, [ar_cfg] * len(ids), args.batch_size)]
                 for s, ids in prompts.items()}
    rows = []
    for name, loaded in heads.items():
        block = loaded.head.config.block_size
        seen = set()
        for spec in specs:
            tree = spec.capped(block)
            if tree in seen:  # a chain past the block size is the same chain
                continue
            seen.add(tree)
            row = {"head": name, "tree": tree.key, "algorithm": tree.algorithm, "budget": tree.budget}
            lossless = True
            for s, ids in prompts.items():
                cfg = DecodeConfig(tree=tree, max_new_tokens=args.new_tokens)
                gens = decode_all(target, loaded.head, ids, [cfg] * len(ids), args.batch_size, task=s)
                total = DecodeStats()
                for g in gens:
                    total = total.merge(g.stats)
                row[f"tau/{s}"] = round(total.tau, 3)
                lossless &= all(greedy_equal(target, i, g.token_ids, r)
                                for i, g, r in zip(ids, gens, reference[s]))
            row["lossless"] = lossless
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"| head | tree | {' | '.join('τ ' + s for s in sets)} | lossless |",
             "|---|---|" + "---|" * len(sets) + "---|"]
    for r in rows:
        taus = " | ".join(f"{r['tau/' + s]:.2f}" for s in sets)
        lines.append(f"| {r['head']} | {r['tree']} | {taus} | {'yes' if r['lossless'] else 'NO'} |")
    table = "\n".join(lines)
    print(f"\n{args.prompts} prompts per set ({', '.join(sets)}), {args.new_tokens} tokens, greedy, "
          f"width {args.width}, {date.today()}\n\n{table}")
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "table": table}, indent=2) + "\n")
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
