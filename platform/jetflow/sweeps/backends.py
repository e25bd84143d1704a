"""What the budget sweep times beside JetFlow's own decoding: vLLM, where it is installed.

- **The baseline** (timed pass): the speedups users read should be against the fastest plain decoding they could
  run instead — vLLM's AR where vLLM is importable here or the checkout has its venv (.venv-vllm, `make
  setup-vllm`), else JetFlow's own AR loop. Each timed trial runs vLLM AR on its set's timed prompts, same token
  budget, greedy, right after JetFlow's finalists and AR (one engine start per trial; `jetflow.vllm.timing`), so
  every finalist has a speedup vs JetFlow AR (what the tree buys, on our engine) and one vs vLLM AR.
- **The backends** (backend pass, after the decision): tokens/s of JetFlow's serving setting on its engine, vLLM
  AR and vLLM DFlash with the head exported (`jetflow export --to vllm`; a head vLLM cannot run is skipped, with
  the reason), with `backend_concurrency` requests in flight (closed loops, prefill included). The backend whose
  tokens/s have the highest geometric mean over sets and loads is the one the serving setting records.

vLLM never fails the sweep: missing, or failing, it is reported (a logged reason) and JetFlow AR is the baseline.
"""

from __future__ import annotations

import math
from typing import Any

JETFLOW_AR, VLLM_AR = "jetflow_ar", "vllm_ar"
LABELS = {JETFLOW_AR: "JetFlow AR", VLLM_AR: "vLLM AR", "jetflow": "JetFlow", "vllm_dflash": "vLLM DFlash"}
BACKEND_CANDIDATES = ("jetflow", "vllm_ar", "vllm_dflash")


def timed_prompts(target, dataset: str, count: int) -> list[list[int]]:
    """The timed pass's prompts of `dataset`, as `jetflow.eval.compare.evaluate` encodes them."""
    from jetflow.data import spread_prompts
    from jetflow.decode import encode_prompt

    return [encode_prompt(target.tokenizer, it.chat) for it in spread_prompts(dataset, count)][:count]


def _request(target, sweep, prompts: dict, **kw):
    from jetflow.decode import stop_token_ids
    from jetflow.vllm.engine import vllm_dtype
    from jetflow.vllm.regenerate import model_source
    from jetflow.vllm.timing import TimingRequest

    # graphs off: both engines eager (a quick check); else vLLM's default, compiled, as users run it
    return TimingRequest(model=model_source(sweep.target), prompts=prompts, max_new_tokens=sweep.max_new_tokens,
                         stop_ids=sorted(stop_token_ids(target)), dtype=vllm_dtype(target.dtype),
                         enforce_eager=sweep.graphs == "off", **kw)


def vllm_ar_beside(target, dataset: str, label: str, sweep) -> tuple[dict[str, Any], dict | None]:
    """vLLM AR on the timed prompts of `dataset` (one engine start): (the trial's metrics, a report row or None).
    Metrics: `vllm_ar_tokens_per_s` (decode-only, pooled over `timed_repeats` passes), `vllm_ar_run<i>` per pass,
    `vllm_ar_c<N>` (closed loop of N clients, for the backend pass), `vllm_note` (what ran, or why nothing did)."""
    from jetflow.vllm.timing import run_timing

    if sweep.vllm_baseline == "off":
        return {"vllm_note": "vLLM not timed (vllm_baseline off)"}, None
    result = run_timing(_request(target, sweep, {label: timed_prompts(target, dataset, sweep.timed_prompts)},
                                 repeats=sweep.timed_repeats, concurrency=list(sweep.backend_concurrency)),
                        sweep.vllm_python)
    if "error" in result:
        return {"vllm_note": result["error"]}, None
    s = result["sets"][label]
    if not s.get("tokens_per_s"):
        return {"vllm_note": "vLLM AR generated no tokens"}, None
    where = "in the trial's process" if result["runner"] == "in-process" else f"in a child process of {result['runner']}"
    where += f", {result.get('threads', '?')} thread(s), {result.get('bind', 'auto')} core binding"
    metrics = {"vllm_ar_tokens_per_s": s["tokens_per_s"], "vllm_version": result["vllm_version"],
               "vllm_ar_startup_s": result["startup_s"],
               "vllm_note": f"vLLM {result['vllm_version']} AR, {'compiled' if result.get('compiled') else 'eager'}, {where}",
               **{f"vllm_ar_run{i}": p["tokens_per_s"] for i, p in enumerate(s["passes"])},
               **{f"vllm_ar_c{c}": v for c, v in s["throughput"].items()}}
    row = {"dataset": label, "method": VLLM_AR, "algorithm": None, "budget": 1, "width": 1, "temperature": 0.0,
           "tree": None, "tau": 1.0, "tokens_per_s": s["tokens_per_s"], "tokens": sum(map(len, s["token_ids"])),
           "prompts": len(s["token_ids"]), "timing": "decode", "vllm_version": result["vllm_version"]}
    return metrics, row


def add_vllm_row(report: dict, row: dict) -> None:
    """Put vLLM AR's row into a timed trial's report, with its metric (`tokens_per_s/<set>/vllm_ar/t0`), so the
    trial's child run carries it beside ours."""
    from jetflow.metrics import metric_key

    report["rows"].append(row)
    report["metrics"][metric_key("tokens_per_s", row["dataset"], VLLM_AR, None, 0.0)] = float(row["tokens_per_s"])


def baseline_of(timed: dict[str, dict[str, Any]], sweep) -> dict:
    """The baseline the sweep's figures name, from the timed trials' metrics ({set: metrics}): vLLM AR when every
    set has its tokens/s, else JetFlow AR with the reason."""
    notes = {ds: m.get("vllm_note", "") for ds, m in timed.items()}
    measured = {ds: m for ds, m in timed.items() if _finite(m.get("vllm_ar_tokens_per_s"))}
    out: dict = {"sets": {}}
    for ds, m in timed.items():
        v, j = m.get("vllm_ar_tokens_per_s"), m.get("ar_tokens_per_s")
        out["sets"][ds] = {"jetflow_ar_tokens_per_s": j if _finite(j) else None,
                           "vllm_ar_tokens_per_s": v if _finite(v) else None,
                           "jetflow_ar_vs_vllm_ar": j / v if _finite(j) and _finite(v) and v > 0 else None}
    if timed and len(measured) == len(timed):
        versions = sorted({str(m.get("vllm_version")) for m in measured.values()})
        out.update(name=VLLM_AR, label=LABELS[VLLM_AR], vllm_version=versions[0] if len(versions) == 1 else versions,
                   note=next(iter(notes.values())))
    else:
        missing = {ds: notes[ds] for ds in timed if ds not in measured}
        why = "; ".join(sorted(set(missing.values()))) or "no timed trial"
        if sweep.vllm_baseline != "off" and measured:
            why = f"vLLM AR missing on {', '.join(sorted(missing))}: {why}"
        out.update(name=JETFLOW_AR, label=LABELS[JETFLOW_AR], vllm_version=None, note=why)
    return out


# --------------------------------------------------------------------------- the backend pass
def backend_metrics(target, loaded, sweep, serving: dict, export_key: str | None) -> dict[str, Any]:
    """The backend trial: per set, tokens/s with N requests in flight (N in `backend_concurrency`) of JetFlow's
    serving setting on its engine (`jetflow_c<N>@<set>`: `serving["tree"]`, or, per level, the budget of
    `serving["budget_by_concurrency"]`), and of vLLM DFlash with the head exported (`vllm_dflash_c<N>@<set>`,
    one engine for every set), plus `dflash_note` and `dflash_tau` (vLLM's mean acceptance length)."""
    from jetflow.decode import DecodeConfig
    from jetflow.eval.batched import throughput
    from jetflow.eval.compare import dataset_label
    from jetflow.tree import TreeSpec

    levels = sorted(set(sweep.backend_concurrency))
    prompts = {dataset_label(ds): timed_prompts(target, ds, sweep.timed_prompts) for ds in sweep.sets}
    spec = TreeSpec.from_dict(serving["tree"])
    table = {int(k): int(v) for k, v in (serving.get("budget_by_concurrency") or {}).items()}
    out: dict[str, Any] = {}
    for label, ids in prompts.items():
        for c in levels:
            budget = table.get(c, spec.budget)
            tree = TreeSpec(budget=1) if budget <= 1 or spec.plain else TreeSpec.from_dict({**spec.to_dict(),
                                                                                              "budget": budget})
            head = loaded.head if not tree.plain else None
            run = throughput(target, head, ids, DecodeConfig(tree=tree, max_new_tokens=sweep.max_new_tokens), c,
                             graphs=sweep.graphs)
            out[f"jetflow_c{c}@{label}"] = run.tokens_per_s
            out[f"jetflow_budget_c{c}"] = float(tree.budget)
    out.update(_dflash(target, loaded, sweep, prompts, levels, export_key))
    return out


def _dflash(target, loaded, sweep, prompts: dict, levels: list[int], export_key: str | None) -> dict:
    from jetflow.errors import ExportUnsupportedError
    from jetflow.vllm.export import export_cached
    from jetflow.vllm.timing import run_timing, vllm_runner

    if sweep.vllm_baseline == "off":
        return {"dflash_note": "vLLM not timed (vllm_baseline off)"}
    runner, why = vllm_runner(sweep.vllm_python)
    if runner is None:
        return {"dflash_note": why}
    if loaded.path is None:
        return {"dflash_note": "the head has no folder to export (a random head)"}
    try:
        exported = export_cached(loaded.path, export_key,
                                 lm_head=lambda: (target.lm_head_weight.detach().cpu(), target.lm_head_bias))
    except ExportUnsupportedError as exc:
        return {"dflash_note": f"vLLM DFlash skipped: the head cannot export ({exc})"}
    result = run_timing(_request(target, sweep, prompts, repeats=0, concurrency=levels, exported_head=str(exported)),
                        sweep.vllm_python)
    if "error" in result:
        return {"dflash_note": f"vLLM DFlash failed: {result['error']}"}
    out = {"dflash_note": f"vLLM {result['vllm_version']} DFlash, {result['num_speculative_tokens']} speculative "
                          f"tokens, head exported to {exported}"}
    taus = []
    for label, s in result["sets"].items():
        out.update({f"vllm_dflash_c{c}@{label}": v for c, v in s["throughput"].items()})
        if s.get("mean_acceptance_length"):
            taus.append(s["mean_acceptance_length"])
    if taus:
        out["dflash_tau"] = sum(taus) / len(taus)
    return out


def backends_of(backend: dict[str, Any], timed: dict[str, dict[str, Any]], sweep) -> dict:
    """The backend comparison from the backend trial's metrics and the timed trials' (vLLM AR's closed loops):
    {"levels", "sets": {set: {"c<N>": {candidate: tokens/s}}}, "score": {candidate: geometric mean}, "winner",
    "backend": "jetflow" | "vllm", "vllm_mode": "ar" | "dflash" | None, "notes"}. A candidate missing a cell is
    not scored."""
    levels = sorted(set(sweep.backend_concurrency))
    sets: dict[str, dict] = {}
    for ds, m in timed.items():
        sets[ds] = {f"c{c}": {name: value for name, value in (
            ("jetflow", backend.get(f"jetflow_c{c}@{ds}")), ("vllm_ar", m.get(f"vllm_ar_c{c}")),
            ("vllm_dflash", backend.get(f"vllm_dflash_c{c}@{ds}"))) if _finite(value)} for c in levels}
    score = {}
    for name in BACKEND_CANDIDATES:
        cells = [cell.get(name) for per in sets.values() for cell in per.values()]
        if cells and all(_finite(v) and v > 0 for v in cells):
            score[name] = math.exp(sum(math.log(v) for v in cells) / len(cells))
    winner = max(score, key=score.get) if score else "jetflow"
    return {"levels": levels, "sets": sets, "score": score, "winner": winner,
            "backend": "vllm" if winner.startswith("vllm") else "jetflow",
            "vllm_mode": winner.removeprefix("vllm_") if winner.startswith("vllm") else None,
            "jetflow_budget": {str(c): backend.get(f"jetflow_budget_c{c}") for c in levels},
            "dflash_tau": backend.get("dflash_tau"),
            "notes": {"vllm_ar": sorted({m.get("vllm_note", "") for m in timed.values()}),
                      "vllm_dflash": backend.get("dflash_note", "")}}


def backends_text(b: dict) -> str:
    """The backend comparison in a few lines: tokens/s per load (mean over sets), the winner."""
    lines = []
    for c in b["levels"]:
        cells = {name: [per[f"c{c}"].get(name) for per in b["sets"].values()] for name in BACKEND_CANDIDATES}
        parts = [f"{LABELS[n]} {_mean(v):.1f}" for n, v in cells.items() if v and all(_finite(x) for x in v)]
        lines.append(f"{c} in flight: " + (", ".join(parts) if parts else "nothing measured") + " tok/s")
    skipped = [f"{LABELS[n]}: {note}" for n, note in (("vllm_dflash", b["notes"]["vllm_dflash"]),)
               if n not in b["score"] and note]
    skipped += [f"vLLM AR: {'; '.join(b['notes']['vllm_ar'])}" for _ in [0] if "vllm_ar" not in b["score"]]
    won = LABELS[b["winner"]] if b["score"] else "JetFlow (nothing else measured)"
    return ("; ".join(lines) + f" — serving backend: {b['backend']} ({won})"
            + (f" [{'; '.join(skipped)}]" if skipped else ""))


# --------------------------------------------------------------------------- MLflow
def log_backend_run(parent: str | None, metrics: dict, node: str) -> str | None:
    """The backend trial's child run of the sweep's parent: its tokens/s as metrics, what ran as tags."""
    from jetflow.sweeps.budget import BACKENDS_KEY, TRIAL_TAG, drop_earlier_children
    from jetflow.tracking.store import client

    if not parent:
        return None
    c = client()
    run = c.create_run(c.get_run(parent).info.experiment_id, run_name=BACKENDS_KEY, tags={
        "mlflow.parentRunId": parent, TRIAL_TAG: BACKENDS_KEY, "jetflow.sweep.stage": "backends",
        "jetflow.node": node, "jetflow.kind": "backend_pass",
        **{f"jetflow.{k}": str(v)[:5000] for k, v in metrics.items() if isinstance(v, str)}})
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
            c.log_metric(run.info.run_id, k.replace("@", "/"), float(v))
    c.set_terminated(run.info.run_id)
    drop_earlier_children(parent, BACKENDS_KEY, keep=run.info.run_id)
    return run.info.run_id



def log_parent_rows(parent: str, decision: dict) -> None:
    """The parent run's vLLM rows: which baseline the figures name (tags), vLLM AR's and JetFlow AR's tokens/s per
    set, the serving setting against each (metrics), and the backend comparison."""
    from jetflow.tracking.store import client

    c = client()
    tags = {"jetflow.baseline": decision.get("baseline_label", "JetFlow AR"),
            "jetflow.baseline.note": str(decision.get("baseline_note") or "")[:5000],
            "jetflow.vllm.version": str(decision.get("vllm_version") or "none"),
            "jetflow.serving.backend": decision.get("backend", "jetflow")}
    backends = decision.get("backends") or {}
    if backends:
        tags["jetflow.serving.backend.winner"] = backends["winner"]
        tags["jetflow.vllm.dflash.note"] = str(backends["notes"]["vllm_dflash"])[:5000]
    for k, v in tags.items():
        c.set_tag(parent, k, v)
    metrics = {}
    for ds, ar in (decision.get("ar") or {}).items():
        metrics.update({f"{k}/{ds}": v for k, v in ar.items()})
    for ds, ev in (decision.get("sets") or {}).items():
        metrics[f"best_speedup_vs_vllm_ar/{ds}"] = ev.get("speedup_vs_vllm_ar")
    metrics["best_speedup_vs_vllm_ar"] = decision.get("speedup_vs_vllm_ar")
    metrics["speedup_vs_baseline"] = decision.get("speedup_vs_baseline")
    for ds, per in (backends.get("sets") or {}).items():
        for level, cell in per.items():
            metrics.update({f"backend_tokens_per_s/{ds}/{name}/{level}": v for name, v in cell.items()})
    metrics.update({f"backend_score/{name}": v for name, v in (backends.get("score") or {}).items()})
    if backends.get("dflash_tau") is not None:
        metrics["vllm_dflash_tau"] = backends["dflash_tau"]
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
            c.log_metric(parent, k, float(v))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mean(values) -> float:
    vals = [v for v in values if _finite(v)]
    return sum(vals) / len(vals) if vals else math.nan
