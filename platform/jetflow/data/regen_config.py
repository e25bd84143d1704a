"""`RegenConfig`: what regeneration answers (target, prompts, lengths, sampling) and where (workers, device,
backend), validated on construction; its `key` names the output folder. Imports no torch or pyarrow, so that
`jobs/datagen.py --help` answers fast; the regeneration itself is `jetflow.data.regenerate`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from jetflow.data.prompts import prompt_set_version
from jetflow.errors import InvalidSettingError

BACKENDS = ("hf", "vllm")


@dataclass
class RegenConfig:
    model: str = "smollm2-135m"      # the target: a bundled name, a local HF folder or a hub id
    prompt_sets: list[str] = field(default_factory=lambda: ["sharegpt", "gsm"])  # train splits, interleaved
    num_prompts: int = 256            # prompts taken from the sets, in turn
    max_prompt_tokens: int = 256      # longer prompts are skipped (recorded in the manifest)
    max_new_tokens: int = 256         # the longest answer regenerated per prompt
    temperature: float = 0.0          # 0 = greedy (the paper's default)
    batch_size: int = 16              # prompts decoded together (left padding)
    shard_size: int = 64              # prompts per stored shard: the unit of resume and of work per worker
    workers: int = 1                  # >1: shards spread over this many Ray actors
    backend: str = "hf"               # "hf" (our batched greedy/sampling loop on the transformers model) or
                                      # "vllm" (needs vLLM: `make setup-vllm` on a CPU, the [vllm] extra on a GPU)
    device: str | None = None         # cpu, cuda, cuda:N (default: cuda when a GPU is visible); one GPU per worker
    dtype: str | None = None          # fp32, bf16, fp16 (default: bf16 on a GPU, fp32 on a CPU)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "batch_size", "shard_size", "workers"):
            if getattr(self, name) < 1:
                raise InvalidSettingError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise InvalidSettingError(f"temperature must be >= 0, got {self.temperature}")
        self.target_dtype()  # a clear error for an unknown dtype
        if self.backend not in BACKENDS:
            raise InvalidSettingError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "vllm" and self.workers > 1:
            raise InvalidSettingError("backend 'vllm' batches every prompt of a shard itself on one engine; "
                                      "use workers=1 (Ray actors would each start a vLLM engine)")

    def key(self, revision: str) -> str:
        """Content key of the output: what it depends on (not workers/batching). The HF backend keeps the
        key it always had; another backend's (numerically different) output gets a folder of its own."""
        drop = ("workers", "batch_size", "device", "dtype") + (("backend",) if self.backend == "hf" else ())
        settings = {k: v for k, v in asdict(self).items() if k not in drop}
        if (dtype := self.target_dtype()) != "fp32":  # other numbers, another folder; fp32 keeps the old key
            settings["dtype"] = dtype
        content = {"settings": settings, "revision": revision}
        if versions := self.prompt_set_versions():
            content["prompt_set_versions"] = versions
        blob = json.dumps(content, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def target_dtype(self) -> str:
        """The dtype name the target is answered in (the default resolved for this machine; no check that the
        device exists, so a manifest written on a GPU still names its folder anywhere)."""
        from jetflow.target.placement import DTYPES

        if self.dtype is not None:
            if self.dtype not in DTYPES:
                raise InvalidSettingError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
            return self.dtype
        import torch

        gpu = self.device.startswith("cuda") if self.device else torch.cuda.is_available()
        return "bf16" if gpu else "fp32"

    def load_target(self):
        """The target on this config's device, in its dtype."""
        from jetflow.target import TargetModel
        from jetflow.target.placement import placement

        device, dtype = placement(self.device, self.dtype)
        return TargetModel.load(self.model, device=device, dtype=dtype)

    def on_gpu(self) -> bool:
        from jetflow.target.placement import placement

        return placement(self.device, self.dtype)[0].type == "cuda"

    def prompt_set_versions(self) -> dict[str, str]:
        """The content versions of the sets whose content no package pin fixes (e.g. pycode: the
        Python version); part of the key and the manifest."""
        return {name: v for name in self.prompt_sets if (v := prompt_set_version(name)) is not None}
