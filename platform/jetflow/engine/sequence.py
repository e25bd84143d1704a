"""What the engine keeps per request: the request as submitted, its slot state while it runs, and the events
a step emits for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from jetflow.decode import DecodeConfig, DecodeStats, Generation
from jetflow.errors import JetFlowError


class RequestTimeoutError(JetFlowError):
    """A request that did not finish before its deadline (its slot is freed)."""


class RequestCancelledError(JetFlowError):
    """A request cancelled by its caller (a client that went away)."""


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    config: DecodeConfig
    deadline: float | None = None             # time.monotonic() by which it must finish
    task: str | None = None                   # the prompt's label, for the prompt-adaptive tree algorithms
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class Event:
    """One step's news for one request: the tokens it committed; on its last event, the Generation (or the
    error that ended it)."""

    request_id: str
    tokens: list[int]
    finished: bool = False
    generation: Generation | None = None
    error: JetFlowError | None = None
    logprobs: list | None = None              # TokenLogprob per token of `tokens` (the request asked for them)
    prompt_logprobs: list | None = None       # on a request's first event: TokenLogprob per prompt token but the first


class Seq:
    """A request in a slot. Invariant between steps (as in the reference `Decoder`): the target's KV and
    the head's context cover every committed token but the last, the anchor, at `past`."""

    def __init__(self, request: Request, device: torch.device):
        self.request = request
        self.cfg = request.config
        self.ids = list(request.prompt_ids)       # committed tokens: prompt + generated
        self.generated: list[int] = []
        self.prefilled = 0                        # prompt tokens (of prompt[:-1]) in the KV so far
        self.past = 0                             # tokens in the KV (= the anchor's position) once running
        self.anchor = self.ids[-1]
        self.finish_reason: str | None = None
        self.lookahead = 2.0                      # running mean of accepted path lengths (LM-head prefetch)
        self.stats = DecodeStats(prompt_tokens=len(self.ids))
        # the reference decoder's sampling generator, seeded the same way: the same seed, the same tokens
        self.rng = torch.Generator(device=device)
        if self.cfg.seed is not None:
            self.rng.manual_seed(self.cfg.seed)
        self.admitted = time.monotonic()
        self.started: float | None = None         # first decode step
        self.tree_context = None                  # the request's TreeContext (the engine sets it on admission)
        # TokenLogprobs, kept only for requests that ask (jetflow.decode.logprobs): of the generated tokens, of
        # the prompt's tokens but the first (filled chunk by chunk in prefill), of this step's path + bonus
        self.logprobs: list | None = [] if self.cfg.logprobs is not None else None
        self.prompt_logprobs: list | None = [] if self.cfg.prompt_logprobs is not None else None
        self.step_logprobs: list | None = None

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def prefill_target(self) -> int:
        """Prompt tokens the KV must hold before decoding: all but the last (the first anchor)."""
        return len(self.request.prompt_ids) - 1

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.prefill_target
