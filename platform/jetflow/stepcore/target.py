"""`TargetCore`: one verify (or AR) step of the target, as plain tensor code over static-shape buffers.

What HF's forward does for Llama, Qwen2 and Qwen3 decoders, written out: embeddings → RoPE → for every layer
(RMSNorm, q/k/v projections with their biases, Qwen3's per-head q/k RMSNorm, rotation, the keys/values written
into the slot KV at each node's position, attention over the bucket's key window under the tree mask, output
projection, SwiGLU MLP) → the tapped layers' outputs → final RMSNorm → the LM head's argmax of every node →
the greedy acceptance of every row. No HF output capture, no thread-locals, no host sync: every shape is the
bucket's, every input a tensor (`StepRunner` fills persistent ones in place), so `torch.compile(fullgraph=True,
dynamic=False)` sees one graph per bucket. The arithmetic is HF's, op for op (RMSNorm in fp32, RoPE tables in
fp32, grouped-query heads folded into the query axis as `jetflow.target.attention` does), so the eager core and
the reference agree to the last bits where the kernels do.

Acceptance on the device (greedy rows): node j matches when its token is the target's argmax at its parent and it
is its parent's first child with that token (a duplicate sibling counts once, as `DraftTree.children` says); a
node is accepted when it and all its ancestors match; a row's accepted path ends at its deepest accepted node
and the bonus is the argmax there — exactly `jetflow.tree.accept.walk` with argmax choices.

`accept="walk"` leaves the LM head and the acceptance out of the graph: the step ends at the final norm and the
engine's acceptance walk computes the LM head on the nodes it visits, as the eager engine does. That is the
cheaper choice where the LM head over every node costs more than the few rows a walk visits — a CPU: 10 ms for
8 nodes of SmolLM2's 49k-row head on 2 cores, against ~3 ms for the 2-3 a walk visits; on a GPU the GEMM over
every node is nearly free and the device acceptance saves host syncs (`accept="device"`, the default there).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from jetflow.errors import InvalidSettingError
from jetflow.stepcore.buckets import kv_write_index

CORE_ARCHITECTURES = ("llama", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load time (not dynamic / longrope)
ACCEPT = ("device", "walk")  # greedy acceptance in the graph, or left to the engine's walk (see the docstring)


class LayerWeights(NamedTuple):
    """One decoder layer's tensors (views of the HF model's parameters, never copies); None where the
    architecture has no such tensor (biases: Qwen2's q/k/v, `attention_bias`/`mlp_bias` configs; q/k norms: Qwen3)."""

    ln1: torch.Tensor
    q: torch.Tensor
    q_b: torch.Tensor | None
    k: torch.Tensor
    k_b: torch.Tensor | None
    v: torch.Tensor
    v_b: torch.Tensor | None
    o: torch.Tensor
    o_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ln2: torch.Tensor
    gate: torch.Tensor
    gate_b: torch.Tensor | None
    up: torch.Tensor
    up_b: torch.Tensor | None
    down: torch.Tensor
    down_b: torch.Tensor | None


class Shape(NamedTuple):
    """The static numbers of the target's layers (Python scalars: constants of the compiled graph)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float


class StepOut(NamedTuple):
    hidden: torch.Tensor     # (R, N, H) final-normed hidden states (the LM head's input)
    features: torch.Tensor   # (R, N, k·H) the tapped layers' outputs, concatenated (the head's context input)
    best: torch.Tensor | None    # (R, N) long: the target's argmax after every node (accept="device")
    accept: torch.Tensor | None  # (R, 2) long: greedy acceptance per row — (deepest accepted node, bonus token)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen3RMSNorm: normalise in fp32, scale in the input's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for one tensor: x (R, heads, N, d), cos/sin (R, 1, N, d)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def decoder_layer(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                  write: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kbuf: torch.Tensor, vbuf: torch.Tensor,
                  w: LayerWeights, shape: Shape, window: int) -> torch.Tensor:
    """One layer for R rows × N new tokens: h (R, N, H); mask the additive tree mask, (R, 1, 1, window) for one
    node, (R, 1, g·N, window) packed for g query heads per key/value head; write the (row, head, position) index
    tensors, broadcasting to (R, kv, N), where the new keys/values go in kbuf/vbuf (slots, kv, capacity + 1, d).
    The write is one `index_put_` into the whole buffer: a write through a slice of a graph input would make the
    compiled graph copy the whole buffer back (1.1 ms vs 0.04 ms per write for 8 slots × 16k positions)."""
    r, n, _ = h.shape
    heads, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    x = rms_norm(h, w.ln1, shape.eps)
    q = F.linear(x, w.q, w.q_b).view(r, n, heads, d)
    k = F.linear(x, w.k, w.k_b).view(r, n, kv, d)
    v = F.linear(x, w.v, w.v_b).view(r, n, kv, d).transpose(1, 2)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, shape.eps), rms_norm(k, w.k_norm, shape.eps)
    q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
    kbuf.index_put_(write, k)
    vbuf.index_put_(write, v)
    out = F.scaled_dot_product_attention(q.reshape(r, kv, (heads // kv) * n, d), kbuf[:r, :, :window],
                                         vbuf[:r, :, :window], attn_mask=mask, scale=shape.scaling)
    out = out.reshape(r, heads, n, d).transpose(1, 2).reshape(r, n, heads * d)
    h = h + F.linear(out, w.o, w.o_b)
    x = rms_norm(h, w.ln2, shape.eps)
    return h + F.linear(F.silu(F.linear(x, w.gate, w.gate_b)) * F.linear(x, w.up, w.up_b), w.down, w.down_b)


def tree_mask(write: torch.Tensor, past: torch.Tensor, anc: torch.Tensor, window: int, groups: int,
              dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of a tree step: node i of row r sees the row's prefix (keys < past[r]) and its own
    ancestors-or-self at their write positions; every query sees key 0, so a padding node (whose own key goes to
    the scratch position, outside the window) attends to something. write (R, N) long (≥ window: scratch);
    anc (R, N, N) bool. → (R, 1, 1, window) for one node, else (R, 1, groups·N, window) (query heads folded)."""
    r, n = write.shape
    keys = torch.arange(window + 1, device=write.device)
    visible = (keys[None, None, :] < past[:, None, None]).expand(r, n, window + 1).clone()
    visible.scatter_(2, write.clamp(max=window)[:, None, :].expand(r, n, n), anc)
    visible = visible[..., :window]
    visible[..., 0] = True
    mask = torch.zeros(visible.shape, dtype=dtype, device=write.device).masked_fill_(~visible, torch.finfo(dtype).min)
    if n == 1:
        return mask[:, None]
    return mask[:, None, None].expand(r, 1, groups, n, window).reshape(r, 1, groups * n, window)


def greedy_accept(ids: torch.Tensor, best: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                  parent: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Every row's greedy acceptance walk at once (see the module docstring): ids, best, depth, parent (R, N)
    long, anc (R, N, N) bool, eligible (R, N) bool (a real node that is its parent's first child with its
    token) → (R, 2) long: (deepest accepted node, bonus token)."""
    match = eligible & (ids == best.gather(1, parent))
    match[:, 0] = True                                                      # the root is committed already
    accepted = ~(anc & ~match[:, None, :]).any(-1)                          # (R, N): no mismatch on its path
    deepest = torch.where(accepted, depth, -1).argmax(-1)                   # the path's end (one node per depth)
    return torch.stack([deepest, best.gather(1, deepest[:, None])[:, 0]], dim=-1)


def check_supported(target) -> None:
    """InvalidSettingError unless the core can run this target exactly as HF's forward does."""
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


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return linear.bias if linear.bias is not None else None


def layer_weights(layer) -> LayerWeights:
    a, m = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    return LayerWeights(
        layer.input_layernorm.weight, a.q_proj.weight, _bias(a.q_proj), a.k_proj.weight, _bias(a.k_proj),
        a.v_proj.weight, _bias(a.v_proj), a.o_proj.weight, _bias(a.o_proj),
        q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
        layer.post_attention_layernorm.weight, m.gate_proj.weight, _bias(m.gate_proj), m.up_proj.weight,
        _bias(m.up_proj), m.down_proj.weight, _bias(m.down_proj))


class TargetCore:
    """The target's step as plain functions over its own weights (shared with the HF model, never copied).
    `step` is the whole forward; `prologue`, `layer` and `epilogue` are its parts, which `StepRunner` compiles
    one by one in its `layer` unit (one compile serves every layer of a bucket)."""

    def __init__(self, target, layer_ids: Sequence[int] = (), accept: str = "device"):
        check_supported(target)
        if accept not in ACCEPT:
            raise ValueError(f"accept must be one of {ACCEPT}, got {accept!r}")
        self.accept = accept
        body = target.model.model
        cfg = target.config
        attn = body.layers[0].self_attn
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", heads)
        self.shape = Shape(heads, kv, attn.head_dim, float(body.layers[0].input_layernorm.variance_epsilon),
                           float(attn.scaling))
        self.groups = heads // kv
        self.layers = [layer_weights(layer) for layer in body.layers]
        self.embed = body.embed_tokens.weight
        self.norm = body.norm.weight
        self.norm_eps = float(body.norm.variance_epsilon)
        self.lm_head = target.lm_head_weight
        self.lm_bias = target.lm_head_bias
        rotary = body.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().to(torch.float32).clone()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.layer_ids = tuple(layer_ids)
        self.dtype = target.dtype

    def prologue(self, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, past: torch.Tensor,
                 anc: torch.Tensor, window: int):
        """→ (h (R, N, H) embeddings, cos, sin (R, 1, N, d), mask, the KV write's index tensors)."""
        h = F.embedding(ids, self.embed)
        freqs = pos[..., None].to(torch.float32) * self.inv_freq.to(pos.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)[:, None]
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)[:, None]
        mask = tree_mask(write, past, anc, window, self.groups, self.dtype)
        return h, cos, sin, mask, kv_write_index(write, self.shape.kv_heads)

    def epilogue(self, h: torch.Tensor, taps: dict[int, torch.Tensor], ids: torch.Tensor, pos: torch.Tensor,
                 past: torch.Tensor, anc: torch.Tensor, parent: torch.Tensor, eligible: torch.Tensor) -> StepOut:
        """taps: the tapped layers' outputs; the last layer's tap is HF's last hidden state, the final-normed one."""
        hidden = rms_norm(h, self.norm, self.norm_eps)
        features = (torch.cat([taps.get(i, hidden) for i in self.layer_ids], dim=-1) if self.layer_ids
                    else hidden.new_zeros((*hidden.shape[:2], 0)))
        if self.accept == "walk":
            return StepOut(hidden, features, None, None)
        best = F.linear(hidden, self.lm_head, self.lm_bias).argmax(-1)
        accept = greedy_accept(ids, best, pos - past[:, None], anc, parent, eligible)
        return StepOut(hidden, features, best, accept)

    def step(self, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, past: torch.Tensor, anc: torch.Tensor,
             parent: torch.Tensor, eligible: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
             window: int, layer=decoder_layer) -> StepOut:
        """One step for R rows × N nodes (all (R, N) long unless said): ids, RoPE positions `pos` (past + depth),
        KV `write` positions (the scratch position for padding), past (R,), anc (R, N, N) bool ancestor-or-self,
        parent (root: 0), eligible (R, N) bool; keys/values: every layer's slot buffers, written in place."""
        h, cos, sin, mask, index = self.prologue(ids, pos, write, past, anc, window)
        taps = {}
        for i, w in enumerate(self.layers):
            h = layer(h, cos, sin, mask, index, keys[i], values[i], w, self.shape, window)
            if i in self.layer_ids and i < len(self.layers) - 1:
                taps[i] = h
        return self.epilogue(h, taps, ids, pos, past, anc, parent, eligible)
