"""A request's choices: one engine request per prompt (a completions batch — a list of texts or of token-id lists —
has several; everything else one), submitted together so that they decode side by side in the engine's batch, and
answered in `index` order. The first error of any choice ends them all: the others' engine requests are
cancelled (their slots freed at the next step) and the error goes to the client."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from jetflow.decode import DecodeConfig, Generation
from jetflow.serving.engine import Event, GenerationEngine


@dataclass
class Choice:
    index: int
    ids: list[int]                          # the prompt's token ids
    prompt: str | list[int]                 # as the client sent it (echo returns its text)
    events: AsyncIterator[Event] | None = field(default=None, repr=False)
    first: Event | None = None              # its first event (the first tokens, or its end)
    last: Event | None = None               # its latest event


def choice_id(rid: str, index: int, count: int) -> str:
    """The engine request id of choice `index` of `count` (one choice: the request's own id)."""
    return rid if count == 1 else f"{rid}-{index}"


async def _all_or_none(aws: list, on_error) -> list:
    """Await every awaitable concurrently; on the first exception cancel the rest, run `on_error()`, raise it."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is None:
            return [t.result() for t in tasks]
    except asyncio.CancelledError:   # the client left: every choice's request is cancelled (their `finally`)
        failed = None
        raise
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if failed is not None:
            await on_error()
    raise failed.exception()


async def start(engine: GenerationEngine, rid: str, choices: list[Choice], cfg: DecodeConfig) -> None:
    """Submit every choice and wait for each one's first event: request errors (a full replica, a prompt that
    does not fit) surface before any byte is sent."""
    for c in choices:
        c.events = engine.events(choice_id(rid, c.index, len(choices)), c.ids, cfg)

    async def first(c: Choice) -> None:
        c.first = c.last = await anext(c.events)

    await _all_or_none([first(c) for c in choices], lambda: close(choices))


async def close(choices: list[Choice]) -> None:
    """End every choice's engine request (those still running are cancelled)."""
    await asyncio.gather(*(c.events.aclose() for c in choices if c.events is not None), return_exceptions=True)


async def finish(choices: list[Choice]) -> list[Generation]:
    """Every choice run to its end, concurrently → their Generations in index order."""
    async def run(c: Choice) -> Generation:
        while c.last.done is None:
            c.last = await anext(c.events)
        return c.last.done

    gens = await _all_or_none([run(c) for c in choices], lambda: close(choices))
    await close(choices)  # each generator past its last event (nothing left to cancel)
    return gens


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Event]]:
    """Every choice's events (the first included) as they come, each choice's in order; several choices
    interleave. Closing this iterator early cancels the choices still running."""
    if len(choices) == 1:  # the common case, without tasks
        c = choices[0]
        try:
            yield c, c.first
            while c.last.done is None:
                c.last = await anext(c.events)
                yield c, c.last
        finally:
            await close(choices)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            await queue.put((c, c.first))
            while c.last.done is None:
                c.last = await anext(c.events)
                await queue.put((c, c.last))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((c, exc))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        ended = 0
        while ended < len(choices):
            c, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            ended += item.done is not None
            yield c, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close(choices)
