"""What one served application is: target, head choice, tree settings, request limits, scaling.

`ServeConfig` is the `args` of the Ray Serve application builder (`jetflow.serving.app:build_app`),
so the same typed, validated object comes from `serve/config.yaml`, from `serve run ... key=value`
(strings, coerced by pydantic) and from `python serve/app.py --key value`. Unknown keys are errors.
"""

from __future__ import annotations

import argparse
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_serializer, field_validator, model_validator

from jetflow.tree import TreeSpec

TREE_OPTIONS = ("algorithm", "budget", "width")  # flat spellings of `tree` (command line, `serve run k=v`)


class ServeConfig(BaseModel):
    """One OpenAI-compatible JetFlow application (one deployment, autoscaled)."""

    # hide_input_in_errors: a validation error's text never carries the input, which may hold api_key
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    model: str = Field("smollm2-135m", description="target: bundled name, local HF folder or hub id")
    device: str | None = Field(None, description="cpu, cuda or cuda:N (default: cuda when the replica has a GPU "
                                                 "(replica_gpus > 0), else cpu)")
    dtype: Literal["fp32", "bf16", "fp16"] | None = Field(None, description="default: bf16 on a GPU, fp32 on a CPU")
    head: str | None = Field(
        None, description="head folder, name under $JETFLOW_HOME/heads, models:/NAME@ALIAS or models:/NAME/VERSION, "
                          "'random' (random-init causal head, for testing), or 'none' (plain decoding); "
                          "unset = the registered head under --alias")
    alias: str = Field("champion", description="registry alias used when --head is unset")
    champion_poll_s: float = Field(
        30.0, ge=0, description="with --head unset, each replica re-reads --alias this often (seconds) and serves "
                                "a newly promoted version from its next request on; requests already running "
                                "finish on the head they started with. 0: read once, at the replica's start")
    tracking_uri: str | None = Field(None, description="MLflow store holding the registry (default: "
                                                       "$MLFLOW_TRACKING_URI, else $JETFLOW_HOME/mlflow.db)")
    served_name: str | None = Field(None, description="model id clients send (default: the target id)")
    api_key: SecretStr | None = Field(None, description="clients must send 'Authorization: Bearer <key>' (OpenAI's "
                                                        "401 otherwise; /healthz stays open). Default: "
                                                        "$JETFLOW_API_KEY where the app is built; unset: no auth")
    tree: TreeSpec | None = Field(None, description="tree setting {algorithm, budget, width, params}; default: the "
                                                    "registered head's stored setting, else TreeSpec() "
                                                    "(accum_logp, budget 8, width 7)")
    max_prompt_tokens: int = Field(2048, ge=1, description="longest prompt accepted, in tokens")
    max_tokens: int = Field(512, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(128, ge=1, description="max_tokens when a request gives none")
    seed: int = Field(0, description="init seed of a 'random' head")
    max_slots: int = Field(8, ge=1, description="requests decoded at once per replica, batched (the engine's slots)")
    max_queued_requests: int = Field(16, ge=0, description="requests waiting for a slot per replica; more get 429")
    request_timeout_s: float | None = Field(600.0, gt=0, description="a request not finished by then gets 504 and "
                                                                     "leaves its slot (unset: no deadline)")
    backend: Literal["jetflow", "vllm"] = Field(
        "jetflow", description="what decodes: jetflow (JetFlow's batched engine with the head's tree) or vllm (vLLM's "
                               "engine: plain AR, or its dflash method with the head exported, a chain of the head's "
                               "block; needs vLLM in the Python that runs Serve, e.g. .venv-vllm after `make "
                               "setup-vllm`). With vllm, policy, prefill_*, cost_curve and tree do not apply; graphs "
                               "off = vLLM's eager mode, auto/compile = its default, compiled")
    policy: Literal["auto", "fixed", "plain"] = Field(
        "auto", description="speculation per step: auto (load-aware: plain or a budget up to the tree's, from the "
                            "measured step cost and the rows' acceptance), fixed (always the tree), plain")
    graphs: Literal["auto", "compile", "off"] = Field(
        "auto", description="how engine steps run: off (the eager reference), compile (the step core, its graphs "
                            "compiled before the replica takes traffic), auto (compile on a GPU; on a CPU where this "
                            "host's verdict says it pays — measured by the first engine that meets none, then kept)")
    prefill_chunk: int = Field(128, ge=1, description="prompt tokens fed per request and engine step")
    prefill_tokens: int = Field(256, ge=1, description="prompt tokens fed per engine step over all new requests")
    cost_curve: str | None = Field(None, description="a step cost curve JSON (jetflow.engine.cost) for the auto "
                                                     "policy; unset: measured once on this machine and cached")
    torch_threads: int | None = Field(None, ge=1, description="intra-op threads per replica (default: Ray's "
                                                              "OMP_NUM_THREADS, i.e. replica_cpus rounded, min 1)")
    replica_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per replica")
    replica_gpus: float = Field(0.0, ge=0, description="Ray GPUs per replica (the target loads on cuda then)")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0, description="autoscaler's target of in-flight "
                                                                          "requests per replica (default: max_slots)")
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="before")
    @classmethod
    def _flat_tree(cls, data: Any) -> Any:
        """`budget=8` / `--budget 8` (and algorithm, width) stand for `tree`: an explicit tree setting,
        replacing the registered one whole (fields not given take TreeSpec's defaults)."""
        if not isinstance(data, dict) or not any(data.get(k) is not None for k in TREE_OPTIONS):
            return data
        if data.get("tree") is not None:
            raise ValueError(f"give either tree or {'/'.join(TREE_OPTIONS)}, not both")
        data = dict(data)
        flat = {k: data.pop(k) for k in TREE_OPTIONS if data.get(k) is not None}
        for k in ("budget", "width"):
            if isinstance(flat.get(k), str) and flat[k].strip().lstrip("-").isdigit():
                flat[k] = int(flat[k])
        data["tree"] = TreeSpec.from_options(**flat)
        return data

    @field_validator("tree", mode="before")
    @classmethod
    def _tree(cls, value: Any) -> Any:
        return TreeSpec.from_dict(value) if isinstance(value, dict) else value

    @field_serializer("tree")
    def _dump_tree(self, tree: TreeSpec | None) -> dict | None:
        return tree.to_dict() if tree is not None else None

    @model_validator(mode="after")
    def _consistent(self) -> "ServeConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self

    def autoscaling_config(self) -> dict[str, Any]:
        """Scale on how full the replicas' slots are: a replica with every slot busy is at its target."""
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or self.max_slots,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}

    @property
    def max_ongoing_requests(self) -> int:
        """What Serve lets into a replica: its slots, its queue, and one more, which the replica answers
        with 429 itself (OpenAI's error body, not the proxy's 503)."""
        return self.max_slots + self.max_queued_requests + 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ServeConfig field as `--field-name` (strings; pydantic coerces and validates them); `tree` as
    TreeSpec's own options (--algorithm, --budget, --width)."""
    from jetflow.config_cli import add_dataclass_args

    group = parser.add_argument_group("application (ServeConfig)")
    for name, field in ServeConfig.model_fields.items():
        if name == "tree":
            add_dataclass_args(parser, TreeSpec, "", group=group)
            continue
        default = "unset" if field.default is None else field.default
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                           help=f"{field.description or ''} (default {default})".strip())


def from_arguments(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the options given on the command line; pydantic errors propagate."""
    names = [n for n in ServeConfig.model_fields if n != "tree"] + list(TREE_OPTIONS)
    return ServeConfig.model_validate({k: getattr(args, k) for k in names if getattr(args, k, None) is not None})
