"""`DraftTree`: the candidate continuations of one round, root = the anchor (last committed token)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class DraftTree:
    """Nodes in insertion order; parents always precede children; node 0 is the root.

    tokens (N,) token ids; parents (N,) with -1 at the root; depths (N,) (root 0);
    scores (N,) cumulative draft log-prob (root 0.0); ranks (N,) rank of the token among its
    depth's top-W draft tokens (root 0).
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not self.scores:
            self.scores = [0.0] * n
        if not self.ranks:
            self.ranks = [0] * n
        if not (n == len(self.parents) == len(self.depths) == len(self.scores) == len(self.ranks)):
            raise ValueError("DraftTree fields must have equal lengths")
        if n == 0 or self.parents[0] != -1 or self.depths[0] != 0:
            raise ValueError("node 0 must be the root (parent -1, depth 0)")

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        return cls([token], [-1], [0])

    def add(self, token: int, parent: int, score: float = 0.0, rank: int = 0) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        self.ranks.append(rank)
        self.__dict__.pop("children", None)  # invalidate the cached child index
        return len(self.tokens) - 1

    @cached_property
    def children(self) -> list[dict[int, int]]:
        """Per node: token → first child carrying it (a duplicate sibling token counts once)."""
        kids: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, self.size):
            kids[self.parents[i]].setdefault(self.tokens[i], i)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Root-to-node node indices, root first."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_mask(self) -> np.ndarray:
        """(N, N) bool: [i, j] is True iff j is i itself or an ancestor of i."""
        n = self.size
        anc = np.zeros((n, n), dtype=bool)
        for i in range(n):
            p = self.parents[i]
            if p >= 0:
                anc[i, : p + 1] = anc[p, : p + 1]
            anc[i, i] = True
        return anc

    def token_tensor(self, device=None) -> torch.Tensor:
        import torch  # here, not at the top: option classes hold a TreeSpec, and `--help` must not load torch

        return torch.tensor(self.tokens, dtype=torch.long, device=device)

    def depth_tensor(self, device=None) -> torch.Tensor:
        import torch

        return torch.tensor(self.depths, dtype=torch.long, device=device)
