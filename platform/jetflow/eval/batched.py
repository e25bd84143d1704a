"""The evaluation's batched passes, on the engine: every prompt of a set decoded at once (τ, acceptance,
losslessness over all prompts, in a fraction of the single-stream time), and aggregate throughput with
`concurrency` requests in flight."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from jetflow.decode import DecodeConfig, Generation


def decode_all(target, head, prompts: Sequence[Sequence[int]], configs: Sequence[DecodeConfig],
               slots: int, task: str | None = None, graphs: str = "off") -> list[Generation]:
    """Every prompt through one engine, `slots` at a time (each request's own config); in prompt order.
    `task`: the prompts' label (their set's name) for the prompt-adaptive tree algorithms. `graphs`: how the
    engine runs its steps — τ and losslessness do not depend on it (nothing here is timed), the pass's time does;
    the engines of one process share their compiled graphs."""
    from jetflow.engine import Engine, EngineConfig

    return Engine(target, head, EngineConfig(max_slots=slots, graphs=graphs)).generate(prompts, configs,
                                                                                        [task] * len(prompts))


@dataclass(frozen=True)
class Throughput:
    concurrency: int
    requests: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def throughput(target, head, prompts: Sequence[Sequence[int]], cfg: DecodeConfig, concurrency: int,
               policy: str = "fixed", graphs: str = "off") -> Throughput:
    """A closed loop of `concurrency` clients: that many requests in the engine at all times (the prompts,
    cycled), until max(concurrency, len(prompts)) requests are done. Tokens per second of the whole run,
    prefill included — what a replica serving that many clients delivers. One short warm-up request first
    (graphs=compile: the step's graphs are compiled before the clock starts)."""
    from jetflow.engine import Engine, EngineConfig

    engine = Engine(target, head, EngineConfig(max_slots=concurrency, policy=policy, graphs=graphs))
    engine.warm_decoding(cfg)
    engine.generate([prompts[0]], DecodeConfig(tree=cfg.tree, max_new_tokens=2))
    total = max(concurrency, len(prompts))
    queue = [prompts[i % len(prompts)] for i in range(total)]
    tokens = done = 0
    t0 = time.perf_counter()
    for _ in range(min(concurrency, total)):
        engine.add(queue.pop(0), cfg)
    while done < total:
        for event in engine.step():
            tokens += len(event.tokens)
            if event.finished:
                done += 1
                if queue:
                    engine.add(queue.pop(0), cfg)
    return Throughput(concurrency, total, tokens, time.perf_counter() - t0)
