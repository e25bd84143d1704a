"""The budget sweep (the product's main job): Ray Tune over tree budget × width × algorithm (×
temperature) for one head, each trial a side-by-side evaluation (the head's setting and our AR loop on
the same prompts) logged as an MLflow child run; the best lossless setting becomes the head's serving
tree config on its registry version.

Head selection: an explicit head (path, name, `models:/…`), else the registry's `champion`; with an
empty registry the training pipeline's preset runs first, its head is registered, swept, and promoted
through the gate — so a fresh machine needs nothing else.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jetflow.errors import InvalidSettingError, JetFlowError
from jetflow.paths import jetflow_home

SELECT = ("speedup", "tau")
SPEC_METHODS = ("tree", "chain", "tree_bidirectional", "chain_bidirectional")


@dataclass
class BudgetSweepConfig:
    target: str = "smollm2-135m"
    head: str = ""                     # folder, name, models:/NAME@ALIAS; "" = the registry's champion
    preset: str = "demo"               # trained first when the registry has no champion and no head is given
    budgets: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32, 64])
    widths: list[int] = field(default_factory=lambda: [7])
    algorithms: list[str] = field(default_factory=lambda: ["accum_logp", "chain"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    sets: list[str] = field(default_factory=lambda: ["mtbench", "humaneval"])
    prompts_per_set: int = 2
    max_new_tokens: int = 48
    select: str = "speedup"            # what "best" means: decode speedup vs our AR, or τ
    name: str = "budget-sweep"         # Tune experiment name (resumes when it exists)
    storage: str = ""                  # absolute Tune storage path; default $JETFLOW_HOME/ray_results
    max_concurrent: int = 2
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    store_best: bool = True            # write the best setting onto the head's registry version

    def __post_init__(self) -> None:
        from jetflow.eval.compare import EvalConfig

        if self.select not in SELECT:
            raise InvalidSettingError(f"select must be one of {SELECT}, got {self.select!r}")
        # the evaluation config validates budgets, widths, algorithms, temperatures and prompt sets
        ev = EvalConfig(sets=list(self.sets), prompts_per_set=self.prompts_per_set,
                        max_new_tokens=self.max_new_tokens, budgets=list(self.budgets), widths=list(self.widths),
                        algorithms=list(self.algorithms), temperatures=list(self.temperatures))
        self.budgets, self.widths, self.temperatures = ev.budgets, ev.widths, ev.temperatures
        if self.max_concurrent < 1 or self.cpus_per_trial <= 0 or self.gpus_per_trial < 0:
            raise InvalidSettingError("max_concurrent >= 1, cpus_per_trial > 0 and gpus_per_trial >= 0 are required")
        if self.storage and not Path(self.storage).is_absolute():
            raise InvalidSettingError(f"storage must be an absolute path (Ray Tune requires it), got {self.storage!r}")

    @property
    def storage_path(self) -> Path:
        return Path(self.storage) if self.storage else jetflow_home() / "ray_results"

    def settings(self, block_size: int | None = None) -> list[dict[str, Any]]:
        """One dict per trial; a chain ignores width, so it appears once per budget — and, for a head
        of `block_size`, once for all budgets >= block_size (a chain has at most block_size nodes)."""
        out = []
        for t in self.temperatures:
            for alg in self.algorithms:
                widths = [1] if alg == "chain" else self.widths
                budgets = self.budgets
                if alg == "chain" and block_size:
                    budgets = sorted({min(b, block_size) for b in self.budgets})
                out += [{"algorithm": alg, "budget": b, "width": w, "temperature": t}
                        for b in budgets for w in widths]
        return out


def _block_size(head_path: str) -> int | None:
    """The head's block size, read the way `load_head` reads it (None if the folder has no config)."""
    from jetflow.head.config import HeadConfig
    from jetflow.head.io import CONFIG

    try:
        return HeadConfig.from_dflash_dict(json.loads(Path(head_path, CONFIG).read_text())).block_size
    except (OSError, KeyError, ValueError, JetFlowError):
        return None


# --------------------------------------------------------------------------- trials
_LOADED: dict[tuple, Any] = {}


def _target_and_head(target_id: str, head_path: str):
    """Loaded once per Tune worker process (actors are reused across trials)."""
    key = (target_id, head_path)
    if key not in _LOADED:
        import torch

        from jetflow.eval.heads import load_eval_head
        from jetflow.target import TargetModel

        torch.set_num_threads(max(1, int(os.environ.get("JETFLOW_TRIAL_THREADS", "1"))))
        _LOADED.clear()
        # a trial given a GPU (--gpus-per-trial) decodes on it
        target = TargetModel.load(target_id, device="cuda" if torch.cuda.is_available() else "cpu")
        _LOADED[key] = (target, load_eval_head(head_path, target))
    return _LOADED[key]


def trial_metrics(report: dict) -> dict[str, float]:
    """The trial's Tune metrics from its evaluation report: means over prompt sets of the speculative
    rows (τ, decode speedup vs our AR measured in the same trial, tokens/s), and losslessness."""
    rows = [r for r in report["rows"] if r["method"] in SPEC_METHODS]
    ar = [r for r in report["rows"] if r["method"] == "ar"]
    if not rows:
        raise InvalidSettingError("the evaluation produced no speculative rows")

    def mean(key: str, among) -> float:
        vals = [r[key] for r in among if r.get(key) is not None and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else math.nan

    lossless = [r["lossless"] for r in rows if r.get("lossless") is not None]
    return {"tau": mean("tau", rows), "speedup": mean("speedup_vs_ar", rows),
            "e2e_speedup": mean("e2e_speedup", rows), "tokens_per_s": mean("tokens_per_s", rows),
            "ar_tokens_per_s": mean("tokens_per_s", ar),
            "lossless": float(all(lossless)) if lossless else math.nan}


def budget_trial(config: dict) -> None:
    """A Tune function trainable: evaluate one tree setting against AR on the sweep's prompts, log the
    report as a child MLflow run, report the trial's metrics."""
    from ray import tune

    from jetflow.eval.compare import EvalConfig, evaluate
    from jetflow.tracking import log_evaluation

    s, shared = config["setting"], config["shared"]
    os.environ["MLFLOW_TRACKING_URI"] = shared["tracking_uri"]  # the driver's store, whatever this worker inherited
    target, head = _target_and_head(shared["target"], shared["head_path"])
    head.uri = shared.get("head_uri")
    cfg = EvalConfig(sets=shared["sets"], prompts_per_set=shared["prompts_per_set"],
                     max_new_tokens=shared["max_new_tokens"], budgets=[s["budget"]], widths=[s["width"]],
                     algorithms=[s["algorithm"]], temperatures=[s["temperature"]], baselines=False,
                     cost_model=False)
    report = evaluate(target, [head], cfg)
    run_name = f"{s['algorithm']} b{s['budget']} w{s['width']} t{s['temperature']:g}"
    run_id = log_evaluation(report, run_name=run_name, parent_run_id=shared.get("parent_run_id"))
    tune.report({**trial_metrics(report), "mlflow_run_id": run_id})


# --------------------------------------------------------------------------- driver
@dataclass
class SweepOutcome:
    head_path: str
    registered: tuple[str, str] | None      # (name, version)
    rows: list[dict]                          # one per trial: setting + metrics
    best: dict | None
    parent_run_id: str
    promotion: str | None = None
    seconds: float = 0.0


def _select_head(cfg: BudgetSweepConfig) -> tuple[str, str | None, tuple[str, str] | None, bool]:
    """(local head folder, registry URI or None, (name, version) or None, freshly trained?)."""
    from jetflow.eval.heads import resolve_head_spec
    from jetflow.tracking import CHAMPION, find_version, registered_model_name, resolve_alias

    if cfg.head:
        path, uri = resolve_head_spec(cfg.head)
        if path is None:
            raise InvalidSettingError("the budget sweep needs a trained head, not a random one")
        mv = find_version(cfg.target, uri=uri, path=path)
        return str(path), uri, ((mv.name, str(mv.version)) if mv else None), False
    champ = resolve_alias(cfg.target, CHAMPION)
    if champ is not None:
        return str(champ.path), f"models:/{champ.name}@{CHAMPION}", (champ.name, champ.version), False
    print(f"[budget sweep] no champion registered for {cfg.target} ({registered_model_name(cfg.target)}): "
          f"training the {cfg.preset!r} preset first")
    return (*_train_and_register(cfg), True)


def _train_and_register(cfg: BudgetSweepConfig) -> tuple[str, str, tuple[str, str]]:
    from jetflow.target import TargetModel
    from jetflow.tracking import CHALLENGER, log_training_run, register_head, registered_model_name, set_alias
    from jetflow.train.pipeline import run_pipeline

    head_dir = run_pipeline(cfg.preset, name=cfg.preset, model=cfg.target)
    target = TargetModel.load(cfg.target)
    run_id = log_training_run(head_dir, cfg.target, target.revision)
    name = registered_model_name(cfg.target)
    version = register_head(run_id, cfg.target)
    set_alias(name, CHALLENGER, version)
    return str(head_dir), f"models:/{name}/{version}", (name, version)


def _parent_run(cfg: BudgetSweepConfig, exp_dir: Path, head_path: str, registered) -> str:
    """The sweep's MLflow parent run; reused when the sweep resumes (its id lives beside Tune's state)."""
    from jetflow.tracking.store import client, experiment_for

    marker = exp_dir / "mlflow_parent_run.json"
    if marker.exists():
        run_id = json.loads(marker.read_text())["run_id"]
        try:
            client().get_run(run_id)
            return run_id
        except Exception:  # a different tracking store: start a new parent
            pass
    tags = {"jetflow.kind": "budget_sweep", "jetflow.target.id": cfg.target, "jetflow.head.path": head_path}
    if registered:
        tags.update({"jetflow.head.registered_name": registered[0], "jetflow.head.version": registered[1]})
    run = client().create_run(experiment_for(cfg.target), run_name=f"budget sweep {cfg.name}", tags=tags)
    for k, v in asdict(cfg).items():
        client().log_param(run.info.run_id, k, json.dumps(v) if isinstance(v, (list, dict)) else str(v))
    exp_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"run_id": run.info.run_id}))
    return run.info.run_id


def pick_best(rows: list[dict], select: str) -> dict | None:
    """The lossless trial with the highest `select` metric (greedy rows must be lossless; sampled rows,
    whose losslessness is not checkable token by token, count as lossless)."""
    ok = [r for r in rows if r.get("lossless") != 0.0 and math.isfinite(r.get(select, math.nan))]
    return max(ok, key=lambda r: r[select], default=None)


def summary_table(rows: list[dict], best: dict | None) -> str:
    from jetflow.eval.table import markdown_table

    cols = ["algorithm", "budget", "width", "temperature", "tau", "speedup", "tokens_per_s", "ar_tokens_per_s",
            "lossless"]
    ordered = sorted(rows, key=lambda r: (r["temperature"], r["algorithm"], r["width"], r["budget"]))
    return markdown_table(ordered, cols, [" **best**" if best is not None and r is best else "" for r in ordered])


def run_budget_sweep(cfg: BudgetSweepConfig, ray_address: str | None = None) -> SweepOutcome:
    import ray
    from ray import tune

    from jetflow.tracking import promote, set_tree_config, tracking_uri
    from jetflow.tracking.store import client

    t0 = time.perf_counter()
    uri = tracking_uri()
    env = {"JETFLOW_HOME": str(jetflow_home()), "MLFLOW_TRACKING_URI": uri, "TOKENIZERS_PARALLELISM": "false",
           "JETFLOW_TRIAL_THREADS": str(max(1, int(cfg.cpus_per_trial)))}
    if not ray.is_initialized():
        ray.init(address=ray_address, runtime_env={"env_vars": env}, include_dashboard=False,
                 log_to_driver=False, ignore_reinit_error=True)
    head_path, head_uri, registered, fresh = _select_head(cfg)
    exp_dir = cfg.storage_path / cfg.name
    parent = _parent_run(cfg, exp_dir, head_path, registered)
    shared = {"target": cfg.target, "head_path": head_path, "head_uri": head_uri, "sets": list(cfg.sets),
              "prompts_per_set": cfg.prompts_per_set, "max_new_tokens": cfg.max_new_tokens, "parent_run_id": parent,
              "tracking_uri": uri}
    trainable = tune.with_resources(budget_trial, {"cpu": cfg.cpus_per_trial, "gpu": cfg.gpus_per_trial})
    if tune.Tuner.can_restore(str(exp_dir)):
        print(f"[budget sweep] resuming {exp_dir} (finished trials are kept)")
        tuner = tune.Tuner.restore(str(exp_dir), trainable, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={"setting": tune.grid_search(cfg.settings(_block_size(head_path))),
                                 "shared": shared},
            tune_config=tune.TuneConfig(metric=cfg.select, mode="max", max_concurrent_trials=cfg.max_concurrent,
                                        reuse_actors=True),
            run_config=tune.RunConfig(name=cfg.name, storage_path=str(cfg.storage_path), verbose=1),
        )
    grid = tuner.fit()
    rows = []
    for res in grid:
        if res.error is not None or not res.metrics or "tau" not in res.metrics:
            continue
        rows.append({**res.config["setting"], **{k: res.metrics[k] for k in (
            "tau", "speedup", "e2e_speedup", "tokens_per_s", "ar_tokens_per_s", "lossless",
            "mlflow_run_id")}})
    failed = sum(1 for res in grid if res.error is not None)
    best = pick_best(rows, cfg.select)
    table = summary_table(rows, best)
    c = client()
    c.log_text(parent, table, "sweep_table.md")
    if best is not None:
        for k in ("tau", "speedup", "tokens_per_s"):
            c.log_metric(parent, f"best_{k}", float(best[k]))
        for k in ("algorithm", "budget", "width", "temperature"):
            c.set_tag(parent, f"jetflow.best.{k}", str(best[k]))
    promotion = None
    if best is not None and cfg.store_best:
        tree = {"algorithm": best["algorithm"], "budget": int(best["budget"]), "width": int(best["width"])}
        if registered:
            set_tree_config(registered[0], registered[1], tree)
        else:
            Path(head_path, "tree_config.json").write_text(json.dumps(tree) + "\n")
        if fresh and registered:  # the head trained for this sweep: the gate decides whether it becomes champion
            promotion = promote(cfg.target, registered[1], metric=cfg.select).summary()
    c.set_terminated(parent, "FINISHED" if failed == 0 else "FAILED")
    return SweepOutcome(head_path=head_path, registered=registered, rows=rows, best=best, parent_run_id=parent,
                        promotion=promotion, seconds=time.perf_counter() - t0)
