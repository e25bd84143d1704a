"""Typed training configuration; presets; `section=value` style overrides come from the job scripts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from jetflow.errors import InvalidSettingError
from jetflow.head.config import HeadArch, HeadConfig
from jetflow.tree import TreeSpec

LOSSES = ("fkl", "ce", "rkl")  # the per-depth losses (`jetflow.train.losses`); named here, where they are chosen


@dataclass(kw_only=True)
class TrainConfig(HeadArch):
    """A head to train: its architecture (the `HeadArch` fields, validated there; a draft vocabulary is
    the N most frequent ShareGPT ids) plus the data, objective, optimiser and monitoring settings."""

    name: str = "head"               # the head's name: it lands in $JETFLOW_HOME/heads/<name>/
    num_taps: int = 5                # target layers tapped for context features, spread from layer 1 to n-3
    # initialisation
    zero_init: bool = True           # zero o_proj/down_proj: each layer starts as the identity
    init_from_target: bool = False   # copy the target's top layers into the head
    # objective and optimiser
    loss: str = "fkl"                # fkl (forward KL on the teacher's top-K), ce (the target's token) or rkl
    gamma: float = 0.0               # > 0: weight depth k by exp(-(k-1)/gamma) (DFlash decay); 0 = uniform
    lr: float = 3e-4                 # AdamW peak learning rate (warmup, then cosine to 0)
    weight_decay: float = 0.0        # AdamW weight decay
    feature_noise: float = 0.0       # > 0: std of Gaussian noise on the normalized taps, training forwards only
    warmup_frac: float = 0.05        # fraction of the steps spent warming the learning rate up
    epochs: float = 2.0              # passes over the training sequences (fractions allowed)
    max_steps: int = 0               # > 0 caps the run
    anchors_per_seq: int = 16        # random anchors (blocks) per sequence and step, response region only
    seqs_per_step: int = 4           # sequences per optimizer step (per worker)
    grad_clip: float = 1.0           # clip the gradient norm to this
    # monitoring and checkpoints
    max_sequences: int = 0           # > 0: train on only the first N training sequences (data-size studies)
    eval_every: int = 0              # > 0: held-out eval every N steps (what ASHA stops on); always at the end
    eval_sequences: int = 16         # sequences held out for the monitor (per-depth agreement, simulated tau)
    eval_width: int = 7              # tree width W of the monitor's simulated tree tau
    eval_budget: int = 32            # tree budget of the monitor's simulated tree tau
    checkpoint_every: int = 50       # save a resumable checkpoint every N steps
    seed: int = 0                    # seeds the head init, the split, the epoch orders and the anchors

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss not in LOSSES:
            raise InvalidSettingError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not 1 <= self.anchors_per_seq <= 512:
            raise InvalidSettingError(f"anchors_per_seq must be in 1..512, got {self.anchors_per_seq}")
        if self.max_sequences < 0 or self.eval_every < 0:
            raise InvalidSettingError("max_sequences and eval_every must be >= 0 (0 = all / only at the end)")
        self.eval_tree  # the monitor's tree setting is valid (TreeSpec checks it)
        for name in ("num_taps", "seqs_per_step", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise InvalidSettingError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.feature_noise < 0:
            raise InvalidSettingError(f"feature_noise must be >= 0, got {self.feature_noise}")
        if self.lr <= 0 or self.gamma < 0 or self.epochs <= 0:
            raise InvalidSettingError("lr and epochs must be > 0 and gamma >= 0")

    @property
    def eval_tree(self) -> TreeSpec:
        """The tree the monitor's simulated tree τ and the held-out decoded τ use."""
        return TreeSpec(budget=self.eval_budget, width=self.eval_width)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def head_config(self, target, layer_ids: list[int]) -> HeadConfig:
        """The config of the head this run trains for `target`, tapping `layer_ids`."""
        return HeadConfig.for_target(target, target_layer_ids=list(layer_ids), **self.arch())

    @classmethod
    def from_overrides(cls, base: "TrainConfig", overrides: dict[str, Any]) -> "TrainConfig":
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(overrides) - set(known)
        if unknown:
            raise InvalidSettingError(f"unknown training options {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{**base.to_dict(), **overrides})
