"""`DraftStep`: the draft head's block for R rows, over a flat token axis → the top-k per depth.

Each row drafts one block [anchor, MASK × D] at positions past..past+D; its tokens sit one after another, T = R·B
(B = the head's block size ≥ 2, so T ≥ 2 always). The head's own modules run (its projections, norms, MLPs and
input options: depth embedding, copy inputs, anchor shortcut — `DraftHead.block_inputs`); what differs from its
cached forward (`DraftHead.forward_cached`, the eager reference) is only the layout: every per-token input is
(T,), the block's keys/values are written into the head's slot KV at (row, position) and attention is
`slot_attention` under the block mask built by the runner — so one compiled graph serves every row count and key
window, as `jetflow.stepcore.target` explains. The LM-head product runs over the D drafted positions of every row
(the draft vocabulary's rows of the target's head, or all of it), then log-softmax and the top-k: one (2, R·D, k)
tensor — log-probs and target token ids (exact in fp32 below 2^24) — comes to the host in one copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jetflow.stepcore.attention import slot_attention
from jetflow.stepcore.target import write_kv


class DraftStep(nn.Module):
    def __init__(self, head, target, top: int):
        super().__init__()
        if target.vocab_size >= 1 << 24:
            raise ValueError("token ids travel as fp32 values: the vocabulary must stay below 2^24")
        self.head = head                                             # its parameters are this module's
        self.embed_tokens = target.model.get_input_embeddings()      # the target's, shared
        if head.config.draft_vocab_size:                             # the draft vocabulary's rows: a small copy
            weight = target.lm_head_weight.detach()[head.draft_vocab].contiguous()
            bias = target.lm_head_bias[head.draft_vocab].contiguous() if target.lm_head_bias is not None else None
            self.lm_weight = nn.Parameter(weight, requires_grad=False)
            self.lm_bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
            self.lm_head = None
        else:
            self.lm_head = target.model.get_output_embeddings()     # the target's module, shared
        self.top = top
        cfg = head.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scaling = cfg.head_dim ** -0.5

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, row: torch.Tensor, offset: torch.Tensor,
                mask: torch.Tensor, shortcut: torch.Tensor, depth_rows: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], copy_embeds: torch.Tensor | None = None,
                copy_lens: torch.Tensor | None = None) -> torch.Tensor:
        """ids (T,) long [anchor, MASK × D] per row; pos (T,) past + offset, also where the block's keys/values
        go; row (T,) the slot; offset (T,) 0..B-1; mask (R, 1, g·B, W) additive (context < past, the block
        causally or whole); shortcut (T, H) each token's row's anchor context feature (zeros without context);
        depth_rows (R·D,) the indices of the drafted tokens; keys/values every head layer's slot buffers;
        copy inputs (T, H), (T,) for copy_ngram heads. → (2, R·D, top) float32: log-probs and token ids."""
        head, tokens = self.head, ids.shape[0]
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        short = shortcut if head.config.anchor_shortcut else None
        copy = (copy_embeds, copy_lens) if copy_embeds is not None else None
        x = head.block_inputs(F.embedding(ids, self.embed_tokens.weight), offset, copy, short)
        cos, sin = head.rotary(pos)                                   # (T, 1, d)
        for i, layer in enumerate(head.layers):
            a = layer.self_attn
            xn = layer.input_layernorm(x)
            q = _rotate(a.q_norm(a.q_proj(xn).view(tokens, heads, d)), cos, sin)
            k = _rotate(a.k_norm(a.k_proj(xn).view(tokens, kv, d)), cos, sin)
            v = a.v_proj(xn).view(tokens, kv, d)
            write_kv(keys[i], row, pos, k)
            write_kv(values[i], row, pos, v)
            out = slot_attention(q, keys[i], values[i], mask, self.scaling)
            x = x + a.o_proj(out.view(tokens, heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = head.norm(x)[depth_rows]
        if self.lm_head is not None:
            logits = F.linear(h.to(self.lm_head.weight.dtype), self.lm_head.weight, self.lm_head.bias)
        else:
            logits = F.linear(h.to(self.lm_weight.dtype), self.lm_weight, self.lm_bias)
        best = torch.topk(torch.log_softmax(logits.float(), dim=-1), self.top, dim=-1)
        return torch.stack([best.values, head.to_target_ids(best.indices).to(torch.float32)])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The head's rotation (`jetflow.head.model._rotate`), on (T, heads, d) with (T, 1, d) tables."""
    half = x.shape[-1] // 2
    return (x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin).to(x.dtype)
