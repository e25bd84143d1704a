"""The static shapes of a compiled step, the KV capacity steps, and where a step writes into the slot KV.

A compiled step has one entry per bucket; every input of a step is padded up to its bucket:

- rows: the running rows, padded to the next power of two (1, 2, 4, 8, 16, …), at most the engine's slots;
- nodes: the widest tree of the step, padded to the next power of two (1 = a plain AR step);
- keys: the attention window, `KEY_STEP · 2^k` positions (256, 512, 1024, …) ≥ every row's past + nodes.

Doubling keeps the number of buckets logarithmic in the context (a 4,096-position request meets 5 key windows)
while at most doubling the keys attention reads (masked keys cost reads, not results). Padding rows and padding
nodes write their keys/values to the buffer's scratch position (see `jetflow.engine.kv.SlotKV`), which no row
ever reads, and see only key 0; real nodes never see them: padding is masked both ways.
"""

from __future__ import annotations

import torch

KEY_STEP = 256  # the smallest attention window, and the step of the KV capacity (doubling from it)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"a bucket holds at least 1, got {n}")
    return 1 << (n - 1).bit_length()


def key_window(length: int) -> int:
    """The attention window (a bucket) for `length` positions: KEY_STEP · 2^k >= length."""
    return KEY_STEP * next_pow2(-(-max(1, length) // KEY_STEP))


def row_bucket(rows: int, max_rows: int) -> int:
    """`rows` padded to the next power of two, at most `max_rows` (the engine's slots)."""
    return min(next_pow2(rows), max_rows)


def bucket_label(key: tuple[int, ...]) -> str:
    """(rows, nodes, window[, width]) → "rows×nodes@window[ top-width]"."""
    rows, nodes, window = key[:3]
    return f"{rows}×{nodes}@{window}" + (f" top-{key[3]}" if len(key) > 3 else "")


def kv_write_index(write: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where rows [0, R)'s new keys/values go in a slot buffer (slots, kv_heads, positions, d): `write` (R, N)
    positions → the (row, head, position) index tensors, broadcasting to (R, kv_heads, N), for one `index_put_`
    into the whole buffer (a write through a slice of a compiled graph's input makes the graph copy the whole
    buffer back)."""
    dev = write.device
    return (torch.arange(write.shape[0], device=dev)[:, None, None],
            torch.arange(kv_heads, device=dev)[None, :, None], write[:, None, :])
