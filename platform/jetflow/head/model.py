"""The draft head: a few Qwen3-style layers whose block queries attend to fused target features.

Owns no embedding and no LM head (the target's are reused, frozen). Module names follow the
DFlash layout (`fc`, `hidden_norm`, `layers.*`, `norm`) so checkpoints load in vLLM's DFlash path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jetflow.head.config import HeadConfig
from jetflow.sdpa import scaled_dot_product_attention
from jetflow.stepcore.buckets import kv_write_index
from jetflow.target.projection import RowProjector


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, L) long → cos, sin of shape (b, 1, L, head_dim)."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Queries from the block; keys/values from [context features | block] through the same projections."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project_kv(self, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, T, H) inputs → keys (q/k-normed, rotated at their positions) and values, (b, kv_heads, T, head_dim).
        A context token's keys/values depend only on its feature and position: decoding caches them."""
        b = h.shape[0]
        k = self.k_norm(self.k_proj(h).view(b, -1, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(b, -1, self.n_kv, self.head_dim).transpose(1, 2)
        return _rotate(k, *rope), v

    def attend(self, x, rope_q, k, v, mask):
        b, q_len, _ = x.shape
        q = _rotate(self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2), *rope_q)
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))

    def forward(self, x, context, rope_q, rope_kv, mask):
        k, v = self.project_kv(torch.cat([context, x], dim=1), rope_kv)
        return self.attend(x, rope_q, k, v, mask)

    def forward_cached(self, x, rope_q, kv: tuple[torch.Tensor, torch.Tensor], write: torch.Tensor, mask,
                       window: int | None = None):
        """x (b, Q, H) normed block inputs; kv = this layer's cached context (keys, values), (≥ b, kv_heads, L,
        head_dim), rows [0, b) of which are the block's rows: the block's own keys/values are written there at
        `write` (b, Q) before attending over positions [0, window) (all L when None; the compiled step core passes
        whole slot buffers, writes padding beyond its window, and needs one `index_put_` into the buffer itself)."""
        keys, values = kv
        k, v = self.project_kv(x, rope_q)
        index = kv_write_index(write, keys.shape[1])
        keys.index_put_(index, k)
        values.index_put_(index, v)
        b = x.shape[0]
        keys, values = keys[:b, :, :window], values[:b, :, :window]
        return self.attend(x, rope_q, keys, values, mask)


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, context, rope_q, rope_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, rope_q, kv, write, mask, window: int | None = None):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), rope_q, kv, write, mask, window)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftHead(nn.Module):
    """Causal (JetFlow) or bidirectional (DFlash) parallel draft head; `config.causal` selects.
    `tree_profile`: its measured per-(depth, rank) acceptance (`jetflow.tree.AcceptanceProfile`), attached by
    `load_head` when its folder holds `tree_profile.json`; the profile-guided tree algorithms read it."""

    tree_profile = None

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.config = cfg
        k = len(cfg.target_layer_ids)
        self.tap_norms = (nn.ModuleList(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in range(k))
                          if cfg.tap_norm else None)
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        if cfg.depth_embedding:
            # one vector per block offset: the MASK inputs of a block are otherwise identical and told
            # apart only by RoPE, so every depth shares one input. Random (not zero) init, std 0.5 — the
            # scale of the unit-RMS context features — separates the depths from the first step.
            self.depth_embed = nn.Parameter(torch.randn(cfg.block_size, cfg.hidden_size) * 0.5)
        if cfg.copy_ngram:
            # copy inputs (jetflow.head.copy): the candidate's token embedding brought to unit RMS (SmolLM2's
            # embeddings have RMS ~0.13, the context features ~1), plus a learned vector per match length
            self.copy_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.copy_len_embed = nn.Parameter(torch.zeros(cfg.copy_ngram, cfg.hidden_size))
        if cfg.draft_vocab_size:
            # target ids the head drafts over, ascending; set by `set_draft_vocab`, saved with the weights
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size), persistent=True)
        self._lm_cache: tuple | None = None
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def identity_layers(self) -> None:
        """Zero every layer's residual writes (o_proj, down_proj): each layer starts as the identity."""
        for layer in self.layers:
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)

    def project_context(self, features: torch.Tensor, noise: float = 0.0,
                        generator: torch.Generator | None = None) -> torch.Tensor:
        """(..., k*H) concatenated target taps → (..., H) context features every layer reads.
        `noise` > 0 (training only) adds Gaussian noise of that std to the normalized taps."""
        features = features.to(self.fc.weight.dtype)
        if self.tap_norms is not None:
            taps = features.split(self.config.hidden_size, dim=-1)
            features = torch.cat([norm(t) for norm, t in zip(self.tap_norms, taps)], dim=-1)
        if noise > 0:
            features = features + noise * torch.randn(features.shape, generator=generator, dtype=features.dtype,
                                                      device=features.device)
        return self.hidden_norm(self.fc(features))

    def block_mask(self, ctx_len: int, block_len: int, device=None) -> torch.Tensor:
        """(1, 1, Q, T+Q) bool, True = visible: all context, and the block causally or fully."""
        mask = torch.ones((block_len, ctx_len + block_len), dtype=torch.bool, device=device)
        if self.config.causal:
            mask[:, ctx_len:] = torch.ones(block_len, block_len, dtype=torch.bool, device=device).tril()
        return mask[None, None]

    def forward(
        self,
        context: torch.Tensor,
        block: torch.Tensor,
        ctx_positions: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        copy: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """context (b, T, H) projected features; block (b, Q, H) block input embeddings;
        positions (b, T) and (b, Q) long; mask (b|1, 1, Q, T+Q) bool (True = visible) or None
        for the single-block default; copy (heads with `copy_ngram` only, required there) = the target
        embeddings of the copy candidates (b, Q, H) and the match lengths (b, Q) long, 0 = no candidate
        (`jetflow.head.copy.copy_block_inputs`). Returns (b, Q, H) final-normed hidden states.

        Queries are whole blocks of `block_size`, laid out one after another. With `anchor_shortcut`,
        each query's input gains the context feature at its anchor position minus one — the newest
        feature that query may see; with `depth_embedding`, the learned vector of its block offset."""
        if mask is None:
            mask = self.block_mask(context.shape[1], block.shape[1], block.device)
        offset = torch.arange(block.shape[1], device=block.device) % self.config.block_size
        shortcut = None
        if self.config.anchor_shortcut and context.shape[1] > 0:
            row = block_positions - offset - 1  # anchor position - 1
            valid = (row >= 0) & (row < context.shape[1])
            gathered = context.gather(1, row.clamp(0, context.shape[1] - 1)[..., None].expand(-1, -1, context.shape[-1]))
            shortcut = gathered * valid[..., None]
        x = self.block_inputs(block, offset, copy, shortcut)
        rope_q = self.rotary(block_positions)
        rope_kv = self.rotary(torch.cat([ctx_positions, block_positions], dim=1))
        for layer in self.layers:
            x = layer(x, context, rope_q, rope_kv, mask)
        return self.norm(x)

    def block_inputs(self, block: torch.Tensor, offset: torch.Tensor, copy=None,
                     shortcut: torch.Tensor | None = None) -> torch.Tensor:
        """The block's input vectors: token embeddings (b, Q, H) plus, by option, the learned vector of each
        offset (Q,), the copy candidates, and the anchor shortcut `shortcut` (b, Q, H) or None."""
        if self.config.depth_embedding:
            block = block + self.depth_embed[offset].to(block.dtype)
        if self.config.copy_ngram:
            if copy is None:
                raise ValueError("this head reads copy inputs (copy_ngram > 0): pass copy=(embeddings, lengths)")
            embeds, lens = copy
            term = self.copy_norm(embeds.to(block.dtype)) + self.copy_len_embed[(lens - 1).clamp(min=0)].to(block.dtype)
            block = block + term * (lens > 0)[..., None].to(block.dtype)
        if shortcut is not None:
            block = block + shortcut.to(block.dtype)
        return block

    # ------------------------------------------------------------ cached context (decoding engines)
    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Projected context features (b, T, H) at positions (b, T) → every layer's (keys, values) of them,
        (b, kv_heads, T, head_dim): computed once per context token and cached by the engine."""
        rope = self.rotary(positions)
        return [layer.self_attn.project_kv(context, rope) for layer in self.layers]

    def forward_cached(self, block: torch.Tensor, block_positions: torch.Tensor, kv: list, write: torch.Tensor,
                       mask: torch.Tensor, copy=None, shortcut: torch.Tensor | None = None,
                       window: int | None = None) -> torch.Tensor:
        """One block per row over cached context keys/values (what `forward` computes, without re-projecting
        the context): block (b, B, H) embeddings at block_positions (b, B); kv[layer] = (keys, values) whose
        rows [0, b) are the rows' contexts (≥ b, kv_heads, L, head_dim), written at `write` (b, B) with the
        block's own (`Attention.forward_cached`); mask
        (b, 1, B, L) bool; shortcut (b, H) the anchor's context feature (anchor_shortcut heads; zeros when
        the row has no context); window: attend over positions [0, window) only (mask (b, 1, B, window)).
        Returns (b, B, H) final-normed hidden states."""
        offset = torch.arange(block.shape[1], device=block.device)
        if self.config.anchor_shortcut and shortcut is not None:
            shortcut = shortcut[:, None, :].expand(-1, block.shape[1], -1)
        else:
            shortcut = None
        x = self.block_inputs(block, offset, copy, shortcut)
        rope_q = self.rotary(block_positions)
        for layer, layer_kv in zip(self.layers, kv):
            x = layer.forward_cached(x, rope_q, layer_kv, write, mask, window)
        return self.norm(x)

    # ------------------------------------------------------------ output vocabulary
    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """(draft_vocab_size,) distinct target ids → the vocabulary drafted over."""
        ids = torch.as_tensor(ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocab needs {self.config.draft_vocab_size} distinct ids, got {ids.numel()}")
        self.draft_vocab.copy_(ids.to(self.draft_vocab.device))
        self._lm_cache = None

    def _lm_projector(self, target) -> RowProjector:
        """The draft vocabulary's rows of the target's LM head, projected in the fastest orientation per row count."""
        weight = target.lm_head_weight
        key = (weight.data_ptr(), weight.dtype, weight.device, self.draft_vocab.data_ptr(), self.draft_vocab._version,
               torch.is_inference_mode_enabled())  # an inference-mode copy cannot enter autograd (training)
        if self._lm_cache is None or self._lm_cache[0] != key:
            self._lm_cache = (key, RowProjector(weight.detach()[self.draft_vocab].contiguous()))
        return self._lm_cache[1]

    def warm_lm_head(self, target, max_rows: int) -> None:
        """Time the draft LM-head product's orientations for every row-count bucket up to `max_rows` now (in the
        caller's grad mode: an engine warms under inference mode, as it decodes)."""
        if self.config.draft_vocab_size:
            self._lm_projector(target).warm(max_rows)
        else:
            target.warm_lm_head(max_rows)

    def output_logits(self, target, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) final-normed hidden → (..., V') logits through the target's frozen LM head, V' = the
        draft vocabulary (index i is target id `draft_vocab[i]`) or the full vocabulary. The hidden states are
        cast to the LM head's dtype (a head training in fp32 over a bf16 target); the logits come in that dtype."""
        weight = target.lm_head_weight
        hidden = hidden.to(weight.dtype)
        if not self.config.draft_vocab_size:
            return target.logits(hidden)
        out = self._lm_projector(target)(hidden)  # (..., V'), in the product's fastest orientation for this many rows
        if target.lm_head_bias is not None:
            out = out + target.lm_head_bias[self.draft_vocab]
        return out

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into `output_logits` → target token ids."""
        return self.draft_vocab[index] if self.config.draft_vocab_size else index

    def to_draft_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids → indices into `output_logits`; -1 for ids outside the draft vocabulary."""
        if not self.config.draft_vocab_size:
            return ids
        pos = torch.searchsorted(self.draft_vocab, ids).clamp(max=self.draft_vocab.numel() - 1)
        return torch.where(self.draft_vocab[pos] == ids, pos, torch.full_like(pos, -1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
