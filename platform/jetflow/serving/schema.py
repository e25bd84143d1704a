"""OpenAI request/response shapes for /v1/completions, /v1/chat/completions and /v1/models.

Requests are validated here (ranges, required fields, unknown fields); what depends on the served
application (max_tokens cap, prompt length, model id) is checked by the engine and the app. Any
validation error becomes a 400 with the OpenAI error body (`ErrorBody`), never FastAPI's 422.
Responses add speculative-decoding stats under `usage.jetflow` (`JetFlowUsage`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jetflow.decode.config import MAX_TOP_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5   # OpenAI's cap on completions' `logprobs` (chat's `top_logprobs`: MAX_TOP_LOGPROBS, 20)


class _Request(BaseModel):
    # OpenAI rejects parameters it does not know; so do we (a typo must not be silently ignored).
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by both endpoints. Temperature 0 = greedy (lossless: identical to AR greedy)."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="extension (as vLLM): 0 = off")
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = None
    user: str | None = None
    # Accepted only at their neutral values: the decoder samples from the target distribution as is.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("presence_penalty", "frequency_penalty", "suffix", check_fields=False)
    @classmethod
    def _neutral_only(cls, v: Any) -> Any:
        if v not in (None, False, 0, 0.0, ""):
            raise ValueError("not supported by this server (only its neutral value: unset, 0 or false)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions: the prompt is fed as is (no chat template). A batch (a list of texts or of token-id
    lists) is answered with one choice per prompt, in `index` order."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a batch: a list of texts or a list of token-id lists")
    max_tokens: int | None = Field(None, ge=0, description="0: with echo, the prompt's logprobs only")
    echo: bool = Field(False, description="the prompt before the completion (with logprobs: its tokens' too)")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="each token's log-probability and its k likeliest alternatives")
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_shape(cls, v: Any) -> Any:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if not (isinstance(v, str) or ids(v) or (isinstance(v, list) and (all(isinstance(p, str) for p in v)
                                                                          or all(ids(p) for p in v)))):
            raise ValueError("give a text, a list of token ids, or a batch: a list of texts or a list of token-id "
                             "lists (one kind per request)")
        return v

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, v: str | list[int] | list[str] | list[list[int]]):
        if not v:
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)):
            empty = [i for i, p in enumerate(v) if not p]
            if empty:
                raise ValueError(f"prompt {empty[0]} of the batch is empty")
        return v

    @model_validator(mode="after")
    def _zero_tokens_only_to_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 asks for no completion; it is only for echo (the prompt's logprobs)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt (text or token ids) per choice."""
        v = self.prompt
        return list(v) if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: messages rendered with the target's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="newer name of max_tokens")
    logprobs: bool | None = Field(None, description="each generated token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="with logprobs: the k likeliest alternatives of each token")
    tools: list[dict] | None = None

    @field_validator("tools")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported by this server")
        return v

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: set logprobs to true to use top_logprobs")
        return self

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        # the template knows system/user/assistant; "developer" is OpenAI's newer name for system
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# ----------------------------------------------------------------------------------- responses


class JetFlowUsage(BaseModel):
    """Speculative-decoding stats of one response. τ = tokens committed per target verify forward."""

    speculative: bool
    backend: str = "jetflow"          # what decoded it: JetFlow's engine, or vLLM (ServeConfig.backend)
    head: str | None                  # "models:/NAME/VERSION", a head folder, "random", or None (plain)
    head_version: str | None = None   # the registry version that served this request ("3"); None if not registered
    tree: dict[str, Any] | None       # the TreeSpec served: {"algorithm", "budget", "width"[, "params"]}
    tau: float
    rounds: int                       # target verify forwards
    tokens_per_s: float               # decode throughput, prefill excluded
    note: str | None = None           # e.g. "no champion registered ...: plain decoding"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    jetflow: JetFlowUsage


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs: per token its text, log-probability (None for an echoed prompt's first
    token), its alternatives {text: log-prob} (the k likeliest, plus the token itself) and its character offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None            # the token's UTF-8 bytes (a token may hold part of a character)


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]     # the k likeliest tokens at this position, most likely first


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: list[TokenLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jetflow"
    jetflow: dict[str, Any]           # target revision, head, tree settings, speculative, note


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's route, which lm-evaluation-harness probes): a text, or chat messages rendered with the
    chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages, exactly one")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
