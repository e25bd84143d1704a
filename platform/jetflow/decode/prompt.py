"""Turn a user prompt (or chat messages) into target token ids."""

from __future__ import annotations

from typing import Sequence


def encode_prompt(tokenizer, prompt: str | Sequence[dict], raw: bool = False) -> list[int]:
    """A string is a user turn rendered with the chat template (`add_generation_prompt=True`) when
    the tokenizer has one; `raw=True` feeds the text as is. A list is chat messages."""
    if isinstance(prompt, str):
        if raw or not getattr(tokenizer, "chat_template", None):
            return tokenizer.encode(prompt, add_special_tokens=True)
        messages: Sequence[dict] = [{"role": "user", "content": prompt}]
    else:
        messages = prompt
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer, prompt: str | Sequence[dict] | Sequence[int], raw: bool = False) -> list[int]:
    """Text (a user turn, chat-templated unless raw), chat messages, or token ids → token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
        return encode_prompt(tokenizer, prompt, raw=raw)  # type: ignore[arg-type]
    return [int(t) for t in prompt]  # type: ignore[union-attr]


def stop_token_ids(target) -> set[int]:
    """EOS ids from the tokenizer and the generation config."""
    ids: set[int] = set()
    tok_eos = getattr(target.tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(int(tok_eos))
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return ids
