"""The engine's cost model: the time of a whole engine step T(B, N) for B running requests that each verify
an N-node tree (N = 1: plain decoding, no draft), measured on this device with the engine's own code.

Why whole steps: the isolated verify latency t(N) of `jetflow.eval.cost_model` under-counts a decoding round
— the draft, the LM head on the walked nodes, the KV compaction and the head-context update come on top —
so predictions from t(N) ran 0.1-0.4x above the measured speedup (BENCHMARKS.md). A step measured end to
end carries all of it; the prediction for B rows at budget N is then

    tokens/s(B, N) = Σ_rows τ_row(N) / T(B, N),        speedup over plain = that / (B / T(B, 1)).

Serving adds prompts: under a closed loop every request also costs its prompt's prefill, the same in every
mode, which dilutes the decode speedup toward 1 as the batch grows (at 8-16 rows on 2 CPU cores a
150-token prompt costs about as much as the request's 64 decoded tokens). `serving_speedup` counts it from
the measured prefill cost per prompt token.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from jetflow.errors import InvalidSettingError


@dataclass(frozen=True)
class StepCostCurve:
    """Median step times ms[i][j] (milliseconds) for batch sizes batch[i] and tree sizes nodes[j] (nodes[0]
    must be 1, plain decoding), with `context` cached tokens per row, on `device`."""

    device: str
    context: int
    batch: tuple[int, ...]
    nodes: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]
    prefill_ms_per_token: float = 0.0    # one prompt of `context` tokens prefilled alone, per token (0: unknown)

    def __post_init__(self) -> None:
        if not self.batch or not self.nodes or self.nodes[0] != 1:
            raise InvalidSettingError("a step cost curve needs batch sizes and tree sizes starting at 1")
        if len(self.ms) != len(self.batch) or any(len(r) != len(self.nodes) for r in self.ms):
            raise InvalidSettingError("step cost curve: ms must have one row per batch size, one column per tree size")
        if any(b2 <= b1 for b1, b2 in zip(self.batch, self.batch[1:])) or \
                any(n2 <= n1 for n1, n2 in zip(self.nodes, self.nodes[1:])):
            raise InvalidSettingError("step cost curve: batch and tree sizes must increase")

    @staticmethod
    def _interp(xs: Sequence[int], x: float) -> tuple[int, int, float]:
        """(i, j, w): x lies between xs[i] and xs[j] with weight w on xs[j]; beyond the ends, the last segment
        is extended (step time grows about linearly in rows and nodes once compute-bound)."""
        if len(xs) == 1:
            return 0, 0, 0.0
        j = next((k for k in range(1, len(xs)) if x <= xs[k]), len(xs) - 1)
        i = j - 1
        return i, j, (x - xs[i]) / (xs[j] - xs[i])

    def step_ms(self, batch: float, nodes: float) -> float:
        """T(B, N) in ms, bilinear between measured points — but never between plain and a tree: a speculative
        step pays the head's draft whatever its tree's size, so a tree smaller than the smallest one measured
        (N between 1 and nodes[1]) costs the smallest tree's time less the verify slope of the next measured
        segment (nodes[1]..nodes[2]), at least a plain step's; with one tree size measured, that tree's time.
        (Interpolated from plain, a 2-node tree at 8 rows came out 35 % cheaper than it is, and the budget table
        and the load-aware policy chose it over plain where plain was faster.)"""
        bi, bj, bw = self._interp(self.batch, batch)
        n = self.nodes
        if len(n) > 1 and 1 < nodes < n[1]:
            def row(r):
                ms = self.ms[r]
                slope = (ms[2] - ms[1]) / (n[2] - n[1]) if len(n) > 2 else 0.0
                return max(ms[0], ms[1] - slope * (n[1] - nodes))
        else:
            ni, nj, nw = self._interp(n, nodes)

            def row(r):
                return self.ms[r][ni] + (self.ms[r][nj] - self.ms[r][ni]) * nw

        return max(1e-3, row(bi) + (row(bj) - row(bi)) * bw)

    def speedup(self, batch: int, nodes: int, tau: float) -> float:
        """Predicted tokens/s of B rows at budget N with mean τ, over plain decoding of the same B rows."""
        return tau * self.step_ms(batch, 1) / self.step_ms(batch, nodes)

    def serving_speedup(self, batch: int, nodes: int, tau: float, prompt_tokens: float, new_tokens: float) -> float:
        """`speedup` for requests that each bring `prompt_tokens` of prompt and ask for `new_tokens`, served B at
        a time: per request, its share of the decode steps (new_tokens / τ steps of B rows) plus its prefill,
        which costs the same with or without speculation."""
        prefill = prompt_tokens * self.prefill_ms_per_token
        plain = new_tokens * self.step_ms(batch, 1) / batch + prefill
        spec = new_tokens / max(tau, 1e-9) * self.step_ms(batch, nodes) / batch + prefill
        return plain / spec

    def to_dict(self) -> dict:
        return {**asdict(self), "batch": list(self.batch), "nodes": list(self.nodes), "ms": [list(r) for r in self.ms]}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCostCurve":
        try:
            return cls(str(d["device"]), int(d["context"]), tuple(d["batch"]), tuple(d["nodes"]),
                       tuple(tuple(float(x) for x in r) for r in d["ms"]), float(d.get("prefill_ms_per_token", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidSettingError(f"not a step cost curve ({exc}); it needs device, context, batch, nodes, ms") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: a process reading the cached curve never sees half of it
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "StepCostCurve":
        return cls.from_dict(json.loads(Path(path).read_text()))


class _SetTree:
    """The measuring engine's policy: every running row drafts the tree set for the coming step."""

    def __init__(self, tree):
        self.tree = tree

    def choose(self, rows) -> list:
        return [self.tree] * len(rows)

    def observe(self, rows, trees, committed, times) -> None:
        pass


def measure_step_curve(target, head, batch: Sequence[int] = (1, 2, 4, 8), nodes: Sequence[int] = (1, 4, 8, 16, 32),
                       context: int = 200, repeats: int = 16, graphs: str = "off") -> StepCostCurve:
    """Time engine steps on this device: per batch size B, one engine with B rows of `context` random tokens
    each — every row drafting an N-node accum_logp tree with `head` (a random head is fine: it is the shapes
    that cost, and a walk that accepts little still pays every forward; with the demo head, these steps and
    its steps on real prompts cost the same within noise). After a warm-up round, `repeats` rounds, each of
    one step per (batch size, tree size): the batch sizes in turn, and within each the tree sizes in turn,
    both orders reversed every other round. Trees keep their size whatever is accepted, so every timed step
    verifies B x N nodes; a point's time is the median of its steps. Every point is measured across the
    whole run, so a process still warming up or a host whose speed drifts weighs on every point alike
    (measured one size after another, plain decoding at one row — the first point — came out 10-25 % slow
    on a noisy host; measured one batch size after another, a 4-row plain step once came out cheaper than a
    2-row one). The prefill cost per prompt token is the median of three single-row prefills of a
    `context`-token prompt. `graphs`: how the engines run their steps (compile: round 0 compiles the graphs)."""
    from jetflow.decode import DecodeConfig
    from jetflow.engine.engine import Engine, EngineConfig
    from jetflow.eval.cost_model import device_name
    from jetflow.tree import TreeSpec

    batch = sorted(set(batch))
    nodes = sorted(set(nodes) | {1}) if head is not None else [1]
    trees = [TreeSpec("accum_logp", n, 7) if n > 1 else TreeSpec(budget=1) for n in nodes]
    vocab = target.vocab_size
    engines, prefill_ms = [], []
    for b in batch:  # every batch size's rows prefilled first; they stay in their engine for the whole run
        policy = _SetTree(trees[0])
        engine = Engine(target, head, EngineConfig(max_slots=b, prefill_chunk=context, prefill_tokens=context * b,
                                                   graphs=graphs), policy=policy)
        cfg = DecodeConfig(tree=trees[-1], max_new_tokens=engine.max_len - context -
                           (head.config.block_size if head else 0) - 2)
        prompts = [[(17 * r + 31 * i + 5) % vocab for i in range(context + 1)] for r in range(b)]
        ids: list[str] = []
        for _ in range(3 if b == 1 else 1):  # one row: three timed prefills, the rows of the last one kept
            for rid in ids:
                engine.cancel(rid)
            ids = [engine.add(p, cfg) for p in prompts]
            seconds = 0.0
            while engine.prefilling or engine.waiting:
                engine.step()  # the prefill phase is timed alone (the step decodes the new rows right after)
                seconds += engine.times.prefill
            if b == 1:
                prefill_ms.append(seconds * 1000 / context)
        engines.append((engine, policy, ids))
    samples = [[[] for _ in nodes] for _ in batch]
    for k in range(repeats + 1):
        order = range(len(batch)) if k % 2 == 0 else reversed(range(len(batch)))
        for i in order:
            engine, policy, _ = engines[i]
            for j in (range(len(nodes)) if k % 2 == 0 else reversed(range(len(nodes)))):
                policy.tree = trees[j]
                t0 = time.perf_counter()
                engine.step()
                if k:  # round 0 warms every shape up
                    samples[i][j].append((time.perf_counter() - t0) * 1000)
    for engine, _, ids in engines:
        for rid in ids:
            engine.cancel(rid)
        engine.step()
    rows_ms = [tuple(statistics.median(ms) for ms in per_size) for per_size in samples]
    return StepCostCurve(device_name(target.device), context, tuple(batch), tuple(nodes), tuple(rows_ms),
                         statistics.median(prefill_ms) if prefill_ms else 0.0)


def cached_step_curve(target, head, max_slots: int, max_budget: int, context: int = 200,
                      graphs: str = "off") -> StepCostCurve:
    """The step cost curve of this target, head shape and device, measured once per machine and kept under
    `$JETFLOW_HOME/cost/` (batch sizes 1, 2, 4, … up to `max_slots`; tree sizes 1, 2, 4, 8, … up to
    `max_budget`): the auto policy of every later engine on this machine starts from it. A curve kept for the same
    target, head shape, device, dtype, threads, context and step mode that measured every batch and tree size
    asked for (and more) is read instead of measuring again: the budget sweep's curve (trees up to its largest
    budget) serves the replica of the head it promotes. `graphs`: the engines' resolved step mode (off or
    compile): each has its own curve."""
    import hashlib

    import torch

    from jetflow.eval.cost_model import device_name
    from jetflow.paths import jetflow_home

    batch = sorted({min(max_slots, 2 ** k) for k in range(0, 8) if 2 ** k <= 2 * max_slots} | {max_slots})
    # 2: the smallest tree (one drafted node) is measured, not inferred: it pays the whole draft
    nodes = sorted({1} | {n for n in (2, 4, 8, 16, 32, 64, 128, 256) if n <= max(max_budget, 4)})
    family = {"target": target.model_id, "revision": target.revision, "device": device_name(target.device),
              "dtype": str(target.dtype), "threads": torch.get_num_threads(), "context": context,
              "head": head.config.to_dict() if head is not None else None,
              "measures": "steps+prefill, batch and tree sizes alternating",  # a curve cached by an older method
              **({"graphs": graphs} if graphs != "off" else {})}                # is re-measured

    def digest(d: dict) -> str:
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    folder, fam = jetflow_home() / "cost", digest(family)
    for path in sorted(folder.glob(f"steps-{fam}-*.json")):
        try:
            curve = StepCostCurve.load(path)
        except (OSError, ValueError, InvalidSettingError):
            continue
        if set(batch) <= set(curve.batch) and set(nodes) <= set(curve.nodes):
            return curve
    curve = measure_step_curve(target, head, batch, nodes, context, graphs=graphs)
    curve.save(folder / f"steps-{fam}-{digest({'batch': batch, 'nodes': nodes})}.json")
    return curve
