"""Token log-probabilities as OpenAI and vLLM report them: under the target's own distribution — the fp32
log-softmax of its raw logits at the position that predicted the token, before temperature, top-k or top-p —
with the k likeliest alternatives. One definition, used by the reference decoder and the batched engine
(generated tokens: the logits at the accepted path's nodes; prompt tokens: the prefill's hidden states)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int                                # the token (generated, or a prompt token)
    logprob: float                            # its natural-log probability under the target
    top: tuple[tuple[int, float], ...] = ()   # the k likeliest (token, log-prob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int | Sequence[int]) -> list[TokenLogprob]:
    """(n, V) logits, row i the target's prediction of `tokens[i]` → n TokenLogprobs, row i with its top-`k`
    alternatives (`k`: one count for every row, or one per row). Two device → host copies."""
    n = len(tokens)
    if n == 0:
        return []
    ks = [k] * n if isinstance(k, int) else list(k)
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.as_tensor(list(tokens), device=logp.device)[:, None])
    width = min(max(ks), logp.shape[-1])
    if width:
        top = torch.topk(logp, width, dim=-1)
        values, alternatives = torch.cat([chosen, top.values], 1).tolist(), top.indices.tolist()
    else:
        values, alternatives = chosen.tolist(), [[]] * n
    return [TokenLogprob(int(t), v[0], tuple(zip(a[:kk], v[1: 1 + kk])))
            for t, v, a, kk in zip(tokens, values, alternatives, ks)]
