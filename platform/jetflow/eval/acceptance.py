"""τ of a head measured by the real decoder on held-out prompts (greedy, lossless-checked)."""

from __future__ import annotations

from jetflow.data import spread_prompts
from jetflow.decode import DecodeConfig, Decoder, DecodeStats


def measure_acceptance(target, head, sets=("mtbench", "humaneval"), prompts_per_set: int = 5,
                       new_tokens: int = 64, budget: int = 32, width: int = 7,
                       algorithms=("accum_logp", "chain"), check_lossless: bool = True) -> dict[str, float]:
    """{"tau/<set>/<algorithm>": τ, "tokens_per_s/...": ..., "lossless": 1.0/0.0} over held-out eval prompts
    (`prompts_per_set` of each set's eval split, evenly spaced: see `spread_prompts`)."""
    spec, ar = Decoder(target, head), Decoder(target)
    out: dict[str, float] = {}
    lossless = True
    for name in sets:
        items = spread_prompts(name, prompts_per_set)
        refs = [ar.generate(it.chat, DecodeConfig(max_new_tokens=new_tokens)).token_ids
                for it in items] if check_lossless else None
        for alg in algorithms:
            cfg = DecodeConfig(budget=budget if alg != "chain" else min(budget, head.config.block_size),
                               width=width, algorithm=alg, max_new_tokens=new_tokens)
            total = DecodeStats()
            for i, it in enumerate(items):
                g = spec.generate(it.chat, cfg)
                total = total.merge(g.stats)
                if refs is not None:
                    lossless &= g.token_ids == refs[i]
            out[f"tau/{name}/{alg}"] = total.tau
            out[f"tokens_per_s/{name}/{alg}"] = total.tokens_per_s
    out["lossless"] = float(lossless) if check_lossless else float("nan")
    return out
