"""Transformers' `sdpa` attention against ours (`jetflow.target.attention`: grouped-query heads packed, not
repeated), side by side in one process: the engine's steady step time for B rows that each verify an N-node
tree (N = 1: plain decoding). The two alternate step by step on the same engine (pairs, the order swapped
each pair), so both see the same batch, context lengths and machine state; per point the median step time
of each and the median of the paired ratios. Outputs are the same bit for bit (tests/test_target.py).

    python benchmarks/attention.py --head demo
    python benchmarks/attention.py --head random --rows 1,8 --budgets 1,8 --steps 4   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path


def paired_steps(target, head, rows: int, budget: int, context: int, steps: int, impls: list[str]) -> dict:
    """`steps` pairs of engine steps, one per attention implementation, with `rows` requests of `context`
    prompt tokens all decoding → {implementation: [ms, ...]}."""
    from jetflow.decode import DecodeConfig
    from jetflow.engine import Engine, EngineConfig
    from jetflow.tree import TreeSpec

    engine = Engine(target, head, EngineConfig(max_slots=rows, prefill_chunk=context, prefill_tokens=context * rows))
    tree = TreeSpec("accum_logp", budget, 7) if budget > 1 else TreeSpec(budget=1)
    cfg = DecodeConfig(tree=tree, max_new_tokens=engine.max_len - context - head.config.block_size - 2)
    vocab = target.vocab_size
    for r in range(rows):
        engine.add([(17 * r + 31 * i + 5) % vocab for i in range(context + 1)], cfg)
    while engine.prefilling or engine.waiting:
        engine.step()
    for impl in impls:  # warm-up
        target.model.set_attn_implementation(impl)
        engine.step()
    samples: dict = {impl: [] for impl in impls}
    for k in range(steps):
        for impl in (impls if k % 2 == 0 else impls[::-1]):
            target.model.set_attn_implementation(impl)
            t0 = time.perf_counter()
            engine.step()
            samples[impl].append((time.perf_counter() - t0) * 1000)
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--head", default="demo", help="head folder, name, models:/ URI, or 'random'")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--budgets", default="1,8,32")
    p.add_argument("--context", type=int, default=200, help="prompt tokens per row")
    p.add_argument("--steps", type=int, default=16, help="timed step pairs per point")
    p.add_argument("--out", default=None, help="write the report JSON here")
    args = p.parse_args(argv)

    from jetflow.eval.cost_model import device_name
    from jetflow.head import HeadRef
    from jetflow.target import TargetModel
    from jetflow.target.attention import GQA_SDPA

    target = TargetModel.load(args.model)
    head = HeadRef.parse(args.head).load(target).head
    points = [(int(r), int(n)) for r in args.rows.split(",") for n in args.budgets.split(",")]
    rows = []
    print(f"engine step ms, {args.context} prompt tokens per row, {args.steps} step pairs per point "
          f"({device_name(target.device)})\n")
    print("| rows | tree nodes | HF sdpa ms | ours ms | ours / HF (median of pairs) |")
    print("|---|---|---|---|---|")
    for pt in points:
        ms = paired_steps(target, head, *pt, args.context, args.steps, ["sdpa", GQA_SDPA])
        hf, ours = ms["sdpa"], ms[GQA_SDPA]
        ratio = statistics.median(o / h for o, h in zip(ours, hf))
        rows.append({"rows": pt[0], "nodes": pt[1], "hf_sdpa_ms": statistics.median(hf),
                     "gqa_sdpa_ms": statistics.median(ours), "ratio": ratio, "steps": {"hf_sdpa": hf, "gqa_sdpa": ours}})
        print(f"| {pt[0]} | {pt[1]} | {statistics.median(hf):.1f} | {statistics.median(ours):.1f} | {ratio:.2f} |",
              flush=True)
    target.model.set_attn_implementation(GQA_SDPA)
    if args.out:
        report = {"date": str(date.today()), "device": device_name(target.device), "head": args.head,
                  "context": args.context, "steps": args.steps, "points": rows}
        Path(args.out).expanduser().write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
