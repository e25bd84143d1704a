"""The budget sweep: Ray Tune over the tree settings (`TreeSpec`: algorithm × budget × width, × temperature)
of one head, in two stages of Tune trials under one MLflow parent run. It only sweeps: choosing the head,
storing the serving setting and promoting it are the main job's (`jetflow.main_job`).

1. The wide pass (`<name>`): a trial per setting, its τ and losslessness on `prompts_per_set` held-out prompts
   of each set, decoded batched on the engine (τ is deterministic: no timing, no noise).
2. The step cost model (`jetflow.engine.cost.StepCostCurve`, measured where the trials decode) turns each τ
   into predicted speedups, per set and per concurrency level; the `finalists` best predicted (each set's own
   predicted winner among them) go on.
3. The timed pass (`<name>-timed`): a trial per prompt set, every finalist and our AR decoded one prompt at a
   time, interleaved, `timed_repeats` passes over `timed_prompts` prompts: each speedup with its run-to-run
   spread (max - min over the passes); then, in the same trial, vLLM AR on the same prompts where vLLM is
   installed (`jetflow.sweeps.backends`): the baseline the figures name — vLLM AR, the fastest plain decoding
   installed, else JetFlow AR.
4. The serving setting: the fastest lossless finalist that is not slower than JetFlow's AR on any set (plain
   decoding when every finalist loses somewhere); the table says whether its lead over the runner-up exceeds
   the spread. The best budget per concurrency level comes from the predictions of its kind.
5. The backend pass (`<name>-backends`, where vLLM ran in step 3): tokens/s of the serving setting on JetFlow's
   engine beside vLLM AR and vLLM DFlash with the head exported, at `backend_concurrency` requests in flight;
   the decision records which backend won.

Across nodes: trials get the head as a reference their node resolves (its registry URI, or a storage URI),
never a folder of the driver's; Tune's state and the parent run's marker live in cluster storage; the step
cost curve is measured by a task on a worker node of the trials' kind."""

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
VLLM_BASELINE = ("auto", "off")


@dataclass
class BudgetSweepConfig:
    target: str = "smollm2-135m"       # target: bundled name, local folder or hub id
    budgets: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32, 64])  # tree nodes per round, root counted
    widths: list[int] = field(default_factory=lambda: [7])                       # top-W per depth (chains: 1)
    algorithms: list[str] = field(default_factory=lambda: ["best_first", "accum_logp", "chain"])  # name or
                                       # name:key=value; best_first (ours) beside the paper's accum_logp and a chain
    temperatures: list[float] = field(default_factory=lambda: [0.0])            # 0 = greedy (lossless-checked)
    sets: list[str] = field(default_factory=lambda: ["mtbench", "humaneval"])   # held-out prompt sets
    prompts_per_set: int = 8           # the wide pass: τ of every setting on this many prompts per set, batched
    max_new_tokens: int = 48           # tokens generated per prompt (both passes)
    finalists: int = 3                 # settings the step cost model predicts fastest from τ: timed against AR
    timed_prompts: int = 6             # the timed pass: prompts per set, each finalist and AR in turn per prompt
    timed_repeats: int = 2             # passes over them: each speedup's run-to-run spread (max - min)
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # requests in flight: the best budget per
                                       # level, predicted by the step cost model from τ (where Serve's policy starts)
    select: str = "speedup"            # what "best" means: decode speedup vs our AR, or tau
    name: str = "budget-sweep"         # Tune experiment name (resumes when it exists; the timed pass: <name>-timed)
    storage: str = ""                  # absolute Tune storage path (default: cluster storage's ray_results,
                                       # $JETFLOW_STORAGE; $JETFLOW_HOME/ray_results on one machine)
    max_concurrent: int = 2            # trials at once
    cpus_per_trial: float = 1.0        # Ray CPUs per trial (its torch threads)
    gpus_per_trial: float = 0.0        # Ray GPUs per trial (a trial given one decodes on it)
    dtype: str | None = None           # fp32, bf16 or fp16 (default: bf16 on a trial's GPU, fp32 on CPU)
    max_failures: int = 2              # reruns of a trial whose worker or node died (Tune's FailureConfig;
                                       # τ is deterministic, so a rerun elsewhere gives the same row)
    graphs: str = "auto"               # how the timed pass and the step cost curve run their steps: the way a
                                       # replica will (auto: compile where it pays on the trials' node, measured
                                       # there on first use; jetflow.stepcore.modes). The τ pass runs eager.
    vllm_baseline: str = "auto"        # auto: time vLLM AR beside ours in each timed trial (the baseline figures
                                       # name), and vLLM AR / DFlash in the backend pass, where vLLM imports here or
                                       # the checkout has .venv-vllm (`make setup-vllm`); else, or off: JetFlow AR
    vllm_python: str = ""              # the vLLM venv's Python when this one has no vLLM (default:
                                       # $JETFLOW_VLLM_PYTHON, else the checkout's .venv-vllm/bin/python)
    backend_concurrency: list[int] = field(default_factory=lambda: [1, 8])  # requests in flight of the backend
                                       # pass: JetFlow's serving setting vs vLLM AR and DFlash, tokens/s

    def __post_init__(self) -> None:
        if self.select not in SELECT:
            raise InvalidSettingError(f"select must be one of {SELECT}, got {self.select!r}")
        ev = self.eval_config({})  # validates the tree grid, temperatures, prompt sets and pass sizes
        self.budgets, self.widths, self.temperatures = ev.budgets, ev.widths, ev.temperatures
        if self.finalists < 1:
            raise InvalidSettingError(f"finalists must be >= 1, got {self.finalists}")
        if self.max_concurrent < 1 or self.cpus_per_trial <= 0 or self.gpus_per_trial < 0:
            raise InvalidSettingError("max_concurrent >= 1, cpus_per_trial > 0 and gpus_per_trial >= 0 are required")
        if self.max_failures < -1:
            raise InvalidSettingError(f"max_failures must be >= 0 (or -1: no limit), got {self.max_failures}")
        if self.vllm_baseline not in VLLM_BASELINE:
            raise InvalidSettingError(f"vllm_baseline must be one of {VLLM_BASELINE}, got {self.vllm_baseline!r}")
        if not self.backend_concurrency or any(not isinstance(c, int) or not 1 <= c <= 256
                                               for c in self.backend_concurrency):
            raise InvalidSettingError(f"backend_concurrency must be integers in 1..256, got {self.backend_concurrency}")
        from jetflow.stepcore.modes import check_graphs

        check_graphs(self.graphs)
        if self.storage and not Path(self.storage).is_absolute():
            raise InvalidSettingError(f"storage must be an absolute path (Ray Tune requires it), got {self.storage!r}")

    def eval_config(self, setting: dict[str, Any]):
        """The wide pass's evaluation of one trial's setting (or, with {}, of the whole grid, for validation):
        batched τ and losslessness only, on the eager reference steps (`graphs=off`): τ is what the tree accepts,
        not how fast its steps run, so no trial of this pass calibrates or compiles (on a 2-core CPU the first
        trials of each process did both, ~4 min apiece, two at once). The step cost curve and the timed pass run
        the steps the way a replica will (`graphs`); the timed pass checks those steps' losslessness."""
        from jetflow.eval.config import EvalConfig

        grid = {"algorithms": self.algorithms, "budgets": self.budgets, "widths": self.widths,
                "temperatures": self.temperatures}
        if setting:
            spec = TreeSpec.from_dict(setting["tree"])
            grid = {"algorithms": [spec.algorithm_option], "budgets": [spec.budget], "widths": [spec.width],
                    "temperatures": [setting["temperature"]]}
        ev = EvalConfig(sets=list(self.sets), prompts_per_set=self.prompts_per_set, timed_prompts=0,
                        max_new_tokens=self.max_new_tokens, baselines=False, cost_model=False, graphs="off", **grid)
        if not setting:
            for c in self.concurrency:
                if not isinstance(c, int) or not 1 <= c <= 256:
                    raise InvalidSettingError(f"concurrency levels must be integers in 1..256, got {c!r}")
            self.timed_config([], self.sets[0])  # the timed pass's sizes are valid too
        return ev

    def timed_config(self, finalists: list[dict[str, Any]], dataset: str):
        """The timed pass's evaluation of one prompt set: the finalists and AR, interleaved per prompt."""
        from jetflow.eval.config import EvalConfig

        return _grid_eval(EvalConfig, [TreeSpec.from_dict(f["tree"]) for f in finalists],
                          sets=[dataset], prompts_per_set=self.timed_prompts, timed_prompts=self.timed_prompts,
                          timed_repeats=self.timed_repeats, max_new_tokens=self.max_new_tokens, baselines=False,
                          cost_model=False, temperatures=sorted({f["temperature"] for f in finalists} or {0.0}),
                          graphs=self.graphs)

    @property
    def location(self):
        """Where the wide pass's Tune state (and the parent run's marker) lives (`jetflow.storage.TuneLocation`)."""
        from jetflow.storage import tune_location

        return tune_location(self.name, self.storage)

    @property
    def timed_location(self):
        from jetflow.storage import tune_location

        return tune_location(f"{self.name}-timed", self.storage)

    @property
    def backends_location(self):
        from jetflow.storage import tune_location

        return tune_location(f"{self.name}-backends", self.storage)

    def settings(self, block_size: int | None = None) -> list[dict[str, Any]]:
        """One trial per (TreeSpec, temperature), as Tune's JSON-able config: {"tree": dict, "temperature"}.
        Duplicates are gone: a chain ignores width, and for a head of `block_size` has at most that many nodes."""
        trees = self.eval_config({}).trees(block_size)
        return [{"tree": spec.to_dict(), "temperature": t} for t in self.temperatures for spec in trees]


def _grid_eval(config_cls, trees: list[TreeSpec], **kw):
    """An EvalConfig of exactly `trees` (their algorithms × budgets × widths, narrowed by `keys`)."""
    if not trees:
        return config_cls(**kw)
    return config_cls(algorithms=list(dict.fromkeys(t.algorithm_option for t in trees)),
                      budgets=sorted({t.budget for t in trees}), widths=sorted({t.width for t in trees}),
                      keys=[t.key for t in trees], **kw)


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


def _mean(values) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def trial_metrics(report: dict) -> dict[str, float]:
    """A wide-pass trial's Tune metrics from its evaluation report: τ (mean over prompt sets and per set,
    `tau@<set>`) and losslessness of the head's rows."""
    from jetflow.metrics import HEAD_METHODS

    rows = [r for r in report["rows"] if r["method"] in HEAD_METHODS]
    if not rows:
        raise InvalidSettingError("the evaluation produced no rows of the head")
    lossless = [r["lossless"] for r in rows if r.get("lossless") is not None]
    out = {"tau": _mean(r["tau"] for r in rows), "lossless": float(all(lossless)) if lossless else math.nan}
    for r in rows:
        out[f"tau@{r['dataset']}"] = r["tau"]
        if r.get("work_digest") is not None:
            out[f"work@{r['dataset']}"] = float(r["work_digest"])  # 52 bits: exact as a float
    return out


def timed_metrics(report: dict) -> dict[str, float]:
    """A timed-pass trial's Tune metrics (one prompt set, every finalist): per finalist `<key>` its decode
    speedup vs the AR decoded beside it (`speedup@<key>`), the speedup of each pass (`run<i>@<key>`), τ,
    tokens/s (and AR's, `ar_tokens_per_s`) and losslessness."""
    from jetflow.metrics import HEAD_METHODS

    out: dict[str, float] = {}
    for r in report["rows"]:
        if r["method"] == "ar":
            out["ar_tokens_per_s"] = r["tokens_per_s"] if r.get("tokens_per_s") is not None else math.nan
        if r["method"] not in HEAD_METHODS:
            continue
        key = _row_key(r)
        out[f"speedup@{key}"] = r["speedup_vs_ar"] if r.get("speedup_vs_ar") is not None else math.nan
        out[f"tau@{key}"] = r["tau"]
        out[f"tokens_per_s@{key}"] = r["tokens_per_s"] if r.get("tokens_per_s") is not None else math.nan
        out[f"lossless@{key}"] = float(r["lossless"]) if r.get("lossless") is not None else math.nan
        for i, v in enumerate(r.get("speedup_runs") or []):
            out[f"run{i}@{key}"] = v
    if not any(k.startswith("speedup@") for k in out):
        raise InvalidSettingError("the timed pass produced no rows of the head")
    out["compiled"] = float(report.get("params", {}).get("graphs_resolved") == "compile")  # how the decodes ran
    return out


def _row_key(row: dict) -> str:
    """A report row's finalist key: `trial_key` of its setting."""
    return trial_key({"tree": row["tree"], "temperature": row["temperature"]})


def set_rows(rows: list[dict]) -> list[dict]:
    """One row per trial and prompt set, at concurrency 1 — what `jetflow.tracking.plots.budget_sweep_figures`
    draws: τ, the measured speedup over AR (finalists; None for the others) and the step cost model's
    prediction."""
    out = []
    for r in rows:
        spec = TreeSpec.from_dict(r["tree"])
        for key, tau in r.items():
            if not key.startswith("tau@"):
                continue
            dataset = key.removeprefix("tau@")
            out.append({"tree": r["tree"], "algorithm": spec.algorithm, "budget": spec.budget, "width": spec.width,
                        "temperature": r["temperature"], "dataset": dataset, "concurrency": 1, "tau": tau,
                        "speedup": r.get(f"speedup@{dataset}"), "predicted_speedup": r.get(f"predicted@{dataset}")})
    return out


def budget_trial(config: dict) -> None:
    """A Tune function trainable, for both stages. The wide pass (`config["setting"]`): the setting's batched τ
    and losslessness on the sweep's prompts. The timed pass (`config["dataset"]`, `config["finalists"]`): every
    finalist and AR, one prompt at a time, interleaved, over `timed_repeats` passes. Each logs its report as a
    child MLflow run of the sweep's parent and reports its metrics."""
    import os

    import ray
    from ray import tune

    from jetflow.eval.compare import evaluate
    from jetflow.head import HeadRef
    from jetflow.tracking import log_evaluation
    from jetflow.tracking.probe import check_tracking_server

    shared = config["shared"]
    os.environ["MLFLOW_TRACKING_URI"] = shared["tracking_uri"]  # the driver's store, as this node reaches it
    check_tracking_server(shared["tracking_uri"], who=f"this trial on node {ray.util.get_node_ip_address()}")
    target, loaded = _target_and_head(shared["target"], shared["head"], shared["sweep"].get("dtype"))
    if shared.get("head_uri"):  # report the head as the registry version it is
        loaded = type(loaded)(loaded.head, HeadRef.parse(shared["head_uri"]), loaded.path, loaded.provenance)
    sweep = BudgetSweepConfig(**shared["sweep"])
    parent = shared.get("parent_run_id")
    if "backends" in config:  # the backend pass: JetFlow's serving setting vs vLLM, with requests in flight
        from jetflow.sweeps.backends import backend_metrics, log_backend_run

        metrics = backend_metrics(target, loaded, sweep, config["backends"], shared.get("export_key"))
        run_id = log_backend_run(parent, metrics, ray.util.get_node_ip_address())
        tune.report({**metrics, "mlflow_run_id": run_id})
        return
    vllm: dict = {}
    if "setting" in config:
        key, ev = trial_key(config["setting"]), sweep.eval_config(config["setting"])
    else:
        key, ev = timed_key(config["dataset"]), sweep.timed_config(config["finalists"], config["dataset"])
    report = evaluate(target, [loaded], ev)
    if "dataset" in config:  # vLLM AR right after ours, on the same prompts and token budget (the baseline)
        from jetflow.eval.compare import dataset_label
        from jetflow.sweeps.backends import add_vllm_row, vllm_ar_beside

        vllm, row = vllm_ar_beside(target, config["dataset"], dataset_label(config["dataset"]), sweep)
        print(f"[budget sweep] {key}: {vllm['vllm_note']}", flush=True)
        if row is not None:
            add_vllm_row(report, row)
    # born with its trial's name and node (a run its node's loss cut short still says which trial it was)
    run_id = log_evaluation(report, run_name=key, parent_run_id=parent,
                            tags={TRIAL_TAG: key, "jetflow.sweep.stage": "wide" if "setting" in config else "timed",
                                  "jetflow.node": ray.util.get_node_ip_address(),
                                  **({"jetflow.vllm.note": vllm["vllm_note"]} if vllm else {})})
    if parent:
        drop_earlier_children(parent, key, keep=run_id)
    metrics = trial_metrics(report) if "setting" in config else timed_metrics(report)
    tune.report({**metrics, **vllm, "mlflow_run_id": run_id})


TRIAL_TAG = "jetflow.trial"
BACKENDS_KEY = "backends"


def trial_key(setting: dict) -> str:
    """A wide-pass trial's name in the sweep (its child run's name and `jetflow.trial` tag): tree key and
    temperature."""
    return f"{TreeSpec.from_dict(setting['tree']).key} t{setting['temperature']:g}"


def timed_key(dataset: str) -> str:
    """A timed-pass trial's name: its prompt set's."""
    return f"timed {dataset}"


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
    rows: list[dict]                          # one per setting: the wide pass, predictions, the timed pass
    best: dict | None                         # the serving setting's row (None: incomplete grid, or plain)
    parent_run_id: str
    seconds: float = 0.0
    budget_table: dict[int, int] = field(default_factory=dict)      # concurrency → best budget (1 = plain)
    tau_by_budget: dict[int, float] = field(default_factory=dict)   # the best tree's kind: budget → τ
    errors: dict[str, str] = field(default_factory=dict)            # trial folder → the error it ended in
    missing: list[str] = field(default_factory=list)                # trials with no row (`trial_key`, `timed_key`)
    finalists: list[str] = field(default_factory=list)              # trial keys of the timed settings
    decision: dict = field(default_factory=dict)                    # the serving decision and its evidence

    @property
    def complete(self) -> bool:
        """Every trial of both passes has its row: only then is there a setting to store and promote."""
        return not self.missing

    @property
    def plain(self) -> bool:
        """Every finalist is slower than AR on some set: the head is served with plain decoding."""
        return self.complete and self.best is None and bool(self.decision)

    @property
    def best_tree(self) -> TreeSpec | None:
        return TreeSpec.from_dict(self.best["tree"]) if self.best else None


def _backend_pass(cfg: BudgetSweepConfig, trainable, shared: dict, decision: dict, table: dict,
                  timed: dict) -> tuple[dict | None, dict]:
    """The backend trial (`<name>-backends`): JetFlow's serving setting (per load, the budget of `table`) vs vLLM
    DFlash; with the timed trials' vLLM AR, the backend comparison (`jetflow.sweeps.backends.backends_of`).
    Skipped (None, said) when no timed trial could run vLLM: there is nothing to compare with."""
    from jetflow.sweeps.backends import backends_of
    from jetflow.sweeps.cluster import trial_errors

    if cfg.vllm_baseline == "off" or not any("vllm_ar_tokens_per_s" in m for m in timed.values()):
        print(f"[budget sweep] backend pass skipped: {decision.get('baseline_note') or 'vLLM not timed'}; the "
              "serving backend stays jetflow", flush=True)
        return None, {}
    serving = {"tree": decision["tree"], "budget_by_concurrency": {str(k): v for k, v in table.items()}}
    grid = _tuner(trainable, cfg.backends_location, {"backends": serving, "shared": shared}, cfg).fit()
    result = next((r for r in grid if r.error is None and r.metrics and "dflash_note" in r.metrics), None)
    if result is None:
        return None, trial_errors(grid)
    backends = backends_of(result.metrics, timed, cfg)
    from jetflow.sweeps.backends import backends_text

    print(f"[budget sweep] backends: {backends_text(backends)}", flush=True)
    return backends, trial_errors(grid)


def _block_size(head_path: str) -> int | None:
    """The head's block size, read the way `load_head` reads it (None if the folder has no config)."""
    from jetflow.head.config import HeadConfig
    from jetflow.head.io import CONFIG

    try:
        return HeadConfig.from_dflash_dict(json.loads(Path(head_path, CONFIG).read_text())).block_size
    except (OSError, KeyError, ValueError):
        return None


def step_curve_here(target_id: str, head: str, dtype: str | None, gpu: bool, max_slots: int, max_budget: int,
                    threads: int = 1, graphs: str = "auto") -> dict:
    """The step cost curve of this node's device for the head, with the trials' `threads` torch threads and the
    steps a replica of `max_slots` runs there (`graphs` resolved on this node, calibrated on first use; measured
    once per node and device kind, cached in its `$JETFLOW_HOME`), as a dict: a Ray task of the trials' kind on
    a cluster."""
    import torch

    from jetflow.engine.cost import cached_step_curve
    from jetflow.head import HeadRef
    from jetflow.target import TargetModel
    from jetflow.target.placement import placement

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        from jetflow.engine import Engine, EngineConfig
        from jetflow.stepcore.modes import resolve_graphs, target_key

        device, torch_dtype = placement("cuda" if gpu else "cpu", dtype)
        target = TargetModel.load(target_id, device=device, dtype=torch_dtype)
        loaded = HeadRef.parse(head).load(target).head
        mode = Engine(target, loaded, EngineConfig(max_slots=max_slots, graphs=graphs)).graphs  # auto, resolved
        # the timed pass decodes one stream at a time: its steps' verdict is taken here too, alone, not by its
        # trials while they run side by side (one compiling while the other timed: two verdicts, the last kept)
        timed = resolve_graphs(graphs, target_key(target, 1), target.device.type)[0]
        if timed == "calibrate":  # no verdict yet: an engine of one slot measures it (and keeps it)
            timed = Engine(target, loaded, EngineConfig(max_slots=1, graphs=graphs)).graphs
        curve = cached_step_curve(target, loaded, max_slots=max_slots, max_budget=max_budget, graphs=mode).to_dict()
        return {**curve, "graphs": mode, "timed_graphs": timed}
    finally:
        torch.set_num_threads(before)


def _step_curve(cfg: BudgetSweepConfig, head: str):
    """The step cost curve where the trials decode (this machine, or a worker node like theirs): what turns τ
    into predicted speedups. None (said) when it cannot be measured: finalists are then the highest τ."""
    from jetflow.cluster import on_worker
    from jetflow.engine.cost import StepCostCurve

    try:
        curve = on_worker(step_curve_here, cfg.target, head, cfg.dtype, cfg.gpus_per_trial > 0, max(cfg.concurrency),
                          max(cfg.budgets), max(1, int(cfg.cpus_per_trial)), cfg.graphs,
                          num_cpus=cfg.cpus_per_trial, num_gpus=cfg.gpus_per_trial)
        print(f"[budget sweep] step cost curve of the trials' node, steps graphs={curve.pop('graphs')}; the timed "
              f"pass's single-stream steps graphs={curve.pop('timed_graphs')}")
        return StepCostCurve.from_dict(curve)
    except Exception as exc:  # noqa: BLE001 - finalists by τ beat no sweep result
        print(f"[budget sweep] no step cost curve: finalists by τ alone ({exc.__class__.__name__}: {exc})")
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


def predict(rows: list[dict], curve, levels: list[int]) -> None:
    """Add to each wide-pass row the step cost model's speedups from its τ: per set at one request in flight
    (`predicted@<set>`), their mean (`predicted`), and the mean per concurrency level (`predicted_c<N>`)."""
    for r in rows:
        sets = [k.removeprefix("tau@") for k in r if k.startswith("tau@")]
        for level in levels:
            per_set = {ds: curve.speedup(level, r["budget"], r[f"tau@{ds}"]) for ds in sets
                       if math.isfinite(r.get(f"tau@{ds}", math.nan))}
            r[f"predicted_c{level}"] = _mean(per_set.values())
            if level == 1:
                r.update({f"predicted@{ds}": v for ds, v in per_set.items()})
                r["predicted"] = r[f"predicted_c{level}"]


def _usable(row: dict) -> bool:
    return row.get("lossless") != 0.0


def choose_finalists(rows: list[dict], count: int, select: str = "speedup") -> list[dict]:
    """The settings the timed pass measures: each set's own predicted winner (highest `predicted@<set>`, or τ
    without predictions / with select=tau), then the best by the mean of the same, up to `count` in all
    (more when the sets' winners alone are more). Lossy rows never, nor a row that did the same work as one
    already chosen (`same_work`: at budget 2 every algorithm drafts the same single node)."""
    ok = [r for r in rows if _usable(r)]
    by = "predicted" if select == "speedup" and all(math.isfinite(r.get("predicted", math.nan)) for r in ok) else "tau"
    sets = _sets(ok)

    def score(r, ds=None):
        v = r.get(f"{by}@{ds}" if ds else by, math.nan)
        return (v if math.isfinite(v) else -math.inf, -r["budget"])  # ties: the smaller tree

    chosen: list[dict] = []

    def take(r) -> None:
        if r is not None and not any(r is c or same_work(r, c) for c in chosen):
            chosen.append(r)

    for ds in sets:
        take(max(ok, key=lambda r: score(r, ds), default=None))
    for r in sorted(ok, key=score, reverse=True):
        if len(chosen) >= count:
            break
        take(r)
    return chosen


def same_work(a: dict, b: dict) -> bool:
    """Whether two wide-pass rows decoded the same way on every prompt set: the same temperature and equal
    `work@<set>` digests (`DecodeStats.work_digest`: the same nodes verified and tokens accepted, round by
    round). Timing both would measure one decode twice. Rows without digests are never the same."""
    sets = [k for k in a if k.startswith("work@")]
    return (bool(sets) and a["temperature"] == b["temperature"] and {k for k in b if k.startswith("work@")} == set(sets)
            and all(a[k] == b[k] for k in sets))


def merge_timed(rows: list[dict], timed: dict[str, dict[str, float]]) -> None:
    """Put the timed pass's measurements (per prompt set label: that trial's metrics) on the finalists' rows:
    `speedup@<set>`, `spread@<set>` (max - min over passes), `speedup` (mean over sets), `spread` (max - min
    over passes of that mean), tokens/s, AR's tokens/s; losslessness is the wide pass's and the timed pass's."""
    for r in rows:
        key = r["trial"]
        per_set = {ds: m for ds, m in timed.items() if f"speedup@{key}" in m}
        if not per_set:
            continue
        passes: list[list[float]] = []
        for ds, m in per_set.items():
            r[f"speedup@{ds}"] = m[f"speedup@{key}"]
            runs = [m[k] for k in sorted((k for k in m if k.startswith("run") and k.endswith(f"@{key}")),
                                         key=lambda k: int(k[3:k.index("@")]))]
            r[f"spread@{ds}"] = max(runs) - min(runs) if len(runs) > 1 else math.nan
            passes.append(runs)
            if m.get(f"lossless@{key}") == 0.0:
                r["lossless"] = 0.0
        r["speedup"] = _mean(r[f"speedup@{ds}"] for ds in per_set)
        n = min((len(p) for p in passes), default=0)
        means = [_mean(p[i] for p in passes) for i in range(n)]
        r["spread"] = max(means) - min(means) if n > 1 else math.nan
        r["tokens_per_s"] = _mean(m.get(f"tokens_per_s@{key}") for m in per_set.values())
        r["ar_tokens_per_s"] = _mean(m.get("ar_tokens_per_s") for m in per_set.values())
        # vs vLLM AR (the fastest plain decoding installed), timed in the same trial: decode tokens/s over vLLM's
        vs = {ds: m[f"tokens_per_s@{key}"] / m["vllm_ar_tokens_per_s"] for ds, m in per_set.items()
              if _pos(m.get("vllm_ar_tokens_per_s")) and _pos(m.get(f"tokens_per_s@{key}"))}
        for ds, v in vs.items():
            r[f"speedup_vs_vllm_ar@{ds}"] = v
        r["speedup_vs_vllm_ar"] = _mean(vs.values()) if len(vs) == len(per_set) else math.nan
        flags = {m["compiled"] for m in per_set.values() if "compiled" in m}
        if flags:
            r["compiled"] = 1.0 if flags == {1.0} else 0.0 if flags == {0.0} else math.nan


def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _loses(row: dict) -> list[str]:
    """The prompt sets on which a timed row is slower than AR."""
    return sorted(k.removeprefix("speedup@") for k, v in row.items()
                  if k.startswith("speedup@") and math.isfinite(v) and v < 1.0)


def decide(rows: list[dict], select: str, cfg: BudgetSweepConfig,
           baseline: dict | None = None) -> tuple[dict | None, dict]:
    """The serving setting among the timed finalists, and the decision's evidence. The rule (select=speedup):
    lossless, not slower than JetFlow's AR on any prompt set (the tree must pay for itself on our engine), then the
    highest timed mean speedup over sets; None when every finalist is slower than AR on some set: the head is
    served plain there and everywhere (one setting serves all requests). With select=tau the highest τ of the
    lossless finalists, speed reported, not required. `baseline` (`jetflow.sweeps.backends.baseline_of`): the
    plain decoding the headline figures compare with — vLLM AR where it was timed (each set's `speedup_vs_vllm_ar`
    beside the speedup over JetFlow AR), else JetFlow AR."""
    timed = [r for r in rows if math.isfinite(r.get("speedup", math.nan)) and _usable(r)]
    ranked = sorted(timed, key=lambda r: r[select], reverse=True)
    winners = [r for r in ranked if select == "tau" or not _loses(r)]
    best = winners[0] if winners else None
    runner = next((r for r in ranked if r is not best), None) if best is not None else None
    evidence = {
        "setting": best["trial"] if best else "plain",
        "tree": best["tree"] if best else TreeSpec(budget=1).to_dict(),
        "select": select, "timed_prompts": cfg.timed_prompts, "timed_repeats": cfg.timed_repeats,
        "tau_prompts": cfg.prompts_per_set, "max_new_tokens": cfg.max_new_tokens,
        "sets": {}, "finalists": [r["trial"] for r in timed],
        "losing": {r["trial"]: _loses(r) for r in timed if _loses(r)},
        "graphs": _timed_graphs(rows),
    }
    base = baseline or {"name": "jetflow_ar", "label": "JetFlow AR", "note": "vLLM not timed", "sets": {}}
    vllm = base["name"] == "vllm_ar"
    evidence.update({"baseline": base["name"], "baseline_label": base["label"], "baseline_note": base.get("note"),
                     "vllm_version": base.get("vllm_version"), "ar": base.get("sets", {})})
    if best is not None:
        sets = [k.removeprefix("speedup@") for k in best if k.startswith("speedup@")]
        evidence["sets"] = {ds: {"speedup": best[f"speedup@{ds}"], "spread": best.get(f"spread@{ds}", math.nan),
                                 "tau": best.get(f"tau@{ds}", math.nan),
                                 **({"speedup_vs_vllm_ar": best.get(f"speedup_vs_vllm_ar@{ds}", math.nan)}
                                    if vllm else {})} for ds in sets}
        evidence.update({"speedup": best["speedup"], "spread": best.get("spread", math.nan), "tau": best["tau"],
                         "runner_up": runner["trial"] if runner else None})
        if vllm:
            evidence["speedup_vs_vllm_ar"] = best.get("speedup_vs_vllm_ar", math.nan)
        if runner is not None:
            lead = best[select] - runner[select]
            spread = max(best.get("spread", math.nan), runner.get("spread", math.nan))
            evidence.update({"lead": lead, "lead_spread": spread,
                             "decisive": bool(math.isfinite(spread) and lead > spread)})
    # the headline figure: the serving setting (plain: JetFlow's AR itself) against the baseline
    ar_vs = [v.get("jetflow_ar_vs_vllm_ar") for v in base.get("sets", {}).values()]
    evidence["speedup_vs_baseline"] = (
        (evidence.get("speedup_vs_vllm_ar", math.nan) if best is not None else _mean(ar_vs)) if vllm
        else (evidence.get("speedup", math.nan) if best is not None else 1.0))
    return best, _json_safe(evidence)


def _timed_graphs(rows: list[dict]) -> str:
    """How the timed pass ran its steps (`graphs` resolved on the trials' node): compile, off or mixed."""
    flags = {r["compiled"] for r in rows if math.isfinite(r.get("compiled", math.nan))}
    return "mixed" if len(flags) > 1 else ("compile" if flags == {1.0} else "off") if flags else "unknown"


def _json_safe(obj):
    """NaN → None, so the decision is strict JSON (an MLflow artifact, a registry tag)."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def budget_by_concurrency(rows: list[dict], best: dict) -> dict[int, int]:
    """Per concurrency level: the budget of the best setting's kind whose predicted speedup over plain
    decoding at that level (`predicted_c<N>`, the step cost model's from τ) is highest — or 1 (plain
    decoding) when none is predicted to beat plain there."""
    kind = [r for r in rows if _same_kind(r, best) and _usable(r)]
    table = {}
    for level in _levels(kind):
        scored = [(r[f"predicted_c{level}"], r["budget"]) for r in kind
                  if math.isfinite(r.get(f"predicted_c{level}", math.nan))]
        speedup, budget = max(scored, default=(0.0, 1))
        table[level] = budget if speedup > 1.0 else 1
    return table


def _same_kind(row: dict, best: dict) -> bool:
    """The best setting's algorithm (with its parameters) and width at greedy decoding, any budget."""
    a, b = TreeSpec.from_dict(row["tree"]), TreeSpec.from_dict(best["tree"])
    return (a.algorithm, a.width, a.params) == (b.algorithm, b.width, b.params) and row["temperature"] == 0


def _levels(rows: list[dict]) -> list[int]:
    """The concurrency levels with predictions (`predicted_c<N>`)."""
    return sorted({int(k.removeprefix("predicted_c")) for r in rows for k in r if k.startswith("predicted_c")})


def tau_by_budget(rows: list[dict], best: dict) -> dict[int, float]:
    """τ of the best setting's kind per budget (the serving policy's first estimates)."""
    return {r["budget"]: r["tau"] for r in rows if _same_kind(r, best) and math.isfinite(r.get("tau", math.nan))}


def _sets(rows: list[dict]) -> list[str]:
    return sorted({k.removeprefix("tau@") for r in rows for k in r if k.startswith("tau@")})


def summary_table(rows: list[dict], best: dict | None) -> str:
    """Every setting: τ per set (the wide pass), the predicted speedup, and for the finalists the timed speedup
    per set with its spread (max - min over passes)."""
    from jetflow.eval.table import markdown_table

    sets = _sets(rows)
    vllm = [ds for ds in sets if any(f"speedup_vs_vllm_ar@{ds}" in r for r in rows)]
    cols = (["algorithm", "budget", "width", "temperature", "tau"]
            + [(f"τ {ds}", f"tau@{ds}", "{:.2f}") for ds in sets]
            + [("predicted (× JetFlow AR)", "predicted", "{:.2f}x")]
            + [(f"timed {ds} (× JetFlow AR)", f"speedup@{ds}", "{:.2f}x") for ds in sets]
            + [(f"± {ds}", f"spread@{ds}", "{:.2f}") for ds in sets]
            + [("timed mean (× JetFlow AR)", "speedup", "{:.2f}x")]
            + [(f"{ds} (× vLLM AR)", f"speedup_vs_vllm_ar@{ds}", "{:.2f}x") for ds in vllm]
            + ["lossless"])
    ordered = sorted(rows, key=lambda r: (r["temperature"], r["algorithm"], r["width"], r["budget"], r["key"]))
    return markdown_table(ordered, cols, [" **serving**" if best is not None and r is best else "" for r in ordered])


def winners_table(rows: list[dict], decision: dict) -> str:
    """Per prompt set: the highest τ, the fastest predicted, the fastest timed (± spread), and the serving
    setting's speedup there; then the decision (lead over the runner-up vs the spread)."""
    def top(ds, field):
        cands = [r for r in rows if _usable(r) and math.isfinite(r.get(f"{field}@{ds}", math.nan))]
        return max(cands, key=lambda r: r[f"{field}@{ds}"], default=None)

    def vs_vllm(v) -> str:
        return f", {v:.2f}x vLLM AR" if v is not None and math.isfinite(v) else ""

    lines = ["| set | highest τ | fastest predicted | fastest timed | serving |", "|---|---|---|---|---|"]
    for ds in _sets(rows):
        t, p, m = top(ds, "tau"), top(ds, "predicted"), top(ds, "speedup")
        ev = decision.get("sets", {}).get(ds)
        ar = (decision.get("ar") or {}).get(ds) or {}
        plain = (f"plain ({ar['jetflow_ar_vs_vllm_ar']:.2f}x vLLM AR)" if ar.get("jetflow_ar_vs_vllm_ar") is not None
                 else "plain")
        timed = (f"{m['key']} {m[f'speedup@{ds}']:.2f}x JetFlow AR ± {_f(m.get(f'spread@{ds}'))}"
                 f"{vs_vllm(m.get(f'speedup_vs_vllm_ar@{ds}'))}" if m else "-")
        serving = (f"{ev['speedup']:.2f}x JetFlow AR ± {_f(ev['spread'])}{vs_vllm(ev.get('speedup_vs_vllm_ar'))}"
                   if ev else plain)
        lines.append("| " + " | ".join([ds, f"{t['key']} τ {t[f'tau@{ds}']:.2f}" if t else "-",
                                        f"{p['key']} {p[f'predicted@{ds}']:.2f}x JetFlow AR" if p else "-",
                                        timed, serving]) + " |")
    from jetflow.tracking.promotion import evidence_text

    text = "\n".join(lines) + "\n\n" + (evidence_text(decision) if decision else "no decision (incomplete sweep)") + "\n"
    if decision.get("backends"):
        from jetflow.sweeps.backends import backends_text

        text += "\nbackends: " + backends_text(decision["backends"]) + "\n"
    return text


def _f(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}"


def _tuner(trainable, location, param_space: dict, cfg: BudgetSweepConfig):
    """A Tune experiment at `location`: restored when it exists there (finished trials kept), else new."""
    from ray import tune

    from jetflow.sweeps.setup_errors import SetupErrorsNotRetried

    if location.can_restore():
        print(f"[budget sweep] resuming {location.describe()} (finished trials are kept)")
        return tune.Tuner.restore(location.path, trainable, resume_errored=True,
                                  storage_filesystem=location.filesystem)
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(max_concurrent_trials=cfg.max_concurrent, reuse_actors=True),
        run_config=tune.RunConfig(name=location.name, storage_path=location.storage_path,
                                  storage_filesystem=location.filesystem, verbose=1,
                                  failure_config=tune.FailureConfig(max_failures=cfg.max_failures),
                                  callbacks=[SetupErrorsNotRetried(cfg.max_failures)]))


def run_budget_sweep(cfg: BudgetSweepConfig, head: SweptHead, ray_address: str | None = None) -> SweepOutcome:
    """Run (or resume) the sweep of `head`: the wide pass (a trial per setting), the step cost model's
    finalists, the timed pass (a trial per prompt set); an MLflow child run per trial."""
    from ray import tune

    from jetflow.cluster import handed_tracking_uri, init_ray
    from jetflow.eval.compare import dataset_label
    from jetflow.sweeps.cluster import trial_errors
    from jetflow.sweeps.setup_errors import not_retried_on_setup_error
    from jetflow.tracking.plots import budget_sweep_figures
    from jetflow.tracking.probe import check_tracking_server
    from jetflow.tracking.runs import log_figures
    from jetflow.tracking.store import client

    t0 = time.perf_counter()
    init_ray(ray_address)
    tracking = handed_tracking_uri()  # the trials' store, as their nodes reach it: asked now, in seconds
    check_tracking_server(tracking, who="the sweep's trials")
    trial_head = head.for_trials()  # before anything is logged: a folder other nodes cannot see fails here
    parent = _parent_run(cfg, head)
    shared = {"target": cfg.target, "head": trial_head, "head_uri": head.uri, "sweep": asdict(cfg),
              "parent_run_id": parent, "tracking_uri": tracking,
              # where a trial keeps the head's vLLM export ($JETFLOW_HOME/vllm-heads/<key>; else by weights)
              "export_key": "/".join(head.registered) if head.registered else None}
    trainable = tune.with_resources(not_retried_on_setup_error(budget_trial),
                                    {"cpu": cfg.cpus_per_trial, "gpu": cfg.gpus_per_trial})
    settings = cfg.settings(_block_size(head.path))  # the grid: its trials, and the rows a complete sweep has
    grid = _tuner(trainable, cfg.location, {"setting": tune.grid_search(settings), "shared": shared}, cfg).fit()
    errors = trial_errors(grid)
    rows = []
    for res in grid:
        if res.error is not None or not res.metrics or "tau" not in res.metrics:
            continue
        setting = res.config["setting"]
        spec = TreeSpec.from_dict(setting["tree"])
        rows.append({"tree": spec.to_dict(), "key": spec.key, "trial": trial_key(setting), "algorithm": spec.algorithm,
                     "budget": spec.budget, "width": spec.width, "temperature": setting["temperature"],
                     **{k: res.metrics[k] for k in ("tau", "lossless", "mlflow_run_id")},
                     **{k: v for k, v in res.metrics.items() if k.startswith(("tau@", "work@"))}})
    rows.sort(key=lambda r: (r["temperature"], r["algorithm"], r["width"], r["budget"], r["key"]))  # Tune's order varies
    done = {r["trial"] for r in rows}
    missing = [trial_key(s) for s in settings if trial_key(s) not in done]
    finalists: list[dict] = []
    best, decision = None, {}
    if not missing:  # finalists only from the whole grid
        curve = _step_curve(cfg, trial_head)
        if curve is not None:
            predict(rows, curve, sorted(set(cfg.concurrency) | {1}))
        finalists = choose_finalists(rows, cfg.finalists, cfg.select)
        picked = [{"tree": r["tree"], "temperature": r["temperature"]} for r in finalists]
        timed: dict[str, dict] = {}
        if finalists:  # (none when no setting is lossless: nothing to time, the head is served plain)
            twins = {f["trial"]: [r["trial"] for r in rows if r is not f and same_work(r, f)] for f in finalists}
            print(f"[budget sweep] finalists for the timed pass: "
                  + ", ".join(f"{t} (the same work as {', '.join(w)})" if w else t for t, w in twins.items()))
            timed_grid = _tuner(trainable, cfg.timed_location, {"dataset": tune.grid_search(list(cfg.sets)),
                                                                "finalists": picked, "shared": shared}, cfg).fit()
            errors.update(trial_errors(timed_grid))
            timed = {dataset_label(res.config["dataset"]): res.metrics for res in timed_grid
                     if res.error is None and res.metrics and "ar_tokens_per_s" in res.metrics}
            missing = [timed_key(ds) for ds in cfg.sets if dataset_label(ds) not in timed]
            merge_timed(rows, timed)
        if not missing:
            from jetflow.sweeps.backends import baseline_of

            baseline = baseline_of(timed, cfg)
            print(f"[budget sweep] figures name their baseline: {baseline['label']} ({baseline['note']})", flush=True)
            best, decision = decide(rows, cfg.select, cfg, baseline)
    table = budget_by_concurrency(rows, best) if best is not None else (
        {c: 1 for c in cfg.concurrency} if decision else {})
    if decision:  # the backends: JetFlow's serving setting beside vLLM AR and DFlash, with requests in flight
        backends, backend_errors = _backend_pass(cfg, trainable, shared, decision, table, timed)
        errors.update(backend_errors)
        if backends is not None:
            decision = _json_safe({**decision, "backends": backends, "backend": backends["backend"],
                                   "vllm_mode": backends["vllm_mode"]})
    c = client()
    expected = len(settings) + (len(cfg.sets) if finalists or missing else 0)
    c.set_tag(parent, "jetflow.sweep.trials", f"{expected - len(missing)}/{expected}")
    c.set_tag(parent, "jetflow.sweep.missing", ", ".join(missing) if missing else "none")
    c.set_tag(parent, "jetflow.sweep.finalists", ", ".join(r["trial"] for r in finalists) or "none")
    c.log_text(parent, summary_table(rows, best), "sweep_table.md")
    if decision:
        c.log_text(parent, winners_table(rows, decision), "sweep_winners.md")
        c.log_dict(parent, decision, "serving_decision.json")
        c.set_tag(parent, "jetflow.serving.setting", decision["setting"])
    if decision:
        from jetflow.sweeps.backends import log_parent_rows

        log_parent_rows(parent, decision)
    log_figures(parent, budget_sweep_figures(set_rows(rows)))
    if best is not None:
        for k in ("tau", "speedup", "tokens_per_s", "spread"):
            if math.isfinite(best.get(k, math.nan)):
                c.log_metric(parent, f"best_{k}", float(best[k]))
        for k in ("algorithm", "budget", "width", "temperature", "key"):
            c.set_tag(parent, f"jetflow.best.{k}", str(best[k]))
        for level, budget in table.items():
            c.log_metric(parent, f"best_budget_c{level}", float(budget))
    c.set_terminated(parent, "FAILED" if errors or missing else "FINISHED")
    return SweepOutcome(head=head, rows=rows, best=best, parent_run_id=parent, seconds=time.perf_counter() - t0,
                        budget_table=table, tau_by_budget=tau_by_budget(rows, best) if best is not None else {},
                        errors=errors, missing=missing, finalists=[r["trial"] for r in finalists], decision=decision)
