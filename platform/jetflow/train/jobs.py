"""The options of `jobs/train.py` (`TrainJob`) and `jobs/datagen.py` (`DatagenJob`), beside the training and
regeneration options they are combined with. Imports no torch, so that both jobs answer `--help` fast; the
presets and the pipeline they drive are `jetflow.train.pipeline`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainJob:
    """`jobs/train.py`'s own options; the training options (`TrainConfig`) override the preset's."""

    preset: str = "demo"                 # data + training sizes: smoke, demo, demo-vllm (a head vLLM serves) or long
    model: str = "smollm2-135m"          # target: bundled name, local folder or hub id
    workers: int = 1                     # Ray Train workers
    ray: bool = True                     # train under Ray Train (false: in this process)
    features: str = "cache"              # cache: tapped features stored once under $JETFLOW_HOME/features (shared
                                         # by sweep trials); online: computed each epoch (no feature disk)
    device: str | None = None            # cpu, cuda, cuda:N for datagen, features and training (default: cuda when
                                         # a GPU is visible; Ray Train then gives each worker a GPU, DDP over NCCL)
    dtype: str | None = None             # the frozen target's: fp32, bf16, fp16 (default bf16 on a GPU, fp32 on a
                                         # CPU); the head trains in fp32 either way


@dataclass
class DatagenJob:
    """`jobs/datagen.py`'s own options; the regeneration options (`RegenConfig`) override the preset's."""

    preset: str = "demo"                 # base settings: smoke, demo, demo-vllm or long
    features: bool = True                # also build the feature cache (false: only regenerate)
    feature_max_len: int | None = None   # tokens per sequence in the feature cache (default: the preset's)
