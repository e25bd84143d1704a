"""The budget sweep: Ray Tune over the tree settings (`TreeSpec`: algorithm × budget × width, × temperature)
of one head, each trial a side-by-side evaluation — the head's setting and our AR loop on the same prompts —
logged as an MLflow child run of the sweep's parent run. It only sweeps: choosing the head, storing the best
setting and promoting it are the main job's (`jetflow.main_job`).

Across nodes: trials get the head as a reference their node resolves (its registry URI, or a storage URI),
never a folder of the driver's; Tune's state and the parent run's marker live in cluster storage; the step
cost curve of the picture is measured by a task on a worker node of the trials' kind."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jetflow.errors import InvalidSettingError
from jetflow.tree import TreeSpec

SELECT = ("speedup", "tau")


@dataclass
class BudgetSweepConfig:
    target: str = "smollm2-135m"       # target: bundled name, local folder or hub id
    budgets: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32, 64])  # tree nodes per round, root counted
    widths: list[int] = field(default_factory=lambda: [7])                       # top-W per depth (chains: 1)
    algorithms: list[str] = field(default_factory=lambda: ["accum_logp", "chain"])  # name or name:key=value
    temperatures: list[float] = field(default_factory=lambda: [0.0])            # 0 = greedy (lossless-checked)
    sets: list[str] = field(default_factory=lambda: ["mtbench", "humaneval"])   # held-out prompt sets
    prompts_per_set: int = 2           # prompts per set, spread over its eval split
    max_new_tokens: int = 48           # tokens generated per prompt
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # requests in flight: each setting's
                                       # tokens/s with that many on the engine, beside plain decoding's
    select: str = "speedup"            # what "best" means: decode speedup vs our AR, or tau
    name: str = "budget-sweep"         # Tune experiment name (resumes when it exists)
    storage: str = ""                  # absolute Tune storage path (default: cluster storage's ray_results,
                                       # $JETFLOW_STORAGE; $JETFLOW_HOME/ray_results on one machine)
    max_concurrent: int = 2            # trials at once
    cpus_per_trial: float = 1.0        # Ray CPUs per trial (its torch threads)
    gpus_per_trial: float = 0.0        # Ray GPUs per trial (a trial given one decodes on it)
    dtype: str | None = None           # fp32, bf16 or fp16 (default: bf16 on a trial's GPU, fp32 on CPU)
    max_failures: int = 2              # reruns of a trial whose worker or node died (Tune's FailureConfig;
                                       # τ is deterministic, so a rerun elsewhere gives the same row)

    def __post_init__(self) -> None:
        if self.select not in SELECT:
            raise InvalidSettingError(f"select must be one of {SELECT}, got {self.select!r}")
        ev = self.eval_config({})  # validates the tree grid, temperatures and prompt sets
        self.budgets, self.widths, self.temperatures = ev.budgets, ev.widths, ev.temperatures
        if self.max_concurrent < 1 or self.cpus_per_trial <= 0 or self.gpus_per_trial < 0:
            raise InvalidSettingError("max_concurrent >= 1, cpus_per_trial > 0 and gpus_per_trial >= 0 are required")
        if self.max_failures < -1:
            raise InvalidSettingError(f"max_failures must be >= 0 (or -1: no limit), got {self.max_failures}")
        if self.storage and not Path(self.storage).is_absolute():
            raise InvalidSettingError(f"storage must be an absolute path (Ray Tune requires it), got {self.storage!r}")

    def eval_config(self, setting: dict[str, Any]):
        """The evaluation of one trial's setting (or, with {}, of the whole grid, for validation)."""
        from jetflow.eval.compare import EvalConfig

        grid = {"algorithms": self.algorithms, "budgets": self.budgets, "widths": self.widths,
                "temperatures": self.temperatures}
        if setting:
            spec = TreeSpec.from_dict(setting["tree"])
            grid = {"algorithms": [spec.algorithm_option], "budgets": [spec.budget], "widths": [spec.width],
                    "temperatures": [setting["temperature"]]}
        return EvalConfig(sets=list(self.sets), prompts_per_set=self.prompts_per_set,
                          timed_prompts=self.prompts_per_set, max_new_tokens=self.max_new_tokens,
                          concurrency=list(self.concurrency), baselines=False, cost_model=False, **grid)

    @property
    def location(self):
        """Where the sweep's Tune state lives (`jetflow.storage.TuneLocation`)."""
        from jetflow.storage import tune_location

        return tune_location(self.name, self.storage)

    def settings(self, block_size: int | None = None) -> list[dict[str, Any]]:
        """One trial per (TreeSpec, temperature), as Tune's JSON-able config: {"tree": dict, "temperature"}.
        Duplicates are gone: a chain ignores width, and for a head of `block_size` has at most that many nodes."""
        trees = self.eval_config({}).trees(block_size)
        return [{"tree": spec.to_dict(), "temperature": t} for t in self.temperatures for spec in trees]


@dataclass(frozen=True)
class SweptHead:
    """The head a sweep measures: its local folder, the registry URI it came from, its registered version, and
    the reference it was given as (a storage URI travels as itself)."""

    path: str
    uri: str | None = None
    registered: tuple[str, str] | None = None      # (registered model name, version)
    ref: str | None = None                         # as given (folder, name, models:/…, s3://…)

    def for_trials(self) -> str:
        """What trials load: this folder on one machine; on a multi-node cluster a reference every node
        resolves (InvalidSettingError for a folder only this node has, saying to register it)."""
        from jetflow.cluster import is_multi_node
        from jetflow.head import HeadRef

        if not is_multi_node():
            return self.path
        if self.uri is None and self.registered:  # a folder whose weights are a registered version: that version
            return f"models:/{self.registered[0]}/{self.registered[1]}"
        return str(HeadRef.parse(self.uri or self.ref or self.path).portable())

    @property
    def label(self) -> str:
        return f"{self.registered[0]} v{self.registered[1]}" if self.registered else self.path


# --------------------------------------------------------------------------- trials
_LOADED: dict[tuple, Any] = {}


def _target_and_head(target_id: str, head: str, dtype_name: str | None = None):
    """Loaded once per Tune worker process (actors are reused across trials); as many torch threads as
    the trial has CPUs. `head`: a folder, or a reference this node resolves (`SweptHead.for_trials`)."""
    key = (target_id, head, dtype_name)
    if key not in _LOADED:
        import ray
        import torch

        from jetflow.head import HeadRef
        from jetflow.target import TargetModel
        from jetflow.target.placement import placement

        resources = ray.get_runtime_context().get_assigned_resources()
        torch.set_num_threads(max(1, int(resources.get("CPU", 1))))
        _LOADED.clear()
        # a trial given a GPU (--gpus-per-trial) decodes on it
        device, dtype = placement("cuda" if resources.get("GPU") else "cpu", dtype_name)
        target = TargetModel.load(target_id, device=device, dtype=dtype)
        _LOADED[key] = (target, HeadRef.parse(head).load(target))
    return _LOADED[key]


def trial_metrics(report: dict) -> dict[str, float]:
    """The trial's Tune metrics from its evaluation report: means over prompt sets of the head's rows (τ,
    decode speedup vs our AR measured in the same trial, tokens/s), and losslessness."""
    from jetflow.metrics import HEAD_METHODS

    rows = [r for r in report["rows"] if r["method"] in HEAD_METHODS]
    ar = [r for r in report["rows"] if r["method"] == "ar"]
    if not rows:
        raise InvalidSettingError("the evaluation produced no rows of the head")

    def mean(key: str, among) -> float:
        vals = [r[key] for r in among if r.get(key) is not None and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else math.nan

    lossless = [r["lossless"] for r in rows if r.get("lossless") is not None]
    out = {"tau": mean("tau", rows), "speedup": mean("speedup_vs_ar", rows),
           "e2e_speedup": mean("e2e_speedup", rows), "tokens_per_s": mean("tokens_per_s", rows),
           "ar_tokens_per_s": mean("tokens_per_s", ar),
           "lossless": float(all(lossless)) if lossless else math.nan}
    for c in sorted({c for r in rows for c in (r.get("speedup_at") or {})}, key=int):
        flat = [{"speedup": r["speedup_at"][c], "tps": r["throughput"][c]} for r in rows if c in (r.get("speedup_at") or {})]
        out[f"speedup_c{c}"] = mean("speedup", flat)
        out[f"tokens_per_s_c{c}"] = mean("tps", flat)
    for r in rows:  # per prompt set, for the sweep's picture (`set_rows`)
        out[f"tau@{r['dataset']}"] = r["tau"]
        for c, value in (r.get("speedup_at") or {}).items():
            out[f"speedup_c{c}@{r['dataset']}"] = value
    return out


def set_rows(rows: list[dict], curve=None) -> list[dict]:
    """One row per trial, prompt set and concurrency level — what `jetflow.tracking.plots.budget_sweep_figures`
    draws: τ, the speedup over plain decoding at that many requests in flight (the engine's), and the step
    cost model's prediction for it (`jetflow.engine.cost.StepCostCurve`) when a curve is given."""
    out = []
    for r in rows:
        spec = TreeSpec.from_dict(r["tree"])
        for key, value in r.items():
            if not key.startswith("speedup_c") or "@" not in key:
                continue
            level, dataset = key.removeprefix("speedup_c").split("@", 1)
            tau = r.get(f"tau@{dataset}", math.nan)
            predicted = curve.speedup(int(level), spec.budget, tau) if curve is not None and math.isfinite(tau) else None
            out.append({"tree": r["tree"], "algorithm": spec.algorithm, "budget": spec.budget, "width": spec.width,
                        "temperature": r["temperature"], "dataset": dataset, "concurrency": int(level), "tau": tau,
                        "speedup": value, "predicted_speedup": predicted})
    return out


def budget_trial(config: dict) -> None:
    """A Tune function trainable: evaluate one tree setting against AR on the sweep's prompts, log the
    report as a child MLflow run, report the trial's metrics."""
    import os

    from ray import tune

    from jetflow.eval.compare import evaluate
    from jetflow.head import HeadRef
    from jetflow.tracking import log_evaluation

    setting, shared = config["setting"], config["shared"]
    os.environ["MLFLOW_TRACKING_URI"] = shared["tracking_uri"]  # the driver's store, as this node reaches it
    target, loaded = _target_and_head(shared["target"], shared["head"], shared["sweep"].get("dtype"))
    if shared.get("head_uri"):  # report the head as the registry version it is
        loaded = type(loaded)(loaded.head, HeadRef.parse(shared["head_uri"]), loaded.path, loaded.provenance)
    sweep = BudgetSweepConfig(**shared["sweep"])
    report = evaluate(target, [loaded], sweep.eval_config(setting))
    key = trial_key(setting)
    parent = shared.get("parent_run_id")
    import ray

    # born with its trial's name and node (a run its node's loss cut short still says which trial it was)
    run_id = log_evaluation(report, run_name=key, parent_run_id=parent,
                            tags={TRIAL_TAG: key, "jetflow.node": ray.util.get_node_ip_address()})
    if parent:
        drop_earlier_children(parent, key, keep=run_id)
    tune.report({**trial_metrics(report), "mlflow_run_id": run_id})


TRIAL_TAG = "jetflow.trial"


def trial_key(setting: dict) -> str:
    """A trial's name in the sweep (its child run's name and `jetflow.trial` tag): tree key and temperature."""
    return f"{TreeSpec.from_dict(setting['tree']).key} t{setting['temperature']:g}"


def drop_earlier_children(parent_run_id: str, key: str, keep: str) -> list[str]:
    """Delete the parent's other child runs of trial `key`: a trial rerun after its node died (Tune's
    FailureConfig, or the sweep resumed) may have logged before it was lost. The parent keeps each trial
    once, its latest run. → the deleted run ids."""
    from jetflow.tracking.store import client

    c = client()
    parent = c.get_run(parent_run_id)
    runs = c.search_runs([parent.info.experiment_id],
                         f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`{TRIAL_TAG}` = '{key}'")
    dropped = [r.info.run_id for r in runs if r.info.run_id != keep]
    for run_id in dropped:
        c.delete_run(run_id)
    return dropped


# --------------------------------------------------------------------------- driver
@dataclass
class SweepOutcome:
    head: SweptHead
    rows: list[dict]                          # one per trial: setting + metrics
    best: dict | None
    parent_run_id: str
    seconds: float = 0.0
    budget_table: dict[int, int] = field(default_factory=dict)      # concurrency → best budget (1 = plain)
    tau_by_budget: dict[int, float] = field(default_factory=dict)   # the best tree's kind: budget → τ
    errors: dict[str, str] = field(default_factory=dict)            # trial folder → the error it ended in
    missing: list[str] = field(default_factory=list)                # trials of the grid with no row (`trial_key`)

    @property
    def complete(self) -> bool:
        """Every setting of the grid has its row: only then is there a best setting to store and promote."""
        return not self.missing

    @property
    def best_tree(self) -> TreeSpec | None:
        return TreeSpec.from_dict(self.best["tree"]) if self.best else None


def _block_size(head_path: str) -> int | None:
    """The head's block size, read the way `load_head` reads it (None if the folder has no config)."""
    from jetflow.head.config import HeadConfig
    from jetflow.head.io import CONFIG

    try:
        return HeadConfig.from_dflash_dict(json.loads(Path(head_path, CONFIG).read_text())).block_size
    except (OSError, KeyError, ValueError):
        return None


def step_curve_here(target_id: str, head: str, dtype: str | None, gpu: bool, max_slots: int, max_budget: int) -> dict:
    """The step cost curve of this node's device for the head (measured once per node and device kind, cached
    in its `$JETFLOW_HOME`), as a dict: a Ray task of the trials' kind on a cluster."""
    from jetflow.engine.cost import cached_step_curve
    from jetflow.head import HeadRef
    from jetflow.target import TargetModel
    from jetflow.target.placement import placement

    device, torch_dtype = placement("cuda" if gpu else "cpu", dtype)
    target = TargetModel.load(target_id, device=device, dtype=torch_dtype)
    return cached_step_curve(target, HeadRef.parse(head).load(target).head, max_slots=max_slots,
                             max_budget=max_budget).to_dict()


def _step_curve(cfg: BudgetSweepConfig, head: str):
    """The step cost curve where the trials decode (this machine, or a worker node like theirs): the
    picture's predictions."""
    from jetflow.cluster import on_worker
    from jetflow.engine.cost import StepCostCurve

    try:
        curve = on_worker(step_curve_here, cfg.target, head, cfg.dtype, cfg.gpus_per_trial > 0, max(cfg.concurrency),
                          max(cfg.budgets), num_cpus=cfg.cpus_per_trial, num_gpus=cfg.gpus_per_trial)
        return StepCostCurve.from_dict(curve)
    except Exception as exc:  # noqa: BLE001 - a picture without predictions beats no sweep result
        print(f"[budget sweep] no cost curve for the predictions ({exc.__class__.__name__}: {exc})")
        return None


def _parent_run(cfg: BudgetSweepConfig, head: SweptHead) -> str:
    """The sweep's MLflow parent run; reused when the sweep resumes (its id lives beside Tune's state)."""
    from jetflow.tracking.runs import PARENT_MARKER
    from jetflow.tracking.store import client, experiment_for

    location = cfg.location
    marker = location.read_json(PARENT_MARKER)
    if marker and "run_id" in marker:
        run_id = marker["run_id"]
        try:
            client().get_run(run_id)
            return run_id
        except Exception:  # a different tracking store: start a new parent
            pass
    tags = {"jetflow.kind": "budget_sweep", "jetflow.target.id": cfg.target, "jetflow.head.path": head.path}
    if head.registered:
        tags.update({"jetflow.head.registered_name": head.registered[0], "jetflow.head.version": head.registered[1]})
    run = client().create_run(experiment_for(cfg.target), run_name=f"budget sweep {cfg.name}", tags=tags)
    for k, v in asdict(cfg).items():
        client().log_param(run.info.run_id, k, json.dumps(v) if isinstance(v, (list, dict)) else str(v))
    location.write_json(PARENT_MARKER, {"run_id": run.info.run_id})
    return run.info.run_id


def pick_best(rows: list[dict], select: str) -> dict | None:
    """The lossless trial with the highest `select` metric (greedy rows must be lossless; sampled rows,
    whose losslessness is not checkable token by token, count as lossless)."""
    ok = [r for r in rows if r.get("lossless") != 0.0 and math.isfinite(r.get(select, math.nan))]
    return max(ok, key=lambda r: r[select], default=None)


def _same_kind(row: dict, best: dict) -> bool:
    """The best setting's algorithm (with its parameters) and width at greedy decoding, any budget."""
    a, b = TreeSpec.from_dict(row["tree"]), TreeSpec.from_dict(best["tree"])
    return (a.algorithm, a.width, a.params) == (b.algorithm, b.width, b.params) and row["temperature"] == 0


def _levels(rows: list[dict]) -> list[int]:
    """The concurrency levels the trials measured (their mean `speedup_c<N>` metrics)."""
    return sorted({int(k.removeprefix("speedup_c")) for r in rows for k in r
                   if k.startswith("speedup_c") and "@" not in k})


def budget_by_concurrency(rows: list[dict], best: dict) -> dict[int, int]:
    """Per concurrency level the sweep measured: the budget of the best setting's kind with the highest
    tokens/s over plain decoding at that level — or 1 (plain decoding) when no budget beats plain there."""
    kind = [r for r in rows if _same_kind(r, best) and r.get("lossless") != 0.0]
    levels = _levels(kind)
    table = {}
    for level in levels:
        scored = [(r[f"speedup_c{level}"], r["budget"]) for r in kind if math.isfinite(r.get(f"speedup_c{level}", math.nan))]
        speedup, budget = max(scored, default=(0.0, 1))
        table[level] = budget if speedup > 1.0 else 1
    return table


def tau_by_budget(rows: list[dict], best: dict) -> dict[int, float]:
    """τ of the best setting's kind per budget (the serving policy's first estimates)."""
    return {r["budget"]: r["tau"] for r in rows if _same_kind(r, best) and math.isfinite(r.get("tau", math.nan))}


def summary_table(rows: list[dict], best: dict | None) -> str:
    from jetflow.eval.table import markdown_table

    levels = _levels(rows)
    cols = ["algorithm", "budget", "width", "temperature", "tau", "speedup", "tokens_per_s", "ar_tokens_per_s",
            "lossless"] + [(f"×plain @{c}", f"speedup_c{c}", "{:.2f}x") for c in levels]
    ordered = sorted(rows, key=lambda r: (r["temperature"], r["algorithm"], r["width"], r["budget"], r["key"]))
    return markdown_table(ordered, cols, [" **best**" if best is not None and r is best else "" for r in ordered])


def run_budget_sweep(cfg: BudgetSweepConfig, head: SweptHead, ray_address: str | None = None) -> SweepOutcome:
    """Run (or resume) the sweep of `head`: one Tune trial per setting, an MLflow child run each."""
    from ray import tune

    from jetflow.cluster import handed_tracking_uri, init_ray
    from jetflow.sweeps.cluster import trial_errors
    from jetflow.tracking.plots import budget_sweep_figures
    from jetflow.tracking.runs import log_figures
    from jetflow.tracking.store import client

    t0 = time.perf_counter()
    init_ray(ray_address)
    location = cfg.location
    trial_head = head.for_trials()  # before anything is logged: a folder other nodes cannot see fails here
    parent = _parent_run(cfg, head)
    shared = {"target": cfg.target, "head": trial_head, "head_uri": head.uri, "sweep": asdict(cfg),
              "parent_run_id": parent, "tracking_uri": handed_tracking_uri()}
    trainable = tune.with_resources(budget_trial, {"cpu": cfg.cpus_per_trial, "gpu": cfg.gpus_per_trial})
    settings = cfg.settings(_block_size(head.path))  # the grid: its trials, and the rows a complete sweep has
    if location.can_restore():
        print(f"[budget sweep] resuming {location.describe()} (finished trials are kept)")
        tuner = tune.Tuner.restore(location.path, trainable, resume_errored=True,
                                   storage_filesystem=location.filesystem)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={"setting": tune.grid_search(settings), "shared": shared},
            tune_config=tune.TuneConfig(metric=cfg.select, mode="max", max_concurrent_trials=cfg.max_concurrent,
                                        reuse_actors=True),
            run_config=tune.RunConfig(name=cfg.name, storage_path=location.storage_path,
                                      storage_filesystem=location.filesystem, verbose=1,
                                      failure_config=tune.FailureConfig(max_failures=cfg.max_failures)),
        )
    grid = tuner.fit()
    expected = [trial_key(s) for s in settings]
    rows = []
    for res in grid:
        if res.error is not None or not res.metrics or "tau" not in res.metrics:
            continue
        setting = res.config["setting"]
        spec = TreeSpec.from_dict(setting["tree"])
        rows.append({"tree": spec.to_dict(), "key": spec.key, "algorithm": spec.algorithm, "budget": spec.budget,
                     "width": spec.width, "temperature": setting["temperature"],
                     **{k: res.metrics[k] for k in ("tau", "speedup", "e2e_speedup", "tokens_per_s",
                                                    "ar_tokens_per_s", "lossless", "mlflow_run_id")},
                     **{k: v for k, v in res.metrics.items() if k.startswith(("speedup_c", "tokens_per_s_c", "tau@"))}})
    errors = trial_errors(grid)
    done = {trial_key(r) for r in rows}
    missing = [k for k in expected if k not in done]
    # an incomplete grid has no best setting: nothing is stored or promoted from part of it
    best = pick_best(rows, cfg.select) if not missing else None
    table = budget_by_concurrency(rows, best) if best is not None else {}
    c = client()
    c.set_tag(parent, "jetflow.sweep.trials", f"{len(expected) - len(missing)}/{len(expected)}")
    c.set_tag(parent, "jetflow.sweep.missing", ", ".join(missing) if missing else "none")
    c.log_text(parent, summary_table(rows, best), "sweep_table.md")
    log_figures(parent, budget_sweep_figures(set_rows(rows, _step_curve(cfg, trial_head))))
    if best is not None:
        for k in ("tau", "speedup", "tokens_per_s"):
            c.log_metric(parent, f"best_{k}", float(best[k]))
        for k in ("algorithm", "budget", "width", "temperature", "key"):
            c.set_tag(parent, f"jetflow.best.{k}", str(best[k]))
        for level, budget in table.items():
            c.log_metric(parent, f"best_budget_c{level}", float(budget))
    c.set_terminated(parent, "FAILED" if errors or missing else "FINISHED")
    return SweepOutcome(head=head, rows=rows, best=best, parent_run_id=parent, seconds=time.perf_counter() - t0,
                        budget_table=table, tau_by_budget=tau_by_budget(rows, best) if best is not None else {},
                        errors=errors, missing=missing)
