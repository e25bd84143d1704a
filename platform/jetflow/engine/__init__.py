"""The batched engine: continuous batching of tree speculation across requests (slots, chunked prefill,
one batched draft and one batched verify per step, load-aware speculation)."""

from jetflow.engine.engine import Engine, EngineConfig
from jetflow.engine.sequence import Event, Request, RequestCancelledError, RequestTimeoutError
from jetflow.engine.single import SingleStream, decoder_for

__all__ = ["Engine", "EngineConfig", "Event", "Request", "RequestCancelledError", "RequestTimeoutError",
           "SingleStream", "decoder_for"]
