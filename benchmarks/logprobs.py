"""What logprobs cost, side by side in one run: the batched engine's tokens/s at 1 and at 8 clients (closed loops,
as one replica serves them, `benchmarks/engine.py`'s ClosedLoop stepped in lockstep, each on its own clock), plain
and speculative, without logprobs and with `logprobs` = 1 and 5 (every request asks); and what prompt logprobs
(`echo` with `logprobs`, lm-eval's loglikelihood request: `max_tokens` 1, decoded plainly) cost per request, with
and without them.

    python benchmarks/logprobs.py --head demo --budget 8
    python benchmarks/logprobs.py --head random --new-tokens 8 --requests 2   # a quick look

Prints a markdown table and writes report.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import ClosedLoop, lockstep  # noqa: E402  (benchmarks/engine.py)

from jetflow.data import spread_prompts  # noqa: E402
from jetflow.decode import DecodeConfig, encode_prompt  # noqa: E402
from jetflow.engine import Engine, EngineConfig  # noqa: E402
from jetflow.tree import TreeSpec  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--head", default="demo", help="head folder, name, models:/ URI, or 'random'")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=2, help="requests per loop, times its concurrency")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--logprobs", default="1,5", help="the logprobs counts to compare with none")
    p.add_argument("--echo-prompts", type=int, default=8, help="echo requests per loop (HumanEval prompts)")
    p.add_argument("--graphs", default="auto", help="engine steps: off (eager), compile, auto (this host's verdict)")
    p.add_argument("--out", default=str(Path.home() / ".jetflow" / "bench" / "logprobs"))
    args = p.parse_args(argv)

    from jetflow.head import HeadRef
    from jetflow.target import TargetModel

    target = TargetModel.load(args.model)
    head = HeadRef.parse(args.head).load(target).head
    tok = target.tokenizer
    chats = [encode_prompt(tok, item.chat) for s in ("mtbench", "humaneval") for item in spread_prompts(s, 4)]
    levels = [int(c) for c in args.concurrency.split(",")]
    ks = [None] + [int(k) for k in args.logprobs.split(",")]
    modes = {"plain": (None, TreeSpec(budget=1)), "speculative": (head, TreeSpec(budget=args.budget))}
    slots = max(levels)

    loops, keys = [], []
    for c in levels:
        for mode, (h, tree) in modes.items():
            for k in ks:
                engine = Engine(target, h, EngineConfig(max_slots=slots, policy="fixed", graphs=args.graphs))
                engine.generate([chats[0]], DecodeConfig(tree=tree, max_new_tokens=4))  # warm-up
                cfg = DecodeConfig(tree=tree, max_new_tokens=args.new_tokens, logprobs=k)
                loops.append(ClosedLoop(engine, chats, cfg, c, args.requests * c))
                keys.append((c, mode, k))
    t0 = time.perf_counter()
    results = lockstep(loops)
    decode = {f"{c}/{mode}/{k}": r for (c, mode, k), r in zip(keys, results)}

    # prompt logprobs: lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1), plain decoding
    code = [tok.encode(item.text) for item in spread_prompts("humaneval", args.echo_prompts)]
    echo_loops, echo_keys = [], []
    for c in levels:
        for k in (None, 1):
            engine = Engine(target, head, EngineConfig(max_slots=slots, policy="fixed", graphs=args.graphs))
            cfg = DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=1, logprobs=k, prompt_logprobs=k)
            engine.generate([code[0]], cfg)  # warm-up
            echo_loops.append(ClosedLoop(engine, code, cfg, c, max(args.echo_prompts, c)))
            echo_keys.append((c, k))
    echo = {f"{c}/{k}": r for (c, k), r in zip(echo_keys, lockstep(echo_loops))}
    prompt_tokens = sum(len(x) for x in code) / len(code)

    report = {"model": args.model, "head": args.head, "budget": args.budget, "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(), "device": str(target.device), "graphs": loops[0].engine.graphs,
              "seconds": time.perf_counter() - t0,
              "decode": decode, "echo": echo, "echo_prompt_tokens": prompt_tokens}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(markdown(report, levels, ks, list(modes)))
    return 0


def markdown(report: dict, levels: list[int], ks: list, modes: list[str]) -> str:
    def fmt(k):
        return "none" if k is None else f"k={k}"

    lines = [f"{report['model']}, head {report['head']}, budget {report['budget']}, {report['new_tokens']} new "
             f"tokens, {report['threads']} threads, {report['device']}, graphs={report['graphs']}: aggregate tokens/s "
             "(each loop on its own clock, prefill included)", "",
             "| clients | mode | " + " | ".join(f"logprobs {fmt(k)}" for k in ks) + " | cost of the largest |",
             "|---:|---|" + "---:|" * (len(ks) + 1)]
    for c in levels:
        for mode in modes:
            rates = [report["decode"][f"{c}/{mode}/{k}"]["tokens_per_s"] for k in ks]
            lines.append(f"| {c} | {mode} | " + " | ".join(f"{r:.1f}" for r in rates)
                         + f" | {100 * (1 - rates[-1] / rates[0]):+.1f} % |")
    lines += ["", f"echo requests (lm-eval loglikelihood: max_tokens 1, plain; {report['echo_prompt_tokens']:.0f}-"
                  "token HumanEval prompts): requests/s", "",
              "| clients | no logprobs | echo + logprobs 1 | cost |", "|---:|---:|---:|---:|"]
    for c in levels:
        a, b = (report["echo"][f"{c}/{k}"] for k in (None, 1))
        ra, rb = a["requests"] / a["seconds"], b["requests"] / b["seconds"]
        lines.append(f"| {c} | {ra:.2f} | {rb:.2f} | {100 * (1 - rb / ra):+.1f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
