"""Head training as a Ray Train `TorchTrainer`: one worker using every local core on a laptop, N GPU
workers on a cluster. Each worker loads the frozen target and the shared feature cache; rank 0
checkpoints and saves. The training is tracked live in MLflow (`jetflow.tracking.live`): the driver
opens and ends the run and prints progress, the rank-0 worker logs every step into it.

On a multi-node cluster (`jetflow.cluster`) no worker opens a path of the driver's: each reads the feature
cache through its node's copy of it in cluster storage, decides its device where it runs, and rank 0 writes
the head into its own node's `$JETFLOW_HOME`; the head comes back to the caller as the run's Ray Train
checkpoint, which Ray keeps in cluster storage (`RunConfig(storage_path, storage_filesystem)`)."""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import nullcontext
from pathlib import Path


def _loop(config: dict) -> None:
    import ray.train

    from jetflow.data.features import FeatureCache, FeatureSpec, OnlineFeatures
    from jetflow.target import TargetModel
    from jetflow.train.config import TrainConfig
    from jetflow.train.trainer import train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    tracked = config.get("mlflow")
    run_tag = {"mlflow_run_id": tracked["run_id"]} if tracked else {}  # which run a Tune trial's reports belong to
    step_log = None
    if tracked:
        from jetflow.tracking.live import StepLogger

        os.environ["MLFLOW_TRACKING_URI"] = tracked["tracking_uri"]  # the driver's store, whatever we inherited
        step_log = StepLogger(tracked["run_id"], steps=rank == 0, flush_every=config["train"]["checkpoint_every"],
                              node_id=f"rank{rank}" if world > 1 else None)
    import ray.train.torch
    import torch

    from jetflow.target.placement import placement

    # a GPU worker's own device (Ray Train set CUDA_VISIBLE_DEVICES and the NCCL process group), else the CPU
    device = ray.train.torch.get_device() if config.get("use_gpu") else torch.device("cpu")
    target = TargetModel.load(config["model"], device=device, dtype=placement(device.type, config.get("dtype"))[1])
    online = config.get("online")
    if online:  # features computed on the fly from the regenerated data (no feature cache on disk)
        data = OnlineFeatures(Path(online["regen_dir"]), target, FeatureSpec.from_dict(online["spec"]))
    elif "features_rel" in config:  # this node's copy of the cache in cluster storage
        from jetflow.storage import storage

        data = FeatureCache(storage().local(config["features_rel"], required=("features.json",)))
    else:
        data = FeatureCache(Path(config["features"]))
    every = max(1, config["train"]["checkpoint_every"])
    pending: dict = {}  # a checkpoint step's metrics, reported with its checkpoint

    def log(metrics: dict, step: int) -> None:
        if step_log is not None:  # every step into MLflow (rank 0)
            step_log(metrics, step)
        # to Ray Train: every checkpoint interval (with the checkpoint, below) and every periodic held-out eval
        # (what a Tune scheduler stops on); the final metrics are reported at the end, with the head
        has_eval = any(k.startswith("eval/") for k in metrics)
        if config.get("evals_only") and not has_eval:
            return  # under a Tune scheduler every report must carry the metric it stops on
        if "train/seconds" in metrics:
            return
        if step % every == 0:
            pending.update({**metrics, "step": step, **run_tag})
        elif has_eval:
            ray.train.report({**metrics, "step": step, **run_tag})

    def on_checkpoint(step: int, folder: Path | None) -> None:
        """Every rank reports together; rank 0 hands Ray Train the checkpoint it wrote, with the MLflow run it
        belongs to, and Ray keeps it in cluster storage: what every rank of a restarted worker group — on any
        node — resumes from (Ray registers a checkpoint only once it is whole in storage)."""
        metrics = dict(pending) or {"step": step, **run_tag}
        pending.clear()
        if config.get("evals_only") and not any(k.startswith("eval/") for k in metrics):
            return  # no report without the scheduler's metric: this checkpoint stays on the node
        checkpoint = None
        if folder is not None:
            (folder / RESUME_MARKER).write_text(json.dumps({"step": step, "train_hash": config["train_hash"],
                                                            **run_tag}) + "\n")
            checkpoint = ray.train.Checkpoint.from_directory(str(folder))
        ray.train.report(metrics, checkpoint=checkpoint)

    from jetflow.paths import jetflow_home

    out = Path(config["out"]) if "out" in config else jetflow_home() / config["out_home_rel"]  # this node's
    shared = "out_home_rel" in config
    resume_state = stored_state(ray.train.get_checkpoint(), config["train_hash"])
    with step_log or nullcontext():  # flushes the last points and stops the system metrics, however it ends
        metrics = train(TrainConfig(**config["train"]), target, data, out, log=log, progress=False,
                        rank=rank, world=world, on_start=step_log.start if step_log else None,
                        resume_state=resume_state, local_checkpoints=not shared, on_checkpoint=on_checkpoint)
    # the trained head folder is the run's Ray checkpoint (rank 0 owns it; every rank reports)
    checkpoint = ray.train.Checkpoint.from_directory(str(out)) if rank == 0 else None
    ray.train.report({**metrics, "step": metrics.get("train/steps", 0), **run_tag}, checkpoint=checkpoint)


RESUME_MARKER = "jetflow_train.json"  # in a reported checkpoint: its step, the training's hash, its MLflow run


def train_hash(loop_config: dict) -> str:
    """What makes a stored checkpoint this training's: its settings, target and data (not where it writes)."""
    import hashlib

    keys = {k: loop_config.get(k) for k in ("train", "model", "features", "features_rel", "online")}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _resume_marker(folder: Path) -> tuple[Path, dict] | None:
    """(the state file, its marker) of a checkpoint folder: a step checkpoint, or a trained head folder holding
    its step checkpoints (the run's final report). None when it holds no complete one."""
    from jetflow.train.trainer import STATE, latest_checkpoint

    step_dir = folder if (folder / STATE).exists() else latest_checkpoint(folder / "checkpoints")
    if step_dir is None:
        return None
    try:
        return step_dir / STATE, json.loads((step_dir / RESUME_MARKER).read_text())
    except (OSError, ValueError):
        return None


def stored_state(checkpoint, expected_hash: str) -> dict | None:
    """The trainer state of Ray Train's latest checkpoint of this run (`ray.train.get_checkpoint()`), when it is
    this training's (`train_hash`); None to start from step 0."""
    if checkpoint is None:
        return None
    import torch

    with checkpoint.as_directory() as folder:
        found = _resume_marker(Path(folder))
        if found is None or found[1].get("train_hash") != expected_hash:
            return None
        return torch.load(found[0], weights_only=False, map_location="cpu")


def stored_resume(run_name: str, storage: Path | None, expected_hash: str) -> dict | None:
    """The marker of the furthest checkpoint of Ray Train run `run_name` in its storage that belongs to this
    training: {"step", "mlflow_run_id", …}, read by the driver before it starts the run (which MLflow run
    to continue). Folders without a readable marker — an upload cut short — are skipped."""
    import pyarrow.fs as pafs

    path, fs = _ray_storage(storage)
    fs = fs or pafs.LocalFileSystem()
    try:
        entries = fs.get_file_info(pafs.FileSelector(f"{path}/{run_name}", allow_not_found=True))
    except OSError:
        return None
    best = None
    for entry in entries:
        if entry.type != pafs.FileType.Directory or not entry.base_name.startswith("checkpoint_"):
            continue
        marker = _read_marker(fs, entry.path)
        if marker and marker.get("train_hash") == expected_hash and (best is None or
                                                                     marker.get("step", 0) > best.get("step", 0)):
            best = marker
    return best


def _read_marker(fs, folder: str) -> dict | None:
    """A checkpoint folder's marker (`_resume_marker`, read through `fs`): at its top — a step checkpoint — or in
    its newest step checkpoint — a trained head folder. None when neither is readable."""
    import pyarrow.fs as pafs

    def read(path: str) -> dict | None:
        try:
            with fs.open_input_stream(f"{path}/{RESUME_MARKER}") as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            return None

    found = read(folder)
    if found is not None:
        return found
    try:
        steps = sorted(e.path for e in fs.get_file_info(pafs.FileSelector(f"{folder}/checkpoints", allow_not_found=True))
                       if e.base_name.startswith("step-"))
    except OSError:
        return None
    return read(steps[-1]) if steps else None


def train_on_ray(cfg, model: str, features, out: Path, num_workers: int = 1, use_gpu: bool = False,
                 storage: Path | None = None, callbacks: list | None = None, run_name: str | None = None,
                 evals_only: bool = False, cpus_per_worker: float | None = None, *, track: bool = True,
                 parent_run_id: str | None = None, mlflow_run_name: str | None = None,
                 progress_s: float | None = 30.0, dtype: str | None = None, max_failures: int = 2) -> dict:
    """Run `jetflow.train.trainer.train` under Ray Train; returns the last reported metrics. `callbacks`
    go to the run config (a Tune trial passes `TuneReportCallback` so its reports reach Tune, and
    `evals_only` so that only reports with held-out metrics are made). `features` is a feature-cache
    folder, or an `OnlineFeatures` (its regenerated data and spec travel to the workers instead).
    Without `cpus_per_worker` (and without GPUs) each worker gets `default_cpus_per_worker`.

    With `track` the training is a live MLflow run (`jetflow.tracking.live.training_run`: named
    `mlflow_run_name`, default "train <name>", nested under `parent_run_id`), continued when `out` has
    checkpoints to resume, and this process prints a progress line every `progress_s` seconds (None:
    silent). `use_gpu` gives each worker one GPU (gradients averaged over NCCL; gloo on CPUs); `dtype`
    is the frozen target's (default: bf16 on GPU workers, fp32 on CPU ones), the head trains in fp32."""
    import ray
    from ray.exceptions import RayActorError
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from jetflow.cluster import is_multi_node

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    if cpus_per_worker is None and not use_gpu:
        cpus_per_worker = default_cpus_per_worker(num_workers)
    out = Path(out).resolve()
    shared = is_multi_node()
    loop_config = {"train": dataclasses.asdict(cfg), "model": model, **_features_config(features, shared),
                   **_out_config(out, shared), "evals_only": evals_only, "use_gpu": use_gpu, "dtype": dtype}
    loop_config["train_hash"] = train_hash(loop_config)
    run_name = run_name or f"train-{cfg.name}"
    storage_path, storage_fs = _ray_storage(storage)

    def fit() -> dict:
        trainer = TorchTrainer(
            _loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                         resources_per_worker={"CPU": cpus_per_worker} if cpus_per_worker else None),
            # a worker or node lost: the worker group restarts (on any node) from the last checkpoint in storage
            run_config=RunConfig(name=run_name, callbacks=callbacks or None, storage_path=storage_path,
                                 storage_filesystem=storage_fs, failure_config=FailureConfig(max_failures=max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )
        result = trainer.fit()
        metrics = dict(result.metrics or {})
        if result.checkpoint is not None:  # the trained head, as rank 0 handed it to Ray Train's storage
            metrics["checkpoint_uri"] = checkpoint_uri(result.checkpoint)
            if shared:  # rank 0 wrote it on its own node: bring it to this one
                result.checkpoint.to_directory(str(out))
        return metrics

    if not track:
        return fit()
    from jetflow.tracking.live import ConsoleProgress, training_run

    # Ctrl-C reaches Ray Train's own SIGINT handler, which aborts its controller: `fit` then ends in a
    # RayActorError, which marks the run KILLED like the signal itself would.
    from jetflow.train.trainer import latest_checkpoint

    # resuming: from Ray Train's last checkpoint of this training in storage (continuing the MLflow run it names),
    # or — one machine — from the head folder's own checkpoints
    stored = stored_resume(run_name, storage, loop_config["train_hash"])
    resuming = stored is not None or (not shared and latest_checkpoint(out / "checkpoints") is not None)
    with training_run(cfg, out, features, parent_run_id=parent_run_id, run_name=mlflow_run_name,
                      interruptions=(RayActorError,), resuming=resuming,
                      run_id=(stored or {}).get("mlflow_run_id")) as run, ConsoleProgress(run, cfg.name, progress_s):
        loop_config["mlflow"] = run.worker_config()
        return fit()


def default_cpus_per_worker(num_workers: int) -> float:
    """An equal share of the Ray cluster's CPUs, at most the largest node's (a worker cannot span
    nodes), at least 1. Ray sizes a worker's thread pools (OMP_NUM_THREADS, hence torch's threads) by
    its CPUs: with Ray Train's default of one CPU, the one worker of a laptop run used 1 of its cores."""
    import ray

    nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        return 1.0
    return float(max(1, min(int(max(nodes)), int(sum(nodes)) // max(1, num_workers))))


def _features_config(features, shared: bool) -> dict:
    from jetflow.data.features import OnlineFeatures

    if isinstance(features, OnlineFeatures):
        if shared:
            from jetflow.errors import InvalidSettingError

            raise InvalidSettingError("online features (features='online') read the regenerated data from the "
                                      "driver's disk: on a multi-node cluster use the feature cache (features='cache')")
        return {"online": {"regen_dir": str(features.regen_dir), "spec": dataclasses.asdict(features.spec)}}
    if shared:  # every worker reads its node's copy of the cache from cluster storage
        from jetflow.storage import storage

        return {"features_rel": storage().rel(features)}
    return {"features": str(features)}


def _out_config(out: Path, shared: bool) -> dict:
    """Where rank 0 writes the head: `out` itself on one machine; on a cluster the same place under the worker
    node's own `$JETFLOW_HOME` (a path of the driver's may not exist there)."""
    from jetflow.paths import jetflow_home

    if shared:
        try:
            return {"out_home_rel": str(out.relative_to(jetflow_home()))}
        except ValueError:
            return {"out_home_rel": f"heads/{out.name}"}
    return {"out": str(out)}


def _ray_storage(storage: Path | None) -> tuple[str, object | None]:
    """Ray Train's storage: `storage` when given (a local folder, one machine), else cluster storage's
    `ray_results` (`$JETFLOW_HOME/ray_results` on one machine)."""
    if storage is not None:
        return str(Path(storage).resolve()), None
    from jetflow.storage import storage as cluster_storage

    return cluster_storage().ray_storage()


def checkpoint_uri(checkpoint) -> str:
    """A Ray Train checkpoint as a head reference another node can resolve: its URI in cluster storage (an
    object store's s3://…), or its absolute path on a mounted filesystem."""
    import pyarrow.fs as pafs

    from jetflow.storage import storage

    if isinstance(checkpoint.filesystem, pafs.LocalFileSystem):
        return str(Path(checkpoint.path).resolve())
    st = storage()
    if checkpoint.path.startswith(st.path() + "/"):
        return st.uri_for(checkpoint.path[len(st.path()) + 1:])
    return f"{checkpoint.filesystem.type_name}://{checkpoint.path}"
