"""The architecture sweep: Ray Tune over head architecture and training settings, each trial a Ray Train
run (a `ScalingConfig` worker per trial: CPU locally, a GPU each on a cluster) reading the shared feature
cache, stopped early by ASHA on the held-out simulated tree τ; the finalists are decoded for real on
held-out prompts, logged and registered, and the best becomes the `challenger` (the promotion gate, not
the sweep, decides about `champion`).

In MLflow the sweep is a parent run (`arch sweep <name>`) and every trial a live training run nested under
it (`jetflow.tracking.live`), so a trial ASHA stopped keeps its curves up to the stop and is marked KILLED;
the parent run holds the summary table and the sweep's picture (simulated τ over steps per trial, final τ
per setting).

Across nodes: the data and feature caches are built on worker nodes into cluster storage, each trial's Ray
Train run reads its node's copy, a finished trial's head comes back as its Ray Train checkpoint in storage,
and the finalists are decoded by tasks on worker nodes.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jetflow.errors import InvalidSettingError
from jetflow.paths import heads_dir
from jetflow.train.config import TrainConfig
from jetflow.tree import TreeSpec

METRIC = "eval/tree_tau"
DRIVER_CPU = 0.01  # a trial = this driver + Ray Train workers of 1 - DRIVER_CPU CPUs: N trials fit N cores


@dataclass
class ArchSearch:
    """What a trial may vary: each non-empty list is searched (a grid over all of them); an empty one keeps
    the preset's value. Names are `TrainConfig`'s."""

    num_hidden_layers: list[int] = field(default_factory=lambda: [1, 2])  # decoder layers in the head
    block_size: list[int] = field(default_factory=list)       # anchor + drafted depths per block
    num_taps: list[int] = field(default_factory=list)         # target layers tapped
    causal: list[bool] = field(default_factory=lambda: [True, False])  # causal (JetFlow) or bidirectional
    loss: list[str] = field(default_factory=list)             # fkl, ce, rkl
    gamma: list[float] = field(default_factory=list)          # depth decay (0 = uniform)
    lr: list[float] = field(default_factory=lambda: [6e-4, 2e-3])      # AdamW peak learning rate
    max_sequences: list[int] = field(default_factory=list)    # training sequences (data-size studies)
    draft_vocab_size: list[int] = field(default_factory=list)  # draft vocabulary (0 = full)
    anchor_shortcut: list[bool] = field(default_factory=list)  # anchor feature added to block inputs
    depth_embedding: list[bool] = field(default_factory=list)  # learned per-depth block input
    copy_ngram: list[int] = field(default_factory=list)       # copy inputs from the context (0 = off)

    def space(self) -> dict[str, list]:
        return {k: list(dict.fromkeys(v)) for k, v in asdict(self).items() if v}


@dataclass
class ArchSweepConfig:
    target: str = "smollm2-135m"         # target: bundled name, local folder or hub id
    preset: str = "demo"                 # data (regeneration + features) and base training settings
    search: ArchSearch = field(default_factory=ArchSearch)
    max_steps: int = 120                 # per trial (the preset's other training settings stay)
    eval_every: int = 20                 # held-out eval interval: ASHA's rungs
    grace_steps: int = 40                # ASHA: no stopping before this many steps
    finalists: int = 2                   # decoded on held-out prompts, registered; the best → challenger
    eval_prompts: int = 3                # per held-out set, for the finalists
    eval_new_tokens: int = 48            # tokens per prompt, for the finalists
    name: str = "arch-sweep"             # Tune experiment name (resumes when it exists)
    storage: str = ""                    # absolute Tune storage path (default: cluster storage's ray_results,
                                         # $JETFLOW_STORAGE; $JETFLOW_HOME/ray_results on one machine)
    max_concurrent: int = 2              # trials at once
    workers_per_trial: int = 1           # Ray Train workers per trial
    use_gpu: bool = False                # a GPU per Ray Train worker
    dtype: str | None = None             # the frozen target's: fp32, bf16, fp16 (default bf16 on a GPU, fp32 on CPU)
    max_failures: int = 2                # reruns of a trial whose worker or node died (Tune's FailureConfig); the
                                         # rerun's training resumes from its last checkpoint in storage

    def __post_init__(self) -> None:
        self.space = self.search.space()
        if not self.space:
            raise InvalidSettingError("the architecture sweep needs at least one searched option")
        for name in ("max_steps", "eval_every", "finalists", "eval_prompts", "eval_new_tokens", "max_concurrent",
                     "workers_per_trial"):
            if getattr(self, name) < 1:
                raise InvalidSettingError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.storage and not Path(self.storage).is_absolute():
            raise InvalidSettingError(f"storage must be an absolute path (Ray Tune requires it), got {self.storage!r}")
        if self.max_failures < -1:
            raise InvalidSettingError(f"max_failures must be >= 0 (or -1: no limit), got {self.max_failures}")
        from jetflow.train.pipeline import PRESETS

        if self.preset not in PRESETS:
            raise InvalidSettingError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        self.base_train({})  # every choice must make a valid TrainConfig
        for name, choices in self.space.items():
            for c in choices:
                self.base_train({name: c})

    def base_train(self, sampled: dict[str, Any], name: str = "arch") -> TrainConfig:
        from jetflow.train.pipeline import PRESETS

        return TrainConfig.from_overrides(PRESETS[self.preset].train, {
            "name": name, "max_steps": self.max_steps, "eval_every": self.eval_every,
            "checkpoint_every": self.eval_every, **sampled})  # each held-out report carries a checkpoint

    @property
    def location(self):
        """Where the sweep's Tune state lives (`jetflow.storage.TuneLocation`)."""
        from jetflow.storage import tune_location

        return tune_location(self.name, self.storage)


def prepare_features(cfg: ArchSweepConfig) -> dict[int, str]:
    """The preset's data, regenerated once, and one content-keyed feature cache per tap count searched
    (every trial with that count reads the same cache), built where targets run (a worker node on a
    cluster). {num_taps: the cache's folder in cluster storage, relative to it}."""
    from jetflow.cluster import on_worker, wants_gpu
    from jetflow.data.regenerate import RegenConfig, regenerate
    from jetflow.storage import storage
    from jetflow.train.pipeline import PRESETS, build_features_on_worker

    preset = PRESETS[cfg.preset]
    device = "cuda" if cfg.use_gpu else None
    regen = RegenConfig(**{**asdict(preset.regen), "model": cfg.target, "device": device, "dtype": cfg.dtype})
    regen_rel = storage().rel(regenerate(regen))
    taps = cfg.space.get("num_taps", [preset.train.num_taps])
    return {k: on_worker(build_features_on_worker, regen_rel, cfg.target, device, cfg.dtype, k,
                         preset.features_max_len, num_gpus=1 if wants_gpu(device) else 0)
            for k in sorted(set(taps))}


def arch_trial(config: dict) -> None:
    """Tune trial: one Ray Train run of the sampled head; its reports reach Tune via TuneReportCallback."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from jetflow.train.ray_train import train_on_ray

    from jetflow.cluster import node_address
    from jetflow.storage import storage
    from jetflow.tracking.probe import check_tracking_server

    shared, sampled = config["shared"], config["arch"]
    trial_id = tune.get_context().get_trial_id()
    tcfg = TrainConfig(**{**shared["train"], **sampled, "name": f"{shared['name']}-{trial_id}"})
    os.environ["MLFLOW_TRACKING_URI"] = shared["tracking_uri"]  # the driver's store, as this node reaches it
    check_tracking_server(shared["tracking_uri"], who=f"this trial on node {node_address()}")
    features = storage().local(shared["features"][str(tcfg.num_taps)], required=("features.json",),
                               only=("features.json",))  # the cache's description; workers read their copy
    train_on_ray(tcfg, shared["target"], features, heads_dir() / tcfg.name, num_workers=shared["workers"],
                 use_gpu=shared["use_gpu"], dtype=shared.get("dtype"),
                 storage=Path(shared["storage"]) if shared["storage"] else None, callbacks=[TuneReportCallback()],
                 run_name=f"train-{tcfg.name}", evals_only=True, cpus_per_worker=1 - DRIVER_CPU,
                 parent_run_id=shared["parent_run_id"], mlflow_run_name=f"arch {tcfg.name}", progress_s=None)


@dataclass
class ArchOutcome:
    rows: list[dict]                  # per trial: sampled settings + last metrics + whether ASHA stopped it
    finalists: list[dict]             # decoded finalists: head dir, version, τ per set
    challenger: str | None            # registered version now aliased `challenger`
    seconds: float = 0.0
    parent_run_id: str | None = None  # the sweep's MLflow parent run
    errors: dict[str, str] = field(default_factory=dict)  # trial folder -> the error it ended in

    @property
    def failed(self) -> int:
        """Trials that ended in an error (the parent run is then FAILED)."""
        return len(self.errors)


def run_arch_sweep(cfg: ArchSweepConfig, ray_address: str | None = None) -> ArchOutcome:
    from jetflow.cluster import init_ray
    from jetflow.tracking.runs import ending, sweep_parent_run
    from jetflow.tracking.store import client

    t0 = time.perf_counter()
    init_ray(ray_address)
    parent = sweep_parent_run(cfg.target, cfg.location, f"arch sweep {cfg.name}", "arch_sweep",
                              {k: v for k, v in asdict(cfg).items() if k != "search"} | {"search": cfg.space})
    with ending(parent):  # FINISHED, or KILLED / FAILED when the sweep itself stops
        out = _sweep(cfg, parent)
    if out.failed:
        client().set_terminated(parent, "FAILED")
    out.seconds = time.perf_counter() - t0
    return out


def _sweep(cfg: ArchSweepConfig, parent: str) -> ArchOutcome:
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from jetflow.cluster import handed_tracking_uri
    from jetflow.sweeps.cluster import trial_errors
    from jetflow.sweeps.setup_errors import SETUP_ERROR, SetupErrorsNotRetried, not_retried_on_setup_error
    from jetflow.tracking.probe import check_tracking_server

    location = cfg.location
    tracking = handed_tracking_uri()  # the trials' store, as their nodes reach it: asked now, in seconds
    check_tracking_server(tracking, who="the sweep's trials")
    features = prepare_features(cfg)
    base = cfg.base_train({})
    shared = {"train": {k: v for k, v in base.to_dict().items() if k not in cfg.space}, "target": cfg.target,
              "features": {str(k): v for k, v in features.items()}, "name": cfg.name,
              "workers": cfg.workers_per_trial, "use_gpu": cfg.use_gpu, "dtype": cfg.dtype, "storage": cfg.storage,
              "parent_run_id": parent, "tracking_uri": tracking}
    # the trial's driver holds almost nothing (Tune refuses zero); its Ray Train workers ask for the rest
    # ASHA needs its metric in every result, a setup error's report included
    trainable = tune.with_resources(not_retried_on_setup_error(arch_trial, **{METRIC: math.nan}), {"cpu": DRIVER_CPU})
    if location.can_restore():
        print(f"[arch sweep] resuming {location.describe()} (finished trials are kept)")
        tuner = tune.Tuner.restore(location.path, trainable, resume_errored=True,
                                   storage_filesystem=location.filesystem)
    else:
        asha = ASHAScheduler(time_attr="step", max_t=cfg.max_steps, grace_period=min(cfg.grace_steps, cfg.max_steps),
                             reduction_factor=2)
        tuner = tune.Tuner(
            trainable,
            param_space={"arch": {k: tune.grid_search(v) for k, v in cfg.space.items()}, "shared": shared},
            tune_config=tune.TuneConfig(metric=METRIC, mode="max", scheduler=asha,
                                        max_concurrent_trials=cfg.max_concurrent),
            run_config=tune.RunConfig(name=cfg.name, storage_path=location.storage_path,
                                      storage_filesystem=location.filesystem, verbose=1,
                                      failure_config=tune.FailureConfig(max_failures=cfg.max_failures),
                                      callbacks=[SetupErrorsNotRetried(cfg.max_failures)]),
        )
    grid = tuner.fit()
    rows, histories = [], []
    for res in grid:
        m = res.metrics or {}
        if METRIC not in m or SETUP_ERROR in m:
            continue
        rows.append({**res.config["arch"], "tree_tau": m[METRIC], "chain_tau": m.get("eval/chain_tau", math.nan),
                     "step": m.get("step", 0), "finished": "train/seconds" in m,
                     "head_dir": str(heads_dir() / f"{cfg.name}-{m['trial_id']}"),
                     "checkpoint_path": m.get("checkpoint_path"), "mlflow_run_id": m.get("mlflow_run_id")})
        histories.append(_history(res, rows[-1], list(cfg.space)))
    _settle_trial_runs(rows)
    finalists = _finalize(cfg, rows)
    challenger = finalists[0]["version"] if finalists and finalists[0].get("version") else None
    _log_parent(parent, cfg, rows, histories)
    return ArchOutcome(rows=rows, finalists=finalists, challenger=challenger, parent_run_id=parent,
                       errors=trial_errors(grid))


def setting_label(row: dict, keys: list[str]) -> str:
    """A trial's sampled setting in one line: "num_hidden_layers=2 causal=True lr=0.0006"."""
    return " ".join(f"{k}={row[k]}" for k in keys)


def _history(result, row: dict, keys: list[str]) -> dict:
    """A trial's held-out reports, as `jetflow.tracking.plots.arch_sweep_figures` takes them."""
    frame = result.metrics_dataframe
    if frame is not None and METRIC in frame:
        frame = frame[frame[METRIC].notna()].sort_values("step")
        steps = [int(s) for s in frame["step"]]
        tree, chain = ([float(v) for v in frame[key]] if key in frame else [] for key in (METRIC, "eval/chain_tau"))
    else:  # no history kept: the last report alone
        steps, tree, chain = [int(row["step"])], [row["tree_tau"]], [row["chain_tau"]]
    return {"label": setting_label(row, keys), "steps": steps, "tree_tau": tree, "chain_tau": chain,
            "stopped": not row["finished"]}


def _settle_trial_runs(rows: list[dict]) -> None:
    """Tune ends a trial by stopping its actor — ASHA at a rung, or at max_t right after the final report
    — so a trial's training run may have ended KILLED although its training completed. The sweep knows:
    FINISHED when the trial reported its final metrics, else KILLED, tagged with who stopped it and at which
    step (its curves stay as logged); the end time stays the one the run recorded."""
    from jetflow.tracking.live import recorded_run
    from jetflow.tracking.store import client

    for row in rows:
        run = client().get_run(row["mlflow_run_id"]) if row.get("mlflow_run_id") else recorded_run(row["head_dir"])
        if run is None:
            continue
        status = "FINISHED" if row["finished"] else "KILLED"
        if run.info.status != status:
            ended = run.info.end_time if run.info.status != "RUNNING" else None
            client().set_terminated(run.info.run_id, status, end_time=ended)
        if not row["finished"]:
            client().set_tag(run.info.run_id, "jetflow.stopped_by", f"ASHA at step {row['step']}")


def _log_parent(parent: str, cfg: ArchSweepConfig, rows: list[dict], histories: list[dict]) -> None:
    """The sweep's parent run: summary table (markdown + MLflow table), the sweep's picture, the best τ."""
    import pandas as pd

    from jetflow.tracking.plots import arch_sweep_figures
    from jetflow.tracking.runs import log_figures
    from jetflow.tracking.store import client

    c = client()
    keys = list(cfg.space)
    c.log_text(parent, summary_table(rows, keys) if rows else "(no trial reported)\n", "sweep_table.md")
    if rows:
        c.log_table(parent, pd.DataFrame(rows), "sweep_table.json")
        best = max(rows, key=lambda r: r["tree_tau"])
        c.log_metric(parent, "best_tree_tau", float(best["tree_tau"]))
        c.set_tag(parent, "jetflow.best.setting", setting_label(best, keys))
    c.log_metric(parent, "trials", float(len(rows)))
    c.log_metric(parent, "trials_stopped_early", float(sum(not r["finished"] for r in rows)))
    log_figures(parent, arch_sweep_figures(histories))


def _finalize(cfg: ArchSweepConfig, rows: list[dict]) -> list[dict]:
    """Decode the best finished trials (ASHA let them run to the end) on held-out prompts, log and register
    them; alias the best lossless one `challenger`. A finished trial's head is its Ray Train checkpoint (in
    cluster storage on a cluster, fetched here); it is decoded where targets run (`on_worker`)."""
    from jetflow.cluster import is_multi_node, on_worker, wants_gpu
    from jetflow.tracking import CHALLENGER, log_training_run, register_head, registered_model_name, set_alias
    from jetflow.train.pipeline import decode_on_worker

    done = sorted((r for r in rows if r["finished"] and (r.get("checkpoint_path")
                                                          or (Path(r["head_dir"]) / "model.safetensors").exists())),
                  key=lambda r: -r["tree_tau"])
    if not done:
        return []
    device = "cuda" if cfg.use_gpu else None
    out = []
    for row in done[: cfg.finalists]:
        head_dir = Path(row["head_dir"])
        head = str(head_dir)
        if is_multi_node() or not (head_dir / "model.safetensors").exists():
            head = _fetch_checkpoint(cfg, row["checkpoint_path"], head_dir)
        decoded = on_worker(decode_on_worker, cfg.target, device, cfg.dtype, head, cfg.eval_prompts,
                            cfg.eval_new_tokens, [TreeSpec(budget=32).to_dict()],
                            num_gpus=1 if wants_gpu(device) else 0)
        metrics = {**json.loads((head_dir / "metrics.json").read_text()), **decoded}
        (head_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        run_id = log_training_run(head_dir, cfg.target, run_name=f"arch {head_dir.name}")
        version = register_head(run_id, cfg.target, tags={"jetflow.sweep": cfg.name})
        taus = [v for k, v in decoded.items() if k.startswith("tau/")]
        out.append({**{k: row[k] for k in cfg.space}, "simulated_tree_tau": row["tree_tau"], **decoded,
                    "version": version, "head_dir": str(head_dir), "mean_tau": sum(taus) / len(taus)})
    out.sort(key=lambda r: -r["mean_tau"])
    if out[0]["lossless"] == 1.0:
        set_alias(registered_model_name(cfg.target), CHALLENGER, out[0]["version"])
    return out


def _fetch_checkpoint(cfg: ArchSweepConfig, path: str, head_dir: Path) -> str:
    """A trial's Ray Train checkpoint (`path` in the sweep's storage) copied into `head_dir` on this node; →
    the reference a worker node resolves it by."""
    from ray.train import Checkpoint

    from jetflow.train.ray_train import checkpoint_uri

    checkpoint = Checkpoint(path, filesystem=cfg.location.filesystem)
    checkpoint.to_directory(str(head_dir))
    return checkpoint_uri(checkpoint)


def summary_table(rows: list[dict], keys: list[str]) -> str:
    from jetflow.eval.table import markdown_table

    return markdown_table(sorted(rows, key=lambda r: -r["tree_tau"]), keys + ["step", "finished", "chain_tau", "tree_tau"])
