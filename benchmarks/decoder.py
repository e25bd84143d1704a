"""Decoder micro-benchmarks on the bundled target (METHOD.md §7 cost questions), one run, side by side:

1. target verify time t(N) for N tree nodes over ~300 cached tokens: the body forward under a tree
   mask plus the LM head for the nodes an acceptance walk visits (what the decoder pays), and the
   naive variant computing LM-head logits for all N nodes;
2. draft-head forward time (head + LM head on D rows + top-W);
3. the decoder's per-round overhead beyond (draft forward + verify forward), as a fraction of a round;
4. tokens/s of our AR loop vs HF `generate`, decode only (prefill excluded) and end to end.

Prints a markdown report and writes it (plus raw JSON) under $JETFLOW_HOME/bench/.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date

import torch

from jetflow.data import load_prompts
from jetflow.decode import DecodeConfig, Decoder, encode_prompt
from jetflow.tree import TreeSpec
from jetflow.eval.cost_model import time_verify
from jetflow.eval.timing import median_ms
from jetflow.head import DraftHead, HeadConfig
from jetflow.paths import jetflow_home
from jetflow.target import TargetModel


def verify_curve(target: TargetModel, sizes, past: int, reps: int, walk_rows: int) -> list[dict]:
    """The cost model's timing of the real tree-masked verify (jetflow.eval.cost_model.time_verify)."""
    rows = [{"N": t.n, "body_ms": t.body_ms, "verify_ms": t.verify_ms, "naive_ms": t.naive_ms}
            for t in time_verify(target, sizes, past, reps, walk_rows)]
    base = rows[0]["verify_ms"]
    for r in rows:
        r["ratio"] = r["verify_ms"] / base
    return rows


@torch.inference_mode()
def head_forward(target: TargetModel, head: DraftHead, past: int, reps: int) -> float:
    decoder = Decoder(target, head)
    cfg = DecodeConfig(tree=TreeSpec(budget=32), max_new_tokens=4)
    state = decoder._prefill(list(range(100, 100 + past + 1)), cfg)
    return median_ms(lambda: decoder.draft(state, cfg), reps)


def decode_overhead(target, head, prompts, budgets, new_tokens) -> list[dict]:
    out = []
    for budget in budgets:
        decoder = Decoder(target, head)
        stats = None
        for ids in prompts:
            s = decoder.generate(ids, DecodeConfig(tree=TreeSpec(budget=budget), max_new_tokens=new_tokens)).stats
            stats = s if stats is None else stats.merge(s)
        out.append({"budget": budget, "rounds": stats.rounds, "round_ms": stats.decode_s / stats.rounds * 1000,
                    "draft_ms": stats.draft_s / stats.rounds * 1000, "verify_ms": stats.verify_s / stats.rounds * 1000,
                    "overhead_ms": stats.overhead_s / stats.rounds * 1000,
                    "overhead_frac": stats.overhead_s / stats.decode_s})
    return out


def ar_vs_hf(target, prompts, new_tokens) -> dict:
    ours_decode = ours_total = hf_decode = hf_total = 0.0
    n_ours = n_hf = 0
    decoder = Decoder(target)
    for ids in prompts:
        r = decoder.generate(ids, DecodeConfig(max_new_tokens=new_tokens))
        ours_decode += r.stats.decode_s
        ours_total += r.stats.total_s
        n_ours += r.stats.new_tokens
        x = torch.tensor([ids])
        kw = dict(do_sample=False, pad_token_id=target.tokenizer.pad_token_id)
        with torch.inference_mode():
            t0 = time.perf_counter()
            target.model.generate(x, max_new_tokens=1, **kw)
            t_prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            g = target.model.generate(x, max_new_tokens=new_tokens, **kw)
            t_all = time.perf_counter() - t0
        n = g.shape[1] - len(ids)
        hf_total += t_all
        hf_decode += t_all - t_prefill
        n_hf += n
    return {"ours_decode_tok_s": n_ours / ours_decode, "hf_decode_tok_s": (n_hf - len(prompts)) / hf_decode,
            "ours_e2e_tok_s": n_ours / ours_total, "hf_e2e_tok_s": n_hf / hf_total,
            "tokens": n_ours}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--past", type=int, default=300, help="cached tokens before the verified tree")
    p.add_argument("--sizes", default="1,8,16,32,64,128,256")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--walk-rows", type=int, default=2, help="LM-head rows an acceptance walk computes")
    p.add_argument("--prompts", type=int, default=4, help="MT-Bench + HumanEval prompts for decode runs")
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args()

    torch.manual_seed(0)
    target = TargetModel.load(args.model)
    head = DraftHead(HeadConfig.for_target(target))
    items = load_prompts("mtbench", limit=args.prompts // 2) + load_prompts("humaneval", limit=args.prompts - args.prompts // 2)
    prompts = [encode_prompt(target.tokenizer, it.chat) for it in items]

    sizes = [int(s) for s in args.sizes.split(",")]
    report = {
        "date": date.today().isoformat(), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__, "model": args.model, "past": args.past,
        "verify": verify_curve(target, sizes, args.past, args.reps, args.walk_rows),
        "head_forward_ms": head_forward(target, head, args.past, args.reps * 3),
        "head_params_m": head.num_parameters() / 1e6,
        "overhead": decode_overhead(target, head, prompts, [8, 32], args.new_tokens),
        "ar_vs_hf": ar_vs_hf(target, prompts, args.new_tokens),
    }
    lines = [f"### Decoder micro-benchmarks ({report['date']}, {args.model}, fp32, {report['machine']})", "",
             f"Verify t(N) over {args.past} cached tokens (body + LM head for {args.walk_rows} walk rows; "
             "naive = LM head on all N):", "",
             "| N | body ms | verify ms | t(N)/t(1) | naive ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['body_ms']:.1f} | {r['verify_ms']:.1f} | {r['ratio']:.2f} | {r['naive_ms']:.1f} |"
              for r in report["verify"]]
    lines += ["", f"Draft head forward ({report['head_params_m']:.1f} M params, block 16, + LM head on 15 rows + "
              f"top-7): {report['head_forward_ms']:.1f} ms", "",
              "| budget | rounds | round ms | draft ms | verify ms | overhead ms | overhead / round |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {o['budget']} | {o['rounds']} | {o['round_ms']:.1f} | {o['draft_ms']:.1f} | {o['verify_ms']:.1f} | "
              f"{o['overhead_ms']:.2f} | {o['overhead_frac']:.1%} |" for o in report["overhead"]]
    a = report["ar_vs_hf"]
    lines += ["", f"AR tokens/s ({a['tokens']} tokens, {len(prompts)} prompts): ours {a['ours_decode_tok_s']:.1f} "
              f"vs HF generate {a['hf_decode_tok_s']:.1f} decode-only "
              f"({a['ours_decode_tok_s'] / a['hf_decode_tok_s']:.2f}x); end to end {a['ours_e2e_tok_s']:.1f} vs "
              f"{a['hf_e2e_tok_s']:.1f}"]
    text = "\n".join(lines)
    print(text)
    out = jetflow_home() / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "decoder.json").write_text(json.dumps(report, indent=2))
    (out / "decoder.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
