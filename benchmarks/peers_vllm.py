"""vLLM's rows of benchmarks/peers.py, in process: run by that harness with the vLLM venv's python
(`.venv-vllm/bin/python`, `make setup-vllm`), one process per row so each engine's memory and worker processes
go with it.

    .venv-vllm/bin/python benchmarks/peers_vllm.py --model DIR --prompts P.json --out R.json [--spec-head EXPORTED]

`vllm.LLM(model=DIR, dtype="float32")` with vLLM's own defaults otherwise (compiled, not eager: the peer as a
user runs it; `jetflow.vllm.generate.generate_greedy` forces eager for short checks, so it is not reused here),
`max_num_seqs` = the concurrent clients and prefix caching off (the same prompts run at every client count: a
cache would skip their prefill the second time). Greedy, the target's stop ids.
- 1 client: the prompts one after another, one `generate` call each;
- N clients: all prompts in one `generate` call, at most N in flight (`max_num_seqs`), as N closed-loop
  clients would keep them.
Seconds are `generate` wall time, prefill included. Writes {"clients": {"1": {...}, "N": {...}}, ...} as JSON.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target's HF folder")
    p.add_argument("--prompts", required=True,
                   help='JSON: {"prompts": [[ids]], "stop_ids": [ids], "max_new_tokens": N}')
    p.add_argument("--clients", type=int, default=8, help="concurrent clients of the second measurement")
    p.add_argument("--spec-head", default=None, help="a head written by `jetflow export --to vllm`: DFlash chain")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import vllm

    from jetflow.vllm.baseline import exported_depth
    from jetflow.vllm.engine import engine_kwargs, spec_counters
    from jetflow.vllm.generate import dflash_config

    spec = json.load(open(args.prompts))
    prompts, new_tokens = spec["prompts"], spec["max_new_tokens"]
    speculative = dflash_config(args.spec_head, exported_depth(args.spec_head)) if args.spec_head else None
    depth = speculative["num_speculative_tokens"] if speculative else 0
    kwargs = engine_kwargs(args.model, dtype="float32", max_model_len=max(map(len, prompts)) + new_tokens + depth + 1,
                           speculative_config=speculative, enforce_eager=False)
    kwargs.update(max_num_seqs=args.clients, enable_prefix_caching=False)
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    startup = time.perf_counter() - t0
    params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, stop_token_ids=list(spec["stop_ids"]),
                                 detokenize=False)
    batch = [vllm.TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
    # warm-up, unmeasured: one request alone, then a full batch (first-call allocations at both shapes)
    llm.generate(batch[:1], params, use_tqdm=False)
    llm.generate(batch[: args.clients], vllm.SamplingParams(temperature=0.0, max_tokens=4, detokenize=False),
                 use_tqdm=False)

    out = {"vllm_version": vllm.__version__, "startup_s": startup, "engine_kwargs": kwargs, "clients": {}}
    before = spec_counters(llm)
    ids, seconds = [], []
    for prompt in batch:
        t = time.perf_counter()
        ids.append(list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids))
        seconds.append(time.perf_counter() - t)
    after = spec_counters(llm)
    out["clients"]["1"] = {"token_ids": ids, "request_seconds": seconds, "seconds": sum(seconds),
                           "drafts": after["num_drafts"] - before["num_drafts"],
                           "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"]}
    before = after
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)  # vLLM returns them in input order
    wall = time.perf_counter() - t
    after = spec_counters(llm)
    out["clients"][str(args.clients)] = {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "seconds": wall,
                                         "drafts": after["num_drafts"] - before["num_drafts"],
                                         "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"]}
    with open(args.out, "w") as f:
        json.dump(out, f, default=str)
    return 0


if __name__ == "__main__":  # vLLM's engine spawns workers: nothing may run at import
    raise SystemExit(main())
