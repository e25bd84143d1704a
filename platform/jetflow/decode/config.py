"""Decoding settings (`DecodeConfig`): what to draft and how to sample. Imports no torch, so that the entry
points' option classes that hold one answer `--help` fast."""

from __future__ import annotations

from dataclasses import dataclass, field

from jetflow.errors import InvalidSettingError
from jetflow.tree import TreeSpec

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's chat limit; completions allow 5)


def check_temperature(value) -> float:
    """The sampling temperature rule, stated once: finite and >= 0 (0 = greedy)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise InvalidSettingError(f"temperature must be finite and >= 0 (0 = greedy), got {value!r}")
    return float(value)


@dataclass
class DecodeConfig:
    tree: TreeSpec = field(default_factory=TreeSpec)  # drafted per round with a head (budget 1 = plain)
    temperature: float = 0.0         # 0 = greedy (token-identical to AR); > 0 samples losslessly from the target
    top_p: float = 1.0               # nucleus sampling mass (T > 0)
    top_k: int = 0                   # sample among the k likeliest tokens (T > 0); 0 = off
    max_new_tokens: int = 128        # tokens to generate at most
    stop: list[str] = field(default_factory=list, metadata={"split": False})  # stop strings
    seed: int | None = None          # sampling seed (default: nondeterministic)
    # Log-probabilities under the target's raw distribution (before temperature, top-k, top-p), with the k
    # likeliest alternatives: None = not computed (nobody pays for them), k in 0..MAX_TOP_LOGPROBS.
    logprobs: int | None = field(default=None, metadata={"cli": False})         # of each generated token
    prompt_logprobs: int | None = field(default=None, metadata={"cli": False})  # of each prompt token but the first

    def __post_init__(self) -> None:
        if not isinstance(self.tree, TreeSpec):
            raise InvalidSettingError(f"tree must be a TreeSpec, got {self.tree!r}")
        self.temperature = check_temperature(self.temperature)
        if not 0 < self.top_p <= 1:
            raise InvalidSettingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidSettingError(f"top_k must be >= 0, got {self.top_k}")
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise InvalidSettingError("stop strings must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
                raise InvalidSettingError(f"{name} must be unset or 0..{MAX_TOP_LOGPROBS}, got {k!r}")
        if self.max_new_tokens < 1:
            raise InvalidSettingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
