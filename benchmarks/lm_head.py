"""The LM-head product's orientation (`jetflow.target.projection.RowProjector`), before and after, side by side.

Before: one fixed choice (one row: `x @ W^T` with a contiguous copy; more rows: `(W @ x^T)^T`, for the target's
LM head and the draft vocabulary's alike). After: the fastest of the three forms per row-count bucket, timed on
this machine at first use. Prints (1) each form's median ms per row count for both matrices and what the tuner
picked; (2) single-stream decoding of the same prompts, AR and speculative settings, the two modes alternating
prompt by prompt over `--passes` passes: tokens/s and the speedup over AR of each mode, the ratio after/before,
whether every output equals AR's of the same mode up to an fp32 tie (lossless, the evaluation's rule), and
whether each setting's text is the same in both modes (the forms round differently: a near-tie may flip).

    python benchmarks/lm_head.py --head demo                 # threads 1: what a sweep trial runs with
    python benchmarks/lm_head.py --head random --prompts 1 --max-new-tokens 8 --settings best_first:2
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch


def before() -> dict[int, str]:
    """The code before the tuner, as choices for every bucket (none left to time)."""
    from jetflow.target.projection import BUCKETS

    return {b: "transposed" if b == 1 else "swapped" for b in BUCKETS}


def form_table(projector, rows: list[int], reps: int) -> list[dict]:
    from jetflow.eval.timing import median_ms
    from jetflow.target.projection import FORMS

    out = []
    for m in rows:
        x = torch.randn(m, projector.weight.shape[1], dtype=projector.weight.dtype)
        ms = {f: median_ms(lambda f=f: projector.apply(x, f), reps) for f in FORMS}
        out.append({"rows": m, **ms, "picked": projector.form_for(m, x)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default="demo")
    p.add_argument("--sets", default="mtbench,humaneval")
    p.add_argument("--prompts", type=int, default=4, help="per set")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--settings", default="best_first:2,best_first:8", help="algorithm:budget,…")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from jetflow.data import load_prompts
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.decode.lossless import greedy_equal
    from jetflow.decode.prompt import encode_prompt
    from jetflow.head import HeadRef
    from jetflow.target import TargetModel
    from jetflow.tree import TreeSpec

    target = TargetModel.load("smollm2-135m")
    head = HeadRef.parse(args.head).load(target).head
    target.logits(torch.zeros(1, target.hidden_size))  # make the projectors
    head.output_logits(target, torch.zeros(1, target.hidden_size))
    projectors = {"target LM head": target._projector}
    if head.config.draft_vocab_size:
        projectors["draft vocabulary"] = head._lm_cache[1]
    tables = {name: form_table(pr, [1, 2, 3, 4, 7, 8, 16], args.reps) for name, pr in projectors.items()}
    tuned = {name: dict(pr.choices) for name, pr in projectors.items()}
    for name, table in tables.items():
        print(f"\n{name} {tuple(projectors[name].weight.shape)}, {args.threads} thread(s), median ms")
        print("| rows | linear | transposed | swapped | picked |\n|---|---|---|---|---|")
        for r in table:
            print(f"| {r['rows']} | {r['linear']:.2f} | {r['transposed']:.2f} | {r['swapped']:.2f} | {r['picked']} |")

    def mode(name: str) -> None:
        for key, pr in projectors.items():
            # the same dict each time: a bucket first met while decoding is timed once, not at every switch
            pr.choices = before() if name == "before" else tuned[key]

    settings = [("ar", TreeSpec(budget=1))] + [
        (s, TreeSpec(s.split(":")[0], int(s.split(":")[1]))) for s in args.settings.split(",")]
    prompts = [(ds, encode_prompt(target.tokenizer, item.chat)) for ds in args.sets.split(",")
               for item in load_prompts(ds, limit=args.prompts)]
    ar, spec = Decoder(target), Decoder(target, head)
    seconds = {(m, ds, s): 0.0 for m in ("before", "after") for ds in args.sets.split(",") for s, _ in settings}
    tokens = dict.fromkeys(seconds, 0)
    outputs: dict = {}
    for m in ("before", "after"):  # warm-up: every bucket both modes use
        mode(m)
        for s, tree in settings:
            (spec if tree.budget > 1 else ar).generate(prompts[0][1], DecodeConfig(tree=tree, max_new_tokens=8))
    for k in range(args.passes):
        for i, (ds, ids) in enumerate(prompts):
            for m in (("before", "after") if (i + k) % 2 == 0 else ("after", "before")):
                mode(m)
                for s, tree in settings:
                    t0 = time.perf_counter()
                    g = (spec if tree.budget > 1 else ar).generate(ids, DecodeConfig(tree=tree,
                                                                                    max_new_tokens=args.max_new_tokens))
                    seconds[(m, ds, s)] += time.perf_counter() - t0
                    tokens[(m, ds, s)] += len(g.token_ids)
                    outputs.setdefault((i, s, m), g.token_ids)
    rows = []
    for ds in args.sets.split(","):
        for s, _ in settings:
            r = {"set": ds, "setting": s}
            for m in ("before", "after"):
                r[f"tok_s_{m}"] = tokens[(m, ds, s)] / seconds[(m, ds, s)]
                r[f"speedup_{m}"] = r[f"tok_s_{m}"] / (tokens[(m, ds, "ar")] / seconds[(m, ds, "ar")])
            r["after_over_before"] = r["tok_s_after"] / r["tok_s_before"]
            mine = [i for i, (d, _) in enumerate(prompts) if d == ds]
            r["lossless"] = all(greedy_equal(target, prompts[i][1], outputs[(i, s, m)], outputs[(i, "ar", m)])
                                for i in mine for m in ("before", "after"))  # equal up to an fp32 tie
            r["same_across_modes"] = all(outputs[(i, s, "before")] == outputs[(i, s, "after")] for i in mine)
            rows.append(r)
    print(f"\nsingle-stream decoding, {args.prompts} prompts per set x {args.max_new_tokens} tokens, {args.passes} "
          f"passes, modes alternating prompt by prompt, {args.threads} thread(s)")
    print("| set | setting | tok/s before | tok/s after | speedup vs AR before | after | after / before | lossless | "
          "same text both modes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['setting']} | {r['tok_s_before']:.1f} | {r['tok_s_after']:.1f} | "
              f"{r['speedup_before']:.2f}x | {r['speedup_after']:.2f}x | {r['after_over_before']:.2f} | "
              f"{'yes' if r['lossless'] else 'NO'} | {'yes' if r['same_across_modes'] else 'NO'} |")
    if args.out:
        out = {"date": date.today().isoformat(), "args": vars(args), "forms": tables, "picked": tuned,
               "decode": rows, "statistics_median_of": args.reps}
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
