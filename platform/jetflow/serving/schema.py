"""OpenAI request/response shapes for /v1/completions, /v1/chat/completions and /v1/models.

Requests are validated here (ranges, required fields, unknown fields); what depends on the served
application (max_tokens cap, prompt length, model id) is checked by the engine and the app. Any
validation error becomes a 400 with the OpenAI error body (`ErrorBody`), never FastAPI's 422.
Responses add speculative-decoding stats under `usage.jetflow` (`JetFlowUsage`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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

    @field_validator("presence_penalty", "frequency_penalty", "logprobs", "echo", "suffix", check_fields=False)
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
    """POST /v1/completions: the prompt is fed as is (no chat template)."""

    prompt: str | list[int] | list[str] = Field(description="text, token ids, or a list with one text")
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (send several requests for a batch)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v


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
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None

    @field_validator("top_logprobs", "tools")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported by this server")
        return v

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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


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
    logprobs: None = None


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


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
