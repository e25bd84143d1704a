"""`graphs=auto`'s first use on a host: is the compiled step faster here than the eager one, and are its tokens
the eager tokens? Measured once per host key (`jetflow.stepcore.modes.host_key`: processor, torch, device, target,
dtype, threads, rows) and kept, so every later engine on the host reads the verdict.

The engine that meets no verdict (`Engine.__init__`) built its step core already; this compiles its graphs — the
graphs the engine then keeps using, so a verdict of `compile` costs nothing twice — and decodes the same short
prompts greedily with its compiled steps and with an eager engine of the same slots, side by side, modes
alternating, at one row and at the engine's slots: plain steps, the step every speculative step is built on.
First-call costs stay out of the clock (the LM head's orientation tuning, a first decode at each row count).
Printed as it runs (stderr). The verdict: the smallest compiled/eager tokens-per-second ratio over those rows,
and whether every output equalled the eager one (up to fp32 ties, `jetflow.decode.lossless`).
"""

from __future__ import annotations

import sys
import time
from datetime import date

import torch

from jetflow.decode import DecodeConfig
from jetflow.decode.lossless import greedy_equal
from jetflow.decode.prompt import encode_prompt
from jetflow.stepcore.modes import record_verdict, target_key
from jetflow.tree import TreeSpec
from jetflow.tree.spec import DEFAULT_WIDTH

REQUEST = ("Write a short Python function that returns the squares of the even numbers in a list of {n} numbers, "
           "then explain it line by line.")
NEW_TOKENS = 24
PASSES = 2


def _say(message: str) -> None:
    print(f"[graphs=auto] {message}", file=sys.stderr, flush=True)


def _prompts(target, rows: int) -> list[list[int]]:
    """`rows` distinct requests (user turns, chat-templated where the tokenizer has a template) that each ask for
    an answer longer than NEW_TOKENS: a prompt whose answer stopped at its first token would time its prefill."""
    if target.tokenizer is None:
        return [[(7 * r + t) % target.vocab_size + 1 for t in range(48)] for r in range(rows)]
    return [encode_prompt(target.tokenizer, REQUEST.format(n=10 + r)) for r in range(rows)]


@torch.inference_mode()
def calibrate_engine(engine) -> dict:
    """Measure `engine` (graphs=compile, idle) against an eager engine of its slots; keep and return the verdict."""
    from jetflow.engine.engine import Engine, EngineConfig
    from jetflow.engine.policy import make_policy

    target = engine.target
    key = target_key(target, engine.cfg.max_slots)
    threads = torch.get_num_threads()
    _say(f"no verdict for this host yet ({threads} threads, {engine.cfg.max_slots} slots, {target.dtype}): "
         "compiling the step graphs (once per host; inductor caches them), then eager vs compiled, side by side")
    t0 = time.perf_counter()
    compile_s = engine.warm_graphs(DEFAULT_WIDTH if engine.head is not None else 0)
    _say(f"compiled {len(engine.compile_log)} graphs in {compile_s:.0f} s; measuring")
    eager = Engine(target, None, EngineConfig(max_slots=engine.cfg.max_slots, max_model_len=engine.cfg.max_model_len,
                                              policy="plain", graphs="off"))
    policy, engine.policy = engine.policy, make_policy("plain", engine)
    cfg = DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=NEW_TOKENS)
    rows_list = sorted({1, engine.cfg.max_slots})
    ratios, lossless = {}, True
    eager.warm_lm_head()  # the LM head's orientation per row count: timed once per host, then read (not timed here)
    try:
        for rows in rows_list:
            prompts = _prompts(target, rows)
            for which in (eager, engine):  # first-call costs at this row count (buffers, lazy picks), untimed
                which.generate(prompts, [DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=2)] * rows)
            clock = {"off": 0.0, "compile": 0.0}
            tokens = {"off": 0, "compile": 0}
            for k in range(PASSES):
                outs = {}
                for mode in (("off", "compile") if k % 2 == 0 else ("compile", "off")):
                    which = eager if mode == "off" else engine
                    start = time.perf_counter()
                    gens = which.generate(prompts, [cfg] * rows)
                    clock[mode] += time.perf_counter() - start
                    tokens[mode] += sum(g.stats.new_tokens for g in gens)
                    outs[mode] = [g.token_ids for g in gens]
                lossless &= all(greedy_equal(target, p, a, b) for p, a, b in zip(prompts, outs["compile"], outs["off"]))
            rate = {m: tokens[m] / clock[m] for m in clock}
            ratios[str(rows)] = round(rate["compile"] / rate["off"], 3)
            _say(f"{rows} row{'s' if rows > 1 else ''}: eager {rate['off']:.1f} tok/s, compiled {rate['compile']:.1f} "
                 f"tok/s ({ratios[str(rows)]:.2f}x){'' if lossless else ', tokens DIFFER'}")
    finally:
        engine.policy = policy
    verdict = {"ratio": min(ratios.values()), "rows": ratios, "lossless": lossless, "compile_s": round(compile_s, 1),
               "calibrate_s": round(time.perf_counter() - t0, 1), "new_tokens": NEW_TOKENS, "passes": PASSES,
               "date": str(date.today()), "by": "calibrate"}
    path = record_verdict(key, verdict)
    _say(f"verdict kept in {path}: ratio {verdict['ratio']:.2f}, lossless {lossless} "
         f"({verdict['calibrate_s']:.0f} s in all)")
    return verdict
