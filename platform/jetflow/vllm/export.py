"""Export a JetFlow head as a checkpoint that vLLM's `dflash` speculative method loads.

    LLM(target, speculative_config={"method": "dflash", "model": OUT, "num_speculative_tokens": B - 1})

vLLM drafts a chain (one [anchor, MASK × k] block per step, argmax per depth); the tree search stays
JetFlow's. The export is exact or refused: a head option vLLM's DFlash model has no place for
(per-tap norms, the anchor shortcut) is named in the error, never silently dropped. Needs no vLLM.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from jetflow.errors import (
    ExportUnsupportedError,
    HeadMismatchError,
    HeadNotFoundError,
    InvalidSettingError,
)
from jetflow.head.config import HeadConfig
from jetflow.head.formats import read_causal
from jetflow.head.io import CONFIG, WEIGHTS, load_head
from jetflow.head.ref import local_head_path
from jetflow.paths import file_sha256
from jetflow.vllm import VLLM_VERSION

PROVENANCE = "jetflow_export.json"
VLLM_LOADER = (f"vllm {VLLM_VERSION}: vllm/model_executor/models/qwen3_dflash.py "
               "(DFlashQwen3ForCausalLM.load_weights, DFlashQwen3Model.hf_to_vllm_mapper)")

# Every tensor vLLM's DFlash loader reads, derived from vllm/model_executor/models/qwen3_dflash.py
# (v0.33.0): DFlashQwen3ForCausalLM.load_weights prefixes `model.` to every name except lm_head / d2t,
# so checkpoint names carry no prefix; DFlashQwen3Model's WeightsMapper stacks q/k/v_proj into
# qkv_proj and gate/up_proj into gate_up_proj. No embed_tokens: the target's embedding is shared. No
# lm_head for a full-vocabulary head: has_own_lm_head stays False and the target's LM head is shared.
# Shapes are symbolic, resolved per head by `expected_tensors`.
VLLM_DFLASH_KEYS: dict[str, tuple[str, ...]] = {
    "fc.weight": ("hidden", "taps*hidden"),          # ReplicatedLinear(k*H → H, bias=False)
    "hidden_norm.weight": ("hidden",),              # RMSNorm on fc output (context K/V input)
    "norm.weight": ("hidden",),                     # final RMSNorm before the LM head
}
VLLM_DFLASH_LAYER_KEYS: dict[str, tuple[str, ...]] = {  # under `layers.{i}.`, i = 0..num_hidden_layers-1
    "input_layernorm.weight": ("hidden",),
    "post_attention_layernorm.weight": ("hidden",),
    "self_attn.q_proj.weight": ("heads*head_dim", "hidden"),
    "self_attn.k_proj.weight": ("kv_heads*head_dim", "hidden"),
    "self_attn.v_proj.weight": ("kv_heads*head_dim", "hidden"),
    "self_attn.o_proj.weight": ("hidden", "heads*head_dim"),
    "self_attn.q_norm.weight": ("head_dim",),       # per-head q/k RMSNorm (Qwen3 style)
    "self_attn.k_norm.weight": ("head_dim",),
    "mlp.gate_proj.weight": ("intermediate", "hidden"),
    "mlp.up_proj.weight": ("intermediate", "hidden"),
    "mlp.down_proj.weight": ("hidden", "intermediate"),
}
# Draft-vocabulary heads only: an own LM head over the draft ids (ParallelLMHead(draft_vocab_size)) and
# `d2t` (renamed draft_id_to_target_id), read by compute_logits as target id = index + d2t[index].
VLLM_DFLASH_DRAFT_VOCAB_KEYS: dict[str, tuple[str, ...]] = {
    "lm_head.weight": ("draft_vocab", "hidden"),
    "d2t": ("draft_vocab",),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def expected_tensors(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """name → shape of every tensor vLLM's DFlash loader expects for a head shaped like `cfg`."""
    dims = {
        "hidden": cfg.hidden_size, "taps*hidden": len(cfg.target_layer_ids) * cfg.hidden_size,
        "heads*head_dim": cfg.num_attention_heads * cfg.head_dim,
        "kv_heads*head_dim": cfg.num_key_value_heads * cfg.head_dim,
        "head_dim": cfg.head_dim, "intermediate": cfg.intermediate_size, "draft_vocab": cfg.draft_vocab_size,
    }
    out = {name: tuple(dims[d] for d in shape) for name, shape in VLLM_DFLASH_KEYS.items()}
    for i in range(cfg.num_hidden_layers):
        out.update({f"layers.{i}.{name}": tuple(dims[d] for d in shape)
                    for name, shape in VLLM_DFLASH_LAYER_KEYS.items()})
    if cfg.draft_vocab_size:
        out.update({name: tuple(dims[d] for d in shape) for name, shape in VLLM_DFLASH_DRAFT_VOCAB_KEYS.items()})
    return out


def check_exportable(cfg: HeadConfig, lm_head_weight: torch.Tensor | None = None,
                     lm_head_bias: torch.Tensor | None = None) -> None:
    """Refuse a head that vLLM's DFlash model would run differently from JetFlow's DraftHead."""
    # Every JetFlow input vLLM's DFlash block has no place for, named together (a `demo` head has all four).
    unsupported = [text for on, text in (
        (cfg.tap_norm, "tap_norm=True (a per-tap RMSNorm, weights tap_norms.*: vLLM's fc reads the raw "
                       "concatenated target layers, and RMSNorm is not linear, so it cannot be folded into fc)"),
        (cfg.anchor_shortcut, "anchor_shortcut=True (the context feature of position T-1 added to every block "
                              "input)"),
        (cfg.depth_embedding, "depth_embedding=True (a learned vector per block offset added to the block "
                              "inputs, weight depth_embed)"),
        (cfg.copy_ngram, f"copy_ngram={cfg.copy_ngram} (copy candidates found in the context added to the block "
                         "inputs, weights copy_norm and copy_len_embed)"),
    ) if on]
    if unsupported:
        raise ExportUnsupportedError(
            f"head option{'s' if len(unsupported) > 1 else ''} {'; '.join(unsupported)}: no counterpart in vLLM's "
            "DFlash model, whose block input is token embeddings only. Serve this head with JetFlow's decoder, or "
            "train one without them for vLLM: jobs/train.py --preset demo-vllm (the demo head without these inputs)")
    if cfg.num_target_layers and any(i >= cfg.num_target_layers - 1 for i in cfg.target_layer_ids):
        # vLLM's aux state for tap L is the residual stream after layer L (llama.py _maybe_add_hidden_state);
        # for the last layer HF's hidden_states[-1], which the head was trained on, is final-normed instead.
        raise ExportUnsupportedError(
            f"target_layer_ids {cfg.target_layer_ids} tap the target's last layer "
            f"({cfg.num_target_layers - 1}): there vLLM hands the draft the stream before the final norm, "
            f"the head was trained after it. Train with taps in 0..{cfg.num_target_layers - 2}")
    if cfg.draft_vocab_size:
        if lm_head_weight is None:
            raise ExportUnsupportedError(
                f"head drafts over a {cfg.draft_vocab_size}-token draft vocabulary: vLLM needs its own LM head "
                "over those ids, copied from the target's. Pass the target (jetflow export --target MODEL)")
        if lm_head_bias is not None:
            raise ExportUnsupportedError("the target's LM head has a bias; vLLM's draft LM head has none, so "
                                         "a draft-vocabulary head for this target cannot be exported exactly")
        if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise HeadMismatchError(f"target LM head is {tuple(lm_head_weight.shape)}, the head expects "
                                    f"({cfg.vocab_size}, {cfg.hidden_size}): wrong target for this head")


def vllm_config(cfg: HeadConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for vLLM: the DFlash layout, with every flag vLLM resolves stated explicitly."""
    config = cfg.to_dflash_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    # The causal flag is already under every name (to_dflash_dict): top-level is_causal wins over
    # dflash_config.causal in vLLM (_dflash_layer_causal), the paper's loader reads dflash_config.causal_head.
    config["is_neox_style"] = True  # DraftHead rotates halves (rotate_half), vLLM's neox layout
    if cfg.draft_vocab_size:
        config["draft_vocab_size"] = cfg.draft_vocab_size
    # Left out on purpose: eagle_aux_hidden_state_layer_ids (vLLM would take the ids as-is, skipping the
    # +1 it applies to dflash_config.target_layer_ids) and layer_types (would switch on sliding windows).
    return config


def export_vllm(head: str | Path, out: str | Path, *, lm_head_weight: torch.Tensor | None = None,
                lm_head_bias: torch.Tensor | None = None, dtype: str | None = None,
                overwrite: bool = False) -> Path:
    """Write `head` (a path or name under $JETFLOW_HOME/heads) to folder `out` as a vLLM DFlash draft:
    config.json, model.safetensors, jetflow_export.json (provenance). `lm_head_weight` (V, H) is the
    target's LM head, needed only by draft-vocabulary heads. `dtype` casts floating weights (default:
    as stored). Returns `out`; raises ExportUnsupportedError for heads vLLM would run differently."""
    src = local_head_path(head)
    model = load_head(src)  # validates that config.json and the weights agree
    cfg = model.config
    check_exportable(cfg, lm_head_weight, lm_head_bias)
    if dtype is not None and dtype not in DTYPES:
        raise InvalidSettingError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InvalidSettingError(f"{out} exists and is not empty; choose another --out or pass --force")

    stored = load_file(str(src / WEIGHTS))  # the bytes as saved, not load_head's float32 copy
    # Only what vLLM reads: `draft_vocab` becomes d2t below, rotary buffers are never saved.
    wanted = set(expected_tensors(cfg)) - set(VLLM_DFLASH_DRAFT_VOCAB_KEYS)
    state = {k: v for k, v in stored.items() if k in wanted}
    stored_dtype = state["fc.weight"].dtype
    target_dtype = DTYPES[dtype] if dtype else stored_dtype
    converted: list[str] = []
    if cfg.draft_vocab_size:
        ids = model.draft_vocab.to(torch.long)
        state["lm_head.weight"] = lm_head_weight.detach().to("cpu")[ids].to(stored_dtype)
        state["d2t"] = ids - torch.arange(ids.numel(), dtype=torch.long)
        converted.append(f"draft vocabulary ({ids.numel()} ids): lm_head.weight = target LM-head rows at "
                         "draft_vocab; d2t = draft_vocab - arange (vLLM: target id = index + d2t[index])")
    if target_dtype != stored_dtype:
        state = {k: v.to(target_dtype) if v.is_floating_point() else v for k, v in state.items()}
        converted.append(f"weights cast {str(stored_dtype).removeprefix('torch.')} → "
                         f"{str(target_dtype).removeprefix('torch.')}")

    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(vllm_config(cfg, target_dtype), indent=2) + "\n")
    provenance = {
        "format": "vllm-dflash",
        "vllm_version": VLLM_VERSION,
        "vllm_loader": VLLM_LOADER,
        "speculative_config": {"method": "dflash", "model": str(out), "num_speculative_tokens": cfg.depth},
        "source_head": str(src),
        "source_weights_sha256": file_sha256(src / WEIGHTS),
        "weights_sha256": file_sha256(tmp / WEIGHTS),
        "causal": cfg.causal,
        "converted": converted,
        "target_model_id": cfg.target_model_id,
        "target_revision": cfg.target_revision,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    problems = validate_vllm_export(tmp)
    if problems:  # a bug here, not user input: never leave a checkpoint vLLM would mis-load
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError("export failed its own vLLM check: " + "; ".join(problems))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def validate_vllm_export(path: str | Path) -> list[str]:
    """Check a folder against what vLLM's DFlash loader reads; returns the problems found (empty = ok)."""
    path = Path(path)
    if not (path / CONFIG).exists() or not (path / WEIGHTS).exists():
        raise HeadNotFoundError(f"{path} is not an exported checkpoint: it needs {CONFIG} and {WEIGHTS}")
    config = json.loads((path / CONFIG).read_text())
    problems = []
    if config.get("architectures") != ["DFlashDraftModel"]:
        problems.append(f"architectures is {config.get('architectures')}, vLLM's registry needs ['DFlashDraftModel']")
    dc = config.get("dflash_config") or {}
    for key in ("target_layer_ids", "mask_token_id", "block_size", "causal", "causal_head"):
        if key not in dc:
            problems.append(f"dflash_config lacks {key}")
    if "is_causal" not in config:
        problems.append("config lacks is_causal (vLLM reads it before dflash_config.causal)")
    try:
        read_causal(config)
    except HeadMismatchError as exc:
        problems.append(str(exc))
    if "eagle_aux_hidden_state_layer_ids" in config or "layer_types" in config:
        problems.append("config sets eagle_aux_hidden_state_layer_ids or layer_types, which override DFlash's")
    if problems:
        return problems
    try:
        cfg = HeadConfig.from_dflash_dict(config)  # reads the top-level draft_vocab_size vLLM uses
    except HeadMismatchError as exc:
        return [str(exc)]
    want = expected_tensors(cfg)
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        d2t = f.get_tensor("d2t") if "d2t" in have else None
    if missing := sorted(set(want) - set(have)):
        problems.append(f"missing tensors {missing[:6]}")
    if extra := sorted(set(have) - set(want)):
        problems.append(f"tensors vLLM would not load {extra[:6]}")
    problems += [f"{k} has shape {have[k]}, vLLM expects {s}" for k, s in want.items() if k in have and have[k] != s]
    if d2t is not None:
        targets = torch.arange(d2t.numel()) + d2t
        if d2t.dtype != torch.long or targets.min() < 0 or targets.max() >= cfg.vocab_size:
            problems.append("d2t must be int64 with index + d2t inside the target vocabulary")
    return problems


def exported_dir(key: str) -> Path:
    """Where `export_cached` keeps the export of `key` (a registry version "NAME/VERSION", or "sha-<weights>" for
    a folder): $JETFLOW_HOME/vllm-heads/<key>, node-local, rebuilt on demand."""
    from jetflow.paths import jetflow_home

    return jetflow_home() / "vllm-heads" / key


def export_cached(head: str | Path, key: str | None = None, lm_head=None) -> Path:
    """`head` (a folder or name) in vLLM's DFlash layout, exported once per `key` into $JETFLOW_HOME/vllm-heads/ and
    reused while the source weights are the same (the provenance's sha256). `key`: the registry version
    ("NAME/VERSION"); default: the weights' sha256. `lm_head`: a callable returning the target's (LM-head weight,
    bias), called only for a draft-vocabulary head. Several replicas on a node may export at once: each writes its
    own temporary folder, the first rename wins. Raises ExportUnsupportedError for a head vLLM cannot run."""
    import os
    import uuid

    src = local_head_path(head)
    weights_sha = file_sha256(src / WEIGHTS)
    out = exported_dir(key or f"sha-{weights_sha[:16]}")
    try:
        if json.loads((out / PROVENANCE).read_text())["source_weights_sha256"] == weights_sha:
            return out
    except (OSError, ValueError, KeyError):
        pass
    cfg = HeadConfig.from_dflash_dict(json.loads((src / CONFIG).read_text()))
    exportable(cfg)  # refused before the target's LM head is read
    weight, bias = lm_head() if cfg.draft_vocab_size and lm_head is not None else (None, None)
    tmp = out.with_name(f"{out.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    export_vllm(src, tmp, lm_head_weight=weight, lm_head_bias=bias, overwrite=True)
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process's export landed first: the same weights, so the same files
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def exportable(cfg: HeadConfig) -> None:
    """`check_exportable` for a head's config alone (no target at hand): ExportUnsupportedError for a head vLLM's
    DFlash model would run differently; the LM-head checks of a draft-vocabulary head wait for the export."""
    check_exportable(cfg, *(_meta_lm_head(cfg) if cfg.draft_vocab_size else ()))


def _meta_lm_head(cfg: HeadConfig) -> tuple[torch.Tensor, None]:
    """A stand-in LM head of the right shape (no memory): check_exportable's shape check then passes."""
    return torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta"), None
