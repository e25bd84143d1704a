"""MLflow tracking on a real sqlite store (the default one, under a temporary $JETFLOW_HOME): training and
evaluation runs carry the documented params, metrics, step metrics, tags and artifacts; registered heads
load back bit-identical through `models:/…@champion`; the promotion gate moves `champion` only when the
challenger is lossless and better by the margin on the same eval sets, and otherwise says why."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jetflow.errors import HeadMismatchError, HeadNotFoundError, InvalidSettingError
from jetflow.head import DraftHead, HeadConfig, load_head, save_head
from jetflow.metrics import metric_key, parse_metric_key
from jetflow.tracking import (CHALLENGER, CHAMPION, PREVIOUS_CHAMPION, log_evaluation, log_training_run, plots,
                              promote, register_head, registered_model_name, resolve_alias, resolve_head_uri,
                              set_alias, set_tree_config, tracking_uri)
from jetflow.tree import TreeSpec
from jetflow.tracking.report import validate_report
from jetflow.tracking.store import client, experiment_for

ROOT = Path(__file__).resolve().parents[1]
SETS = ("mtbench", "humaneval")
DEPTH = 3  # block_size 4 → 3 draft depths
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The default store: MLFLOW_TRACKING_URI unset, so sqlite at $JETFLOW_HOME/mlflow.db."""
    home = tmp_path_factory.mktemp("jetflow_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JETFLOW_HOME", str(home))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield home


def make_head(folder: Path, target_id: str, seed: int) -> Path:
    """A tiny causal head folder as jobs/train.py leaves it: weights, config, metrics, provenance,
    train config, and a checkpoints/ folder that must not be logged."""
    torch.manual_seed(seed)
    cfg = HeadConfig(hidden_size=64, vocab_size=128, target_layer_ids=[1, 3], mask_token_id=0,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, block_size=DEPTH + 1, num_target_layers=6,
                     target_model_id=target_id, target_revision="random-r1")
    head = DraftHead(cfg)
    with torch.no_grad():  # the trainer zero-inits some projections; make every tensor seed-specific
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_head(head, folder)
    agree = [0.5 - 0.1 * d for d in range(DEPTH)]
    (folder / "metrics.json").write_text(json.dumps(
        {"train/loss": 3.25, "train/steps": 3, **{f"eval/agree_d{d + 1}": a for d, a in enumerate(agree)},
         "lossless": True}))
    train_cfg = {"name": folder.name, "num_hidden_layers": 1, "lr": 0.0003, "block_size": DEPTH + 1}
    (folder / "train_config.json").write_text(json.dumps(train_cfg))
    (folder / "provenance.json").write_text(json.dumps(
        {"command": "jobs/train.py --preset smoke", "git_commit": "0123abcd" * 5, "git_dirty": False,
         "python": "3.11.7", "packages": {"torch": "2.13.0+cpu", "mlflow": "3.17.2"},
         "data_manifest_sha256": f"{seed:064x}", "data_tokens": 1234, "preset": "smoke",
         "train_config": train_cfg}))
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "step_3.pt").write_bytes(b"optimizer state")
    return folder


def registered(tmp_path: Path, target_id: str, seed: int) -> tuple[str, Path]:
    """(version, head folder) of a freshly trained-logged-registered tiny head."""
    head = make_head(tmp_path / f"head-{seed}", target_id, seed)
    run_id = log_training_run(head, target_id, "random-r1")
    return register_head(run_id, target_id), head


BEST = TreeSpec("accum_logp", 8, 7)


def report(target_id: str, *, uri: str | None = None, path: Path | None = None, sets=SETS,
           speedup: float = 1.5, tau: float = 2.0, lossless: bool | None = True, best: TreeSpec = BEST,
           method: str = "causal") -> dict:
    """A synthetic evaluation report following the contract, for a head of `method`. Its `best` setting
    reaches `speedup` / `tau` on every set; the other settings (chains and accum_logp trees of budget 4
    and 8) are worse."""
    rows, metrics, steps = [], {}, {}
    for s in sets:
        rows.append(dict(dataset=s, method="ar", algorithm=None, budget=1, width=1, temperature=0.0, tau=1.0,
                         tokens_per_s=20.0, speedup_vs_ar=1.0, speedup_vs_hf=1.1, e2e_speedup=1.0,
                         predicted_speedup=None, lossless=None, draft_ms=0.0, verify_ms=45.0, other_ms=2.0))
        specs = dict.fromkeys([TreeSpec(a, b, 7) for a in ("chain", "accum_logp") for b in (4, 8)] + [best])
        for spec in specs:
            sp, t = (speedup, tau) if spec == best else (speedup * 0.8, tau * 0.8)
            rows.append(dict(dataset=s, method=method, algorithm=spec.algorithm, budget=spec.budget,
                             width=spec.width, temperature=0.0, tree=spec.to_dict(), tau=t, tokens_per_s=20.0 * sp,
                             speedup_vs_ar=sp, speedup_vs_hf=sp * 1.1, e2e_speedup=sp * 0.95,
                             predicted_speedup=sp * 1.05, lossless=lossless, draft_ms=5.0, verify_ms=60.0,
                             other_ms=3.0))
            for kind, value in (("tau", t), ("speedup_vs_ar", sp), ("tokens_per_s", 20.0 * sp)):
                metrics[metric_key(kind, s, method, spec, 0.0)] = value
            steps[metric_key("accept_by_depth", s, method, spec, 0.0)] = [0.6, 0.3, 0.1]
    if lossless is not None:
        metrics["lossless"] = float(lossless)
    config = json.loads((path / "config.json").read_text()) if path else None
    return {"target": {"id": target_id, "revision": "random-r1"},
            "head": {"path": str(path) if path else None, "uri": uri, "config": config, "provenance": None},
            "params": {"sets": ",".join(sets), "prompts_per_set": 2, "max_new_tokens": 16, "budgets": "4,8",
                       "check_lossless": True, "head_method": method},
            "metrics": metrics, "step_metrics": steps, "rows": rows,
            "cost_model": {"device": "cpu", "context_tokens": 200, "n": [1, 4, 8], "t_ms": [45.0, 60.0, 78.0]}}


def aliases(target_id: str) -> dict[str, str]:
    return {a: str(v) for a, v in client().get_registered_model(registered_model_name(target_id)).aliases.items()}


def uri_of(target_id: str, version: str) -> str:
    return f"models:/{registered_model_name(target_id)}/{version}"


def run_job(name: str, argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location(f"job_{name}", ROOT / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


# --------------------------------------------------------------------------- store
def test_default_store_is_absolute_sqlite_under_jetflow_home_and_the_env_overrides_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("JETFLOW_HOME", str(tmp_path / "new-home"))
    assert tracking_uri() == f"sqlite:///{tmp_path}/new-home/mlflow.db"
    assert tracking_uri().startswith("sqlite:////")  # absolute: Ray jobs run from a temp cwd
    assert (tmp_path / "new-home").is_dir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri() == "http://127.0.0.1:5999"


def test_a_sqlite_store_elsewhere_keeps_its_artifacts_and_downloads_beside_its_db(tmp_path, monkeypatch):
    # e.g. a test's own db while $JETFLOW_HOME stays the real one (the real target lives there)
    home, elsewhere = tmp_path / "home", tmp_path / "team-store"
    elsewhere.mkdir()
    monkeypatch.setenv("JETFLOW_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{elsewhere / 'shared.db'}")
    version, _ = registered(tmp_path, "elsewhere", seed=6)
    folder = resolve_head_uri(uri_of("elsewhere", version))
    assert folder.is_relative_to(elsewhere / "registry")
    assert (elsewhere / "mlartifacts" / "elsewhere").is_dir()
    assert not (home / "mlartifacts").exists() and not (home / "registry").exists()


# --------------------------------------------------------------------------- training runs
def test_training_run_logs_architecture_data_metrics_by_depth_lineage_and_head_files(store, tmp_path):
    head = make_head(tmp_path / "h", "train-target", seed=1)
    run_id = log_training_run(head, "train-target", "random-r1")
    c = client()
    run = c.get_run(run_id)
    assert (store / "mlflow.db").exists()
    assert run.info.status == "FINISHED"
    assert c.get_experiment(run.info.experiment_id).name == "jetflow/train-target"
    assert run.info.artifact_uri.startswith((store / "mlartifacts").as_uri())

    p = run.data.params
    assert (p["head.num_hidden_layers"], p["head.hidden_size"], p["head.block_size"]) == ("1", "64", "4")
    assert (p["head.causal"], p["head.target_layer_ids"]) == ("True", "[1, 3]")
    assert (p["train.lr"], p["data.manifest_sha256"], p["data.tokens"]) == ("0.0003", f"{1:064x}", "1234")
    m = run.data.metrics
    assert m["train/loss"] == 3.25 and m["lossless"] == 1.0 and m["eval/agree_d2"] == pytest.approx(0.4)
    history = c.get_metric_history(run_id, "eval/agreement_by_depth")
    assert [(h.step, h.value) for h in sorted(history, key=lambda h: h.step)] == \
        [(1, pytest.approx(0.5)), (2, pytest.approx(0.4)), (3, pytest.approx(0.3))]
    t = run.data.tags
    assert (t["jetflow.kind"], t["jetflow.target.id"], t["jetflow.target.revision"]) == \
        ("train", "train-target", "random-r1")
    assert t["jetflow.git_commit"] == "0123abcd" * 5 and t["jetflow.pkg.torch"] == "2.13.0+cpu"
    assert t["jetflow.head.arch"].startswith("causal 1L h64 block4 taps[1,3]")

    logged = {a.path for a in c.list_artifacts(run_id, "head")}
    assert logged == {f"head/{f}" for f in ("config.json", "model.safetensors", "metrics.json",
                                             "provenance.json", "train_config.json")}  # no checkpoints/
    plot = Path(c.download_artifacts(run_id, "plots/agreement_by_depth.png", str(tmp_path)))
    assert plot.read_bytes().startswith(PNG)


def test_training_run_refuses_a_head_of_another_target_or_a_folder_without_a_head(store, tmp_path):
    head = make_head(tmp_path / "h", "target-a", seed=2)
    with pytest.raises(HeadMismatchError, match="trained for target 'target-a'"):
        log_training_run(head, "target-b", "r")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadNotFoundError, match="config.json and model.safetensors"):
        log_training_run(tmp_path / "empty", "target-a", "r")


# --------------------------------------------------------------------------- registry
def test_registered_head_promoted_to_champion_loads_back_identical_with_lineage(store, tmp_path):
    target = "roundtrip"
    version, head = registered(tmp_path, target, seed=3)
    mv = client().get_model_version(registered_model_name(target), version)
    assert mv.source.startswith("runs:/") and mv.source.endswith("/head")
    assert mv.tags["jetflow.train_run_id"] == mv.run_id
    assert mv.tags["jetflow.data.manifest_sha256"] == f"{3:064x}"
    assert mv.tags["jetflow.git_commit"] == "0123abcd" * 5
    assert (mv.tags["jetflow.target.id"], mv.tags["jetflow.target.revision"]) == (target, "random-r1")
    assert "1L h64" in mv.tags["jetflow.head.arch"]

    log_evaluation(report(target, uri=uri_of(target, version), speedup=0.8))
    decision = promote(target, version)  # a head slower than AR on a set is not promoted, even the first one
    assert not decision.promoted and "slower than AR on humaneval (0.80x), mtbench (0.80x)" in decision.reason
    log_evaluation(report(target, uri=uri_of(target, version), speedup=1.2))
    decision = promote(target, version)  # the first lossless head not slower than AR becomes champion
    assert decision.promoted and "no champion yet" in decision.reason
    folder = resolve_head_uri(f"models:/{registered_model_name(target)}@{CHAMPION}")
    assert folder.is_relative_to(store)
    original, loaded = load_file(str(head / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert original.keys() == loaded.keys() and all(torch.equal(original[k], loaded[k]) for k in original)
    assert load_head(folder).config == load_head(head).config

    champ = resolve_alias(target)
    assert (champ.name, champ.version, champ.path, champ.run_id) == \
        (registered_model_name(target), version, folder, mv.run_id)
    assert champ.tree_config is None and champ.metrics["lossless"] == 1.0  # metrics of its eval run
    set_tree_config(champ.name, version, TreeSpec("top2gap", 16, 5, {"margin": 1.5}))
    assert resolve_alias(target).tree_config == TreeSpec("top2gap", 16, 5, {"margin": 1.5})
    tag = client().get_model_version(champ.name, version).tags["jetflow.tree_config"]
    assert json.loads(tag) == {"algorithm": "top2gap", "budget": 16, "width": 5, "params": {"margin": 1.5}}


def test_registry_lookups_and_settings_fail_with_what_to_do(store, tmp_path):
    target = "lookups"
    version, _ = registered(tmp_path, target, seed=4)
    name = registered_model_name(target)
    with pytest.raises(HeadNotFoundError, match="register a head first"):
        resolve_head_uri("models:/no-such-model@champion")
    with pytest.raises(HeadNotFoundError, match=r"no alias 'champion' \(aliases: none\)"):
        resolve_head_uri(f"models:/{name}@{CHAMPION}")
    with pytest.raises(HeadNotFoundError, match="no version 99 .latest is 1"):
        resolve_head_uri(f"models:/{name}/99")
    with pytest.raises(HeadNotFoundError, match="models:/NAME@ALIAS"):
        resolve_head_uri("runs:/abc/head")
    assert resolve_alias("never-registered") is None
    assert resolve_alias(target, CHAMPION) is None
    with pytest.raises(InvalidSettingError, match="promotion gate"):
        set_alias(name, CHAMPION, version)
    set_alias(name, CHALLENGER, version)
    assert resolve_alias(target, CHALLENGER).version == version
    with pytest.raises(InvalidSettingError, match="TreeSpec"):
        set_tree_config(name, version, {"algorithm": "accum_logp", "budget": 8, "width": 7})
    client().set_model_version_tag(name, version, "jetflow.tree_config", '{"algorithm": "beam", "budget": 8}')
    broken = resolve_alias(target, CHALLENGER)  # a stored setting this install cannot read: reported, not served
    assert broken.tree_config is None and "unknown tree algorithm 'beam'" in broken.tree_config_error
    with pytest.raises(HeadNotFoundError):
        register_head("0" * 32, target)


# --------------------------------------------------------------------------- evaluation runs
def test_evaluation_run_has_documented_params_metrics_step_metrics_table_plots_and_lineage(store, tmp_path):
    target = "evaluated"
    version, head = registered(tmp_path, target, seed=5)
    c = client()
    parent = c.create_run(experiment_for(target), run_name="sweep parent").info.run_id
    rep = report(target, path=head)  # a plain path: lineage is found through the weights' sha256
    run_id = log_evaluation(rep, run_name="eval tiny", parent_run_id=parent)
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "eval tiny"

    p = run.data.params
    for key, value in rep["params"].items():
        assert p[key] == str(value)
    assert (p["target.id"], p["target.revision"], p["head.path"]) == (target, "random-r1", str(head))
    assert (p["head.num_hidden_layers"], p["head.causal"]) == ("1", "True")
    assert {k: run.data.metrics[k] for k in rep["metrics"]} == pytest.approx(rep["metrics"])
    key = metric_key("accept_by_depth", "mtbench", "causal", BEST, 0.0)
    history = sorted(c.get_metric_history(run_id, key), key=lambda h: h.step)
    assert [(h.step, h.value) for h in history] == [(1, 0.6), (2, 0.3), (3, 0.1)]

    t = run.data.tags
    assert (t["jetflow.kind"], t["jetflow.eval_sets"], t["mlflow.parentRunId"]) == ("eval", "humaneval,mtbench", parent)
    mv = c.get_model_version(registered_model_name(target), version)
    assert (t["jetflow.head.registered_name"], t["jetflow.head.version"]) == (mv.name, version)
    assert t["jetflow.train_run_id"] == mv.run_id and t["jetflow.head.name"] == f"{head.name} v{version}"
    assert t["jetflow.pkg.mlflow"] == "3.17.2" and "jetflow.git_commit" in t

    art = tmp_path / "art"
    files = {a.path for a in c.list_artifacts(run_id)} | {a.path for a in c.list_artifacts(run_id, "plots")}
    assert {"report.json", "eval_table.json", "eval_table.md", "plots/tau_vs_budget.png",
            "plots/speedup_vs_budget.png", "plots/acceptance_by_depth.png", "plots/verify_cost.png"} <= files
    for png in ("tau_vs_budget", "speedup_vs_budget", "acceptance_by_depth", "verify_cost"):
        assert Path(c.download_artifacts(run_id, f"plots/{png}.png", str(art))).read_bytes().startswith(PNG)
    table = json.loads(Path(c.download_artifacts(run_id, "eval_table.json", str(art))).read_text())
    assert len(table["data"]) == len(rep["rows"]) and "predicted_speedup" in table["columns"]
    md = Path(c.download_artifacts(run_id, "eval_table.md", str(art))).read_text()
    assert md.count("\n") == len(rep["rows"]) + 2


@pytest.mark.parametrize("breakage, match", [
    (lambda r: r.pop("metrics"), "metrics"),
    (lambda r: r["metrics"].update({"tau/mtbench/causal/accum_logp-b8w7-t0.7*": 1.0}), "not valid MLflow keys"),
    (lambda r: r["rows"][0].pop("budget"), r"rows\.0\.budget"),
    (lambda r: r.update(target={"id": "x"}), r"target\.revision"),
])
def test_a_report_that_breaks_the_contract_is_refused_before_anything_is_logged(store, breakage, match):
    target = "contract"
    rep = report(target)
    breakage(rep)
    before = len(client().search_runs([experiment_for(target)]))
    with pytest.raises(InvalidSettingError, match=match):
        log_evaluation(rep)
    assert len(client().search_runs([experiment_for(target)])) == before


def test_metric_keys_round_trip_and_speedup_plot_shows_predicted_beside_measured():
    k = parse_metric_key("speedup_vs_ar/gsm/eval split/causal/top2gap.margin1.5-b16w7-t0.7")
    assert (k.kind, k.dataset, k.method, k.tree, k.temperature) == \
        ("speedup_vs_ar", "gsm/eval split", "causal", TreeSpec("top2gap", 16, 7, {"margin": 1.5}), 0.7)
    assert parse_metric_key("lossless") is None and parse_metric_key("tau/mtbench/ar/t0").tree is None
    assert parse_metric_key("tau/mtbench/causal/beam-b8w7-t0") is None  # an algorithm we do not know
    fig = plots.speedup_vs_budget(validate_report(report("p")).rows)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert sorted(ax.get_title() for ax in panels) == sorted(SETS)
    labels = [line.get_label() for line in panels[0].get_lines()]
    assert "causal accum_logp w7 t0" in labels and "causal accum_logp w7 t0 (predicted)" in labels


# --------------------------------------------------------------------------- promotion gate
@pytest.fixture(scope="module")
def arena(store, tmp_path_factory):
    """Target "gate" with champion v1: lossless, speedup 1.5 and τ 2.0 on mtbench + humaneval."""
    target = "gate"
    version, _ = registered(tmp_path_factory.mktemp("arena"), target, seed=10)
    log_evaluation(report(target, uri=uri_of(target, version)))
    decision = promote(target, version)
    assert decision.promoted and "no champion yet" in decision.reason
    return target, version


def _challenger(tmp_path, target: str, seed: int, **report_kwargs) -> str:
    version, _ = registered(tmp_path, target, seed)
    if report_kwargs.pop("evaluate", True):
        log_evaluation(report(target, uri=uri_of(target, version), **report_kwargs))
    return version


def test_gate_refuses_a_challenger_that_is_not_lossless(arena, tmp_path):
    target, champion = arena
    v = _challenger(tmp_path, target, 11, speedup=3.0, lossless=False)
    d = promote(target, v)
    assert not d.promoted and "not lossless" in d.reason
    assert aliases(target)[CHAMPION] == champion
    assert json.loads(client().get_model_version(d.name, v).tags["jetflow.last_gate"])["promoted"] is False


def test_gate_refuses_a_challenger_within_the_margin_but_promotes_on_tau_when_asked(tmp_path, store):
    target = "margin"
    champion, _ = registered(tmp_path, target, 20)
    log_evaluation(report(target, uri=uri_of(target, champion), speedup=1.5, tau=2.0))
    assert promote(target, champion).promoted
    v = _challenger(tmp_path, target, 21, speedup=1.52, tau=2.4)  # +1.3 % speedup, +20 % τ
    d = promote(target, v, metric="speedup", margin=0.02)
    assert not d.promoted and "does not beat it by the margin 2.0%" in d.reason
    assert (d.challenger_score, d.champion_score) == (pytest.approx(1.52), pytest.approx(1.5))
    assert d.eval_sets == sorted(SETS) and aliases(target)[CHAMPION] == champion
    assert not promote(target, v, metric="tau", margin=0.25).promoted
    d = promote(target, v, metric="tau", margin=0.05)
    assert d.promoted and d.per_set["mtbench"] == {"challenger": pytest.approx(2.4), "champion": pytest.approx(2.0)}
    assert aliases(target) == {CHAMPION: v, PREVIOUS_CHAMPION: champion}


def test_gate_refuses_when_the_eval_sets_differ_or_the_challenger_was_never_evaluated(arena, tmp_path):
    target, champion = arena
    v = _challenger(tmp_path, target, 12, sets=("gsm",), speedup=3.0)
    d = promote(target, v)
    assert not d.promoted and "no evaluation on the same eval sets" in d.reason
    d = promote(target, v, eval_sets=["mtbench"])
    assert not d.promoted and "no speedup on eval sets ['mtbench']" in d.reason
    unevaluated = _challenger(tmp_path, target, 13, evaluate=False)
    d = promote(target, unevaluated)
    assert not d.promoted and "no finished evaluation run" in d.reason
    assert aliases(target)[CHAMPION] == champion


def test_gate_promotes_a_better_lossless_challenger_and_keeps_the_old_champion_reachable(tmp_path, store):
    target = "better"
    old, _ = registered(tmp_path, target, 30)
    log_evaluation(report(target, uri=uri_of(target, old), speedup=1.5))
    assert promote(target, old).promoted
    new = _challenger(tmp_path, target, 31, speedup=1.8)
    set_alias(registered_model_name(target), CHALLENGER, new)
    d = promote(target, CHALLENGER, margin=0.1)  # the alias works as the version
    assert d.promoted and (d.challenger_version, d.champion_version) == (new, old)
    assert "+20.0% > margin 10.0%" in d.reason
    assert aliases(target) == {CHAMPION: new, PREVIOUS_CHAMPION: old}  # challenger alias consumed
    assert resolve_alias(target).version == new and resolve_alias(target, PREVIOUS_CHAMPION).version == old
    assert not promote(target, new).promoted  # already champion


def test_gate_scores_every_tree_algorithm_of_the_head_so_a_top2gap_best_is_promotable(tmp_path, store):
    """The sweep may pick any registered algorithm as best; the gate must see it (it once read only the
    `chain` / `tree` keys, so a top2gap winner was invisible and its head refused)."""
    target = "any-algorithm"
    old, _ = registered(tmp_path, target, 32)
    log_evaluation(report(target, uri=uri_of(target, old), speedup=1.5))
    assert promote(target, old).promoted
    best = TreeSpec("top2gap", 16, 7, {"margin": 1.0})
    new = _challenger(tmp_path, target, 33, speedup=1.8, best=best)  # its other settings: 1.44 < 1.5
    d = promote(target, new, margin=0.1)
    assert d.promoted and d.challenger_score == pytest.approx(1.8), d.reason


def test_gate_scores_only_the_rows_of_the_evaluated_heads_kind(tmp_path, store):
    target = "own-rows"
    v, _ = registered(tmp_path, target, 34)
    rep = report(target, uri=uri_of(target, v), speedup=1.2)
    extra = report(target, speedup=9.0, method="bidirectional")  # a second head measured in the same run
    rep["metrics"].update({k: x for k, x in extra["metrics"].items() if "/bidirectional/" in k})
    log_evaluation(rep)
    d = promote(target, v)
    assert d.promoted and d.challenger_score == pytest.approx(1.2)


def _evidence(setting: str, **speedups) -> dict:
    """A serving decision as the budget sweep stores it (`jetflow.sweeps.budget.decide`)."""
    return {"setting": setting, "tree": TreeSpec("best_first", 4).to_dict(), "select": "speedup",
            "timed_prompts": 6, "timed_repeats": 2, "tau_prompts": 8, "max_new_tokens": 48,
            "sets": {ds: {"speedup": v, "spread": 0.04, "tau": 1.8} for ds, v in speedups.items()},
            "speedup": sum(speedups.values()) / max(1, len(speedups)), "spread": 0.03, "tau": 1.8,
            "runner_up": "accum_logp-b4w7 t0", "lead": 0.1, "lead_spread": 0.04, "decisive": True,
            "finalists": [setting], "losing": {}}


def test_gate_scores_the_sweeps_serving_evidence_and_says_what_stands_behind_each_number(tmp_path, store):
    """With the budget sweep's decision on the version, the gate scores the setting the head would be served
    with (not the best of any run), refuses one served plain, and prints the evidence."""
    from jetflow.tracking import set_serving_evidence

    target = "evidence"
    name = registered_model_name(target)
    plain, _ = registered(tmp_path, target, 50)
    set_serving_evidence(name, plain, {**_evidence("plain"), "losing": {"best_first-b4w7 t0": ["mtbench"]},
                                       "sets": {}})
    log_evaluation(report(target, uri=uri_of(target, plain), speedup=3.0))  # an eval run does not override it
    d = promote(target, plain)
    assert not d.promoted and "would be served with plain decoding" in d.reason
    assert "evidence: serving plain decoding: every timed setting is slower than JetFlow AR on some set " \
           "(best_first-b4w7 t0 on mtbench)" in d.summary()
    first, _ = registered(tmp_path, target, 51)
    set_serving_evidence(name, first, _evidence("best_first-b4w7 t0", mtbench=1.10, humaneval=1.40))
    d = promote(target, first)
    assert d.promoted and d.challenger_score == pytest.approx(1.25)
    text = d.summary()
    assert "mtbench: speedup challenger 1.100 (x JetFlow AR) ± 0.04 (τ 1.80) champion -" in text  # no vLLM timed
    assert "its lead over accum_logp-b4w7 t0 (+0.10) exceeds the run-to-run spread (0.04)" in text
    assert "on 6 prompts per set × 48 tokens, 2 passes" in text
    # the next challenger is compared with the champion's evidence: a mean of 1.25 to beat by the margin
    second, _ = registered(tmp_path, target, 52)
    set_serving_evidence(name, second, _evidence("best_first-b8w7 t0", mtbench=1.05, humaneval=1.60))
    d = promote(target, second, margin=0.02)
    assert d.promoted and d.champion_score == pytest.approx(1.25) and d.champion_run_id is None
    third, _ = registered(tmp_path, target, 53)
    set_serving_evidence(name, third, _evidence("chain-b4w1 t0", mtbench=0.95, humaneval=2.50))
    d = promote(target, third)
    assert not d.promoted and "slower than AR on mtbench (0.95x)" in d.reason
    assert aliases(target)[CHAMPION] == second


def test_gate_rejects_bad_input(arena):
    target, champion = arena
    with pytest.raises(InvalidSettingError, match="speedup, tau"):
        promote(target, champion, metric="bleu")
    with pytest.raises(InvalidSettingError, match="margin"):
        promote(target, champion, margin=-0.1)
    with pytest.raises(HeadNotFoundError, match="no version 999"):
        promote(target, "999")
    with pytest.raises(HeadNotFoundError, match="register a head first"):
        promote("unregistered", "1")


# --------------------------------------------------------------------------- jobs
def test_register_and_promote_jobs_exit_0_promoted_1_refused_2_bad_input(store, tmp_path, capsys):
    target = "jobs"
    head = make_head(tmp_path / "cli-head", target, 40)
    name = registered_model_name(target)
    assert run_job("register", ["--head", str(head), "--alias", "challenger"]) == 0
    assert f"registered {head} as models:/{name}/1 (alias challenger)" in capsys.readouterr().out
    assert run_job("register", ["--head", str(head)]) == 0  # same weights: no duplicate version
    assert f"already registered: {head} as models:/{name}/1" in capsys.readouterr().out
    assert run_job("promote", ["--target", target, "--version", "challenger"]) == 1  # never evaluated
    assert "no finished evaluation run" in capsys.readouterr().out
    log_evaluation(report(target, uri=uri_of(target, "1")))
    assert run_job("promote", ["--target", target, "--version", "1", "--metric", "tau"]) == 0
    out = capsys.readouterr().out
    assert "PROMOTED" in out and f"replicas following {name}@champion serve v1 from their next request" in out
    assert run_job("promote", ["--target", target, "--version", "1"]) == 0  # already champion: nothing to do
    assert "already the champion" in capsys.readouterr().out
    assert len(client().search_model_versions(f"name='{name}'")) == 1
    assert run_job("promote", ["--target", target, "--version", "7"]) == 2
    assert "no version 7" in capsys.readouterr().err
    assert run_job("register", ["--head", str(tmp_path / "missing")]) == 2
