"""The per-replica generation engine: one Decoder, rounds run off the event loop, text streamed.

The decoder is synchronous CPU code. Each round of each request is one task on a small thread pool
(`decode_threads`, default 1), so concurrent requests interleave round by round and the event loop
stays free for other requests and slow clients. A request whose client went away is simply never
asked for its next round: at most the round already running finishes.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from jetflow.decode import DecodeConfig, Decoder, Generation
from jetflow.errors import InvalidSettingError, PromptTooLongError
from jetflow.serving.config import ServeConfig
from jetflow.serving.schema import JetFlowUsage, Usage
from jetflow.serving.selection import HeadChoice
from jetflow.tree import TreeSpec


@dataclass
class Event:
    """One step of a generation: new text, tokens generated so far, on the last event the Generation."""

    text: str
    tokens: int
    done: Generation | None = None


def request_error(cls: type[Exception], message: str, param: str | None) -> Exception:
    """A jetflow.errors exception naming the request parameter at fault (the OpenAI body's `param`)."""
    exc = cls(message)
    exc.param = param  # type: ignore[attr-defined]
    return exc


class TextStream:
    """Growing token ids → text deltas whose concatenation is the final (stop-cut) text.

    Text that may still change is held back: a trailing incomplete UTF-8 sequence (decoded as
    U+FFFD) and a tail that could be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop, self.sent = tokenizer, list(stop), 0

    def update(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        safe = len(text.rstrip("\ufffd"))
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                safe = min(safe, cut)
                continue
            for k in range(min(len(s) - 1, len(text)), 0, -1):  # longest tail that begins s
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent:safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        return final_text[self.sent:]


class GenerationEngine:
    """A loaded target + head choice, serving generations concurrently on `decode_threads` threads."""

    def __init__(self, target, choice: HeadChoice, cfg: ServeConfig):
        self.target, self.choice, self.cfg = target, choice, cfg
        self.decoder = Decoder(target, choice.head if choice.speculative else None)
        self._pool = ThreadPoolExecutor(max_workers=cfg.decode_threads, thread_name_prefix="jetflow-decode")
        self._lock = threading.Lock()
        self.active = 0              # generations holding decoder state (started, not finished or dropped)

    # ------------------------------------------------------------------ requests → decoder inputs
    def encode(self, prompt: str | list[int] | list[dict], chat: bool) -> list[int]:
        """Completions: text fed as is (or token ids); chat: messages through the chat template."""
        param = "messages" if chat else "prompt"
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            if any(not 0 <= t < self.target.vocab_size for t in prompt):
                raise request_error(InvalidSettingError, "prompt token ids must be in "
                                    f"0..{self.target.vocab_size - 1}", param)
            ids = list(prompt)
        else:
            ids = self.decoder.encode(prompt, raw=not chat)
        if len(ids) > self.cfg.max_prompt_tokens:
            raise request_error(PromptTooLongError, f"the prompt has {len(ids)} tokens; this server accepts at "
                                f"most {self.cfg.max_prompt_tokens}: shorten it", param)
        return ids

    def decode_config(self, max_tokens: int | None, temperature: float, top_p: float, top_k: int,
                      stop: list[str], seed: int | None) -> DecodeConfig:
        """Request sampling settings + the served tree settings → a validated DecodeConfig."""
        n = self.cfg.default_max_tokens if max_tokens is None else max_tokens
        if n > self.cfg.max_tokens:
            raise request_error(InvalidSettingError, f"max_tokens {n} exceeds this server's limit of "
                                f"{self.cfg.max_tokens}; ask for fewer tokens", "max_tokens")
        tree = self.choice.tree if self.choice.speculative else TreeSpec(budget=1)
        return DecodeConfig(tree=tree, max_new_tokens=n, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop=stop, seed=seed)

    def usage(self, gen: Generation) -> Usage:
        s = gen.stats
        return Usage(prompt_tokens=s.prompt_tokens, completion_tokens=len(gen.token_ids),
                     total_tokens=s.prompt_tokens + len(gen.token_ids),
                     jetflow=JetFlowUsage(speculative=self.choice.speculative, head=self.choice.label,
                                          tree=self.choice.tree.to_dict() if self.choice.speculative else None,
                                          tau=round(s.tau, 4), rounds=s.rounds,
                                          tokens_per_s=round(s.tokens_per_s, 3), note=self.choice.note))

    # ------------------------------------------------------------------ generation
    async def events(self, ids: list[int], cfg: DecodeConfig) -> AsyncIterator[Event]:
        """Text deltas round by round; the last event carries the Generation. Errors the decoder
        raises for the request (prompt too long for the target, ...) come from the first step."""
        loop = asyncio.get_running_loop()
        rounds = self.decoder.stream(ids, cfg)
        text = TextStream(self.target.tokenizer, cfg.stop)
        self._enter()
        pending: Future | None = None
        state, held = None, True
        try:
            while True:
                pending = self._pool.submit(next, rounds, None)
                step = await asyncio.wrap_future(pending, loop=loop)
                pending = None
                if step is None:
                    break
                state = step
                delta = text.update(state.generated)
                if delta:
                    yield Event(delta, len(state.generated))
            gen = self.decoder.finish(state, cfg)
            held = False
            self._exit()  # before the last yield: a consumer may never come back for more
            yield Event(text.finish(gen.text), len(gen.token_ids), done=gen)
        finally:
            if held and pending is not None and not pending.done():
                # dropped mid-round (client gone): release the slot when that round ends
                pending.add_done_callback(lambda _: self._exit())
            elif held:
                self._exit()

    def _enter(self) -> None:
        with self._lock:
            self.active += 1

    def _exit(self) -> None:
        with self._lock:
            self.active -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
