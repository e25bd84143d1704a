"""Load-aware speculation: each step, plain decoding or the tree budget that the cost model says yields the
most tokens per second for the batch as it is now.

    predicted tokens/s at budget N = Σ_rows τ_row(N) / T(B, N)         (T: `StepCostCurve`, N = 1: plain, τ = 1)

τ_row(N) is the row's own running acceptance (mean tokens committed per step while it speculated at N),
else the engine-wide running mean at N, else the prior (the head's measured τ at N, when known; else an
optimistic 2.0, so the engine tries speculating and learns). An estimate that is not measured yet (prior or
2.0) is capped by the lowest estimate known at a larger budget (measured or prior): a larger tree of the
same rule holds the smaller one (`accum_logp`, `best_first` and `chain` nest exactly), so it accepts at
least as much. Candidates:
plain and the budgets of the per-concurrency table when the head's registry version carries one (the budget
sweep's best per concurrency level), else plain and every measured budget up to the request's own.
Hysteresis: the budget in force changes only when another is predicted better by `margin` for `patience`
steps in a row. While plain, one step in `explore_every` speculates, so the acceptance estimates stay
current: the explored budget rotates over the candidates, and the interval grows with the predicted gap
(plain predicted g x faster than the best tree → every explore_every x min(g^2, 8) plain steps: an
exploration that is predicted to lose much is worth less often). "Off" otherwise costs nothing beyond plain
decoding: no draft, one-token trees.
"""

from __future__ import annotations

from jetflow.engine.policy import PLAIN
from jetflow.tree import TreeSpec

ALPHA = 0.2  # weight of the newest step in the running means


class AutoPolicy:
    def __init__(self, engine, margin: float = 0.05, patience: int = 3, explore_every: int = 64):
        self.engine = engine
        self.curve = engine.cfg.cost_curve
        self.table = {int(k): int(v) for k, v in (engine.cfg.budget_table or {}).items()}
        self.prior = {int(k): float(v) for k, v in (engine.cfg.tau_prior or {}).items()}
        self.block = engine.head.config.block_size if engine.head is not None else None
        self.margin, self.patience, self.explore_every = margin, patience, explore_every
        self.current: int | None = None       # the budget in force (1 = plain)
        self._rival: int | None = None
        self._streak = 0
        self._plain_steps = 0                 # plain steps since the last exploration
        self._explored = 0                    # explorations so far (which candidate is next)
        self.tau_engine: dict[int, float] = {}
        self.tau_row: dict[tuple[str, int], float] = {}
        self.last_choice: int = 1

    # ------------------------------------------------------------------ estimates
    def tau(self, seq, budget: int) -> float:
        if budget <= 1:
            return 1.0
        known = self._known(seq, budget)
        if budget in self.tau_engine:
            return known
        larger = (self._known(seq, n) for n in set(self.tau_engine) | set(self.prior) if n > budget)
        return min([known if known is not None else 2.0] + [t for t in larger if t is not None])

    def _known(self, seq, budget: int) -> float | None:
        """The row's running mean at `budget`, else the engine's, else the prior; None if none."""
        return self.tau_row.get((seq.id, budget), self.tau_engine.get(budget, self.prior.get(budget)))

    def predicted(self, rows, budget: int) -> float:
        """Tokens per ms of this batch at `budget` (1 = plain)."""
        return sum(self.tau(s, budget) for s in rows) / self.curve.step_ms(len(rows), budget)

    def candidates(self, rows) -> list[int]:
        if self.engine.head is None or self.curve is None:
            return [1]
        if self.table:
            level = max((k for k in self.table if k <= len(rows)), default=min(self.table))
            return sorted({1, self.table[level]})
        cap = max(s.cfg.tree.capped(self.block).budget for s in rows)
        return [1] + [n for n in self.curve.nodes if 1 < n <= cap]

    # ------------------------------------------------------------------ the choice
    def choose(self, rows) -> list[TreeSpec]:
        cands = self.candidates(rows)
        if len(cands) == 1:
            budget = cands[0]
        else:
            rates = {n: self.predicted(rows, n) for n in cands}
            best = max(rates, key=rates.get)
            if self.current not in rates:  # first step, or the table/candidates changed under it
                self.current, self._streak = best, 0
            elif best != self.current and rates[best] > rates[self.current] * (1 + self.margin):
                self._streak = self._streak + 1 if best == self._rival else 1
                self._rival = best
                if self._streak >= self.patience:
                    self.current, self._streak = best, 0
            else:
                self._streak = 0
            budget = self.current
            if budget == 1:
                self._plain_steps += 1
                spec = [n for n in cands if n > 1]
                gap = rates[1] / max(rates[n] for n in spec)
                if self._plain_steps >= self.explore_every * min(max(gap, 1.0) ** 2, 8.0):
                    budget = spec[self._explored % len(spec)]  # refresh one estimate, in turn
                    self._explored += 1
                    self._plain_steps = 0
        self.last_choice = budget
        if budget == 1:
            return [PLAIN] * len(rows)
        return [TreeSpec(t.algorithm, budget, t.width, t.params).capped(self.block)
                for t in (s.cfg.tree for s in rows)]

    def observe(self, rows, trees, committed: list[int], times) -> None:
        for seq, tree, c in zip(rows, trees, committed):
            if tree.budget > 1:
                key = (seq.id, tree.budget)
                self.tau_row[key] = c if key not in self.tau_row else (1 - ALPHA) * self.tau_row[key] + ALPHA * c
        spec = [(t.budget, c) for t, c in zip(trees, committed) if t.budget > 1]
        for budget in {b for b, _ in spec}:
            mean = sum(c for b, c in spec if b == budget) / sum(1 for b, _ in spec if b == budget)
            old = self.tau_engine.get(budget)
            self.tau_engine[budget] = mean if old is None else (1 - ALPHA) * old + ALPHA * mean
        live = {s.id for s in rows}
        for key in [k for k in self.tau_row if k[0] not in live]:
            del self.tau_row[key]
