"""`HeadCore`: the draft head's cached forward for R rows, as one static-shape function → the top-W per depth.

The head's own modules run (`DraftHead.forward_cached`, its layers, norms and options: anchor shortcut, depth
embedding, copy inputs); what changes from the engine's eager draft is only what could not be traced or would
change shape: the block mask is built from the rows' `past` inside the function, the keys/values are the full
slot buffers (rows [0, R), attended over the bucket's key window), the LM-head product is a plain `F.linear`
over the draft vocabulary's rows (the eager path's `RowProjector` times orientations on the host), and the
result is one (2, R, D, W) tensor — log-probs and token ids (exact in fp32 below 2^24) — so the tree builder's
inputs come to the host in one copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class HeadCore:
    def __init__(self, head, target):
        self.head = head
        weight = target.lm_head_weight.detach()
        bias = target.lm_head_bias
        if head.config.draft_vocab_size:
            weight = weight[head.draft_vocab].contiguous()
            bias = bias[head.draft_vocab] if bias is not None else None
        self.weight, self.bias = weight, bias
        self.embed = target.model.get_input_embeddings().weight
        self.block = head.config.block_size
        self.causal = head.config.causal
        if target.vocab_size >= 1 << 24:
            raise ValueError("token ids travel as fp32 values: the vocabulary must stay below 2^24")

    def step(self, ids: torch.Tensor, past: torch.Tensor, write: torch.Tensor, shortcut: torch.Tensor,
             copy_embeds: torch.Tensor | None, copy_lens: torch.Tensor | None, keys: list[torch.Tensor],
             values: list[torch.Tensor], window: int, width: int) -> torch.Tensor:
        """ids (R, B) long: [anchor, MASK × D] per row; past (R,) long: the anchor's position; write (R, B) long:
        where the block's keys/values go (past + offset; the scratch position for padding rows); shortcut (R, H)
        the anchor's context feature (zeros without context); copy inputs (R, B, H), (R, B) or None; keys/values:
        every head layer's slot buffers. → (2, R, D, width) float32: the top-`width` log-probs of depths 1..D and
        their target token ids."""
        head, block = self.head, self.block
        cols = torch.arange(block, device=ids.device)
        positions = past[:, None] + cols
        key_pos = torch.arange(window, device=ids.device)
        offset = key_pos[None, None, :] - past[:, None, None]                            # (R, 1, window)
        inner = offset <= cols[None, :, None] if self.causal else offset < block
        visible = (key_pos[None, None, :] < past[:, None, None]) | ((offset >= 0) & inner)
        shortcut = shortcut * (past >= 1)[:, None].to(shortcut.dtype)                   # a one-token prompt
        copy = (copy_embeds, copy_lens) if copy_embeds is not None else None
        kv = list(zip(keys, values))  # whole buffers: rows [0, R) are this bucket's (see Attention.forward_cached)
        h = head.forward_cached(F.embedding(ids, self.embed), positions, kv, write, visible[:, None], copy, shortcut,
                                window)
        logits = F.linear(h[:, 1:].to(self.weight.dtype), self.weight, self.bias)
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), width, dim=-1)
        tokens = head.to_target_ids(top.indices)
        return torch.stack([top.values, tokens.to(torch.float32)])
