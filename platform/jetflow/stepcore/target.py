"""`TargetStep`: one verify (or AR) step of the target, as plain tensor code over a flat token axis.

What HF's forward does for Llama, Qwen2 and Qwen3 decoders, written out: embeddings → RoPE → for every layer
(RMSNorm, q/k/v projections with their biases, Qwen3's per-head q/k RMSNorm, rotation, the keys/values written
into the slot KV at each token's (row, position), attention over the row's key window under the tree mask
(`slot_attention`), output projection, SwiGLU MLP) → the tapped layers' outputs → final RMSNorm. The arithmetic is
HF's, op for op (RMSNorm in fp32, RoPE tables in fp32, grouped-query heads folded as `jetflow.target.attention`
does).

The step's tokens come as one axis, T = rows × nodes (row-major, each row padded to the step's widest tree):
every input is (T,) — token ids, RoPE positions, the token's slot row and its KV write position — plus the
additive mask (R, 1, g·N, W). So the compiled graph has one dynamic token dimension (and the mask's, seen only by
the attention op): one graph serves every step a decoder meets, and holds the one packed copy of the weights
(`jetflow.stepcore.inductor`). T ≥ 2 always (a one-token step carries one padding token): a size-1 token axis
would specialise the graph.

The module holds the HF model's own parameters (registered as its submodule, never copied): `freezing` folds
exactly those. The LM head is its own module (`LMHead`): the runner applies it to every node of a small step, and
to the nodes an acceptance walk visits in a large one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jetflow.errors import InvalidSettingError
from jetflow.stepcore.attention import slot_attention

CORE_ARCHITECTURES = ("llama", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load time (not dynamic / longrope)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen3RMSNorm: normalise in fp32, scale in the input's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for one tensor: x (..., heads, d), cos/sin broadcasting to it."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """(T,) long positions → cos, sin (T, 1, d) in `dtype` (HF: fp32 tables, cast at the end)."""
    freqs = pos[:, None].to(torch.float32) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype)[:, None], (emb.sin() * scaling).to(dtype)[:, None]


def write_kv(buf: torch.Tensor, row: torch.Tensor, write: torch.Tensor, new: torch.Tensor) -> None:
    """new (T, kv_heads, d) into buf (slots, kv_heads, positions, d) at (row[t], ·, write[t]): one `index_put_`
    into the whole buffer (a write through a slice of a graph input makes the graph copy the buffer back)."""
    heads = torch.arange(new.shape[1], device=new.device)
    buf.index_put_((row[:, None], heads[None, :], write[:, None]), new)


def check_supported(target) -> None:
    """InvalidSettingError unless the step core can run this target exactly as HF's forward does."""
    cfg = target.config
    if cfg.model_type not in CORE_ARCHITECTURES:
        raise InvalidSettingError(f"the compiled step core supports {', '.join(CORE_ARCHITECTURES)} targets, not "
                                  f"{cfg.model_type!r}: use graphs=off")
    rope = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE:
        raise InvalidSettingError(f"the compiled step core needs RoPE tables fixed at load time; this target's "
                                  f"rope_type is {rope_type!r}: use graphs=off")
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise InvalidSettingError("the compiled step core has no sliding-window attention: use graphs=off")
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        raise InvalidSettingError("the compiled step core runs SwiGLU (silu) MLPs without tensor-parallel "
                                  "slicing: use graphs=off")


class TargetStep(nn.Module):
    """The target's step over flat tokens (see the module docstring); `forward` → (hidden (T, H) final-normed,
    features (T, k·H) the tapped layers' outputs concatenated — the head's context input)."""

    def __init__(self, target, layer_ids=()):
        super().__init__()
        check_supported(target)
        self.body = target.model.model  # the HF decoder: its parameters are this module's (shared, not copied)
        cfg = target.config
        attn = self.body.layers[0].self_attn
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", self.heads)
        self.head_dim = attn.head_dim
        self.eps = float(self.body.layers[0].input_layernorm.variance_epsilon)
        self.norm_eps = float(self.body.norm.variance_epsilon)
        self.scaling = float(attn.scaling)
        rotary = self.body.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().to(torch.float32).clone(), persistent=False)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.layer_ids = tuple(layer_ids)
        self.dtype = target.dtype

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, row: torch.Tensor, write: torch.Tensor,
                mask: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """ids, RoPE positions `pos` (past + depth), slot `row` and KV `write` position (the scratch position for
        padding): (T,) long each; mask (R, 1, g·N, W) additive; keys/values every layer's slot buffers, written
        in place."""
        tokens = ids.shape[0]
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        h = F.embedding(ids, self.body.embed_tokens.weight)
        cos, sin = rope_tables(pos, self.inv_freq, self.rope_scaling, self.dtype)
        last = len(self.body.layers) - 1
        taps = {}
        for i, layer in enumerate(self.body.layers):
            a, m = layer.self_attn, layer.mlp
            x = rms_norm(h, layer.input_layernorm.weight, self.eps)
            q = F.linear(x, a.q_proj.weight, a.q_proj.bias).view(tokens, heads, d)
            k = F.linear(x, a.k_proj.weight, a.k_proj.bias).view(tokens, kv, d)
            v = F.linear(x, a.v_proj.weight, a.v_proj.bias).view(tokens, kv, d)
            if getattr(a, "q_norm", None) is not None:  # Qwen3
                q, k = rms_norm(q, a.q_norm.weight, self.eps), rms_norm(k, a.k_norm.weight, self.eps)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            write_kv(keys[i], row, write, k)
            write_kv(values[i], row, write, v)
            out = slot_attention(q, keys[i], values[i], mask, self.scaling)
            h = h + F.linear(out.view(tokens, heads * d), a.o_proj.weight, a.o_proj.bias)
            x = rms_norm(h, layer.post_attention_layernorm.weight, self.eps)
            gate = F.linear(x, m.gate_proj.weight, m.gate_proj.bias)
            up = F.linear(x, m.up_proj.weight, m.up_proj.bias)
            h = h + F.linear(F.silu(gate) * up, m.down_proj.weight, m.down_proj.bias)
            if i in self.layer_ids and i < last:
                taps[i] = h
        hidden = rms_norm(h, self.body.norm.weight, self.norm_eps)
        features = (torch.cat([taps.get(i, hidden) for i in self.layer_ids], dim=-1) if self.layer_ids
                    else hidden[:, :0])
        return hidden, features


class LMHead(nn.Module):
    """The target's frozen LM head over rows of final-normed hidden states: (M, H) → (logits (M, V) in fp32,
    argmax (M,) long). Its own graph (one packed copy of the head, any M ≥ 2)."""

    def __init__(self, target):
        super().__init__()
        self.lm_head = target._lm_head  # the HF module (tied to the embeddings where the model ties them)

    def forward(self, hidden: torch.Tensor):
        logits = F.linear(hidden.to(self.lm_head.weight.dtype), self.lm_head.weight, self.lm_head.bias).float()
        return logits, logits.argmax(-1)
