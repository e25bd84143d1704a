"""Copy inputs: what the context says comes next, fed to the head as block inputs (head option `copy_ngram`).

A one-layer head drafts depth 1 well but cannot follow a copy further: nothing tells the MASK query at
depth k where the anchor's token stood k-1 places back (benchmarks/HISTORY.md, "Where HumanEval τ is lost").
So we find it for the head, prompt-lookup style: the longest suffix of the committed tokens (at most
`max_ngram` long) that occurred earlier, most recent occurrence first; the tokens that followed that
occurrence are the copy candidates for depths 1..D. The head sees each candidate's embedding (and how long
the match was) at the block position that drafts it, and learns when to trust it; the tree is still built
from the head's own distributions only.

Training and inference call the same function on the same tokens (the sequence up to and including the
anchor), so the train/infer parity of the head holds with copy inputs too.
"""

from __future__ import annotations

from typing import Sequence

import torch

NO_COPY = -1


def copy_candidates(tokens: Sequence[int], anchor: int, depth: int, max_ngram: int) -> tuple[list[int], int]:
    """For the anchor at index `anchor` of `tokens` (only tokens[:anchor + 1] are read): the candidates for
    depths 1..depth and the match length n (0: no earlier occurrence of the anchor's token; candidates
    are then all NO_COPY). The match is the longest n <= max_ngram with tokens[j-n+1..j] ==
    tokens[anchor-n+1..anchor] for some j < anchor, the largest such j; the candidates are
    tokens[j+1..j+depth], continued periodically past the anchor (a match p tokens back predicts a
    repetition with period p)."""
    last = tokens[anchor]
    best_n, best_j = 0, -1
    for j in range(anchor - 1, -1, -1):
        if tokens[j] != last:
            continue
        n = 1
        while n < max_ngram and j - n >= 0 and tokens[j - n] == tokens[anchor - n]:
            n += 1
        if n > best_n:
            best_n, best_j = n, j
            if n == max_ngram:
                break
    if best_n == 0:
        return [NO_COPY] * depth, 0
    period = anchor - best_j
    out = []
    for k in range(1, depth + 1):
        i = best_j + k
        while i > anchor:
            i -= period
        out.append(int(tokens[i]))
    return out, best_n


def copy_block_inputs(tokens: torch.Tensor | Sequence[int], anchors: Sequence[int], block_size: int,
                      max_ngram: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy inputs for blocks laid out one after another as in `block_inputs`: candidate ids and match
    lengths, (N*B,) long each; offset 0 (the anchor itself) carries none (NO_COPY, length 0)."""
    toks = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    ids = torch.full((len(anchors), block_size), NO_COPY, dtype=torch.long)
    lens = torch.zeros((len(anchors), block_size), dtype=torch.long)
    for row, a in enumerate(anchors):
        cand, n = copy_candidates(toks, int(a), block_size - 1, max_ngram)
        if n:
            ids[row, 1:] = torch.tensor(cand)
            lens[row, 1:] = n
    return ids.reshape(-1).to(device), lens.reshape(-1).to(device)


def copy_inputs(head, target, tokens: torch.Tensor | Sequence[int],
                anchors: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The `copy=` argument of `DraftHead.forward` for blocks at `anchors` of `tokens` (batch of one):
    candidate embeddings (1, N*B, H) from the target's frozen embedding and match lengths (1, N*B);
    None for a head without copy inputs."""
    cfg = head.config
    if not cfg.copy_ngram:
        return None
    ids, lens = copy_block_inputs(tokens, anchors, cfg.block_size, cfg.copy_ngram, device=target.device)
    with torch.no_grad():
        embeds = target.embed(ids.clamp(min=0))
    return embeds[None], lens[None]
