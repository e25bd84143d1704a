"""Draft-head configuration, serialised in the DFlash layout that vLLM's DFlash loader reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from jetflow.errors import InvalidSettingError


def check_copy_ngram(n: int) -> None:
    """The head option `copy_ngram`: 0 (no copy inputs) or the longest context suffix matched, up to 16."""
    if not 0 <= n <= 16:
        raise InvalidSettingError(f"copy_ngram must be in 0..16 (0 = no copy inputs), got {n}")


@dataclass(kw_only=True)
class HeadArch:
    """The architecture choices of a draft head — what training picks and a checkpoint records — with
    their one set of ranges and defaults (the paper's head: no JetFlow options). `HeadConfig` (a head
    shaped for a target) and `TrainConfig` (a head to train) both are one."""

    num_hidden_layers: int = 2           # decoder layers in the head (the paper: 1-8)
    block_size: int = 16                 # B: the anchor plus B-1 drafted depths per block
    causal: bool = True                  # causal inside the block (JetFlow); false = bidirectional (DFlash)
    tap_norm: bool = False               # RMSNorm each tapped layer before fc (SmolLM2's tapped outliers collapse
                                         # raw fc inputs)
    anchor_shortcut: bool = False        # add the context feature at the anchor's position - 1 to every block input
    depth_embedding: bool = False        # a learned input vector per block offset
    copy_ngram: int = 0                  # > 0: block inputs gain copy candidates from the longest (<= n) earlier
                                         # match of the context's suffix (jetflow.head.copy); 0 = off
    draft_vocab_size: int = 0            # > 0: draft only over this many target ids (stored as `draft_vocab`);
                                         # 0 = the target's full vocabulary

    def __post_init__(self) -> None:
        if not 1 <= self.num_hidden_layers <= 64:
            raise InvalidSettingError(f"num_hidden_layers must be in 1..64, got {self.num_hidden_layers}")
        if not 2 <= self.block_size <= 64:
            raise InvalidSettingError(f"block_size must be in 2..64 (anchor + at least one draft), got {self.block_size}")
        check_copy_ngram(self.copy_ngram)
        if self.draft_vocab_size < 0:
            raise InvalidSettingError(f"draft_vocab_size must be >= 0 (0 = the target's full vocabulary), "
                                      f"got {self.draft_vocab_size}")

    def arch(self) -> dict[str, Any]:
        """The architecture fields alone (what `HeadConfig.for_target` takes)."""
        return {f.name: getattr(self, f.name) for f in fields(HeadArch)}


@dataclass(kw_only=True)
class HeadConfig(HeadArch):
    """A head shaped for one target: its dimensions, taps and MASK token, plus the architecture."""

    hidden_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    num_target_layers: int = 0
    target_model_id: str = ""
    target_revision: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.target_layer_ids:
            raise InvalidSettingError("target_layer_ids must name at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidSettingError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size > self.vocab_size:
            raise InvalidSettingError(f"draft_vocab_size must be in 0..{self.vocab_size} (0 = full vocab), "
                                      f"got {self.draft_vocab_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise InvalidSettingError(f"mask_token_id {self.mask_token_id} outside vocab of {self.vocab_size}")

    @property
    def depth(self) -> int:
        """D = block_size - 1 draft positions per block."""
        return self.block_size - 1

    @classmethod
    def for_target(cls, target, **overrides: Any) -> "HeadConfig":
        """A head shaped like `target` (a TargetModel): same hidden size, heads, head_dim, RoPE base."""
        from jetflow.target.model import default_layer_ids

        cfg = target.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        mask_id = overrides.pop("mask_token_id", None)
        if mask_id is None:
            # A token that never appears in chat text; its (frozen) embedding marks "to be drafted".
            unk = getattr(target.tokenizer, "unk_token_id", None)
            mask_id = unk if unk is not None else target.vocab_size - 1
        base = dict(
            hidden_size=cfg.hidden_size,
            vocab_size=target.vocab_size,
            target_layer_ids=default_layer_ids(target.num_layers, 5),
            mask_token_id=int(mask_id),
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=target.max_positions,
            num_target_layers=target.num_layers,
            target_model_id=target.model_id,
            target_revision=target.revision,
        )
        base.update(overrides)
        return cls(**base)

    # ------------------------------------------------------------ DFlash layout
    def to_dflash_dict(self) -> dict[str, Any]:
        """config.json as the DFlash reference and vLLM's `dflash` method expect (Qwen3-style)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            # the causal flag under every published name (jetflow.head.formats.CAUSAL_FLAGS): vLLM reads
            # is_causal / dflash_config.causal, the paper's loader dflash_config.causal_head
            "is_causal": self.causal,
            "dflash_config": {
                "block_size": self.block_size,
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "causal": self.causal,
                "causal_head": self.causal,
            },
            "jetflow": {
                "tap_norm": self.tap_norm,
                "anchor_shortcut": self.anchor_shortcut,
                "depth_embedding": self.depth_embedding,
                "copy_ngram": self.copy_ngram,
                "draft_vocab_size": self.draft_vocab_size,
                "target_model_id": self.target_model_id,
                "target_revision": self.target_revision,
                "extra": self.extra,
            },
        }

    @classmethod
    def from_dflash_dict(cls, d: dict[str, Any]) -> "HeadConfig":
        """A config.json in any published DFlash layout (DFlash's, the paper's, transformers-4 style, a vLLM
        export, ours: `jetflow.head.formats`). HeadMismatchError for a field the head does not implement;
        KeyError for a missing size."""
        from jetflow.head import formats

        formats.check_implemented(d)
        jf = d.get("jetflow", {})
        rope = d.get("rope_parameters") or {}
        layer_ids = formats.draft_value(d, "target_layer_ids")
        if layer_ids is None:
            if "num_target_layers" not in d:
                raise KeyError("dflash_config.target_layer_ids (or num_target_layers to derive them from)")
            layer_ids = formats.published_layer_ids(int(d["num_target_layers"]), int(d["num_hidden_layers"]))
        mask_token_id = formats.draft_value(d, "mask_token_id")
        if mask_token_id is None:
            raise KeyError("dflash_config.mask_token_id")
        return cls(
            hidden_size=d["hidden_size"],
            vocab_size=d["vocab_size"],
            target_layer_ids=[int(i) for i in layer_ids],
            mask_token_id=int(mask_token_id),
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            block_size=int(formats.draft_value(d, "block_size", 16)),
            causal=formats.read_causal(d),
            tap_norm=bool(jf.get("tap_norm", False)),
            anchor_shortcut=bool(jf.get("anchor_shortcut", False)),
            depth_embedding=bool(jf.get("depth_embedding", False)),
            copy_ngram=int(jf.get("copy_ngram", 0)),
            draft_vocab_size=int(jf.get("draft_vocab_size", d.get("draft_vocab_size") or 0)),
            num_target_layers=d.get("num_target_layers", 0),
            target_model_id=jf.get("target_model_id", ""),
            target_revision=jf.get("target_revision", ""),
            extra=jf.get("extra", {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
