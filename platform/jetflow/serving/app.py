"""The OpenAI-compatible HTTP API (FastAPI) behind a Ray Serve deployment, and its app builder.

    serve run jetflow.serving.app:build_app                      # champion head, else plain decoding
    serve run jetflow.serving.app:build_app head=random budget=4
    serve deploy serve/config.yaml

Routes: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
GET /healthz. Every error is an OpenAI error body: 400 for a bad request (malformed JSON, schema,
ranges, prompt too long, max_tokens over the cap), 401 for a missing or wrong API key (when the app has
one; /healthz needs none), 404 for an unknown model or route, never a 500 for anything a client can send.
With no explicit head a replica follows the registry's alias (`jetflow.serving.champion`). `backend: vllm`
puts vLLM's engine behind the same routes (`jetflow.serving.vllm_backend`, which says why not ray.serve.llm).
"""

# No `from __future__ import annotations` here: Ray Serve reads `build_app`'s parameter annotation
# as a class to validate the builder args with pydantic.

import asyncio
import itertools
import json
import logging
import os
import re
import time
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from jetflow.engine import RequestTimeoutError
from jetflow.errors import ExportUnsupportedError, JetFlowError, PromptTooLongError, UnknownModelError
from jetflow.serving import choices
from jetflow.serving.auth import BearerAuth, key_from_env, set_replica_key
from jetflow.serving.config import ServeConfig
from jetflow.serving.choices import Choice, choice_id
from jetflow.serving.engine import EngineLoop, GenerationEngine, QueueFullError, request_error
from jetflow.serving.logprobs import chat_logprobs, completion_logprobs
from jetflow.serving.selection import check_head_exists
from jetflow.serving.schema import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChunkChoice,
    CompletionChoice, CompletionRequest, CompletionResponse, Delta, DetokenizeRequest, DetokenizeResponse, ErrorBody,
    ErrorDetail, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
)

# Serve attaches the request id to records of this logger emitted while handling a request.
log = logging.getLogger("ray.serve")

api = FastAPI(title="JetFlow", description="OpenAI-compatible API over tree speculative decoding",
              version="0.1.0")


# ------------------------------------------------------------------------------- error bodies


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump())


def status_of(exc: Exception) -> tuple[int, str | None]:
    """(HTTP status, OpenAI error code) of a user-caused JetFlowError."""
    if isinstance(exc, UnknownModelError):
        return 404, "model_not_found"
    if isinstance(exc, PromptTooLongError):
        return 400, "context_length_exceeded"
    if isinstance(exc, QueueFullError):
        return 429, "rate_limit_exceeded"
    if isinstance(exc, RequestTimeoutError):
        return 504, "timeout"
    return 400, None


@api.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    # OpenAI answers 400 (not FastAPI's 422) with one message naming the offending parameter.
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body ({err.get('ctx', {}).get('error', err['msg'])}); "
                                   "send a JSON object", code="invalid_json")
    if err.get("type") == "extra_forbidden":
        return error_response(400, f"unknown parameter {param!r}", param=param, code="unknown_parameter")
    if err.get("type") == "missing" and param is None:
        return error_response(400, "the request needs a JSON object body", code="invalid_json")
    message = err["msg"].removeprefix("Value error, ")
    if param is None and (named := re.match(r"(\w+): ", message)):  # a check across fields names its parameter
        return error_response(400, message, param=named.group(1))
    return error_response(400, f"{param}: {message}" if param else message, param=param)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail),
                          code="not_found" if exc.status_code == 404 else None)


@api.exception_handler(JetFlowError)
async def _user_error(request: Request, exc: JetFlowError) -> JSONResponse:
    status, code = status_of(exc)
    kind = {429: "rate_limit_error", 504: "timeout_error"}.get(status, "invalid_request_error")
    return error_response(status, str(exc), param=getattr(exc, "param", None), code=code, type_=kind)


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    return error_response(500, f"internal error ({exc.__class__.__name__}); see the server log",
                          type_="server_error")


# before routing and body parsing: a request without the key learns nothing, not even a 400
api.add_middleware(BearerAuth)


# ------------------------------------------------------------------------------- deployment


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _chunk_dict(chunk: ChatCompletionChunk | CompletionResponse) -> dict:
    out = chunk.model_dump(mode="json")
    for choice in out["choices"]:  # a delta carries only what changed
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return out


@serve.deployment(name="JetFlow", health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress(api)
class JetFlowServer:
    """One replica: the target, the chosen head and a GenerationEngine — the batched engine, stepped by its
    own thread; requests join and leave its batch at every step. Following the registry's alias, it swaps in a
    new GenerationEngine when the alias moves: each request keeps the one it started on."""

    def __init__(self, config: dict):
        import psutil
        import torch

        from jetflow.serving.metrics import ServingMetrics
        from jetflow.serving.selection import check_registry_reachable, choose_head

        started = time.perf_counter()
        cfg = ServeConfig.model_validate(config)
        set_replica_key(cfg.api_key)
        if cfg.tracking_uri:  # this replica's process reads the registry from there
            os.environ["MLFLOW_TRACKING_URI"] = cfg.tracking_uri
        check_registry_reachable(cfg)  # before the weights load
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        if cfg.backend == "vllm":  # vLLM loads the weights in its own processes: here the tokenizer and config
            from jetflow.serving.vllm_backend import VllmEngines, VllmTarget

            target, self.loop = VllmTarget.load(cfg.model), VllmEngines()
        else:
            from jetflow.target import TargetModel
            from jetflow.target.placement import placement

            device, dtype = placement(cfg.device or ("cuda" if cfg.replica_gpus > 0 else "cpu"), cfg.dtype)
            target = TargetModel.load(cfg.model, device=device, dtype=dtype)
            self.loop = EngineLoop(target.tokenizer)
        loaded = time.perf_counter()
        choice = choose_head(cfg, target)
        self.cfg, self.target, self.metrics = cfg, target, ServingMetrics()
        self.start_s = {"target": round(loaded - started, 1), "head": round(time.perf_counter() - loaded, 1)}
        # what a new request runs on; swapped when the alias moves
        self.engine = self._engine_for(choice, timings=self.start_s)
        self.start_s["total"] = round(time.perf_counter() - started, 1)
        self.model_id = cfg.served_name or target.model_id
        self._process = psutil.Process()
        self._created = int(time.time())
        self._seq = itertools.count()
        log.info("replica ready in %.1f s: %s", self.start_s["total"],
                 ", ".join(f"{k} {v} s" for k, v in self.start_s.items() if k != "total"))
        if self.engine.choice.speculative:
            log.info("serving %s (%s): %s; %d torch threads", self.model_id, target.revision, self.engine.describe(),
                     torch.get_num_threads())
        else:
            log.warning("serving %s (%s) WITHOUT speculation: %s", self.model_id, target.revision,
                        self.engine.describe())
        self._follower = None
        if cfg.head is None and cfg.champion_poll_s > 0:
            from jetflow.serving.champion import ChampionFollower

            self._follower = ChampionFollower(cfg, target, choice.version, self._switch)

    def _engine_for(self, choice, measure=None, timings: dict | None = None) -> GenerationEngine:
        """A GenerationEngine serving `choice` on this replica's loop (its head moved to the target's device; the
        auto policy's step cost curve: given, else measured once per machine and head shape — by `measure`, which
        runs it where the caller wants it run). Its compiled graphs, if any, are compiled before it returns.
        `timings` (given): the seconds of the curve and of the engine are written into it."""
        cfg, target = self.cfg, self.target
        t0 = time.perf_counter()
        if cfg.backend == "vllm":  # a new vLLM engine (its own processes) beside the running one
            from jetflow.serving.vllm_backend import VllmEngine

            engine = VllmEngine(target, choice, cfg, self.loop)
            if timings is not None:
                timings["engine"] = round(time.perf_counter() - t0, 1)
            return engine
        if choice.head is not None:
            choice.head.to(device=target.device, dtype=target.dtype)
        curve = None
        if choice.speculative and cfg.policy == "auto":
            from jetflow.engine.cost import StepCostCurve, cached_step_curve
            from jetflow.stepcore.modes import resolve_graphs, target_key

            graphs = resolve_graphs(cfg.graphs, target_key(target, cfg.max_slots), target.device.type)[0]
            graphs = "compile" if graphs == "calibrate" else graphs  # the curve of the steps this replica runs
            curve = (StepCostCurve.load(cfg.cost_curve) if cfg.cost_curve else (measure or (lambda f: f()))(
                lambda: cached_step_curve(target, choice.head, max_slots=cfg.max_slots, max_budget=choice.tree.budget,
                                          graphs=graphs)))
        t1 = time.perf_counter()
        engine = GenerationEngine(target, choice, cfg, self.loop, cost_curve=curve, budget_table=choice.budget_table,
                                  tau_prior=choice.tau_prior)
        if timings is not None:  # seconds of this build (/healthz start_s): the step cost curve (measured once per
            # machine, else read) and the engine (graphs=compile: its graphs, compiled or from inductor's caches)
            timings.update(cost_curve=round(t1 - t0, 1), engine=round(time.perf_counter() - t1, 1))
        return engine

    def _switch(self, choice) -> None:
        """Serve `choice` from the next request on (called by the follower's thread). The new engine is built here,
        beside the running engine — its compiled graphs too: the target's are the process's already, a new head's
        draft graph compiles now — so running streams keep flowing; a step cost curve this machine has not
        measured yet is measured on the engine thread between two steps (timed alone, no target work beside it).
        Then new requests go to the new engine; the old one keeps stepping its requests to their end, then is
        dropped."""
        t0 = time.perf_counter()
        try:
            new = self._engine_for(choice, measure=lambda fn: self.loop.call(fn).result())
        except ExportUnsupportedError as exc:  # backend vllm, a head vLLM cannot run: the current one stays served
            log.warning("not switching to %s: %s; still serving %s", choice.label, exc, self.engine.describe())
            return
        old, self.engine = self.engine, new
        old.retire()
        log.info("now serving %s: built in %.2f s beside the running engine; %d running requests finish on %s",
                 f"head {choice.label}, tree {choice.tree.to_dict()}" if choice.speculative else
                 f"plain decoding ({choice.note})", time.perf_counter() - t0, old.active + old.queued,
                 old.choice.label or "plain decoding")

    # ------------------------------------------------------------------ info routes
    def check_health(self) -> None:
        """Serve's replica health check: a dead or stuck engine thread makes the replica unhealthy (Serve
        then replaces it)."""
        ok, why = self.loop.healthy()
        if not ok:
            raise RuntimeError(why)

    @api.get("/healthz")
    def healthz(self) -> JSONResponse:
        """Liveness plus what a load test wants to see: running and queued generations, resident memory."""
        ok, why = self.loop.healthy()
        body = {"status": "ok" if ok else why, "model": self.model_id, "backend": self.cfg.backend,
                "runs": self.engine.describe(), "speculative": self.engine.choice.speculative,
                "head_version": self.engine.choice.version, "engines": self.loop.engines,
                "active": self.loop.active, "queued": self.loop.queued, "slots": self.cfg.max_slots,
                "steps": self.loop.steps, "pid": os.getpid(), "rss_bytes": self._process.memory_info().rss,
                "start_s": self.start_s, **self.engine.graphs_info()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @api.get("/v1/models")
    def models(self) -> ModelList:
        choice = self.engine.choice
        info = {"target": self.engine.target.model_id, "revision": self.engine.target.revision,
                "backend": self.cfg.backend, "runs": self.engine.describe(), "speculative": choice.speculative, "head": choice.label, "head_version": choice.version,
                "follows": ({"alias": self.cfg.alias, "poll_s": self.cfg.champion_poll_s} if self._follower else None),
                "tree": choice.tree.to_dict() if choice.speculative else None, "note": choice.note,
                "max_prompt_tokens": self.cfg.max_prompt_tokens, "max_tokens": self.cfg.max_tokens}
        return ModelList(data=[ModelCard(id=self.model_id, created=self._created, jetflow=info)])

    # ------------------------------------------------------------------ tokenizer routes (vLLM's)
    # lm-evaluation-harness's local-completions probes /tokenizer_info and /tokenize and, when both answer, uses
    # the served tokenizer (tokenizer_backend=remote): a client needs no copy of the model's files.
    @api.get("/tokenizer_info")
    def tokenizer_info(self) -> dict:
        tok = self.target.tokenizer
        return {"tokenizer_class": type(tok).__name__, "model_max_length": self._max_model_len,
                "chat_template": getattr(tok, "chat_template", None),
                **{name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}}

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self._check_model(body.model)
        tok = self.target.tokenizer
        if body.messages is not None:
            text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                           add_generation_prompt=body.add_generation_prompt, tokenize=False)
            ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=False)
        else:
            ids = await asyncio.to_thread(tok.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self._max_model_len, tokens=ids)

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        self.engine.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.target.tokenizer.decode, body.tokens))

    @property
    def _max_model_len(self) -> int:
        """Prompt + completion tokens one request may hold."""
        return self.cfg.max_prompt_tokens + self.cfg.max_tokens

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise request_error(UnknownModelError, f"model {model!r} is not served here; use {self.model_id!r} "
                                "(GET /v1/models)", "model")

    # ------------------------------------------------------------------ generation routes
    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        k = body.logprobs
        return await self._serve("completions", request, body, body.prompts, chat=False, max_tokens=body.max_tokens,
                                 respond=self._completion_response, stream=self._completion_stream, logprobs=k,
                                 prompt_logprobs=k if body.echo and k is not None else None)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._serve("chat", request, body, [body.chat()], chat=True, max_tokens=body.requested_tokens,
                                 respond=self._chat_response, stream=self._chat_stream,
                                 logprobs=(body.top_logprobs or 0) if body.logprobs else None)

    async def _serve(self, endpoint: str, request: Request, body, prompts: list, chat: bool, max_tokens: int | None,
                     respond: Callable, stream: Callable, logprobs: int | None = None,
                     prompt_logprobs: int | None = None):
        """One request: a choice per prompt (`jetflow.serving.choices`), decoded side by side."""
        t0 = time.perf_counter()
        # Serve's request id: the client's x-request-id when it sent one, else the one Serve gave it (echoed
        # in the response's x-request-id header)
        rid = request.headers.get("x-request-id") or f"{os.getpid()}-{next(self._seq)}"
        engine = self.engine  # this request's head and engine, to its end (a new champion serves the next one)
        try:
            self._check_model(body.model)
            # tokenizing off the event loop
            ids = await asyncio.to_thread(lambda: [engine.encode(p, chat) for p in prompts])
            dcfg = engine.decode_config(max_tokens, body.temperature, body.top_p, body.top_k, body.stop, body.seed,
                                        logprobs, prompt_logprobs)
            engine.check_room(len(ids))
            picks = [Choice(i, x, p) for i, (x, p) in enumerate(zip(ids, prompts))]
            await choices.start(engine, rid, picks, dcfg)  # request errors surface before any byte is sent
        except JetFlowError as exc:
            self.metrics.finished(endpoint, status_of(exc)[0], time.perf_counter() - t0)
            log.info("%s %s rejected: %s", endpoint, rid, exc)
            raise
        except asyncio.CancelledError:  # the client left: Serve cancels this call (the cancellation raised inside
            self._gone(endpoint, rid, t0, 0)  # `events` cancels the engine request there)
            raise
        self.metrics.active.set(self.loop.active)
        log.info("%s %s: %d prompt tokens%s, max_tokens %d, temperature %s, stream %s", endpoint, rid,
                 sum(len(x) for x in ids), f" in {len(ids)} prompts" if len(ids) > 1 else "", dcfg.max_new_tokens,
                 dcfg.temperature, body.stream)
        if body.stream:
            chunks = stream(engine, rid, picks, body, self._first_text(endpoint, t0))
            return StreamingResponse(self._timed(engine, endpoint, rid, t0, chunks), media_type="text/event-stream")
        try:
            gens = await choices.finish(picks)
        except JetFlowError as exc:  # e.g. the deadline passed while it ran
            self.metrics.finished(endpoint, status_of(exc)[0], time.perf_counter() - t0)
            log.info("%s %s ended: %s", endpoint, rid, exc)
            raise
        except asyncio.CancelledError:
            self._gone(endpoint, rid, t0, sum(c.last.tokens for c in picks if c.last))
            raise
        self._record(endpoint, rid, t0, gens, engine=engine)
        return respond(engine, rid, picks, gens, body)

    def _record(self, endpoint: str, rid: str, t0: float, gens: list | None, status: int = 200,
                engine: GenerationEngine | None = None) -> None:
        seconds = time.perf_counter() - t0
        self.metrics.finished(endpoint, status, seconds)
        self.metrics.active.set(self.loop.active)
        for i, gen in enumerate(gens or []):
            s = gen.stats
            self.metrics.generation(engine.choice.speculative, s.tau, s.tokens_per_s, len(gen.token_ids))
            log.info("%s %s done: %d tokens (%s), %d rounds, tau %.2f, %.1f tok/s, %.2f s", endpoint,
                     choice_id(rid, i, len(gens)), len(gen.token_ids), gen.finish_reason, s.rounds, s.tau,
                     s.tokens_per_s, seconds)

    def _gone(self, endpoint: str, rid: str, t0: float, tokens: int) -> None:
        """A client that left before its response was complete: recorded as 499 (nginx's convention)."""
        self._record(endpoint, rid, t0, None, status=499)
        log.info("%s %s closed by the client after %d tokens", endpoint, rid, tokens)

    async def _timed(self, engine: GenerationEngine, endpoint: str, rid: str, t0: float,
                     chunks: AsyncIterator[tuple[str, list]]):
        """SSE bytes out; latency and a client that left early. `chunks`: (payload, every choice's latest event)."""
        events: list = []
        try:
            async for payload, events in chunks:
                yield payload
        except (asyncio.CancelledError, GeneratorExit):  # the client disconnected
            self._gone(endpoint, rid, t0, sum(e.tokens for e in events if e is not None))
            raise
        except Exception as exc:  # headers are out: end the stream with an OpenAI error event
            log.exception("%s %s failed mid-stream", endpoint, rid)
            self._record(endpoint, rid, t0, None, status=500)
            body = ErrorBody(error=ErrorDetail(message=f"internal error ({exc.__class__.__name__}); see the "
                                                       "server log", type="server_error"))
            yield _sse(body.model_dump())
            return
        done = [e.done for e in events if e is not None and e.done is not None]
        self._record(endpoint, rid, t0, done if len(done) == len(events) else None, engine=engine)

    def _first_text(self, endpoint: str, t0: float) -> Callable[[], None]:
        """Called by a stream at its first non-empty text: records time to first token once."""
        seen = []

        def mark() -> None:
            if not seen:
                seen.append(True)
                self.metrics.first_token.observe(time.perf_counter() - t0, tags={"endpoint": endpoint})

        return mark

    # ------------------------------------------------------------------ OpenAI shapes
    def _completion_response(self, engine: GenerationEngine, rid: str, picks: list[Choice], gens: list,
                             body: CompletionRequest) -> CompletionResponse:
        show = body.max_tokens != 0  # max_tokens 0 (echo): one token decoded, none shown
        out = []
        for c, gen in zip(picks, gens):
            tokens, entries = [], []
            if body.echo:
                tokens, entries = list(c.ids), [None, *(gen.prompt_logprobs or [])]
            if show:
                tokens += gen.token_ids
                entries += gen.logprobs or []
            lp = completion_logprobs(engine.token_text, tokens, entries) if body.logprobs is not None else None
            text = (self._prompt_text(engine, c) if body.echo else "") + (gen.text if show else "")
            out.append(CompletionChoice(index=c.index, text=text, finish_reason=gen.finish_reason, logprobs=lp))
        return CompletionResponse(id=f"cmpl-{rid}", model=self.model_id, choices=out,
                                  usage=engine.usage(gens, completion_tokens=None if show else 0))

    @staticmethod
    def _prompt_text(engine: GenerationEngine, c: Choice) -> str:
        """What echo returns: the prompt as sent, or its token ids' text."""
        return c.prompt if isinstance(c.prompt, str) else engine.target.tokenizer.decode(c.ids,
                                                                                          skip_special_tokens=False)

    def _chat_response(self, engine: GenerationEngine, rid: str, picks: list[Choice], gens: list,
                       body: ChatCompletionRequest) -> ChatCompletionResponse:
        gen = gens[0]
        lp = chat_logprobs(engine.token_text, gen.logprobs) if body.logprobs else None
        return ChatCompletionResponse(
            id=f"chatcmpl-{rid}", model=self.model_id, usage=engine.usage(gen),
            choices=[ChatChoice(message=AssistantMessage(content=gen.text), finish_reason=gen.finish_reason,
                                logprobs=lp)])

    async def _chat_stream(self, engine: GenerationEngine, rid: str, picks: list[Choice], body: ChatCompletionRequest,
                           on_text: Callable[[], None]):
        cid = f"chatcmpl-{rid}"

        def chunk(delta: Delta, finish: str | None = None, logprobs: list | None = None) -> str:
            lp = chat_logprobs(engine.token_text, logprobs) if logprobs else None
            return _sse(_chunk_dict(ChatCompletionChunk(id=cid, model=self.model_id, choices=[
                ChunkChoice(delta=delta, finish_reason=finish, logprobs=lp)])))

        latest = [picks[0].first]
        yield chunk(Delta(role="assistant", content="")), latest
        async for _, event in choices.merged(picks):
            latest = [event]
            if event.text or event.logprobs:
                if event.text:
                    on_text()
                yield chunk(Delta(content=event.text), logprobs=event.logprobs if body.logprobs else None), latest
        gen = event.done
        yield chunk(Delta(), finish=gen.finish_reason), latest
        if body.include_usage:
            final = ChatCompletionChunk(id=cid, model=self.model_id, choices=[], usage=engine.usage(gen))
            yield _sse(final.model_dump(mode="json")), latest
        yield _sse("[DONE]"), latest

    async def _completion_stream(self, engine: GenerationEngine, rid: str, picks: list[Choice],
                                 body: CompletionRequest, on_text: Callable[[], None]):
        """Each choice's chunks in order (a batch interleaves them, by `index`); with echo each choice's first chunk
        is its prompt. max_tokens 0: the prompt only."""
        cid = f"cmpl-{rid}"
        show = body.max_tokens != 0
        offsets = [0] * len(picks)       # each choice's text_offset so far (the logprobs' token texts)
        latest = [c.first for c in picks]

        def chunk(c: Choice, text: str, finish: str | None = None, tokens=(), entries=()) -> str:
            lp = None
            if body.logprobs is not None and tokens:
                lp = completion_logprobs(engine.token_text, tokens, entries, offsets[c.index])
                offsets[c.index] = lp.text_offset[-1] + len(lp.tokens[-1])
            return _sse(CompletionResponse(id=cid, model=self.model_id, choices=[
                CompletionChoice(index=c.index, text=text, finish_reason=finish, logprobs=lp)]).model_dump(
                mode="json", exclude={"usage"}))

        async for c, event in choices.merged(picks):
            latest[c.index] = event
            if body.echo and event is c.first:
                yield chunk(c, self._prompt_text(engine, c), tokens=c.ids,
                            entries=[None, *(event.prompt_logprobs or [])]), latest
            new = (event.logprobs or []) if show else []
            if (event.text and show) or (new and body.logprobs is not None):
                if event.text and show:
                    on_text()
                yield chunk(c, event.text if show else "", tokens=[e.token for e in new], entries=new), latest
            if event.done is not None:
                yield chunk(c, "", finish=event.done.finish_reason), latest
        if body.include_usage:
            gens = [e.done for e in latest]
            final = CompletionResponse(id=cid, model=self.model_id, choices=[],
                                       usage=engine.usage(gens, completion_tokens=None if show else 0))
            yield _sse(final.model_dump(mode="json")), latest
        yield _sse("[DONE]"), latest

    def __del__(self):
        follower, loop = getattr(self, "_follower", None), getattr(self, "loop", None)
        if follower is not None:
            follower.stop()
        if loop is not None:
            loop.close()


def build_app(args: ServeConfig) -> Application:
    """The Ray Serve application for `args` (a ServeConfig, or a dict of its fields). On a multi-node cluster a
    `tracking_uri` given as a loopback address is handed to the replicas as this node's cluster address."""
    from jetflow.cluster import reachable_from_workers

    cfg = args if isinstance(args, ServeConfig) else ServeConfig.model_validate(args or {})
    cfg = key_from_env(cfg)
    if cfg.tracking_uri:
        cfg = cfg.model_copy(update={"tracking_uri": reachable_from_workers(cfg.tracking_uri)})
    check_head_exists(cfg)
    if cfg.backend == "vllm":  # no vLLM here, or a head it cannot run: one line now, no replica started
        from jetflow.serving.vllm_backend import check_vllm_backend

        check_vllm_backend(cfg)
    return JetFlowServer.options(
        autoscaling_config=cfg.autoscaling_config(),
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests + cfg.max_slots,  # the proxy's own backstop (503)
        ray_actor_options={"num_cpus": cfg.replica_cpus, "num_gpus": cfg.replica_gpus},
        logging_config={"log_level": cfg.log_level},
    ).bind(cfg.model_dump())
