"""Which tree each running request drafts in a step.

- `fixed`: each request's own `DecodeConfig.tree` (capped at the head's block size);
- `plain`: no speculation at all (budget 1 for every row);
- `auto`: load-aware — see `AutoPolicy`.
"""

from __future__ import annotations

from jetflow.tree import TreeSpec

PLAIN = TreeSpec(budget=1)


class FixedPolicy:
    def __init__(self, engine):
        self.block = engine.head.config.block_size if engine.head is not None else None

    def choose(self, rows) -> list[TreeSpec]:
        return [s.cfg.tree.capped(self.block) if self.block else PLAIN for s in rows]

    def observe(self, rows, trees, committed, times) -> None:
        pass


class PlainPolicy(FixedPolicy):
    def choose(self, rows) -> list[TreeSpec]:
        return [PLAIN] * len(rows)


def make_policy(name: str, engine):
    if name == "fixed":
        return FixedPolicy(engine)
    if name == "plain":
        return PlainPolicy(engine)
    from jetflow.engine.auto import AutoPolicy

    return AutoPolicy(engine)
