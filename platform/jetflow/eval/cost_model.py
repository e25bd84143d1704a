"""The verify cost model: the target's latency t(N) for verifying an N-node tree on this device, and the
speedup it predicts for any (τ, budget) pair.

    speedup(τ, N) = τ · t(1) / (t(N) + draft_ms + overhead_ms)

AR pays t(1) per token; a speculative round pays one verify of N nodes plus one draft and commits τ
tokens. t(N) is what differs most between machines (nearly flat on an H100 up to N ≈ 128, roughly
linear past N ≈ 8 on two CPU cores), so a curve measured on one device, saved as JSON and loaded
anywhere, projects which budget that device would pick from τ measured elsewhere (greedy τ does not
depend on the device). A GPU run then checks the projection.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from jetflow.errors import InvalidSettingError

# Shape of the synthetic trees timed by `time_verify`: what accum_logp builds from a 16-block head.
_CURVE_DEPTH, _CURVE_WIDTH = 15, 7


@dataclass(frozen=True)
class CostCurve:
    """Verify latency t_ms[i] (milliseconds, median) of feeding n[i] tree nodes to the target against
    `context_tokens` cached tokens on `device`; n ascending and starting at 1 (the AR step).

    draft_ms: the head's draft forward + tree build per round on that device (ms), when measured.
    """

    device: str
    context_tokens: int
    n: tuple[int, ...]
    t_ms: tuple[float, ...]
    draft_ms: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", tuple(int(x) for x in self.n))
        object.__setattr__(self, "t_ms", tuple(float(x) for x in self.t_ms))
        if len(self.n) != len(self.t_ms) or not self.n:
            raise InvalidSettingError(f"a cost curve needs as many t_ms as n values (got {len(self.n)} n, "
                                      f"{len(self.t_ms)} t_ms), at least one")
        if self.n[0] != 1 or any(b <= a for a, b in zip(self.n, self.n[1:])):
            raise InvalidSettingError(f"cost curve n must start at 1 (the AR step) and strictly increase, got {self.n}")
        if any(not math.isfinite(t) or t <= 0 for t in self.t_ms):
            raise InvalidSettingError(f"cost curve t_ms must be positive and finite, got {self.t_ms}")
        if self.draft_ms is not None and (not math.isfinite(self.draft_ms) or self.draft_ms < 0):
            raise InvalidSettingError(f"cost curve draft_ms must be >= 0, got {self.draft_ms}")

    def t(self, n: float) -> float:
        """t(N) in ms, linear between measured points; past the last point it extends the last segment
        (t grows about linearly in N once the GEMMs are compute-bound); below 1 it is t(1)."""
        xs, ys = self.n, self.t_ms
        if n <= xs[0] or len(xs) == 1:
            return ys[0] if n <= xs[0] else ys[-1]
        for i in range(1, len(xs)):
            if n <= xs[i]:
                break
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def predict_speedup(self, tau: float, budget: float, draft_ms: float | None = None,
                        overhead_ms: float = 0.0) -> float:
        """Predicted decode speedup over AR: τ·t(1) / (t(budget) + draft_ms + overhead_ms).

        tau: tokens committed per verify (bonus included); budget: verified nodes per round (the root
        counted; a mean tree size may be fractional); draft_ms: per round, default this curve's own
        measured draft cost (0 if none); budget <= 1 means no drafting (plain AR).
        """
        if budget <= 1:
            draft = 0.0
        else:
            draft = (self.draft_ms or 0.0) if draft_ms is None else draft_ms
        return tau * self.t(1) / (self.t(budget) + draft + overhead_ms)

    def best_budget(self, tau_by_budget: Mapping[int, float], draft_ms: float | None = None,
                    overhead_ms: float = 0.0) -> tuple[int, float]:
        """(budget, predicted speedup) maximizing the prediction over the measured τ per budget."""
        if not tau_by_budget:
            raise InvalidSettingError("best_budget needs τ for at least one budget")
        scored = {b: self.predict_speedup(t, b, draft_ms, overhead_ms) for b, t in tau_by_budget.items()}
        best = max(scored, key=lambda b: (scored[b], -b))  # ties: the smaller budget
        return best, scored[best]

    # --------------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        """The report's `cost_model` entry (lists, JSON-ready)."""
        d = asdict(self)
        d["n"], d["t_ms"] = list(self.n), list(self.t_ms)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "CostCurve":
        try:
            return cls(device=str(d["device"]), context_tokens=int(d["context_tokens"]), n=tuple(d["n"]),
                       t_ms=tuple(d["t_ms"]), draft_ms=d.get("draft_ms"))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidSettingError(f"not a cost curve ({exc.__class__.__name__}: {exc}); it needs device, "
                                      "context_tokens, n and t_ms") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostCurve":
        path = Path(path).expanduser()
        if not path.is_file():
            raise InvalidSettingError(f"no cost curve at {path}; measure one with benchmarks/cost_model.py --save")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise InvalidSettingError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None


# ------------------------------------------------------------------------ measuring
def device_name(device: torch.device) -> str:
    """'NVIDIA H200' for a GPU; 'cpu: <model name>, <k> threads' for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model}, {torch.get_num_threads()} threads"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class VerifyTiming:
    """Median ms of one verify of an n-node tree: body = target layers under the tree mask; verify =
    body + LM head on the `walk_rows` nodes an acceptance walk visits (what the decoder pays);
    naive = body + LM head on all n nodes."""

    n: int
    body_ms: float
    verify_ms: float
    naive_ms: float


@torch.inference_mode()
def time_verify(target, sizes: Sequence[int], context_tokens: int = 200, repeats: int = 7, walk_rows: int = 2,
                variants: Sequence[str] = ("body", "verify", "naive")) -> list[VerifyTiming]:
    """Time the real tree-masked target forward (`TargetModel.forward` + `tree_mask`, as the decoder runs
    it) for each tree size against a cache of `context_tokens` random tokens. Trees are accum_logp trees
    over random per-depth log-probs (depth 15, width 7). Repetitions are interleaved over sizes so
    machine noise spreads evenly instead of hitting one N; the first pass is warm-up. Variants not
    asked for are reported as NaN."""
    from jetflow.tree import TreeSpec, build_tree  # tree/ imports nothing from eval; keep the import local anyway

    if context_tokens < 1:
        raise InvalidSettingError(f"context_tokens must be >= 1, got {context_tokens}")
    dev, vocab = target.device, target.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.forward(torch.randint(0, vocab, (context_tokens,), generator=gen).to(dev),
                   torch.arange(context_tokens, device=dev), cache)
    past = context_tokens
    plans: list[tuple[int, dict[str, Callable[[], object]]]] = []
    for n in sorted({int(s) for s in sizes}):
        if n < 1:
            raise InvalidSettingError(f"tree sizes must be >= 1, got {n}")
        logp = torch.log_softmax(torch.randn(_CURVE_DEPTH, 64, generator=gen) * 3, -1).topk(_CURVE_WIDTH)
        tree = build_tree(TreeSpec("accum_logp", n, _CURVE_WIDTH), 5, logp.values.tolist(),
                          (logp.indices % vocab).tolist())
        ids, pos = tree.token_tensor(dev), tree.depth_tensor(dev) + past
        mask = target.tree_mask(torch.from_numpy(tree.ancestor_mask()).to(dev), past) if tree.size > 1 else None

        def body(ids=ids, pos=pos, mask=mask):
            out = target.forward(ids, pos, cache, mask)
            target.compact_cache(cache, past, torch.arange(0, device=dev))  # leave the cache as found
            return out

        fns = {"body": body,
               "verify": lambda body=body, n=tree.size: target.logits(body().hidden[: min(walk_rows, n)]),
               "naive": lambda body=body: target.logits(body().hidden)}
        plans.append((tree.size, {k: fns[k] for k in variants}))
    samples: dict[tuple[int, str], list[float]] = {(i, k): [] for i, (_, f) in enumerate(plans) for k in f}
    for rep in range(repeats + 1):
        for i, (_, fns) in enumerate(plans):
            for k, fn in fns.items():
                _sync(dev)
                t0 = time.perf_counter()
                fn()
                _sync(dev)
                if rep:
                    samples[(i, k)].append(time.perf_counter() - t0)
    out = []
    for i, (n, fns) in enumerate(plans):
        med = {k: statistics.median(samples[(i, k)]) * 1000 if k in fns else float("nan")
               for k in ("body", "verify", "naive")}
        out.append(VerifyTiming(n, med["body"], med["verify"], med["naive"]))
    return out


@torch.inference_mode()
def measure_draft_ms(target, head, context_tokens: int = 200, budget: int = 32, repeats: int = 21) -> float:
    """Median ms of one draft step: head forward + LM head on D rows + top-W + accum_logp tree build."""
    from jetflow.decode import DecodeConfig, Decoder
    from jetflow.eval.timing import median_ms
    from jetflow.tree import TreeSpec, build_tree

    decoder = Decoder(target, head)
    cfg = DecodeConfig(tree=TreeSpec(budget=budget), max_new_tokens=4)
    ids = [int(t) % target.vocab_size for t in range(100, 100 + context_tokens + 1)]
    state = decoder._prefill(ids, cfg)  # the decoder's own per-call state, as a real round sees it

    def step():
        values, tokens = decoder.draft(state, cfg)
        build_tree(cfg.tree, state.anchor, values, tokens)
        _sync(target.device)

    return median_ms(step, repeats)


def measure_verify_curve(target, budgets: Sequence[int], context_tokens: int = 200, repeats: int = 7,
                         walk_rows: int = 2, head=None) -> CostCurve:
    """t(N) for N in {1} ∪ budgets on this device (what the decoder pays per verify: tree-masked body +
    LM head on `walk_rows` nodes), plus the head's draft cost per round when `head` is given."""
    sizes = sorted({1, *(int(b) for b in budgets)})
    rows = time_verify(target, sizes, context_tokens, repeats, walk_rows, variants=("verify",))
    draft = measure_draft_ms(target, head, context_tokens, budget=max(sizes)) if head is not None else None
    return CostCurve(device=device_name(target.device), context_tokens=context_tokens,
                     n=tuple(r.n for r in rows), t_ms=tuple(r.verify_ms for r in rows), draft_ms=draft)
