"""Greedy decoding on vLLM, AR or with `dflash` chain speculation from an exported head: the vLLM
baseline rows of an evaluation, measured the way JetFlow's decoder is (batch 1, prompt after prompt).

The engine is this process's for those settings (`jetflow.vllm.engine`): built on the first call, shared by
later ones. On a GPU each engine keeps its share of memory (`gpu_memory_utilization`) until the process ends
or `close_engines()`; run configurations that do not fit together in processes of their own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jetflow.vllm import require_vllm
from jetflow.vllm.engine import engine, spec_counters


@dataclass
class VllmRun:
    token_ids: list[list[int]]          # generated ids per prompt (a stop token that ended it included)
    seconds: float                      # generate() wall time summed over prompts, warm-up excluded
    startup_s: float                    # engine construction (0 when this process had built it already)
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
    """Greedy-decode token-id `prompts` one at a time on vLLM for `model` (an HF folder or hub id, see
    `jetflow.vllm.regenerate.model_source`). Speculative with `speculative_config`."""
    vllm = require_vllm("a vLLM baseline")
    t0 = time.perf_counter()
    # eager: CUDA-graph capture (GPU) or inductor (CPU) costs more start-up time than a short check gains
    llm = engine(model, dtype=dtype, max_model_len=max_model_len, speculative_config=speculative_config,
                 enforce_eager=True, attention_backend=attention_backend,
                 gpu_memory_utilization=gpu_memory_utilization)
    startup = time.perf_counter() - t0
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids),
                                 detokenize=False)
    batch = [vllm.TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
    if batch:
        llm.generate(batch[:1], params, use_tqdm=False)  # warm-up: first-call kernels and allocations
    run = VllmRun(token_ids=[], seconds=0.0, startup_s=startup, vllm_version=vllm.__version__)
    before = spec_counters(llm)
    for prompt in batch:
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        run.prompt_seconds.append(time.perf_counter() - t)
        after = spec_counters(llm)
        run.prompt_drafts.append(after["num_drafts"] - before["num_drafts"])
        run.prompt_accepted.append(after["num_accepted_tokens"] - before["num_accepted_tokens"])
        run.token_ids.append(list(out.outputs[0].token_ids))
        before = after
    run.seconds, run.drafts, run.accepted = sum(run.prompt_seconds), sum(run.prompt_drafts), sum(run.prompt_accepted)
    return run

