"""The published DFlash-layout config.json formats, read one way: DFlash's heads (z-lab), the paper's
(JetSpec) heads, transformers-4-style configs, vLLM exports and our own.

Three things differ between them and are settled here:
- where a field lives: `dflash_config.<name>` first, then the top level (the published loaders look in that
  order; some checkpoints carry `block_size` or `mask_token_id` only at the top);
- the causal flag's name: `dflash_config.causal_head` (the paper), `dflash_config.causal` and top-level
  `is_causal` (vLLM). We read all three (they must agree) and write all three; no flag = bidirectional,
  the DFlash head every published DFlash checkpoint is;
- what a missing `target_layer_ids` means: the default DFlash's published loader computes.

A field our DraftHead does not implement (RoPE scaling, sliding windows, attention bias, DFlash-2's
convolutions, logit scales) is an error naming it when it asks for anything but the neutral value, and so is
a field we do not know: a head that would draft other logits than its authors' must never load quietly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jetflow.errors import HeadMismatchError

# Every name the causal flag is published under: (where, key). The paper's loader reads causal_head; vLLM
# reads is_causal, then dflash_config.causal.
CAUSAL_FLAGS = (("dflash_config", "causal_head"), ("dflash_config", "causal"), ("", "is_causal"))

# Top-level fields HeadConfig reads (sizes, norms, RoPE base, DFlash settings, our own section).
READ = {
    "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "rope_theta", "rope_parameters", "max_position_embeddings",
    "num_target_layers", "block_size", "mask_token_id", "target_layer_ids", "is_causal", "draft_vocab_size",
    "dflash_config", "jetflow",
}
# Top-level fields with no effect on the drafted logits: provenance, token ids of the target, the weights'
# dtype (loading casts), training-only dropout, an embedding the head does not own, and the window settings
# of sliding layers (whose presence `layer_types` / `use_sliding_window` decide, checked below).
METADATA = {
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "auto_map", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "attention_dropout", "use_cache", "tie_word_embeddings",
    "sliding_window", "max_window_layers",
}


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected


def _never(_: Any) -> bool:
    return False


# Fields our DraftHead does not implement → whether a value is the neutral one (what DraftHead computes).
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "architectures": _is(["DFlashDraftModel"]),      # DFlash2DraftModel adds convolutions and a selector
    "model_type": _is("qwen3"),                      # Qwen3 layers: q/k RMSNorm, SwiGLU, no biases
    "hidden_act": _is("silu"),
    "attention_bias": lambda v: v in (False, None),
    "mlp_bias": lambda v: v in (False, None),
    "rope_scaling": lambda v: v is None or (isinstance(v, dict) and v.get("rope_type", v.get("type")) == "default"
                                            and set(v) <= {"rope_type", "type", "rope_theta"}),
    "use_sliding_window": lambda v: v in (False, None),
    "layer_types": lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
    "is_neox_style": lambda v: v in (True, None),    # DraftHead rotates halves (rotate_half)
    "eagle_aux_hidden_state_layer_ids": _never,      # vLLM takes these ids as-is, without DFlash's +1
    "quantization_config": _never,
}
NEUTRAL_DFLASH: dict[str, Callable[[Any], bool]] = {  # under dflash_config
    "input_embedding_scale": lambda v: v in (1, 1.0, None),
    "output_multiplier": lambda v: v in (1, 1.0, None),
    "final_logit_softcapping": lambda v: v in (0, 0.0, None),
    "conv_kernel_size": _never, "conv_group_size": _never,   # DFlash-2 convolutions
    "selector_rank": _never, "selector_top_k": _never,       # DFlash-2 candidate selector
}
READ_DFLASH = {"block_size", "target_layer_ids", "mask_token_id", "causal", "causal_head"}


def draft_value(d: dict[str, Any], name: str, default: Any = None) -> Any:
    """`dflash_config[name]`, else the top-level `name`, else `default` — the published loaders' order."""
    dc = d.get("dflash_config") or {}
    return dc[name] if name in dc else d.get(name, default)


def read_causal(d: dict[str, Any]) -> bool:
    """The causal flag under any of its published names; False (bidirectional, DFlash) when none is set.
    HeadMismatchError when two names disagree: which one a tool reads would decide how the head drafts."""
    dc = d.get("dflash_config") or {}
    found = {(f"{where}." if where else "") + key: (dc if where else d)[key]
             for where, key in CAUSAL_FLAGS if key in (dc if where else d)}
    values = {bool(v) for v in found.values()}
    if len(values) > 1:
        raise HeadMismatchError(f"config.json states the causal flag twice, differently: {found}; tools read "
                                "different names (the paper: dflash_config.causal_head, vLLM: is_causal), so "
                                "the head would draft differently in each. Set all of them to one value")
    return values.pop() if values else False


def published_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The taps a checkpoint without `target_layer_ids` means: what DFlash's published loader computes
    (`build_target_layer_ids(num_target_layers, num_hidden_layers)`): one tap per draft layer — the middle
    layer for a 1-layer head, else spread over layers 1..n-3 with Python's rounding. For 2+ draft layers
    that is `jetflow.target.default_layer_ids(n, k)`, the same formula; for 1 they differ (n-3 there)."""
    from jetflow.target.model import default_layer_ids

    if num_draft_layers == 1:
        return [num_target_layers // 2]
    ids = default_layer_ids(num_target_layers, num_draft_layers)
    if num_target_layers < 4 or len(ids) != num_draft_layers:
        raise HeadMismatchError(
            f"config.json has no target_layer_ids, and the published default (one tap per draft layer spread over "
            f"layers 1..n-3) does not exist for {num_draft_layers} draft layers on a {num_target_layers}-layer "
            "target; write dflash_config.target_layer_ids")
    return ids


def check_implemented(d: dict[str, Any]) -> None:
    """Refuse a config that asks for what DraftHead does not compute (HeadMismatchError naming the field)."""
    hint = ("JetFlow's draft head implements the DFlash/JetSpec head (Qwen3 layers, full attention, plain RoPE, "
            "no biases); a head that needs this would draft other logits here than in its authors' code")
    for name, value in d.items():
        if name in NEUTRAL:
            if not NEUTRAL[name](value):
                raise HeadMismatchError(f"config.json field {name}={value!r} is not implemented. {hint}")
        elif name not in READ and name not in METADATA:
            raise HeadMismatchError(f"config.json field {name!r} (= {value!r}) is unknown to JetFlow, so it cannot "
                                    f"tell whether it changes the head. {hint}")
    for name, value in (d.get("dflash_config") or {}).items():
        if name in NEUTRAL_DFLASH:
            if not NEUTRAL_DFLASH[name](value):
                raise HeadMismatchError(f"config.json field dflash_config.{name}={value!r} is not implemented. {hint}")
        elif name not in READ_DFLASH:
            raise HeadMismatchError(f"config.json field dflash_config.{name!r} (= {value!r}) is unknown to JetFlow. "
                                    f"{hint}")
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or set(rope) - {"rope_type", "rope_theta"}:
        raise HeadMismatchError(f"config.json field rope_parameters={rope!r} is not implemented (only plain RoPE "
                                f"with rope_theta). {hint}")
