"""What one served application is: target, head choice, tree settings, request limits, scaling.

`ServeConfig` is the `args` of the Ray Serve application builder (`jetflow.serving.app:build_app`),
so the same typed, validated object comes from `serve/config.yaml`, from `serve run ... key=value`
(strings, coerced by pydantic) and from `python serve/app.py --key value`. Unknown keys are errors.
"""

from __future__ import annotations

import argparse
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Tree settings when neither the config nor the registered champion names them. On the 2-core CPU
# a verify of N nodes costs ~1.6x (N=8) .. 2.4x (N=32) one AR step (BENCHMARKS.md), so small trees;
# served with the demo head, budgets 4 and 8 ran at the same tokens/s (benchmarks/serving.py).
DEFAULT_TREE = {"algorithm": "accum_logp", "budget": 8, "width": 7}


class ServeConfig(BaseModel):
    """One OpenAI-compatible JetFlow application (one deployment, autoscaled)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("smollm2-135m", description="target: bundled name, local HF folder or hub id")
    head: str | None = Field(
        None, description="head folder, name under $JETFLOW_HOME/heads, models:/NAME@ALIAS or models:/NAME/VERSION, "
                          "'random' (random-init causal head, for testing), or 'none' (plain decoding); "
                          "unset = the registered head under --alias")
    alias: str = Field("champion", description="registry alias used when --head is unset")
    tracking_uri: str | None = Field(None, description="MLflow store holding the registry (default: "
                                                       "$MLFLOW_TRACKING_URI, else $JETFLOW_HOME/mlflow.db)")
    served_name: str | None = Field(None, description="model id clients send (default: the target id)")
    algorithm: str | None = Field(None, description="tree algorithm (default: registered tree config, else "
                                                     f"{DEFAULT_TREE['algorithm']})")
    budget: int | None = Field(None, ge=1, le=4096, description="tree nodes per round, root counted (default: "
                                                               f"registered tree config, else {DEFAULT_TREE['budget']})")
    width: int | None = Field(None, ge=1, description=f"top-W draft tokens per depth (default: registered, else "
                                                      f"{DEFAULT_TREE['width']})")
    max_prompt_tokens: int = Field(2048, ge=1, description="longest prompt accepted, in tokens")
    max_tokens: int = Field(512, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(128, ge=1, description="max_tokens when a request gives none")
    seed: int = Field(0, description="init seed of a 'random' head")
    decode_threads: int = Field(1, ge=1, description="rounds run at once per replica (requests interleave "
                                                     "round by round on these threads)")
    torch_threads: int | None = Field(None, ge=1, description="intra-op threads per replica (default: Ray's "
                                                              "OMP_NUM_THREADS, i.e. replica_cpus rounded, min 1)")
    replica_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per replica")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0, description="autoscaler's target of in-flight requests "
                                                                  "per replica")
    max_ongoing_requests: int = Field(8, ge=1, description="in-flight requests per replica; more wait in the proxy")
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="after")
    def _consistent(self) -> "ServeConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens ({self.max_tokens})")
        if self.algorithm is not None:
            from jetflow.tree import TREE_BUILDERS

            if self.algorithm not in TREE_BUILDERS:
                raise ValueError(f"unknown tree algorithm {self.algorithm!r}; known: {', '.join(sorted(TREE_BUILDERS))}")
        return self

    def autoscaling_config(self) -> dict[str, Any]:
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ServeConfig field as `--field-name` (strings; pydantic coerces and validates them)."""
    group = parser.add_argument_group("application (ServeConfig)")
    for name, field in ServeConfig.model_fields.items():
        default = "unset" if field.default is None else field.default
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                           help=f"{field.description or ''} (default {default})".strip())


def from_arguments(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the options given on the command line; pydantic errors propagate."""
    return ServeConfig.model_validate({k: getattr(args, k) for k in ServeConfig.model_fields
                                       if getattr(args, k, None) is not None})
