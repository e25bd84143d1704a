"""PNG plots for evaluation runs: τ vs budget, speedup vs budget (predicted beside measured), acceptance
by depth, verify cost. Figures are built on the Agg canvas directly, so no pyplot global state and no
display is involved (these run inside Ray workers and servers)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
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


def _series_label(row: ReportRow) -> str:
    """A line per head method, algorithm (with its parameters), width and temperature; budget is the x axis."""
    spec = row.spec
    if spec is None:
        return f"{row.method} t{row.temperature:g}"
    params = "".join(f" {k}={v:g}" for k, v in spec.params)
    width = "" if spec.is_chain else f" w{spec.width}"
    return f"{row.method} {spec.algorithm}{params}{width} t{row.temperature:g}"


def _by_dataset(rows: Iterable[ReportRow]) -> dict[str, list[ReportRow]]:
    out: dict[str, list[ReportRow]] = defaultdict(list)
    for r in rows:
        out[r.dataset].append(r)
    return dict(sorted(out.items()))


def _versus_budget(rows: Sequence[ReportRow], field: str, ylabel: str, title: str,
                   reference: float | None, predicted: bool = False) -> Figure | None:
    """One panel per dataset; a line per (method, algorithm, width, temperature) over budget; baselines
    (AR, HF generate, prompt lookup) are measured once per dataset and drawn as horizontal lines."""
    datasets = _by_dataset(r for r in rows if getattr(r, field) is not None)
    if not datasets:
        return None
    fig, axes = _grid(len(datasets))
    for ax, (name, drows) in zip(axes, datasets.items()):
        series: dict[str, list[ReportRow]] = defaultdict(list)
        for r in drows:
            series[_series_label(r)].append(r)
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
            ax.axhline(reference, color="black", linewidth=0.8)
            ax.annotate("AR", (0.01, reference), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
        ax.set_xscale("log", base=2)
        budgets = sorted({r.budget for r in drows if r.method not in BASELINE_METHODS})
        if budgets:  # label the measured budgets themselves, not powers of two
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
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
    ax.set_xscale("log", base=2)
    ax.set_xticks(cost.n, [str(n) for n in cost.n])
    ax.minorticks_off()
    ax.set_xlabel("tree tokens verified (n)")
    ax.set_ylabel("verify time (ms)")
    ax.set_title(f"verify cost on {cost.device}, {cost.context_tokens} cached tokens")
    ax.grid(alpha=0.3)
    return fig
