"""The main job (`sweeps/budget.py`, `make demo`): the product pipeline around the budget sweep.

1. choose the head: the one given (folder, name, `models:/…`), else the registry's `champion`, else — on a
   fresh machine — train the preset (`jetflow.train.pipeline`), log and register it (alias `challenger`);
2. sweep its tree settings (`jetflow.sweeps.budget`);
3. once every trial of both passes has its row (a node lost mid-sweep costs reruns, not rows: `max_failures`;
   an incomplete sweep stores and promotes nothing, and rerunning the job runs only its missing trials),
   store the serving setting on its registry version (the tree config Serve uses: the fastest lossless
   finalist that is slower than AR on no prompt set, else plain decoding), with the best budget per
   concurrency level and τ per budget (where Serve's load-aware policy starts) and the decision's evidence;
4. a head trained here goes through the promotion gate, which decides whether it becomes `champion`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jetflow.errors import InvalidSettingError
from jetflow.sweeps.budget import BudgetSweepConfig, SweepOutcome, SweptHead, run_budget_sweep


@dataclass
class MainJobConfig:
    head: str = ""                     # the head to sweep: folder, name, models:/NAME@ALIAS; "" = the champion
    preset: str = "demo"               # trained first when no head is given and the registry has no champion
    train_workers: int = 1             # Ray Train workers for that training (on a GPU cluster: a GPU each)
    regen_workers: int = 0             # Ray actors regenerating its data (0: the preset's own setting)
    store_best: bool = True            # write the serving setting (and its evidence) onto the head's registry version
    sweep: BudgetSweepConfig = field(default_factory=BudgetSweepConfig)

    def __post_init__(self) -> None:
        from jetflow.train.pipeline import PRESETS

        if self.preset not in PRESETS:
            raise InvalidSettingError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        if self.train_workers < 1 or self.regen_workers < 0:
            raise InvalidSettingError("train_workers must be >= 1 and regen_workers >= 0")


@dataclass
class MainJobOutcome:
    sweep: SweepOutcome
    trained: bool = False              # the head was trained by this job
    stored: bool = False               # the best setting is now the version's tree config
    promotion: str | None = None       # the gate's verdict for a head trained here
    train_seconds: float = 0.0         # training pipeline + registration (0 when the head existed)
    seconds: float = 0.0               # the whole job


def select_head(cfg: MainJobConfig) -> tuple[SweptHead, bool]:
    """(the head to sweep, whether it was trained just now)."""
    from jetflow.head import HeadRef
    from jetflow.tracking import CHAMPION, find_version, registered_model_name, resolve_alias

    target = cfg.sweep.target
    if cfg.head:
        ref = HeadRef.parse(cfg.head)
        if ref.kind in ("none", "random"):
            raise InvalidSettingError("the budget sweep needs a trained head, not a random one or none")
        path = ref.resolve()
        mv = find_version(target, uri=ref.uri, path=path)
        return SweptHead(str(path), ref.uri, (mv.name, str(mv.version)) if mv else None, ref=str(ref)), False
    champ = resolve_alias(target, CHAMPION)
    if champ is not None:
        return SweptHead(str(champ.path), f"models:/{champ.name}@{CHAMPION}", (champ.name, champ.version)), False
    print(f"[main job] no champion registered for {target} ({registered_model_name(target)}): "
          f"training the {cfg.preset!r} preset first", flush=True)
    return train_and_register(cfg.preset, target, cfg.train_workers, cfg.regen_workers), True


def train_and_register(preset: str, target_id: str, workers: int = 1, regen_workers: int = 0) -> SweptHead:
    """Train `preset`, log it as a training run, register it, alias it `challenger`. (The target revision is the
    one the head's config.json records: no target is loaded here, which on a cluster's CPU head matters.)"""
    from jetflow.tracking import CHALLENGER, log_training_run, register_head, registered_model_name, set_alias
    from jetflow.train.pipeline import run_pipeline

    head_dir = run_pipeline(preset, name=preset, model=target_id, workers=workers,
                            regen_overrides={"workers": regen_workers} if regen_workers else None)
    run_id = log_training_run(head_dir, target_id)
    name = registered_model_name(target_id)
    version = register_head(run_id, target_id)
    set_alias(name, CHALLENGER, version)
    return SweptHead(str(head_dir), f"models:/{name}/{version}", (name, version))


def store_tree_profile(sweep: SweepOutcome, registered: tuple[str, str]) -> str | None:
    """Store with the version the head's per-(depth, rank) acceptance profile (depth_rank_histogram and
    class_histogram read it), from the report of the sweep's widest greedy accum_logp trial (else best_first:
    the settings least shaped by a profile of their own). → the tree key it came from, None if no such trial."""
    import mlflow

    from jetflow.tracking import set_tree_profile, tracking_uri
    from jetflow.tree import AcceptanceProfile, TreeSpec
    from jetflow.tree.profile import PROFILE_ALGORITHMS, profile_preference

    rows = [r for r in sweep.rows
            if r["algorithm"] in PROFILE_ALGORITHMS and r["temperature"] == 0 and r.get("mlflow_run_id")]
    if not rows:
        return None
    row = min(rows, key=lambda r: profile_preference(TreeSpec.from_dict(r["tree"])))
    mlflow.set_tracking_uri(tracking_uri())
    report = mlflow.artifacts.load_dict(f"runs:/{row['mlflow_run_id']}/report.json")
    method = report["params"].get("head_method", "causal")
    set_tree_profile(*registered, AcceptanceProfile.from_report(report, method, row["key"]))
    return row["key"]


def run_main_job(cfg: MainJobConfig, ray_address: str | None = None) -> MainJobOutcome:
    from jetflow.cluster import init_ray

    t0 = time.perf_counter()
    init_ray(ray_address)  # first: a tracking server the job cannot use fails it here, in seconds
    from jetflow.tracking import promote, set_serving_evidence, set_serving_profile, set_tree_config
    from jetflow.tree import TreeSpec

    head, trained = select_head(cfg)
    train_seconds = time.perf_counter() - t0 if trained else 0.0
    sweep = run_budget_sweep(cfg.sweep, head)
    out = MainJobOutcome(sweep=sweep, trained=trained, train_seconds=train_seconds)
    # a decision exists only when both passes have every row (`SweepOutcome.complete`); plain decoding when
    # every finalist is slower than AR on some prompt set
    if sweep.complete and sweep.decision and cfg.store_best and head.registered:
        name, version = head.registered
        set_tree_config(name, version, sweep.best_tree or TreeSpec(budget=1))
        if sweep.budget_table:  # what the serving engine's load-aware policy starts from
            set_serving_profile(name, version, sweep.budget_table, sweep.tau_by_budget)
        set_serving_evidence(name, version, sweep.decision)
        store_tree_profile(sweep, head.registered)
        out.stored = True
        if trained:  # the head trained for this job: the gate decides whether it becomes champion
            out.promotion = promote(cfg.sweep.target, head.registered[1], metric=cfg.sweep.select).summary()
    out.seconds = time.perf_counter() - t0
    return out
