"""The per-replica generation engine: one batched `jetflow.engine.Engine`, stepped by one background thread
(`EngineLoop`), feeding each request's queue on the event loop. While a replica changes head (a new champion)
the loop steps two engines, the old one until its requests end.

Requests join and leave the running batch at every step; tokenizing happens in the request's handler off the
event loop (a worker thread), detokenizing incrementally in the engine thread (only the new tokens' text).
A request waits in the engine's queue while every slot is busy; past `max_queued_requests` waiting it is
refused (429). A request past its deadline, or whose client went away, leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any, AsyncIterator, Callable, Sequence

from jetflow.decode import DecodeConfig, Generation
from jetflow.engine import Engine, EngineConfig, RequestTimeoutError
from jetflow.engine.kv import return_freed_memory
from jetflow.errors import InvalidSettingError, JetFlowError, PromptTooLongError
from jetflow.serving.config import ServeConfig
from jetflow.serving.logprobs import TokenText
from jetflow.serving.schema import JetFlowUsage, Usage
from jetflow.serving.selection import HeadChoice
from jetflow.tree import TreeSpec

log = logging.getLogger(__name__)


class QueueFullError(JetFlowError):
    """Every slot is busy and the queue holds `max_queued_requests` already (HTTP 429)."""


@dataclass
class Event:
    """One step of a generation: new text, tokens generated so far, on the last event the Generation."""

    text: str
    tokens: int
    done: Generation | None = None
    logprobs: list | None = None          # TokenLogprob per new token (the request asked for logprobs)
    prompt_logprobs: list | None = None   # on the first event of a request that asked: per prompt token but the first


def request_error(cls: type[Exception], message: str, param: str | None) -> Exception:
    """A jetflow.errors exception naming the request parameter at fault (the OpenAI body's `param`)."""
    exc = cls(message)
    exc.param = param  # type: ignore[attr-defined]
    return exc


class TextStream:
    """Growing token ids → text deltas whose concatenation is the final (stop-cut) text, decoding only a
    window around the new tokens (the last `prefix` tokens give the new text its context).

    Text that may still change is held back: a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and a
    tail that could be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.prefix = self.read = 0      # ids[prefix:read] decode to text already part of `text`
        self.text = ""                   # everything decoded so far
        self.sent = 0                    # characters of `text` handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, new_ids: Sequence[int]) -> str:
        self.ids += list(new_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        safe = len(self.text)
        for s in self.stop:
            cut = self.text.find(s)
            if cut >= 0:
                safe = min(safe, cut)
                continue
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):  # longest tail that begins s
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text. (Its first `sent` characters are what was handed out: the final text is
        the whole decode, cut at a stop string, of which every delta was a prefix.)"""
        return final_text[self.sent:]


class _Subscriber:
    def __init__(self, loop: asyncio.AbstractEventLoop, stream: TextStream, engine: Engine):
        self.loop, self.stream, self.queue = loop, stream, asyncio.Queue()
        self.engine = engine             # the engine the request runs on, to its end (a head change does not move it)
        self.tokens = 0

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineCounts:
    """What a replica's engines add up to (/healthz, admission): engines attached, requests running and waiting.
    Subclasses keep the engines in `_engines`."""

    _engines: list

    @property
    def engines(self) -> int:
        return len(self._engines)

    @property
    def active(self) -> int:
        return sum(e.active for e in list(self._engines))

    @property
    def queued(self) -> int:
        return sum(e.queued for e in list(self._engines))


class EngineLoop(EngineCounts):
    """Steps a replica's engines on one background thread while they have work; hands each request's events to
    its subscriber. Normally one engine; after a head change the new one takes new requests while the previous
    one, `retire`d, keeps stepping until its last request ends, then is dropped. Every target forward, and a new
    engine's construction (`call`), happens on this one thread. `healthy()` is False when the thread died or a
    step has been running too long."""

    def __init__(self, tokenizer, stuck_after_s: float = 120.0):
        self.tokenizer, self.stuck_after_s = tokenizer, stuck_after_s
        self._engines: list[Engine] = []
        self._retiring: list[Engine] = []
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._subs: dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self.step_started: float | None = None     # monotonic time the running step began; None between steps
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="jetflow-engine", daemon=True)
        self._thread.start()

    def attach(self, engine: Engine) -> None:
        with self._lock:
            if engine not in self._engines:
                self._engines.append(engine)

    def retire(self, engine: Engine) -> None:
        """Stop counting on `engine` for new requests: it is dropped once its running and queued ones end."""
        with self._lock:
            if engine in self._engines and engine not in self._retiring:
                self._retiring.append(engine)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the loop's thread between two steps (what touches the target — a new engine's warm-up,
        a step cost measurement — never runs beside a step); its result or exception in the Future."""
        future: Future = Future()
        with self._lock:
            self._calls.append((fn, future))
        self._wake.set()
        return future

    def submit(self, engine: Engine, request_id: str, ids: list[int], cfg: DecodeConfig,
               deadline: float | None) -> _Subscriber:
        sub = _Subscriber(asyncio.get_running_loop(), TextStream(self.tokenizer, cfg.stop), engine)
        with self._lock:  # with the lock: a retired engine is not dropped between this check and `add`
            if engine not in self._engines:  # a request that chose the old head just before it was dropped
                self._engines.append(engine)
                self._retiring.append(engine)
            self._subs[request_id] = sub
            try:
                engine.add(ids, cfg, request_id=request_id, deadline=deadline)
            except JetFlowError:
                self._subs.pop(request_id, None)
                raise
        self._wake.set()
        return sub

    def cancel(self, request_id: str) -> None:
        with self._lock:
            sub = self._subs.get(request_id)
        if sub is not None:
            sub.engine.cancel(request_id)
        self._wake.set()

    def healthy(self) -> tuple[bool, str]:
        if self.error is not None or not self._thread.is_alive():
            return False, f"the engine thread is dead ({self.error!r})"
        started = self.step_started
        if started is not None and time.monotonic() - started > self.stuck_after_s:
            return False, f"an engine step has been running for {time.monotonic() - started:.0f} s"
        return True, "ok"

    def close(self) -> None:
        self._stop = True
        self._wake.set()

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - the caller gets it; the running requests go on
                    future.set_exception(exc)

    def _drop_retired(self) -> None:
        with self._lock:
            idle = [e for e in self._retiring if not e.has_work()]
            for engine in idle:
                self._retiring.remove(engine)
                self._engines.remove(engine)
        if idle:
            return_freed_memory(idle[0].device)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._run_calls()
                self._drop_retired()
                busy = [e for e in list(self._engines) if e.has_work()]
                if not busy:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for engine in busy:  # one step each: old and new head's requests advance side by side
                    self.step_started = time.monotonic()
                    events = engine.step()
                    self.step_started = None
                    self.steps += 1
                    for event in events:
                        self._deliver(event)
        except BaseException as exc:  # noqa: BLE001 - every waiting request must hear about it
            log.exception("the engine loop died")
            self.error = exc
            with self._lock:
                subs, self._subs = dict(self._subs), {}
                calls, self._calls = list(self._calls), deque()
            for sub in subs.values():
                sub.put(exc)
            for _, future in calls:
                future.set_exception(exc)

    def _deliver(self, event) -> None:
        with self._lock:
            sub = self._subs.get(event.request_id)
            if sub is not None and event.finished:
                del self._subs[event.request_id]
        if sub is None:
            return
        if event.error is not None:
            sub.put(event.error)
            return
        sub.tokens += len(event.tokens)
        text = sub.stream.update(event.tokens) if event.tokens else ""
        if event.finished:
            sub.put(Event(text + sub.stream.finish(event.generation.text), sub.tokens, done=event.generation,
                          logprobs=event.logprobs, prompt_logprobs=event.prompt_logprobs))
        elif text or event.logprobs or event.prompt_logprobs is not None:  # logprobs of text still held back too
            sub.put(Event(text, sub.tokens, logprobs=event.logprobs, prompt_logprobs=event.prompt_logprobs))


class RequestShaping:
    """What every backend's engine does with a request before and after decoding it: prompts to token ids, request
    settings to a validated DecodeConfig, room checks, usage. Subclasses set `target`, `choice`, `cfg`, `backend`
    and give `active` and `queued`."""

    backend = "jetflow"
    target: Any
    choice: HeadChoice
    cfg: ServeConfig
    active: int
    queued: int

    # ------------------------------------------------------------------ requests → engine inputs
    def encode(self, prompt: str | list[int] | list[dict], chat: bool) -> list[int]:
        """Completions: text fed as is (or token ids); chat: messages through the chat template."""
        from jetflow.decode import encode_prompt

        param = "messages" if chat else "prompt"
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            self.check_token_ids(prompt, param)
            ids = list(prompt)
        else:
            ids = encode_prompt(self.target.tokenizer, prompt, raw=not chat)
        if len(ids) > self.cfg.max_prompt_tokens:
            raise request_error(PromptTooLongError, f"the prompt has {len(ids)} tokens; this server accepts at "
                                f"most {self.cfg.max_prompt_tokens}: shorten it", param)
        return ids

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        if any(not 0 <= t < self.target.vocab_size for t in ids):
            raise request_error(InvalidSettingError, f"{param}: token ids must be in 0..{self.target.vocab_size - 1}",
                                param)

    def decode_config(self, max_tokens: int | None, temperature: float, top_p: float, top_k: int,
                      stop: list[str], seed: int | None, logprobs: int | None = None,
                      prompt_logprobs: int | None = None) -> DecodeConfig:
        """Request sampling settings + the served tree setting → a validated DecodeConfig. A request for its
        prompt's logprobs (echo) is decoded plainly: it asks for one token, or none (`max_tokens` 0 decodes one,
        which the response leaves out)."""
        n = self.cfg.default_max_tokens if max_tokens is None else max_tokens
        if n > self.cfg.max_tokens:
            raise request_error(InvalidSettingError, f"max_tokens {n} exceeds this server's limit of "
                                f"{self.cfg.max_tokens}; ask for fewer tokens", "max_tokens")
        plain = not self.choice.speculative or prompt_logprobs is not None
        tree = TreeSpec(budget=1) if plain else self.choice.tree
        return DecodeConfig(tree=tree, max_new_tokens=max(n, 1), temperature=temperature, top_p=top_p, top_k=top_k,
                            stop=stop, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def check_room(self, prompts: int) -> None:
        """A batch of `prompts` (one request, one choice each) must fit this replica at once: InvalidSettingError
        (400) past its slots + queue, QueueFullError (429) past what is free now. One prompt: `events` checks."""
        most = self.cfg.max_slots + self.cfg.max_queued_requests
        if prompts > most:
            raise request_error(InvalidSettingError, f"{prompts} prompts in one request; this server takes at most "
                                f"{most} at once: send smaller batches", "prompt")
        free = max(0, self.cfg.max_slots - self.active) + max(0, self.cfg.max_queued_requests - self.queued)
        if prompts > 1 and prompts > free:
            raise QueueFullError(f"this replica has room for {free} of the batch's {prompts} prompts now "
                                 f"({self.active} running, {self.queued} waiting); retry later")

    @cached_property
    def token_text(self) -> TokenText:
        """Token id → text and bytes, for logprobs (cached per token)."""
        return TokenText(self.target.tokenizer)

    def usage(self, gens: Generation | Sequence[Generation], completion_tokens: int | None = None) -> Usage:
        """Usage of one generation, or of a batch's (summed; τ and tokens/s over all its rounds).
        `completion_tokens`: what the response holds, when it leaves the decoded tokens out (max_tokens 0)."""
        gens = [gens] if isinstance(gens, Generation) else list(gens)
        s = functools.reduce(lambda a, b: a.merge(b), [g.stats for g in gens])
        done = sum(len(g.token_ids) for g in gens) if completion_tokens is None else completion_tokens
        return Usage(prompt_tokens=s.prompt_tokens, completion_tokens=done,
                     total_tokens=s.prompt_tokens + done,
                     jetflow=JetFlowUsage(backend=self.backend, speculative=self.choice.speculative,
                                          head=self.choice.label,
                                          head_version=self.choice.version,
                                          tree=self.choice.tree.to_dict() if self.choice.speculative else None,
                                          tau=round(s.tau, 4), rounds=s.rounds,
                                          tokens_per_s=round(s.tokens_per_s, 3), note=self.choice.note))


class GenerationEngine(RequestShaping):
    """A loaded target + head choice, serving generations batched across requests on `loop`'s thread. A replica
    that changes head builds a second one (on that thread: `EngineLoop.call`) and retires the first."""

    def __init__(self, target, choice: HeadChoice, cfg: ServeConfig, loop: EngineLoop, cost_curve=None,
                 budget_table=None, tau_prior=None):
        self.target, self.choice, self.cfg = target, choice, cfg
        policy = cfg.policy if choice.speculative else "plain"
        engine_cfg = EngineConfig(max_slots=cfg.max_slots, max_model_len=cfg.max_prompt_tokens + cfg.max_tokens,
                                  prefill_chunk=cfg.prefill_chunk, prefill_tokens=cfg.prefill_tokens, policy=policy,
                                  cost_curve=cost_curve, budget_table=budget_table, tau_prior=tau_prior,
                                  graphs=cfg.graphs)
        self.engine = Engine(target, choice.head if choice.speculative else None, engine_cfg)
        if self.engine.runner is None:  # the eager LM head's orientations, timed before the first request
            self.engine.warm_lm_head()
        if self.engine.runner is not None:  # graphs=compile: the step's graphs, compiled before taking traffic
            seconds = self.engine.warm_decoding(DecodeConfig(tree=choice.tree if choice.speculative else TreeSpec(budget=1)))
            log.info("graphs=compile (%s): %d step graphs compiled in %.1f s, before taking traffic",
                     self.engine.graphs_reason, len(self.engine.compile_log), seconds)
        self.loop = loop
        loop.attach(self.engine)

    def describe(self) -> str:
        """What this engine runs, in words (/healthz `runs`, the replica's start line)."""
        if self.choice.speculative:
            return f"JetFlow's engine: head {self.choice.label}, tree {self.choice.tree.label()}, policy {self.cfg.policy}"
        return f"JetFlow's engine: plain decoding ({self.choice.note or 'no head'})"

    def graphs_info(self) -> dict:
        """How this engine's steps run (/healthz): the resolved graphs mode and why, and with compile the graphs
        compiled (all of them before the replica took traffic) and their seconds."""
        runner = self.engine.runner
        width = self.choice.tree.width if self.choice.speculative else 0
        return {"graphs": self.engine.graphs, "graphs_reason": self.engine.graphs_reason,
                "graphs_ready": runner is None or runner.ready(width),
                "compiled_graphs": len(self.engine.compile_log), "compile_s": round(self.engine.compile_s, 2),
                "policy": self.engine.cfg.policy, "budget_table": self.engine.cfg.budget_table,
                "decode_steps_by_budget": {str(b): n for b, n in sorted(self.engine.budget_steps.items())}}

    @property
    def active(self) -> int:
        return self.engine.active

    @property
    def queued(self) -> int:
        return self.engine.queued

    # ------------------------------------------------------------------ generation
    async def events(self, request_id: str, ids: list[int], cfg: DecodeConfig) -> AsyncIterator[Event]:
        """Text deltas as the engine commits tokens; the last event carries the Generation. Raises
        QueueFullError (every slot busy, the queue full), PromptTooLongError, RequestTimeoutError (deadline).
        Closing the iterator early (a client that left) cancels the request: its slot is freed at the next
        engine step."""
        if self.engine.queued >= self.cfg.max_queued_requests and self.engine.active >= self.cfg.max_slots:
            raise QueueFullError(f"this replica is full: {self.cfg.max_slots} requests running and "
                                 f"{self.engine.queued} waiting; retry later")
        timeout = self.cfg.request_timeout_s
        deadline = time.monotonic() + timeout if timeout else None
        sub = self.loop.submit(self.engine, request_id, ids, cfg, deadline)
        finished = False
        try:
            while True:
                item = await sub.queue.get()
                if isinstance(item, RequestTimeoutError):
                    finished = True
                    raise RequestTimeoutError(f"the request did not finish within {timeout:g} s "
                                              "(request_timeout_s); ask for fewer tokens or retry")
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.done is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.loop.cancel(request_id)

    def retire(self) -> None:
        """New requests go elsewhere; the running ones finish here, then the engine and its KV are dropped."""
        self.loop.retire(self.engine)
