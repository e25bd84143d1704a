"""The frozen target LLM: loading, layer taps, tree-masked forward over a KV cache, KV compaction."""

from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from jetflow.errors import UnknownModelError
from jetflow.target.attention import GQA_SDPA
from jetflow.target.bundled import BUNDLED, MANIFEST, prepare_bundled
from jetflow.target.projection import RowProjector

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass
class TargetOutput:
    hidden: torch.Tensor     # (N, H) final-normed hidden states (LM-head input); no logits computed
    features: torch.Tensor   # (N, k*H) tapped layer outputs concatenated on channels (head input)


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """k taps spread evenly from layer 1 to layer n-3 (Qwen3-8B, 36 layers, k=5: [1, 9, 17, 25, 33])."""
    if num_layers < 4:  # tiny test models: the distinct layers 0..n-1, at most k of them
        return list(range(min(k, num_layers)))
    last = num_layers - 3
    if k == 1:
        return [last]
    return sorted({int(round(1 + i * (last - 1) / (k - 1))) for i in range(k)})


@functools.cache
def cache_keyword(model_cls: type) -> str:
    """The keyword `model_cls.forward` takes its KV cache by: `cache` from transformers 5.24 on,
    `past_key_values` before (5.24 still accepts the old name, with a warning, until 5.40). Read off the
    signature, never assumed: 5.20-5.23 put an unknown `cache=` into **kwargs and ignore it — the model
    fills a cache of its own, ours stays empty and the next step's logits are wrong, with no error."""
    params = inspect.signature(model_cls.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UnknownModelError(f"{model_cls.__name__}.forward takes neither cache= nor past_key_values=: this "
                            "transformers release passes KV caches in a way JetFlow does not know")


def cache_kwargs(model: nn.Module, cache) -> dict:
    """{keyword: cache} for a forward call of `model` (a HF decoder body or causal LM) on the installed
    transformers: `model(..., **cache_kwargs(model, cache))`."""
    return {cache_keyword(type(model)): cache}


def _load_tokenizer(auto, source: str, local_only: bool):
    """A local model folder without tokenizer files still loads (token ids in, token ids out)."""
    folder = Path(source)
    if folder.is_dir() and not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                     "tokenizer.model", "vocab.json")):
        return None
    return auto.from_pretrained(source, local_files_only=local_only)


class TargetModel:
    """A frozen HF causal LM with the operations speculative decoding needs. Batch size 1."""

    def __init__(self, model: nn.Module, tokenizer, model_id: str, revision: str = "unknown"):
        model.eval()
        if getattr(model.config, "_attn_implementation", None) == "sdpa":
            model.set_attn_implementation(GQA_SDPA)  # sdpa without repeating key/value heads (attention.py)
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        cfg = model.config
        if cfg.model_type not in SUPPORTED_ARCHITECTURES:
            raise UnknownModelError(
                f"target architecture {cfg.model_type!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        self.config = cfg
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.num_layers: int = cfg.num_hidden_layers
        self.max_positions: int = getattr(cfg, "max_position_embeddings", 2048)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._embed = model.get_input_embeddings()
        self._lm_head = model.get_output_embeddings()
        self._body = model.model
        self._neg = torch.finfo(self.dtype).min
        self._projector: RowProjector | None = None

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(cls, name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "TargetModel":
        """Load a bundled name (`smollm2-135m`), a local HF folder, or a hub id (where a hub is reachable)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        revision = "unknown"
        model_id = name
        if name in BUNDLED:
            path = prepare_bundled(name)
            manifest = json.loads((path / MANIFEST).read_text())
            revision = manifest["revision"]
            source: str = str(path)
        elif Path(name).expanduser().is_dir():
            path = Path(name).expanduser().resolve()
            if not (path / "config.json").exists():
                raise UnknownModelError(f"{path} has no config.json: not a Hugging Face model folder")
            if (path / MANIFEST).exists():
                manifest = json.loads((path / MANIFEST).read_text())
                revision, model_id = manifest["revision"], manifest.get("name", name)
            source = str(path)
        else:
            source = name
        # A hub id is tried from the local HF cache first; the hub itself only for names shaped like
        # `org/model`, so a typo fails at once instead of after the hub client's retries.
        attempts = [True, False] if _HUB_ID.fullmatch(name) else [True]
        for i, local_only in enumerate(attempts):
            try:
                tokenizer = _load_tokenizer(AutoTokenizer, source, local_only)
                model = AutoModelForCausalLM.from_pretrained(
                    source, dtype=dtype, attn_implementation="sdpa", local_files_only=local_only
                )
                break
            except (OSError, ValueError) as exc:
                if i + 1 < len(attempts):
                    continue
                raise UnknownModelError(
                    f"cannot load target {name!r}: not bundled ({', '.join(BUNDLED)}), not a local folder, "
                    f"and not loadable from a hub ({exc.__class__.__name__}: {str(exc).splitlines()[0]})"
                ) from exc
        if revision == "unknown":
            revision = getattr(model.config, "_commit_hash", None) or "unknown"
        return cls(model.to(device), tokenizer, model_id=model_id, revision=revision)

    # ------------------------------------------------------------ components
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(..., ) long → (..., H) input embeddings (frozen, shared with the draft head)."""
        return self._embed(ids)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """(V, H) the frozen output embedding (a draft vocabulary slices its rows)."""
        return self._lm_head.weight

    @property
    def lm_head_bias(self) -> torch.Tensor | None:
        return self._lm_head.bias

    def _lm_projector(self) -> RowProjector:
        if self._projector is None or self._projector.weight is not self._lm_head.weight:
            self._projector = RowProjector(self._lm_head.weight, fixed={1: "transposed"})  # AR's step: as it was
        return self._projector

    def warm_lm_head(self, max_rows: int) -> None:
        """Time the LM-head product's orientations for every row-count bucket up to `max_rows` now."""
        self._lm_projector().warm(max_rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) final-normed hidden → (..., V) logits (frozen LM head, shared with the draft head)."""
        out = self._lm_projector()(hidden)  # the product's fastest orientation on this machine for this many rows
        if self._lm_head.bias is not None:
            out = out + self._lm_head.bias
        return out

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    # --------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        mask: torch.Tensor | None = None,
        layer_ids: Sequence[int] = (),
    ) -> TargetOutput:
        """Run N new tokens against the cache (which grows by N).

        ids, positions: (N,) long; positions are RoPE positions (past + depth for tree nodes).
        mask: None for plain causal, else (1, 1, N, past+N) additive float (0 = visible).
        layer_ids: 0-based target layers to tap (HF hidden_states[L+1]).
        """
        out = self.forward_rows(ids[None], positions[None], cache, mask, layer_ids)
        return TargetOutput(hidden=out.hidden[0], features=out.features[0])

    @torch.inference_mode()
    def forward_rows(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        mask: torch.Tensor | None = None,
        layer_ids: Sequence[int] = (),
    ) -> TargetOutput:
        """`forward` for b rows at once: ids, positions (b, n); mask None or (b, 1, n, L) additive float;
        returns hidden (b, n, H) and features (b, n, k*H)."""
        out = self._body(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            **cache_kwargs(self._body, cache),
            use_cache=True,
            output_hidden_states=bool(layer_ids),
        )
        hidden = out.last_hidden_state
        if layer_ids:
            feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        else:
            feats = hidden.new_empty((*hidden.shape[:2], 0))
        return TargetOutput(hidden=hidden, features=feats)

    def tree_mask(self, ancestors: torch.Tensor, past: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, N) bool ancestor-or-self → (1, 1, N, past+N) additive mask: prefix visible, tree by ancestry."""
        n = ancestors.shape[0]
        if out is None:
            out = torch.zeros((1, 1, n, past + n), dtype=self.dtype, device=self.device)
        else:
            out = out[:, :, :n, : past + n]
            out[..., :past].zero_()
        tree = out[0, 0, :, past:]
        tree.zero_()
        tree.masked_fill_(~ancestors, self._neg)
        return out

    @staticmethod
    @torch.inference_mode()
    def compact_cache(cache, past: int, keep: torch.Tensor) -> None:
        """Keep only cache rows past + keep (indices into the last forward's N tokens, in order).

        After this the cache covers exactly `past + len(keep)` tokens, as if they had been fed in order.
        """
        k = keep.shape[0]
        contiguous = bool(torch.equal(keep, torch.arange(k, device=keep.device)))
        for layer in cache.layers:
            if not contiguous:
                src = past + keep
                layer.keys[:, :, past : past + k] = layer.keys.index_select(2, src)
                layer.values[:, :, past : past + k] = layer.values.index_select(2, src)
        extra = cache.get_seq_length() - (past + k)
        if extra:
            cache.crop(-extra)  # transformers 5.x: negative = tokens to drop
