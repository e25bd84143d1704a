"""τ of a head measured by the real decoder on held-out prompts (greedy, lossless-checked)."""

from __future__ import annotations

from jetflow.data import spread_prompts
from jetflow.decode import DecodeConfig, Decoder, DecodeStats
from jetflow.metrics import head_method, metric_key
from jetflow.tree import TreeSpec


def measure_acceptance(target, head, sets=("mtbench", "humaneval"), prompts_per_set: int = 5,
                       new_tokens: int = 64, trees: tuple[TreeSpec, ...] = (TreeSpec(budget=32), TreeSpec("chain")),
                       check_lossless: bool = True) -> dict[str, float]:
    """{"tau/<set>/<method>/<setting>": τ, "tokens_per_s/...": ..., "lossless": 1.0/0.0} (metric keys of
    `jetflow.metrics.metric_key`, greedy) over held-out eval prompts (`prompts_per_set` of each set's eval
    split, evenly spaced: see `spread_prompts`); chains capped at the head's block size."""
    spec, ar = Decoder(target, head), Decoder(target)
    method = head_method(head.config.causal)
    out: dict[str, float] = {}
    lossless = True
    for name in sets:
        items = spread_prompts(name, prompts_per_set)
        refs = [ar.generate(it.chat, DecodeConfig(max_new_tokens=new_tokens)).token_ids
                for it in items] if check_lossless else None
        for tree in dict.fromkeys(t.capped(head.config.block_size) for t in trees):
            cfg = DecodeConfig(tree=tree, max_new_tokens=new_tokens)
            total = DecodeStats()
            for i, it in enumerate(items):
                g = spec.generate(it.chat, cfg)
                total = total.merge(g.stats)
                if refs is not None:
                    lossless &= g.token_ids == refs[i]
            out[metric_key("tau", name, method, tree, 0.0)] = total.tau
            out[metric_key("tokens_per_s", name, method, tree, 0.0)] = total.tokens_per_s
    out["lossless"] = float(lossless) if check_lossless else float("nan")
    return out
