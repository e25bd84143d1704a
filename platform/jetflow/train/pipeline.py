"""One call from prompts to an evaluated head: regenerate → features → train → evaluate with the
real (lossless) decoder on held-out prompts. Presets size it for a laptop or a cluster."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from jetflow.data.features import FeatureSpec, OnlineFeatures, build_features
from jetflow.data.regenerate import MANIFEST, RegenConfig, regenerate
from jetflow.errors import InvalidSettingError
from jetflow.paths import heads_dir
from jetflow.provenance import provenance
from jetflow.train.config import TrainConfig
from jetflow.train.jobs import DatagenJob, TrainJob  # noqa: F401  (their old import path)
from jetflow.tree import TreeSpec


@dataclass
class Preset:
    regen: RegenConfig
    features_max_len: int
    train: TrainConfig
    eval_prompts: int = 5          # per held-out set (MT-Bench, HumanEval)
    eval_new_tokens: int = 64


# The held-out goals are MT-Bench (chat) and HumanEval (code): half of the prompts ask for code, from
# ShareGPT's code-asking part and standard-library functions to complete (BENCHMARKS.md "The `demo`
# preset with per-depth inputs", "The `demo` preset with standard-library code prompts").
TRAIN_MIX = ("sharegpt", "sharegpt-code", "gsm", "pycode")

PRESETS: dict[str, Preset] = {
    # seconds: for tests and CI
    "smoke": Preset(RegenConfig(num_prompts=8, max_new_tokens=24, batch_size=4, shard_size=4),
                    features_max_len=256,
                    train=TrainConfig(name="smoke", num_hidden_layers=1, tap_norm=True, max_steps=3, anchors_per_seq=4, seqs_per_step=2,
                                      eval_sequences=2, checkpoint_every=2),
                    eval_prompts=1, eval_new_tokens=8),
    # Sized so that `make demo` (this pipeline, then the budget sweep, registration and the gate) stays under
    # 30 min on the slower 2-core hosts (BENCHMARKS.md "make demo"): 384 prompts × 128 new tokens regenerated
    # over 2 Ray actors, one per core (1.2x one two-threaded process: "Regeneration over Ray workers"); the
    # held-out τ on 4 prompts per set spread over it (`spread_prompts`). The head settings come from
    # the calibration on the demo cache (BENCHMARKS.md "Head settings for a 30-minute budget", "What a
    # 1-layer head learns in 120 steps"): a 1-layer, block-8 head with
    # the anchor shortcut learns more per CPU-second than the paper's 2-layer block-16 head, more still
    # with a learned per-depth input and a steep depth decay (γ 1.5) that leave depth 1 its gradient; a
    # 16K draft vocabulary covers 97 % of the target's own tokens. Copy inputs (copy_ngram 3: what followed
    # the longest earlier match of the context's last 1-3 tokens) let the head draft repetitions past
    # depth 1 (BENCHMARKS.md "Copy inputs").
    "demo": Preset(RegenConfig(num_prompts=384, max_new_tokens=128, batch_size=32, shard_size=64,
                               prompt_sets=list(TRAIN_MIX), workers=2),
                   features_max_len=448,
                   train=TrainConfig(name="demo", num_hidden_layers=1, block_size=8, tap_norm=True, anchor_shortcut=True,
                                     depth_embedding=True, gamma=1.5, copy_ngram=3,
                                     epochs=5, anchors_per_seq=24, seqs_per_step=4, lr=1e-3, draft_vocab_size=16384,
                                     eval_sequences=16, checkpoint_every=50),
                   eval_prompts=4, eval_new_tokens=48),
    # As much data as fits 2 hours on 2 CPU cores: 3,000 prompts took 65 min (BENCHMARKS.md "The `long`
    # preset at 3,000 prompts"). Hosts of this class differ: on a slower one every stage ran 1.5-1.7x
    # longer, which puts 3,000 prompts at ~102 min and 4,000 (tried, stopped) at ~135, over the limit.
    # Regenerated from the demo's prompt mix (the ShareGPT + GSM data of sessions 4-7 gave the copy head 2.32
    # on HumanEval against the demo's 2.85) over 2 Ray actors (1.2x one two-threaded process: "Regeneration
    # over Ray workers"); the demo's 1-layer head (per-depth input, γ 1.5, copy inputs), 4 epochs.
    "long": Preset(RegenConfig(num_prompts=3000, max_new_tokens=192, batch_size=32, shard_size=64,
                               prompt_sets=list(TRAIN_MIX), workers=2),
                   features_max_len=512,
                   train=TrainConfig(name="long", num_hidden_layers=1, block_size=8, tap_norm=True, anchor_shortcut=True,
                                     depth_embedding=True, gamma=1.5, copy_ngram=3,
                                     epochs=4, anchors_per_seq=24, seqs_per_step=4, lr=1e-3, draft_vocab_size=16384,
                                     eval_sequences=32, checkpoint_every=50),
                   eval_prompts=6, eval_new_tokens=96),
}

# The demo head inside what vLLM's DFlash model runs (`jetflow export --to vllm` accepts it and refuses the other
# presets' heads): the demo's data, feature cache (same keys), depth decay, optimiser and 16K draft vocabulary
# (exported as lm_head + d2t), without the four JetFlow inputs vLLM has no place for — per-tap norms, the anchor
# shortcut, the per-depth input and copy inputs. Its τ beside the demo head's is what vLLM compatibility costs.
PRESETS["demo-vllm"] = replace(PRESETS["demo"], train=TrainConfig.from_overrides(PRESETS["demo"].train, {
    "name": "demo-vllm", "tap_norm": False, "anchor_shortcut": False, "depth_embedding": False, "copy_ngram": 0}))


def run_pipeline(preset: str, name: str | None = None, model: str = "smollm2-135m", use_ray: bool = True,
                 workers: int = 1, train_overrides: dict | None = None, regen_overrides: dict | None = None,
                 features: str = "cache", device: str | None = None, dtype: str | None = None) -> Path:
    """Returns the head folder ($JETFLOW_HOME/heads/<name>) with weights, provenance and metrics.
    `features="online"` computes the tapped features during training instead of caching them. `device` and
    `dtype` place the target for every stage (`jetflow.target.placement`; the regeneration options'
    device/dtype, when given, win for datagen).

    On a multi-node cluster (`jetflow.cluster`) this process loads no target: regeneration runs on Ray actors,
    the feature cache and the held-out decoding are Ray tasks on worker nodes (their device resolved there),
    the data and features travel through cluster storage, and the head comes back as Ray Train's checkpoint."""
    if preset not in PRESETS:
        raise InvalidSettingError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    if features not in ("cache", "online"):
        raise InvalidSettingError(f"features must be 'cache' or 'online', got {features!r}")
    from jetflow.cluster import init_ray, is_multi_node

    if use_ray and os.environ.get("RAY_ADDRESS"):  # a Ray job, or a driver of a running cluster: join it with what
        init_ray()                                 # its workers need (storage, tracking), before deciding anything
    p = PRESETS[preset]
    regen_cfg = RegenConfig(**{**asdict(p.regen), "model": model, "device": device, "dtype": dtype,
                               **(regen_overrides or {})})
    tcfg = TrainConfig.from_overrides(p.train, {"name": name or preset, **(train_overrides or {})})
    if is_multi_node():
        if not use_ray or features == "online":
            raise InvalidSettingError("on a multi-node cluster training runs under Ray Train on the feature cache "
                                      "(ray=true, features=cache): the driver's node has no target and no disk "
                                      "the workers see")
        return _pipeline_on_cluster(preset, p, regen_cfg, tcfg, model, workers, device, dtype)
    from jetflow.target import TargetModel
    from jetflow.target.placement import placement

    on, torch_dtype = placement(device, dtype)
    timings = {}
    t0 = time.perf_counter()
    regen_dir = regenerate(regen_cfg)
    timings["datagen_s"] = time.perf_counter() - t0

    target = TargetModel.load(model, device=on, dtype=torch_dtype)
    spec = FeatureSpec.for_target(target, tcfg.num_taps, p.features_max_len)
    t0 = time.perf_counter()
    data = OnlineFeatures(regen_dir, target, spec) if features == "online" else build_features(regen_dir, target, spec)
    timings["features_s"] = time.perf_counter() - t0

    out = heads_dir() / tcfg.name
    t0 = time.perf_counter()
    if use_ray:
        from jetflow.train.ray_train import train_on_ray

        train_on_ray(tcfg, model, data, out, num_workers=workers, use_gpu=on.type == "cuda", dtype=dtype)
    else:
        train_in_process(tcfg, target, data, out)  # tracked live, like train_on_ray
    timings["train_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    from jetflow.eval import measure_acceptance
    from jetflow.head import load_head

    decode_metrics = measure_acceptance(target, load_head(out, device=on, dtype=torch_dtype), prompts_per_set=p.eval_prompts,
                                        new_tokens=p.eval_new_tokens, trees=(tcfg.eval_tree, TreeSpec("chain")))
    timings["eval_s"] = time.perf_counter() - t0
    _finish_head(out, preset, regen_dir, str(regen_dir), "online" if features == "online" else str(data), tcfg,
                 decode_metrics, timings)
    return out


def _finish_head(out: Path, preset: str, regen_dir: Path, data_dir: str, features: str, tcfg: TrainConfig,
                 decode_metrics: dict, timings: dict) -> None:
    """The head folder's metrics.json (training's + decoded τ) and provenance.json."""
    metrics = {**json.loads((out / "metrics.json").read_text()), **decode_metrics}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    manifest = json.loads((regen_dir / MANIFEST).read_text())
    (out / "provenance.json").write_text(json.dumps(provenance({
        "preset": preset, "data_dir": data_dir, "data_manifest_sha256": manifest["content_sha256"],
        "data_tokens": manifest["response_tokens"], "timings": timings, "features": features,
        "train_config": tcfg.to_dict(),
    }), indent=2) + "\n")


def _pipeline_on_cluster(preset: str, p: Preset, regen_cfg: RegenConfig, tcfg: TrainConfig, model: str,
                         workers: int, device: str | None, dtype: str | None) -> Path:
    from jetflow.cluster import on_worker, wants_gpu
    from jetflow.storage import storage
    from jetflow.train.ray_train import train_on_ray

    st, gpu = storage(), wants_gpu(device)
    timings = {}
    t0 = time.perf_counter()
    regen_dir = regenerate(regen_cfg)  # on actors; the manifest is here too
    regen_rel = st.rel(regen_dir)
    timings["datagen_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    features_rel = on_worker(build_features_on_worker, regen_rel, model, device, dtype, tcfg.num_taps,
                             p.features_max_len, num_gpus=1 if gpu else 0)
    features_dir = st.local(features_rel, required=("features.json",), only=("features.json",))
    timings["features_s"] = time.perf_counter() - t0
    out = heads_dir() / tcfg.name
    t0 = time.perf_counter()
    trained = train_on_ray(tcfg, model, features_dir, out, num_workers=workers, use_gpu=gpu, dtype=dtype)
    timings["train_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    decode_metrics = on_worker(decode_on_worker, model, device, dtype, trained["checkpoint_uri"], p.eval_prompts,
                               p.eval_new_tokens, [tcfg.eval_tree.to_dict(), TreeSpec("chain").to_dict()],
                               num_gpus=1 if gpu else 0)
    timings["eval_s"] = time.perf_counter() - t0
    _finish_head(out, preset, regen_dir, st.uri_for(regen_rel), st.uri_for(features_rel), tcfg, decode_metrics,
                 timings)
    return out


def build_features_on_worker(regen_rel: str, model: str, device: str | None, dtype: str | None, num_taps: int,
                             max_len: int) -> str:
    """A Ray task on a worker node: the feature cache of regenerated data `regen_rel` (this node's copy of it),
    built with the target placed here, published to cluster storage. → its folder in storage."""
    from jetflow.storage import storage
    from jetflow.target import TargetModel
    from jetflow.target.placement import placement

    regen_dir = storage().local(regen_rel, required=(MANIFEST,))
    on, torch_dtype = placement(device, dtype)
    target = TargetModel.load(model, device=on, dtype=torch_dtype)
    spec = FeatureSpec.for_target(target, num_taps, max_len)
    return storage().rel(build_features(regen_dir, target, spec, progress=False))


def decode_on_worker(model: str, device: str | None, dtype: str | None, head: str, prompts_per_set: int,
                     new_tokens: int, trees: list[dict]) -> dict:
    """A Ray task on a worker node: the held-out decoded τ of `head` (a reference this node resolves)."""
    from jetflow.eval import measure_acceptance
    from jetflow.head import HeadRef
    from jetflow.target import TargetModel
    from jetflow.target.placement import placement

    on, torch_dtype = placement(device, dtype)
    target = TargetModel.load(model, device=on, dtype=torch_dtype)
    loaded = HeadRef.parse(head).load(target)
    return measure_acceptance(target, loaded.head, prompts_per_set=prompts_per_set, new_tokens=new_tokens,
                              trees=tuple(TreeSpec.from_dict(t) for t in trees))


def train_in_process(cfg: TrainConfig, target, features, out: str | Path, **train_kw) -> dict:
    """`jetflow.train.trainer.train` in this process (no Ray), tracked live: this process is both the
    driver (`jetflow.tracking.live.training_run`) and the worker (`StepLogger`); the trainer's own progress
    bar is the console progress. `features` is a feature-cache folder or an `OnlineFeatures`; returns the final
    metrics."""
    from jetflow.data.features import FeatureCache
    from jetflow.tracking.live import StepLogger, training_run
    from jetflow.train.trainer import latest_checkpoint, train

    data = features if hasattr(features, "regen_dir") else FeatureCache(Path(features))
    resuming = latest_checkpoint(Path(out) / "checkpoints") is not None
    with training_run(cfg, out, features, resuming=resuming) as run, \
            StepLogger(run.run_id, flush_every=cfg.checkpoint_every) as log:
        return train(cfg, target, data, Path(out), log=log, on_start=log.start, **train_kw)
