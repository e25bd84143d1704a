"""One generation at a time through a one-slot engine, with the reference `Decoder`'s API: how a single-stream
caller (`jetflow generate`, an evaluation's timed pass, the graphs calibration) runs compiled steps.

`decoder_for(target, head, graphs)` → the reference `Decoder` where `graphs` resolves to off, else a
`SingleStream` whose engine runs the step core (`jetflow.stepcore`). Both answer `generate`, `encode`, `warm`,
`graphs`, `compile_s` and `compile_log`.
"""

from __future__ import annotations

from typing import Sequence

from jetflow.decode import DecodeConfig, Decoder, Generation
from jetflow.decode.prompt import prompt_ids
from jetflow.engine.engine import Engine, EngineConfig


class SingleStream:
    """A one-slot `Engine` (policy fixed: each request's own tree) behind `Decoder.generate`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.target, self.head = engine.target, engine.head

    @property
    def graphs(self) -> str:
        return self.engine.graphs

    @property
    def graphs_reason(self) -> str:
        """Why the engine runs its steps as it does (`jetflow.stepcore.modes.resolve_graphs`)."""
        return self.engine.graphs_reason

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling step graphs so far."""
        return self.engine.compile_s

    @property
    def compile_log(self) -> dict[str, float]:
        """Compiled step graphs so far → their compile seconds."""
        return self.engine.compile_log

    def encode(self, prompt: str | Sequence[dict] | Sequence[int], raw: bool = False) -> list[int]:
        return prompt_ids(self.target.tokenizer, prompt, raw)

    def warm(self, prompt_len: int, config: DecodeConfig) -> float:
        """Compile the graphs a generation of `config` runs, now (timings that
        follow exclude compiling) → seconds spent."""
        return self.engine.warm_decoding(config)

    def generate(self, prompt: str | Sequence[dict] | Sequence[int], config: DecodeConfig | None = None,
                 raw: bool = False, task: str | None = None) -> Generation:
        return self.engine.generate([self.encode(prompt, raw=raw)], config or DecodeConfig(), [task])[0]


def decoder_for(target, head=None, graphs: str = "off", graphs_backend: str | None = None) -> Decoder | SingleStream:
    """The single-stream decoder for a `graphs` setting (off | compile | auto, `jetflow.stepcore.modes`): the
    reference `Decoder` where it resolves to off, a `SingleStream` over the compiled step core otherwise."""
    if graphs == "off":
        return Decoder(target, head)
    backend = {"graphs_backend": graphs_backend} if graphs_backend else {}
    engine = Engine(target, head, EngineConfig(max_slots=1, policy="fixed", graphs=graphs, **backend))
    return SingleStream(engine) if engine.runner is not None else Decoder(target, head)
