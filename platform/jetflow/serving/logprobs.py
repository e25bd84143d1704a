"""OpenAI's logprobs objects from the engine's `TokenLogprob`s (`jetflow.decode.logprobs`): the legacy completions
shape (tokens, token_logprobs, top_logprobs as {text: log-prob}, text_offset; an echoed prompt's first token has
no log-probability: null, as OpenAI and vLLM) and the chat shape (content: token, logprob, bytes, top_logprobs).

The values are the target's raw distribution (before temperature, top-k, top-p): what the model thinks of each
token, whatever the request's sampling settings.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from jetflow.decode.logprobs import TokenLogprob
from jetflow.serving.schema import ChatLogprobs, CompletionLogprobs, TokenLogprobEntry, TopLogprob

LOGPROB_FLOOR = -9999.0   # OpenAI's stand-in for -inf (JSON has no infinity)


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's table: printable Latin-1 bytes stand for themselves, the
    other 68 bytes for code points 256 + i) → the byte each stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenText:
    """Token id → (its text decoded alone, special tokens kept; its bytes). A byte-level tokenizer's pieces give
    their own bytes, so a token holding part of a UTF-8 character says which bytes (its text shows U+FFFD);
    other tokenizers' bytes are the text's UTF-8."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            piece = self.tokenizer.convert_ids_to_tokens(token)
            alphabet = _byte_level_alphabet()
            if (isinstance(piece, str) and piece and token not in self._special
                    and all(c in alphabet for c in piece)):
                raw = [alphabet[c] for c in piece]
            else:
                raw = list(text.encode("utf-8"))
            hit = self._cache[token] = (text, raw)
        return hit


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(texts: TokenText, tokens: Sequence[int], entries: Sequence[TokenLogprob | None],
                        start: int = 0) -> CompletionLogprobs:
    """`tokens` with their `entries` (None: no log-probability, an echoed prompt's first token) → the legacy
    completions object; offsets count characters from `start` (the echoed prompt's length, when it is not part
    of these tokens)."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = start
    for token, entry in zip(tokens, entries):
        text = texts(token)[0]
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(entry.logprob))
        top: dict[str, float] = {}
        for alt, lp in entry.top:  # the likeliest first: a text two tokens share keeps the likelier
            top.setdefault(texts(alt)[0], _value(lp))
        top.setdefault(text, _value(entry.logprob))  # OpenAI: the token itself is always there (k + 1 at most)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(texts: TokenText, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """Generated tokens' entries → the chat object (each with its top alternatives as the request asked)."""
    def top(token: int, logprob: float) -> TopLogprob:
        text, raw = texts(token)
        return TopLogprob(token=text, logprob=_value(logprob), bytes=raw)

    return ChatLogprobs(content=[TokenLogprobEntry(**top(e.token, e.logprob).model_dump(),
                                                   top_logprobs=[top(t, lp) for t, lp in e.top]) for e in entries])
