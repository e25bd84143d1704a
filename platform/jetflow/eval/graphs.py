"""The host measurement `graphs=auto` (`jetflow.stepcore.modes`) follows: eager vs compiled decoding of the same
prompts, side by side (`jetflow graphs --measure`, `benchmarks/compiled.py`).

Both modes decode every prompt in one process, the order of the modes alternating prompt by prompt (so a host
that speeds up or slows down over the run weighs on both alike), after the compiled mode's graphs were
compiled (timed apart). Decode tokens/s (prefill excluded) per mode and setting; the verdict's `ratio` is the
smallest compiled/eager ratio over the settings measured — `auto` compiles only where it pays everywhere.
"""

from __future__ import annotations

from datetime import date
from typing import Sequence

from jetflow.decode import DecodeConfig
from jetflow.decode.lossless import greedy_equal
from jetflow.engine.single import decoder_for
from jetflow.stepcore.modes import record_verdict, target_key
from jetflow.tree import TreeSpec


def measure(target, prompts: Sequence[Sequence[int]], head=None, tree: TreeSpec | None = None,
            new_tokens: int = 32, passes: int = 1) -> dict:
    """→ {"settings": {label: {"eager_tok_s", "compiled_tok_s", "ratio", "lossless"}}, "compile_s", "ratio",
    "buckets", "date"} for AR, and for `tree` with `head` when given."""
    settings = {"ar": DecodeConfig(tree=TreeSpec(budget=1), max_new_tokens=new_tokens)}
    if head is not None and tree is not None and not tree.plain:
        settings[tree.key] = DecodeConfig(tree=tree, max_new_tokens=new_tokens)
    eager, compiled = decoder_for(target, head, "off"), decoder_for(target, head, "compile")
    compile_s = sum(compiled.warm(0, cfg) for cfg in settings.values())
    tally = {(label, mode): [0, 0.0] for label in settings for mode in ("off", "compile")}
    lossless = {label: True for label in settings}
    for k in range(passes):
        for i, ids in enumerate(prompts):
            for label, cfg in settings.items():
                outs = {}
                for mode in (("off", "compile") if (i + k) % 2 == 0 else ("compile", "off")):
                    g = (eager if mode == "off" else compiled).generate(list(ids), cfg)
                    tally[(label, mode)][0] += g.stats.new_tokens
                    tally[(label, mode)][1] += g.stats.decode_s
                    outs[mode] = g.token_ids
                lossless[label] &= greedy_equal(target, ids, outs["compile"], outs["off"])
    out = {}
    for label in settings:
        rate = {m: tally[(label, m)][0] / tally[(label, m)][1] for m in ("off", "compile")}
        out[label] = {"eager_tok_s": round(rate["off"], 3), "compiled_tok_s": round(rate["compile"], 3),
                      "ratio": round(rate["compile"] / rate["off"], 4), "lossless": lossless[label]}
    return {"settings": out, "compile_s": round(compile_s, 2), "buckets": compiled.compile_log,
            "ratio": min(s["ratio"] for s in out.values()), "lossless": all(s["lossless"] for s in out.values()),
            "prompts": len(prompts), "new_tokens": new_tokens, "passes": passes, "date": str(date.today()),
            "by": "measure"}


def measure_and_record(target, prompts: Sequence[Sequence[int]], head=None, tree: TreeSpec | None = None,
                       new_tokens: int = 32, passes: int = 1) -> tuple[dict, str]:
    """`measure`, kept as this host's verdict for `target` (what `graphs=auto` reads) → (result, its key)."""
    result = measure(target, prompts, head, tree, new_tokens, passes)
    key = target_key(target)
    record_verdict(key, {k: v for k, v in result.items() if k != "buckets"})
    return result, key
