"""Regeneration throughput: fixed batches vs continuous batching, side by side on one shard.

    python benchmarks/regen_loop.py [--prompts 64] [--batch 32] [--max-new-tokens 160] [--repeats 1]

"fixed": the shard is cut into batches of `--batch` prompts, each decoded until its last row stops
(rows that stop leave the batch). "continuous": at most `--batch` rows decode together and waiting
prompts take the freed slots. Both get the same prompts (the `demo` preset's first shard by default)
and must produce the same greedy tokens; the script prints response tokens/s for each and the ratio.
"""

from __future__ import annotations

import argparse
import time

from jetflow.data.batchgen import generate_batch
from jetflow.data.regenerate import RegenConfig, cut_at_stop, encode_shard, select_prompts
from jetflow.decode.prompt import stop_token_ids
from jetflow.target import TargetModel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=1, help="alternate the two modes this many times")
    args = p.parse_args()

    target = TargetModel.load("smollm2-135m")
    tok = target.tokenizer
    cfg = RegenConfig(num_prompts=args.prompts, max_new_tokens=args.max_new_tokens)
    encoded, _ = encode_shard(cfg, select_prompts(cfg), tok)
    prompts = [ids for _, ids in encoded]
    stops, pad = stop_token_ids(target), tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def fixed():
        out = []
        for b in range(0, len(prompts), args.batch):
            out += generate_batch(target, prompts[b : b + args.batch], args.max_new_tokens, stops, pad)
        return out

    def continuous():
        return generate_batch(target, prompts, args.max_new_tokens, stops, pad, max_batch=args.batch)

    rates: dict[str, list[float]] = {"fixed": [], "continuous": []}
    outputs = {}
    for _ in range(args.repeats):
        for name, run in (("fixed", fixed), ("continuous", continuous)):
            t0 = time.perf_counter()
            outputs[name] = run()
            seconds = time.perf_counter() - t0
            tokens = sum(len(cut_at_stop(r, stops)[0]) for r in outputs[name])
            rates[name].append(tokens / seconds)
            print(f"{name:>10}: {len(prompts)} prompts, {tokens} response tokens in {seconds:.1f} s "
                  f"= {tokens / seconds:.1f} tok/s", flush=True)
    same = sum(a == b for a, b in zip(outputs["fixed"], outputs["continuous"]))
    print(f"identical rows: {same}/{len(prompts)}")
    best = {k: max(v) for k, v in rates.items()}
    print(f"continuous / fixed: {best['continuous'] / best['fixed']:.2f}x (best of {args.repeats})")


if __name__ == "__main__":
    main()
