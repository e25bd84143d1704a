"""`EvalConfig`: what an evaluation measures — prompt sets, the tree grid, temperatures, the timed pass, the
baselines — validated on construction. Imports no torch, so that `jobs/evaluate.py --help` answers fast; the
evaluation itself is `jetflow.eval.compare`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jetflow.decode.config import check_temperature
from jetflow.errors import InvalidSettingError
from jetflow.stepcore.modes import check_graphs
from jetflow.tree import TreeSpec, tree_grid


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise InvalidSettingError(f"{name} must be an integer {bound}, got {value!r}")


@dataclass
class EvalConfig:
    """What to measure. Defaults run on a laptop in a few minutes with a trained head."""

    sets: list[str] = field(default_factory=lambda: ["mtbench", "humaneval"])  # eval splits, or JSONL files
    prompts_per_set: int = field(default=5, metadata={"flags": ("--prompts",)})  # prompts per set, spread
                                             # evenly over its eval split; all decoded batched (τ, lossless)
    timed_prompts: int = 4                   # of those, per set, decoded one at a time for the speed columns
    timed_repeats: int = 1                   # passes of the timed pass over its prompts; > 1 also gives each
                                             # speedup per pass and their spread (max - min): run-to-run noise
    max_new_tokens: int = 64                 # tokens generated per prompt
    batch_size: int = 8                      # requests the engine decodes at once in the batched pass
    concurrency: list[int] = field(default_factory=list)  # also measure tokens/s with this many requests in
                                             # flight (a closed loop on the engine), per setting and AR
    budgets: list[int] = field(default_factory=lambda: [8, 32])       # tree nodes per round, root counted
    widths: list[int] = field(default_factory=lambda: [7])            # top-W per depth (trees; chain uses 1)
    algorithms: list[str] = field(default_factory=lambda: ["accum_logp", "chain"])  # name or name:key=value
    temperatures: list[float] = field(default_factory=lambda: [0.0])  # > 0: sampled, seeded, lossless n/a
    keys: list[str] = field(default_factory=list)  # of the grid, only these tree settings (keys such as
                                             # best_first-b4w7); default: all of them
    baselines: bool = True                   # HF generate + HF prompt lookup rows
    prompt_lookup_num_tokens: int = 10       # HF prompt-lookup candidate tokens per step
    check_lossless: bool = field(default=True, metadata={"flags": ("--lossless-check",)})  # compare greedy
                                             # outputs token by token
    seed: int = 0                            # sampling seed (prompt i uses seed + i) and random-head init
    cost_model: bool = True                  # measure t(N) here and predict each row's speedup
    context_tokens: int = 200                # cached tokens behind the timed verify forwards
    vllm: bool = False                       # also vLLM's own AR rows on the timed prompts (needs vLLM: `make
                                             # setup-vllm` on a CPU, the [vllm] extra on a GPU), and its DFlash
                                             # chain with vllm_head
    vllm_head: str = ""                      # a head exported by `jetflow export --to vllm` for the DFlash row
    curve_repeats: int = 5                   # timed repetitions per tree size (median)
    graphs: str = "auto"                     # how the timed decodes run (timed pass, concurrency loops): off (the
                                             # eager reference), compile (the step core, compiled before timing),
                                             # auto (compile where this host's verdict says it pays)

    def __post_init__(self) -> None:
        from jetflow.data.prompts import PROMPT_SETS

        if isinstance(self.sets, str) or not self.sets:
            raise InvalidSettingError("sets must be a non-empty list of prompt set names or JSONL files")
        for name in self.sets:
            pset = PROMPT_SETS.get(name)
            if pset is None and not Path(name).expanduser().is_file():
                evals = sorted(n for n, p in PROMPT_SETS.items() if "eval" in p.splits)
                raise InvalidSettingError(f"unknown prompt set {name!r}: use one of {', '.join(evals)} "
                                          "or a JSONL file of prompts")
            if pset is not None and "eval" not in pset.splits:
                raise InvalidSettingError(f"prompt set {name!r} has no held-out eval split (it is for training); "
                                          "evaluate on mtbench, humaneval or gsm")
        self.sets = list(dict.fromkeys(self.sets))
        _check_int("prompts_per_set", self.prompts_per_set, 1)
        _check_int("timed_prompts", self.timed_prompts, 0)
        _check_int("timed_repeats", self.timed_repeats, 1, 20)
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("batch_size", self.batch_size, 1)
        for c in self.concurrency:
            _check_int("concurrency", c, 1, 256)
        self.concurrency = sorted(set(self.concurrency))
        grid = tree_grid(self.algorithms, self.budgets, self.widths)  # every tree setting is valid (TreeSpec checks)
        unknown = sorted(set(self.keys) - {t.key for t in grid})
        if unknown:
            raise InvalidSettingError(f"keys {unknown} are not settings of the grid (algorithms × budgets × widths)")
        self.budgets, self.widths = sorted(set(self.budgets)), sorted(set(self.widths))
        self.algorithms = list(dict.fromkeys(self.algorithms))
        if not self.temperatures:
            raise InvalidSettingError("temperatures must name at least one value (0 = greedy)")
        self.temperatures = sorted({check_temperature(t) for t in self.temperatures})
        _check_int("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens, 1, 256)
        _check_int("seed", self.seed, 0)
        _check_int("context_tokens", self.context_tokens, 1)
        _check_int("curve_repeats", self.curve_repeats, 1)
        check_graphs(self.graphs)

    def trees(self, block_size: int | None = None) -> list[TreeSpec]:
        """The grid's tree settings for a head of `block_size` (chains capped at it)."""
        trees = tree_grid(self.algorithms, self.budgets, self.widths, block_size)
        return [t for t in trees if t.key in self.keys] if self.keys else trees

    def params(self) -> dict[str, str | int | float | bool]:
        """Flat MLflow params (lists as comma-separated strings)."""
        return {"sets": ",".join(self.sets), "prompts_per_set": self.prompts_per_set,
                "timed_prompts": self.timed_prompts, "timed_repeats": self.timed_repeats, "batch_size": self.batch_size,
                "concurrency": ",".join(map(str, self.concurrency)),
                "max_new_tokens": self.max_new_tokens, "budgets": ",".join(map(str, self.budgets)),
                "widths": ",".join(map(str, self.widths)), "algorithms": ",".join(self.algorithms),
                **({"keys": ",".join(self.keys)} if self.keys else {}),
                "temperatures": ",".join(f"{t:g}" for t in self.temperatures), "baselines": self.baselines,
                "prompt_lookup_num_tokens": self.prompt_lookup_num_tokens, "check_lossless": self.check_lossless,
                "seed": self.seed, "cost_model": self.cost_model, "context_tokens": self.context_tokens,
                "curve_repeats": self.curve_repeats, "graphs": self.graphs}
