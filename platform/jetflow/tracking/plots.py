"""PNG plots for evaluation runs — τ vs budget, speedup vs budget (predicted beside measured), acceptance
by depth, verify cost — and for sweeps' parent runs: the budget sweep's τ and speedup over budget (and
concurrency) from all its trials, the architecture sweep's simulated τ over steps and per setting.
Figures are built on the Agg canvas directly, so no pyplot global state and no display is involved
(these run inside Ray workers and servers)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from jetflow.metrics import BASELINE_METHODS, parse_metric_key
from jetflow.tracking.report import CostModel, ReportRow


def _grid(n: int, width: float = 4.2, height: float = 3.2) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _series_label(row: ReportRow, method: bool = True) -> str:
    """A line per head method, algorithm (with its parameters), width and temperature; budget is the x axis.
    `method=False` leaves the method out (a sweep measures one head)."""
    spec = row.spec
    head = f"{row.method} " if method else ""
    if spec is None:
        return f"{row.method} t{row.temperature:g}"
    params = "".join(f" {k}={v:g}" for k, v in spec.params)
    width = "" if spec.is_chain else f" w{spec.width}"
    return f"{head}{spec.algorithm}{params}{width} t{row.temperature:g}"


def _by_dataset(rows: Iterable[ReportRow]) -> dict[str, list[ReportRow]]:
    out: dict[str, list[ReportRow]] = defaultdict(list)
    for r in rows:
        out[r.dataset].append(r)
    return dict(sorted(out.items()))


def _reference_line(ax, y: float = 1.0) -> None:
    ax.axhline(y, color="black", linewidth=0.8)
    ax.annotate("AR", (0.01, y), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")


def _log2_ticks(ax, values: Iterable[int]) -> None:
    """A log2 x axis labelled at the measured values themselves, not at powers of two."""
    ax.set_xscale("log", base=2)
    values = sorted(set(values))
    if values:
        ax.set_xticks(values, [str(v) for v in values])
        ax.minorticks_off()


def _versus_budget(rows: Sequence[ReportRow], field: str, ylabel: str, title: str,
                   reference: float | None, predicted: bool = False,
                   series_label: Callable[[ReportRow], str] = _series_label) -> Figure | None:
    """One panel per dataset; a line per `series_label` (method, algorithm, width, temperature) over budget;
    baselines (AR, HF generate, prompt lookup) are measured once per dataset and drawn as horizontal lines."""
    datasets = _by_dataset(r for r in rows if getattr(r, field) is not None)
    if not datasets:
        return None
    fig, axes = _grid(len(datasets))
    for ax, (name, drows) in zip(axes, datasets.items()):
        series: dict[str, list[ReportRow]] = defaultdict(list)
        for r in drows:
            series[series_label(r)].append(r)
        for label, srows in sorted(series.items()):
            srows.sort(key=lambda r: r.budget)
            ys = [getattr(r, field) for r in srows]
            if srows[0].method in BASELINE_METHODS:
                if reference is not None and abs(ys[-1] - reference) < 1e-9:
                    continue  # on the reference line already (AR itself; HF generate's τ = 1)
                ax.axhline(ys[-1], linestyle=":", linewidth=1, color="gray")
                ax.annotate(srows[0].method, (0.01, ys[-1]), xycoords=("axes fraction", "data"),
                            fontsize=7, color="gray", va="bottom")
                continue
            xs = [r.budget for r in srows]
            (line,) = ax.plot(xs, ys, marker="o", label=label)
            pred = [(r.budget, r.predicted_speedup) for r in srows if r.predicted_speedup is not None]
            if predicted and pred:
                ax.plot(*zip(*pred), linestyle="--", marker="x", color=line.get_color(),
                        label=f"{label} (predicted)")
        if reference is not None:
            _reference_line(ax, reference)
        _log2_ticks(ax, (r.budget for r in drows if r.method not in BASELINE_METHODS))
        ax.set_xlabel("budget (tree nodes, root included)")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    return fig


def tau_vs_budget(rows: Sequence[ReportRow]) -> Figure | None:
    """τ (tokens committed per verify, bonus included) against the draft budget."""
    return _versus_budget(rows, "tau", "τ (tokens / verify)", "acceptance length vs budget", reference=1.0)


def speedup_vs_budget(rows: Sequence[ReportRow]) -> Figure | None:
    """Measured speedup over our AR loop against budget, with the cost model's prediction dashed beside it."""
    return _versus_budget(rows, "speedup_vs_ar", "speedup vs AR (×)", "speedup vs budget (dashed: predicted)",
                          reference=1.0, predicted=True)


def acceptance_by_depth(step_metrics: dict[str, Sequence[float]], prefix: str = "accept_by_depth") -> Figure | None:
    """Fraction of rounds whose accepted path reaches depth d (index 0 ↔ depth 1), one panel per dataset."""
    panels: dict[str, list[tuple[str, Sequence[float]]]] = defaultdict(list)
    for key, values in step_metrics.items():
        if not key.startswith(prefix + "/") or not values:
            continue
        parsed = parse_metric_key(key)
        if parsed is None:  # a flat series, e.g. training's eval/agreement_by_depth
            panels[key.removeprefix(prefix + "/")].append(("", values))
        else:
            panels[parsed.dataset].append((f"{parsed.method} {parsed.setting}", values))
    if not panels:
        return None
    fig, axes = _grid(len(panels))
    for ax, (name, series) in zip(axes, sorted(panels.items())):
        for label, values in sorted(series, key=lambda s: s[0]):
            ax.plot(range(1, len(values) + 1), values, marker=".", label=label or None)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("depth")
        ax.set_ylabel("fraction of rounds reaching depth")
        ax.set_ylim(0, 1.02)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if any(label for label, _ in series):
            ax.legend(fontsize=7)
    fig.suptitle("acceptance by depth")
    return fig


def depth_curve(values: Sequence[float], ylabel: str, title: str) -> Figure:
    """A single per-depth curve (index 0 ↔ depth 1), e.g. a training run's top-1 agreement by depth."""
    fig, (ax,) = _grid(1, width=5.0)
    ax.plot(range(1, len(values) + 1), values, marker="o")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("depth")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(1e-3, max(values, default=0) * 1.1))
    ax.grid(alpha=0.3)
    ax.set_title(title)
    return fig


def verify_cost(cost: CostModel) -> Figure:
    """Target verify time (ms) against tree size n, relative to one token."""
    fig, (ax,) = _grid(1, width=5.0)
    ax.plot(cost.n, cost.t_ms, marker="o")
    _log2_ticks(ax, cost.n)
    ax.set_xlabel("tree tokens verified (n)")
    ax.set_ylabel("verify time (ms)")
    ax.set_title(f"verify cost on {cost.device}, {cost.context_tokens} cached tokens")
    ax.grid(alpha=0.3)
    return fig


# --------------------------------------------------------------------------- sweeps' parent runs
def _sweep_rows(rows: Sequence[Mapping[str, Any]]) -> list[ReportRow]:
    """Budget-sweep rows as report rows (speedup → speedup_vs_ar; concurrency kept, 1 when absent)."""
    return [ReportRow(dataset=r["dataset"], method=r.get("method", "head"), algorithm=r["algorithm"],
                      budget=r["budget"], width=r["width"], temperature=r["temperature"], tree=r["tree"],
                      tau=r.get("tau"), speedup_vs_ar=r.get("speedup"), predicted_speedup=r.get("predicted_speedup"),
                      concurrency=int(r.get("concurrency") or 1)) for r in rows]


def _sweep_label(row: ReportRow) -> str:
    return _series_label(row, method=False)


def budget_sweep_figures(rows: Sequence[Mapping[str, Any]]) -> dict[str, Figure]:
    """The budget sweep's picture, for its parent run, from all its trials: {artifact path: figure}.

    A row is one prompt set of one trial: {"tree": TreeSpec.to_dict(), "algorithm", "budget", "width",
    "temperature", "tau", "speedup" (decode speedup vs our AR), "predicted_speedup" (the cost model's, or
    None), "dataset" (the prompt set), "concurrency" (streams decoded at once; absent = 1)}.
    - plots/tau_vs_budget.png, plots/speedup_vs_budget.png: a panel per set, a line per algorithm (with its
      parameters, width and temperature) over budget, at concurrency 1 (else the lowest level measured);
      AR = 1 drawn; the predicted speedup dashed beside the measured one;
    - plots/speedup_vs_concurrency.png, only when more than one concurrency level was measured: a panel
      per set, a line per (setting, budget) over concurrency.
    """
    all_rows = _sweep_rows(rows)
    if not all_rows:
        return {}
    single = min(r.concurrency for r in all_rows)
    at = [r for r in all_rows if r.concurrency == single]
    where = "" if single == 1 else f", concurrency {single}"
    figures = {
        "plots/tau_vs_budget.png": _versus_budget(at, "tau", "τ (tokens / verify)",
                                                  f"budget sweep: acceptance length vs budget{where}", 1.0,
                                                  series_label=_sweep_label),
        "plots/speedup_vs_budget.png": _versus_budget(at, "speedup_vs_ar", "speedup vs AR (×)",
                                                      f"budget sweep: speedup vs budget{where} (dashed: predicted)",
                                                      1.0, predicted=True, series_label=_sweep_label),
    }
    if len({r.concurrency for r in all_rows}) > 1:
        figures["plots/speedup_vs_concurrency.png"] = _speedup_vs_concurrency(all_rows)
    return {path: fig for path, fig in figures.items() if fig is not None}


def _speedup_vs_concurrency(rows: Sequence[ReportRow]) -> Figure | None:
    datasets = _by_dataset(r for r in rows if r.speedup_vs_ar is not None)
    if not datasets:
        return None
    fig, axes = _grid(len(datasets))
    for ax, (name, drows) in zip(axes, datasets.items()):
        series: dict[tuple[str, int], list[ReportRow]] = defaultdict(list)
        for r in drows:
            series[(_sweep_label(r), r.budget)].append(r)
        for (label, budget), srows in sorted(series.items()):
            srows.sort(key=lambda r: r.concurrency)
            ax.plot([r.concurrency for r in srows], [r.speedup_vs_ar for r in srows], marker="o",
                    label=f"{label} b{budget}")
        _reference_line(ax)
        _log2_ticks(ax, (r.concurrency for r in drows))
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("speedup vs AR (×)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("budget sweep: speedup vs concurrency, a line per budget")
    return fig


def arch_sweep_figures(trials: Sequence[Mapping[str, Any]]) -> dict[str, Figure]:
    """The architecture sweep's picture, for its parent run: {artifact path: figure}.

    A trial: {"label": its sampled setting, e.g. "num_hidden_layers=2 causal=True", "steps": [int] (the
    steps of its held-out reports), "tree_tau": [float] and optionally "chain_tau": [float] (simulated τ
    at those steps), "stopped": bool (ASHA stopped it before its last step)}.
    - plots/simulated_tau_over_steps.png: held-out simulated tree τ over training steps, a line per
      trial, ending in an x where ASHA stopped it;
    - plots/final_tau_by_setting.png: each trial's last simulated tree τ (chain τ beside it), best on top;
      stopped trials hatched, with the step they stopped at.
    """
    trials = [t for t in trials if t.get("steps") and t.get("tree_tau")]
    if not trials:
        return {}
    fig, (ax,) = _grid(1, width=7.0, height=4.2)
    for t in sorted(trials, key=lambda t: t["label"]):
        (line,) = ax.plot(t["steps"], t["tree_tau"], marker=".", label=t["label"])
        if t.get("stopped"):
            ax.plot(t["steps"][-1:], t["tree_tau"][-1:], marker="x", markersize=9, color=line.get_color())
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out simulated tree τ")
    ax.set_title("architecture sweep: simulated τ over steps (x: stopped by ASHA)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    over_steps = fig

    ranked = sorted(trials, key=lambda t: t["tree_tau"][-1])
    fig, (ax,) = _grid(1, width=7.0, height=max(2.5, 0.45 * len(ranked) + 1.2))
    ys = range(len(ranked))
    bars = ax.barh([y + 0.2 for y in ys], [t["tree_tau"][-1] for t in ranked], height=0.4)
    chain = [t["chain_tau"][-1] if t.get("chain_tau") else 0.0 for t in ranked]
    chain_bars = ax.barh([y - 0.2 for y in ys], chain, height=0.4, alpha=0.7)
    for bar, t in zip(bars, ranked):
        if t.get("stopped"):
            bar.set_hatch("//")
            ax.annotate(f" stopped at step {t['steps'][-1]}", (bar.get_width(), bar.get_y() + 0.2), fontsize=7,
                        va="center")
    ax.set_yticks(list(ys), [t["label"] for t in ranked], fontsize=7)
    ax.set_xlabel("held-out simulated τ at the trial's last report")
    ax.set_title("architecture sweep: final τ per setting")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(handles=[Patch(color=bars[0].get_facecolor(), label="tree τ"),
                       Patch(color=chain_bars[0].get_facecolor(), label="chain τ")], fontsize=7, loc="lower right")
    return {"plots/simulated_tau_over_steps.png": over_steps, "plots/final_tau_by_setting.png": fig}
