"""`TreeSpec`: the one typed tree setting — algorithm, budget, width and the algorithm's parameters —
validated once, here, with the one budget ceiling and the one set of defaults. Every layer that carries a
tree setting (decoder config, evaluation and sweep grids, the registry tag, the served config) holds a
`TreeSpec`; its `key` names the setting in reports, MLflow metric keys, the promotion gate and the registry.

Temperature is not part of a tree: it belongs to sampling (`DecodeConfig`), and a measured setting's key
adds it (`setting_key`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from jetflow.errors import InvalidSettingError
from jetflow.tree.build import TREE_BUILDERS

MAX_BUDGET = 4096            # tree nodes per round (root counted); no target verifies more in one pass
MAX_WIDTH = 1024             # top-W draft tokens per depth
DEFAULT_ALGORITHM = "accum_logp"
DEFAULT_BUDGET = 8           # on 2 CPU cores budgets 4-8 are fastest (BENCHMARKS.md); GPUs take far more
DEFAULT_WIDTH = 7            # the paper's W

_NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"  # a parameter value in a key: repr() of a float, without "e+"
_PARAM = re.compile(rf"\.([A-Za-z_]+)({_NUMBER})")
_KEY = re.compile(rf"^(?P<algorithm>[A-Za-z0-9_]+)(?P<params>(?:\.[A-Za-z_]+{_NUMBER})*)-b(?P<budget>\d+)w(?P<width>\d+)$")


def _int_in(name: str, value: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidSettingError(f"{name} must be an integer in {lo}..{hi} ({what}), got {value!r}")
    return value


def check_budget(value: Any) -> int:
    """The budget rule, stated once: an integer in 1..MAX_BUDGET, the root counted (1 = plain decoding)."""
    return _int_in("budget", value, 1, MAX_BUDGET, "tree nodes per round, the root counted; 1 = plain decoding")


def check_width(value: Any) -> int:
    return _int_in("width", value, 1, MAX_WIDTH, "top-W draft tokens per depth")


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise InvalidSettingError(f"tree parameter values are numbers, got {text!r}") from None


@dataclass(frozen=True)
class TreeSpec:
    """A tree setting: `algorithm` (a registered builder), `budget` (nodes per round, root counted),
    `width` (top-W per depth; a chain has width 1), `params` (the algorithm's own parameters, as sorted
    (name, value) pairs; a value equal to the algorithm's default is dropped, so equal trees compare
    equal). A dict is accepted for `params`."""

    algorithm: str = DEFAULT_ALGORITHM  # tree algorithm; with parameters as name:key=value (top2gap:margin=1.5)
    budget: int = DEFAULT_BUDGET        # tree nodes per round, the root counted (1 = plain decoding)
    width: int = DEFAULT_WIDTH          # top-W draft tokens per depth (a chain uses 1)
    params: tuple[tuple[str, float], ...] = field(default=(), metadata={"cli": False})  # from `algorithm`

    def __post_init__(self) -> None:
        algo = TREE_BUILDERS.get(self.algorithm) if isinstance(self.algorithm, str) else None
        if algo is None:
            raise InvalidSettingError(f"unknown tree algorithm {self.algorithm!r}; known: "
                                      f"{', '.join(sorted(TREE_BUILDERS))}")
        check_budget(self.budget)
        check_width(self.width)
        given = dict(self.params) if not isinstance(self.params, Mapping) else dict(self.params)
        unknown = sorted(set(given) - set(algo.params))
        if unknown:
            accepted = ", ".join(f"{k} (default {v:g})" for k, v in algo.params.items()) or "none"
            raise InvalidSettingError(f"tree algorithm {self.algorithm!r} has no parameter {unknown}; "
                                      f"it accepts: {accepted}")
        for k, v in given.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidSettingError(f"tree parameter {k} must be a finite number, got {v!r}")
        algo.check_params({**algo.params, **{k: float(v) for k, v in given.items()}})
        params = tuple(sorted((k, float(v)) for k, v in given.items() if v != algo.params[k]))
        object.__setattr__(self, "params", params)
        if algo.chain:
            object.__setattr__(self, "width", 1)  # a chain drafts the argmax spine whatever the width

    # ------------------------------------------------------------------ derived
    @property
    def is_chain(self) -> bool:
        return TREE_BUILDERS[self.algorithm].chain

    @property
    def plain(self) -> bool:
        """A budget-1 tree is the root alone: plain decoding, nothing drafted."""
        return self.budget == 1

    def options(self) -> dict[str, float]:
        """The algorithm's parameters with defaults filled in."""
        return {**TREE_BUILDERS[self.algorithm].params, **dict(self.params)}

    def capped(self, block_size: int) -> "TreeSpec":
        """The same setting for a head drafting `block_size - 1` depths: a chain has at most `block_size`
        nodes, so a larger chain budget is that one."""
        if self.is_chain and self.budget > block_size:
            return TreeSpec(self.algorithm, block_size, self.width, self.params)
        return self

    @property
    def key(self) -> str:
        """Stable name of the setting: `accum_logp-b32w7`, `chain-b8w1`, `top2gap.margin1.5-b32w7`."""
        # repr: the shortest exact float text; "e+" dropped, as MLflow metric keys allow no "+"
        params = "".join(f".{k}{v!r}".replace("e+", "e") for k, v in self.params)
        return f"{self.algorithm}{params}-b{self.budget}w{self.width}"

    @property
    def algorithm_option(self) -> str:
        """The algorithm with its parameters as option lists write it (`top2gap:margin=1.5`), what
        `parse_algorithm` reads back."""
        return self.algorithm + "".join(f":{k}={v:g}" for k, v in self.params)

    def label(self) -> str:
        """For humans: `accum_logp budget 32 width 7 (margin 1.5)`."""
        extra = f" ({', '.join(f'{k} {v:g}' for k, v in self.params)})" if self.params else ""
        return f"{self.algorithm} budget {self.budget} width {self.width}{extra}"

    @classmethod
    def from_options(cls, algorithm: str = DEFAULT_ALGORITHM, budget: int = DEFAULT_BUDGET,
                     width: int = DEFAULT_WIDTH, params=()) -> "TreeSpec":
        """From command-line options: `algorithm` may carry parameters (`top2gap:margin=1.5`); parameters
        carried over from a base setting are kept only where the algorithm accepts them."""
        name, given = parse_algorithm(algorithm)
        algo = TREE_BUILDERS.get(name)
        kept = {k: v for k, v in dict(params).items() if algo is not None and k in algo.params}
        return cls(name, budget, width, {**kept, **given})

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"algorithm": self.algorithm, "budget": self.budget, "width": self.width}
        if self.params:
            out["params"] = dict(self.params)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TreeSpec":
        if not isinstance(d, Mapping):
            raise InvalidSettingError(f"a tree setting is a JSON object with algorithm, budget, width; got {d!r}")
        unknown = sorted(set(d) - {"algorithm", "budget", "width", "params"})
        if unknown:
            raise InvalidSettingError(f"unknown tree setting fields {unknown}; known: algorithm, budget, width, params")
        return cls(d.get("algorithm", DEFAULT_ALGORITHM), d.get("budget", DEFAULT_BUDGET),
                   d.get("width", DEFAULT_WIDTH), d.get("params") or ())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TreeSpec":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise InvalidSettingError(f"a tree setting must be JSON ({exc.msg}): {text!r}") from None

    @classmethod
    def from_key(cls, key: str) -> "TreeSpec":
        """Inverse of `key`."""
        m = _KEY.match(key)
        if m is None:
            raise InvalidSettingError(f"not a tree setting key: {key!r} (expected e.g. accum_logp-b32w7)")
        params = dict((p[0], _number(p[1])) for p in _PARAM.findall(m["params"]))
        return cls(m["algorithm"], int(m["budget"]), int(m["width"]), params)


def parse_algorithm(text: str) -> tuple[str, dict[str, float]]:
    """`top2gap:margin=1.5` → ("top2gap", {"margin": 1.5}): an algorithm with parameters, as option lists
    write it (`--algorithms accum_logp,top2gap:margin=1.5`)."""
    name, *parts = text.strip().split(":")
    params = {}
    for part in parts:
        k, sep, v = part.partition("=")
        if not sep or not k:
            raise InvalidSettingError(f"algorithm parameters are written name:key=value, got {text!r}")
        params[k.strip()] = _number(v.strip())
    return name.strip(), params


def tree_grid(algorithms: Iterable[str], budgets: Iterable[int], widths: Iterable[int],
              block_size: int | None = None) -> list[TreeSpec]:
    """Every TreeSpec of a grid (algorithms may carry parameters, see `parse_algorithm`), in order,
    duplicates removed — a chain ignores width and, for a head of `block_size`, is capped at it."""
    algorithms, budgets, widths = list(algorithms), list(budgets), list(widths)
    for name, values in (("algorithms", algorithms), ("budgets", budgets), ("widths", widths)):
        if not values or isinstance(values, str):
            raise InvalidSettingError(f"{name} must name at least one value")
    out: list[TreeSpec] = []
    for text in algorithms:
        name, params = parse_algorithm(text) if isinstance(text, str) else (text, {})
        for b in budgets:
            for w in widths:
                spec = TreeSpec(name, b, w, params)
                out.append(spec.capped(block_size) if block_size else spec)
    return list(dict.fromkeys(out))


def setting_key(spec: TreeSpec | None, temperature: float) -> str:
    """A measured setting: the tree's key and the sampling temperature (`accum_logp-b32w7-t0`), or just
    `t0.7` for a method without a tree (the baselines)."""
    t = f"t{float(temperature):g}"
    return f"{spec.key}-{t}" if spec is not None else t
