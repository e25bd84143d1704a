"""Off-the-shelf baselines on the same prompt ids: HF `generate` (plain greedy or sampled) and HF
prompt-lookup decoding (`prompt_lookup_num_tokens`, the n-gram drafter a user would try first).

Timing comes from forward hooks on the HF model, so one `generate` call gives everything: the first
forward is the prefill (it also yields the first new token); decode time runs from the end of that
forward to the end of `generate`; verify time is the time spent inside the later forwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from jetflow.decode import stop_token_ids


@dataclass
class HFRun:
    """One HF `generate` call. Times in seconds; token_ids are the generated tokens only (a final EOS
    included, as in our decoder's output)."""

    token_ids: list[int]
    prefill_s: float            # generate start → end of the first forward (prompt + first token)
    decode_s: float             # end of the first forward → generate returns
    forward_s: float            # time inside decode forwards (the verify share of decode_s)
    forwards: int               # target forwards in total, the prefill included
    forward_times: list[float] = field(default_factory=list, repr=False)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the prefill forward (the first token comes with the prefill)."""
        return max(0, len(self.token_ids) - 1)


class _ForwardClock:
    """Pre/post forward hooks on the HF model recording (start, end) of every forward call."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.spans: list[list[float]] = []
        self._handles: list = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def __enter__(self) -> "_ForwardClock":
        self._handles = [
            self.model.register_forward_pre_hook(lambda *_: self.spans.append([self._now()])),
            self.model.register_forward_hook(lambda *_: self.spans[-1].append(self._now())),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


@torch.inference_mode()
def hf_generate(target, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                seed: int | None = None, prompt_lookup_num_tokens: int | None = None) -> HFRun:
    """`target.model.generate` on exactly our prompt ids, stopping on our decoder's stop tokens.

    temperature 0: greedy (`do_sample=False`); > 0: pure temperature sampling (top-k and top-p off),
    seeded with `seed`. prompt_lookup_num_tokens: HF prompt-lookup decoding with that many candidate
    tokens per step (None = plain `generate`).
    """
    dev = target.device
    x = torch.tensor([prompt_ids], device=dev)
    kw: dict = dict(max_new_tokens=max_new_tokens, eos_token_id=sorted(stop_token_ids(target)),
                    attention_mask=torch.ones_like(x))
    pad = getattr(target.tokenizer, "pad_token_id", None) if target.tokenizer is not None else None
    kw["pad_token_id"] = pad if pad is not None else kw["eos_token_id"][0] if kw["eos_token_id"] else 0
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if seed is not None:
            torch.manual_seed(seed)
    else:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if prompt_lookup_num_tokens:
        kw["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    with _ForwardClock(target.model, dev) as clock:
        t0 = clock._now()
        out = target.model.generate(x, **kw)
        t_end = clock._now()
    spans = clock.spans
    first_end = spans[0][1] if spans else t_end
    return HFRun(token_ids=out[0, len(prompt_ids):].tolist(), prefill_s=first_end - t0, decode_s=t_end - first_end,
                 forward_s=sum(e - s for s, e in spans[1:]), forwards=len(spans),
                 forward_times=[e - s for s, e in spans])
