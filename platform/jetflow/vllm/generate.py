"""Greedy decoding on vLLM, AR or with `dflash` chain speculation from an exported head: the vLLM
baseline rows of an evaluation, measured the way JetFlow's decoder is (batch 1, prompt after prompt).

One engine per call; run each configuration in its own process when several share a GPU (a vLLM
engine does not hand its memory back before the process ends).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jetflow.vllm import require_vllm


@dataclass
class VllmRun:
    token_ids: list[list[int]]          # generated ids per prompt (a stop token that ended it included)
    seconds: float                      # generate() wall time summed over prompts, warm-up excluded
    startup_s: float                    # engine construction
    vllm_version: str
    drafts: int = 0                     # speculation steps (vllm:spec_decode_num_drafts)
    accepted: int = 0                   # accepted draft tokens (vllm:spec_decode_num_accepted_tokens)
    extra: dict = field(default_factory=dict)
    # per prompt, in order: generate() seconds, speculation steps, accepted draft tokens
    prompt_seconds: list[float] = field(default_factory=list)
    prompt_drafts: list[int] = field(default_factory=list)
    prompt_accepted: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.token_ids))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per target step, bonus included (METHOD.md τ); None without speculation."""
        return 1 + self.accepted / self.drafts if self.drafts else None


def dflash_config(exported: str | Path, num_speculative_tokens: int) -> dict:
    """vLLM's speculative_config for a head written by `jetflow export --to vllm`."""
    return {"method": "dflash", "model": str(exported), "num_speculative_tokens": num_speculative_tokens}


def generate_greedy(model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int],
                    *, speculative_config: dict | None = None, dtype: str = "auto", max_model_len: int | None = None,
                    attention_backend: str | None = None, gpu_memory_utilization: float = 0.45) -> VllmRun:
    """Greedy-decode token-id `prompts` one at a time on a fresh vLLM engine for `model` (an HF folder or
    hub id, see `jetflow.vllm.regenerate.model_source`). Speculative with `speculative_config`."""
    vllm = require_vllm("a vLLM baseline")
    # eager: CUDA-graph capture costs more start-up time than a short check gains
    # disable_log_stats=False: without the stat loggers get_metrics() has no spec_decode counters (τ)
    kwargs: dict = {"model": model, "dtype": dtype, "seed": 0, "enforce_eager": True,
                    "gpu_memory_utilization": gpu_memory_utilization, "disable_log_stats": False}
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if speculative_config:
        kwargs["speculative_config"] = speculative_config
    if attention_backend:
        kwargs["attention_backend"] = attention_backend
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    startup = time.perf_counter() - t0
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids),
                                 detokenize=False)
    batch = [vllm.TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
    if batch:
        llm.generate(batch[:1], params, use_tqdm=False)  # warm-up: first-call kernels and allocations
    run = VllmRun(token_ids=[], seconds=0.0, startup_s=startup, vllm_version=vllm.__version__)
    before = _spec_counters(llm)
    for prompt in batch:
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        run.prompt_seconds.append(time.perf_counter() - t)
        after = _spec_counters(llm)
        run.prompt_drafts.append(after["num_drafts"] - before["num_drafts"])
        run.prompt_accepted.append(after["num_accepted_tokens"] - before["num_accepted_tokens"])
        run.token_ids.append(list(out.outputs[0].token_ids))
        before = after
    run.seconds, run.drafts, run.accepted = sum(run.prompt_seconds), sum(run.prompt_drafts), sum(run.prompt_accepted)
    return run


def _spec_counters(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters (vllm:spec_decode_num_*); 0 when speculation is off."""
    out = {"num_drafts": 0, "num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in out:
            out[name] += int(getattr(metric, "value", 0))
    return out
