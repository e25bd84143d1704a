"""`slot_attention`: the attention of one step's tokens over their rows of a slot KV, as one opaque custom op.

The compiled step (`jetflow.stepcore.target`, `jetflow.stepcore.head`) runs over a flat token axis — T = R rows ×
N nodes, row-major — so that every weight-bound op (the linears) sees one dynamic dimension and one compiled
graph serves every (rows, nodes, key window) a decoder meets. Attention is the one op that needs the (rows, nodes)
structure back: each row attends over its own slot's keys. Written inside the graph, that structure makes the
compiler guard on rows == 1 and nodes == 1 (one graph per case, each holding its own packed copy of the weights);
behind a custom op the graph sees only (T, heads, d) in and out, and the (R, N) view is taken here, in eager code
(a few microseconds per layer).

The arithmetic is the eager reference's (`jetflow.target.attention`): grouped-query heads folded into the query
axis (g = heads / kv_heads query heads share a key/value head: no repeated keys), one
`scaled_dot_product_attention` per layer, the additive mask already laid out for the folded queries.
"""

from __future__ import annotations

import torch

from jetflow.sdpa import scaled_dot_product_attention


@torch.library.custom_op("jetflow::slot_attention", mutates_args=())
def slot_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q (T, heads, d) for R rows × N nodes (T = R·N, row-major); keys/values a layer's slot buffers
    (slots, kv_heads, positions, d) whose rows [0, R) are the step's rows; mask (R, 1, g·N, W) additive, W the
    key window (positions [0, W) are read), query rows ordered (g, N) per key/value head → (T, heads, d)."""
    rows, window = mask.shape[0], mask.shape[-1]
    tokens, heads, d = q.shape
    nodes = tokens // rows
    kv = keys.shape[1]
    g = heads // kv
    folded = q.view(rows, nodes, kv, g, d).permute(0, 2, 3, 1, 4).reshape(rows, kv, g * nodes, d)
    out = scaled_dot_product_attention(folded, keys[:rows, :, :window], values[:rows, :, :window], attn_mask=mask,
                                       scale=scale)
    return out.view(rows, kv, g, nodes, d).permute(0, 3, 1, 2, 4).reshape(tokens, heads, d).contiguous()


@slot_attention.register_fake
def _(q, keys, values, mask, scale):
    return q.new_empty(q.shape)
