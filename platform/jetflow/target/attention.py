"""The target's attention: Hugging Face's SDPA path, with grouped-query attention packed instead of repeated.

Transformers' `sdpa` attention serves a grouped-query model (SmolLM2: 9 query heads over 3 key/value heads;
Qwen3-8B: 32 over 8) by copying every key/value head once per query head it serves (`repeat_kv`) whenever
more than one token is fed under a mask — every tree verify and every prefill chunk. Keys and values each
become (rows × query heads × cached tokens × head dim) per layer, per forward: at 8 rows and 300 cached
tokens that is 330 MB over SmolLM2's 30 layers, on the order of reading the weights once.

`gqa_sdpa` instead folds a key/value head's query heads into the query axis: queries (b, kv·g, n, d) are
viewed as (b, kv, g·n, d) and attend to the cached keys/values as they are; the mask, shared by all heads
(b, 1, n, L), is repeated g times along its query axis — once per forward, as every layer gets the same
mask tensor. Each query row sees exactly the keys, values and mask entries it saw before, so the output is
the same attention. One query token (plain decoding) is folded the same way, with the mask as it is (newer
Transformers do this themselves; 5.20 repeats there too). Everything else (several tokens without a mask:
causal prefill; a per-head mask; softcap; a position bias) goes to Transformers' own `sdpa` unchanged.

Both paths run with cuDNN's SDPA backend off (`jetflow.sdpa`: on Hopper it rebuilt a plan for every new
key length, every decoding step). Registered with Transformers' public `AttentionInterface` /
`AttentionMaskInterface` under `GQA_SDPA`;
`TargetModel` switches a model loaded with `sdpa` to it.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from jetflow.sdpa import scaled_dot_product_attention, without_cudnn

GQA_SDPA = "jetflow_gqa_sdpa"

_packed = threading.local()  # the last forward's mask and its packed copy, kept until the next (per thread)


def _packed_mask(mask: torch.Tensor, groups: int, length: int) -> torch.Tensor:
    """(b, 1, n, ≥L) → (b, 1, groups·n, L): row r·n + i is row i, for each of the `groups` query heads of a
    key/value head (the first L = cached keys' columns). Computed once per mask tensor (the layers of one
    forward share it)."""
    hit = getattr(_packed, "entry", None)
    if hit is not None and hit[0] is mask and hit[1] == groups and hit[2] == length:
        return hit[3]
    b, _, n, _ = mask.shape
    out = mask[..., :length][:, :, None].expand(b, 1, groups, n, length).reshape(b, 1, groups * n, length)
    _packed.entry = (mask, groups, length, out)  # holding `mask` keeps its identity unique while cached
    return out


def gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
             **kwargs):
    """`sdpa_attention_forward`'s contract: query (b, heads, n, d), key/value (b, kv_heads, L, d), mask None or
    (b|1, 1|heads, n, L) → (b, n, heads, d), None."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, n, dim = query.shape
    shared = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if (groups <= 1 or not shared or (attention_mask is None and n > 1) or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")):
        with without_cudnn():
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
    length = key.shape[2]
    if attention_mask is None or n == 1:  # one query row per head: the mask broadcasts over the folded heads
        mask = None if attention_mask is None else attention_mask[..., :length]
    else:
        mask = _packed_mask(attention_mask, groups, length)
    out = scaled_dot_product_attention(
        query.reshape(b, key.shape[1], groups * n, dim), key, value, attn_mask=mask, dropout_p=dropout,
        scale=scaling, is_causal=False)
    return out.reshape(b, heads, n, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, gqa_sdpa)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
