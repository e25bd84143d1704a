"""Per-call decoding statistics. Metrics themselves are defined once, in `jetflow.metrics`."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from jetflow import metrics

PHASES = ("draft", "tree", "verify", "accept")


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    committed_per_round: list[int] = field(default_factory=list)   # tokens committed per verify (bonus incl.)
    accepted_depths: Counter = field(default_factory=Counter)       # d → rounds that accepted exactly d drafts
    accepted_ranks: Counter = field(default_factory=Counter)        # (depth, rank) → accepted nodes
    tree_nodes: list[int] = field(default_factory=list)             # verified nodes per round
    redrafts: int = 0              # rounds with a second head pass (path_conditional_refresh's gate open)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    tree_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    decode_s: float = 0.0          # wall time of all rounds (prefill excluded)
    graphs: str = "off"            # how the steps ran: off (the eager reference) or compile (jetflow.stepcore)
    compile_s: float = 0.0         # seconds of compiling buckets inside this generation's steps (in decode_s)

    @property
    def tau(self) -> float:
        return metrics.tau(self.committed_per_round)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def overhead_s(self) -> float:
        """Round time not spent in the head forward or the target verify forward."""
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput, prefill excluded."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def per_depth_acceptance(self, max_depth: int | None = None) -> list[float]:
        depth = max_depth if max_depth is not None else max(self.accepted_depths, default=0)
        return metrics.per_depth_acceptance(self.accepted_depths, depth)

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        out = DecodeStats()
        for name in ("prompt_tokens", "new_tokens", "rounds", "redrafts", "prefill_s", "draft_s", "tree_s", "verify_s",
                     "accept_s", "decode_s", "compile_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        modes = {st.graphs for st in (self, other) if st.rounds}
        out.graphs = modes.pop() if len(modes) == 1 else "mixed" if modes else self.graphs
        out.committed_per_round = self.committed_per_round + other.committed_per_round
        out.tree_nodes = self.tree_nodes + other.tree_nodes
        out.accepted_depths = self.accepted_depths + other.accepted_depths
        out.accepted_ranks = self.accepted_ranks + other.accepted_ranks
        return out

    def work_digest(self) -> int:
        """What the rounds did, as a 52-bit integer (exact as a float metric): the verified nodes and the tokens
        committed per round and the accepted nodes per (depth, rank). Two settings with the same digest on the
        same prompts verified the same number of nodes and accepted the same tokens in every round: timing
        both measures one decode twice (e.g. every algorithm at budget 2 drafts the same single node)."""
        ranks = sorted(self.accepted_ranks.items())
        text = json.dumps([self.committed_per_round, self.tree_nodes, ranks])
        return int(hashlib.sha1(text.encode()).hexdigest()[:13], 16)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "redrafts": self.redrafts,
            "mean_tree_nodes": round(sum(self.tree_nodes) / len(self.tree_nodes), 2) if self.tree_nodes else 0,
            "accepted_depth_hist": {str(k): v for k, v in sorted(self.accepted_depths.items())},
            "graphs": self.graphs,
            "compile_s": round(self.compile_s, 3),
            "time_s": {
                "prefill": round(self.prefill_s, 5),
                "decode": round(self.decode_s, 5),
                **{p: round(getattr(self, f"{p}_s"), 5) for p in PHASES},
                "overhead": round(self.overhead_s, 5),
            },
        }
