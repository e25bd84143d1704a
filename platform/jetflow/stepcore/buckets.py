"""The KV capacity steps of the static slot KV, and where a step writes into it.

The compiled step core runs one graph per role with dynamic shapes (`jetflow.stepcore.runner`): no (rows, nodes,
window) buckets. What remains static is the slot KV (`jetflow.engine.kv.StaticSlotKV`): reserved once at
`key_window(max_len)` positions plus a scratch position where padding writes and no row reads.
"""

from __future__ import annotations

import torch

KEY_STEP = 256  # the static KV's capacity is a multiple of this many positions


def key_window(length: int) -> int:
    """The static KV's capacity for `length` positions: `length` rounded up to a multiple of KEY_STEP."""
    return KEY_STEP * -(-max(1, length) // KEY_STEP)


def kv_write_index(write: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where rows [0, R)'s new keys/values go in a slot buffer (slots, kv_heads, positions, d): `write` (R, N)
    positions → the (row, head, position) index tensors, broadcasting to (R, kv_heads, N), for one `index_put_`
    into the whole buffer (a write through a slice of a compiled graph's input makes the graph copy the whole
    buffer back)."""
    dev = write.device
    return (torch.arange(write.shape[0], device=dev)[:, None, None],
            torch.arange(kv_heads, device=dev)[None, :, None], write[:, None, :])
