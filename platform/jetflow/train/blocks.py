"""Training blocks (METHOD.md §2): random anchors in the response region, and the block-causal mask
under which all blocks of a sequence go through one head forward.

KV = [context S tokens | block_0 | ... | block_{N-1}]. A query at block b, offset i sees context
positions < a_b and offsets <= i of its own block (all offsets for the bidirectional head) — exactly
what the same block sees at inference, where the anchor a_b is the last committed token.
"""

from __future__ import annotations

import torch


def sample_anchors(response_start: int, length: int, block_size: int, max_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to `max_anchors` distinct sorted anchor positions a with response_start - 1 <= a <= length - block_size,
    so every drafted position a+1..a+B-1 is a response token. (N,) long; empty if no room."""
    lo, hi = max(response_start - 1, 0), length - block_size
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    count = hi - lo + 1
    if count <= max_anchors:
        return torch.arange(lo, hi + 1)
    return (torch.randperm(count, generator=generator)[:max_anchors] + lo).sort().values


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block token ids [x_a, MASK x (B-1)] and positions a..a+B-1, flattened: (N*B,) each."""
    n = anchors.shape[0]
    ids = torch.full((n, block_size), mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, 0] = tokens[anchors]
    positions = anchors[:, None] + torch.arange(block_size, device=anchors.device)
    return ids.reshape(-1), positions.reshape(-1)


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(N, B-1) the tokens each block should draft: x_{a+1} .. x_{a+B-1}."""
    return tokens[anchors[:, None] + torch.arange(1, block_size, device=anchors.device)]


def training_mask(anchors: torch.Tensor, context_len: int, block_size: int, causal: bool) -> torch.Tensor:
    """(1, 1, N*B, S + N*B) bool, True = visible."""
    n, dev = anchors.shape[0], anchors.device
    q_block = torch.arange(n, device=dev).repeat_interleave(block_size)           # (Q,) block of each query
    q_off = torch.arange(block_size, device=dev).repeat(n)                        # (Q,) offset in its block
    ctx = torch.arange(context_len, device=dev)[None, :] < anchors[q_block][:, None]  # (Q, S)
    same = q_block[:, None] == q_block[None, :]                                   # (Q, Q)
    inner = same & (q_off[None, :] <= q_off[:, None]) if causal else same
    return torch.cat([ctx, inner], dim=1)[None, None]
