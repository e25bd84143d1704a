"""One evaluation run: every method on the same held-out prompts, side by side, as a report dict.

Methods (the report's `method`): `ar` (our AR loop), `hf_generate`, `hf_prompt_lookup` (HF's n-gram
drafter), and our decoder with a head: `causal` (JetFlow) or `bidirectional` (DFlash), each at every
tree setting (`TreeSpec`: algorithm, budget, width) of the grid.

Two passes. The batched pass decodes every prompt of every set on the engine (`batch_size` at a time)
for our methods: τ, per-depth and per-(depth, rank) acceptance and the lossless check cover all prompts.
The timed pass decodes the first `timed_prompts` of each set one at a time with the single-stream decoder
and the HF baselines, interleaved — for each prompt, every method in turn — so machine noise spreads over
all methods instead of hitting one: it gives every speed column; with `timed_repeats` > 1 it runs that many
passes, and each speedup row also carries the speedup of every pass and their spread (max - min), the
run-to-run noise its lead over another setting must exceed. Greedy AR's batched outputs (the lossless
reference) are decoded once per target and prompts in a process. With `concurrency` levels, each of our
settings (and AR) also runs as a closed loop of that many requests on the engine: tokens/s of the replica.

Definitions (metrics from `jetflow.metrics`): times per token are decode-only (prefill excluded)
unless named e2e; speedup_vs_ar / speedup_vs_hf = that baseline's decode time per token ÷ the
method's, at the same temperature; e2e_speedup = the same with prefill included, vs our AR; τ =
tokens per target forward (HF rows: new tokens ÷ model forwards, the prefill's forward counted, since
it yields the first token). Time split (draft / verify / other) in ms per generated token; HF rows:
verify = time inside the model's forwards, other = the rest of `generate` (prompt-lookup's candidate
search included). predicted_speedup = the cost model at the row's τ, mean verified tree size and
measured draft ms per round. lossless (greedy only): our AR row vs HF greedy (timed prompts); every other
row vs our AR (all prompts); "identical" allows a first difference only at an fp32 tie of the target's
top-2 logits (`jetflow.decode.lossless`).
The flat `lossless` metric covers our own methods (AR vs HF included), not HF prompt lookup.
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from jetflow import metrics
from jetflow.decode import DecodeConfig, DecodeStats, Generation, encode_prompt
from jetflow.engine.single import decoder_for
from jetflow.errors import InvalidSettingError
from jetflow.eval.baselines import HFRun, hf_generate
from jetflow.eval.config import EvalConfig  # noqa: F401  (its old import path)
from jetflow.eval.cost_model import CostCurve, measure_verify_curve
from jetflow.head import LoadedHead
from jetflow.metrics import head_method, metric_key
from jetflow.tree import TreeSpec, setting_key


HF_METHODS = ("hf_generate", "hf_prompt_lookup")


@dataclass(frozen=True)
class Setting:
    """One method at one tree setting and temperature; `head` indexes the evaluated heads (None: a baseline)."""

    method: str
    tree: TreeSpec | None
    temperature: float
    head: int | None = None

    def key(self, kind: str, dataset: str) -> str:
        """The metric key, e.g. `tau/mtbench/causal/accum_logp-b32w7-t0` (`jetflow.tracking.report`)."""
        return metric_key(kind, dataset, self.method, self.tree, self.temperature)


def dataset_label(name: str) -> str:
    """A registered set's name, or a JSONL file's stem made safe for MLflow metric keys."""
    if "/" not in name and not name.endswith(".jsonl"):
        return name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", Path(name).stem) or "prompts"


def settings_for(cfg: EvalConfig, heads: Sequence[LoadedHead]) -> list[Setting]:
    """Every (method, setting) the run measures, baselines first, duplicates removed (a chain ignores
    width and is capped at the head's block size)."""
    out: list[Setting] = []
    for t in cfg.temperatures:
        out.append(Setting("ar", None, t))
        if cfg.baselines:
            out += [Setting("hf_generate", None, t), Setting("hf_prompt_lookup", None, t)]
        for i, h in enumerate(heads):
            out += [Setting(head_method(h.causal), spec, t, i) for spec in cfg.trees(h.head.config.block_size)]
    return list(dict.fromkeys(out))


@dataclass
class _Tally:
    """Sums over a set's prompts for one setting. Seconds; tokens."""

    tokens: int = 0            # generated tokens
    decode_tokens: int = 0     # tokens produced by decode steps (HF: the prefill's first token excluded)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0       # head forward + tree build
    verify_s: float = 0.0
    forwards: int = 0          # target forwards that produced tokens
    stats: DecodeStats | None = None
    outputs: list[list[int]] = field(default_factory=list)

    def add_generation(self, g: Generation) -> None:
        s = g.stats
        self.tokens += s.new_tokens
        self.decode_tokens += s.new_tokens
        self.prefill_s += s.prefill_s
        self.decode_s += s.decode_s
        self.draft_s += s.draft_s + s.tree_s
        self.verify_s += s.verify_s
        self.forwards += s.rounds
        self.stats = s if self.stats is None else self.stats.merge(s)
        self.outputs.append(list(g.token_ids))

    def add_hf(self, r: HFRun) -> None:
        self.tokens += len(r.token_ids)
        self.decode_tokens += r.decode_tokens
        self.prefill_s += r.prefill_s
        self.decode_s += r.decode_s
        self.verify_s += r.forward_s
        self.forwards += r.forwards
        self.outputs.append(list(r.token_ids))

    @property
    def decode_s_per_token(self) -> float:
        return self.decode_s / self.decode_tokens if self.decode_tokens else math.nan

    @property
    def total_s_per_token(self) -> float:
        return (self.prefill_s + self.decode_s) / self.tokens if self.tokens else math.nan

    def per_token_ms(self, seconds: float) -> float:
        return seconds / self.decode_tokens * 1000 if self.decode_tokens else math.nan


class _Runner:
    """Runs one Setting on one prompt with the right decoder or HF call."""

    def __init__(self, target, heads: Sequence[LoadedHead], cfg: EvalConfig):
        self.target, self.cfg = target, cfg
        self.ar = decoder_for(target, None, cfg.graphs)
        self.spec = [decoder_for(target, h.head, cfg.graphs) for h in heads]

    def _decoder(self, s: Setting):
        return self.ar if s.head is None else self.spec[s.head]

    def warm(self, s: Setting, prompt_len: int) -> None:
        """graphs=compile: compile the graphs `s` runs, untimed."""
        if s.method not in HF_METHODS:
            self._decoder(s).warm(prompt_len, DecodeConfig(tree=s.tree or TreeSpec(budget=1),
                                                           max_new_tokens=self.cfg.max_new_tokens))

    @property
    def compile_s(self) -> float:
        return sum(d.compile_s for d in [self.ar, *self.spec])

    @property
    def graphs(self) -> tuple[str, str]:
        """(how the timed decodes ran — compile, off or mixed —, why): `graphs=auto` resolved on this host."""
        modes = {d.graphs for d in [self.ar, *self.spec]}
        mode = modes.pop() if len(modes) == 1 else "mixed"
        return mode, "; ".join(sorted({d.graphs_reason for d in [self.ar, *self.spec]}))

    def __call__(self, s: Setting, ids: list[int], seed: int, max_new_tokens: int,
                 task: str | None = None) -> Generation | HFRun:
        sampled = s.temperature > 0
        if s.method in HF_METHODS:
            lookup = self.cfg.prompt_lookup_num_tokens if s.method == "hf_prompt_lookup" else None
            return hf_generate(self.target, ids, max_new_tokens, s.temperature, seed if sampled else None, lookup)
        decoder = self._decoder(s)
        dc = DecodeConfig(tree=s.tree or TreeSpec(budget=1), temperature=s.temperature,
                          max_new_tokens=max_new_tokens, seed=seed if sampled else None)
        return decoder.generate(ids, dc, task=task)  # the prompt set's name: the routers' task label


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def evaluate(target, heads: Sequence[LoadedHead] = (), cfg: EvalConfig | None = None,
             progress: bool = False) -> dict:
    """Measure every setting of `cfg` for `heads` (at most one causal and one bidirectional; none =
    baselines only) on `target`, on the same prompts; return the report dict of the evaluation
    contract (see the module docstring for definitions), plus `rank_acceptance`
    ({key: {"d,r": fraction of rounds}}), `heads` (every head's entry) and `created_at`."""
    from tqdm.auto import tqdm

    from jetflow.data import spread_prompts

    cfg = cfg or EvalConfig()
    heads = list(heads)
    if len(heads) > 2 or len({h.causal for h in heads}) < len(heads):
        raise InvalidSettingError("evaluate at most one causal and one bidirectional head per run")
    settings = settings_for(cfg, heads)
    labels = [dataset_label(name) for name in cfg.sets]
    if len(set(labels)) < len(labels):
        raise InvalidSettingError(f"prompt sets {cfg.sets} share a name ({labels}); rename the JSONL files")
    prompts = {dataset_label(name): [encode_prompt(target.tokenizer, it.chat)
                                     for it in spread_prompts(name, cfg.prompts_per_set)]
               for name in cfg.sets}
    empty = [name for name, label in zip(cfg.sets, labels) if not prompts[label]]
    if empty:
        raise InvalidSettingError(f"prompt set(s) {empty} hold no eval prompts; give sets with prompts")

    curve: CostCurve | None = None
    if cfg.cost_model:
        sizes = {s.tree.budget for s in settings if s.head is not None}
        curve = measure_verify_curve(target, sorted(sizes | {1}), cfg.context_tokens, cfg.curve_repeats,
                                     head=heads[0].head if heads else None)

    batched, thru = _batched_pass(target, heads, settings, prompts, cfg, progress)
    timed_prompts = {ds: ps[: cfg.timed_prompts] for ds, ps in prompts.items()}
    run = _Runner(target, heads, cfg)
    tallies: dict[tuple[str, Setting], _Tally] = {}
    passes: list[dict[tuple[str, Setting], _Tally]] = []  # the same, per pass of the timed pass
    if cfg.timed_prompts:
        # Warm-up (unmeasured), once per decoder / HF mode: first calls pay one-off costs (allocator
        # growth, HF generation setup) that would otherwise land on whichever setting runs first.
        first = next(p for ps in prompts.values() for p in ps)
        longest = max(len(p) for ps in timed_prompts.values() for p in ps)
        for s in settings:  # graphs=compile: the graphs the timed pass runs, compiled before the clock starts
            run.warm(s, longest)
        for s in {(s.method, s.head): s for s in reversed(settings)}.values():
            run(s, first, cfg.seed, min(4, cfg.max_new_tokens))
        total = sum(len(p) for p in timed_prompts.values()) * len(settings) * cfg.timed_repeats
        with tqdm(total=total, desc="evaluate (timed)", disable=not progress) as bar:
            for _ in range(cfg.timed_repeats):
                passes.append({})
                for ds, ids_list in timed_prompts.items():
                    for i, ids in enumerate(ids_list):
                        for s in settings:
                            out = run(s, ids, cfg.seed + i, cfg.max_new_tokens, task=ds)
                            for tally in (tallies.setdefault((ds, s), _Tally()), passes[-1].setdefault((ds, s), _Tally())):
                                if isinstance(out, Generation):
                                    tally.add_generation(out)
                                else:
                                    tally.add_hf(out)
                            bar.update(1)

    report: dict = {
        "target": {"id": target.model_id, "revision": target.revision},
        "head": heads[0].describe() if heads else {"path": None, "uri": None, "config": None, "provenance": None},
        "heads": [h.describe() for h in heads],
        "params": {**cfg.params(), **({"head_method": head_method(heads[0].causal)} if heads else {})},
        "metrics": {},
        "step_metrics": {},
        "rows": [],
        "rank_acceptance": {},
        "cost_model": curve.to_dict() if curve is not None else None,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    lossless_all: list[bool] = []
    for ds in prompts:
        for s in settings:
            row, lossless_counts = _row(ds, s, tallies, batched, thru, cfg, curve, target, prompts[ds])
            if len(passes) > 1 and s.method != "ar":  # the speedup of each pass, and their spread
                runs = [_speedup_vs_ar(p.get((ds, s)), p.get((ds, Setting("ar", None, s.temperature))))
                        for p in passes]
                if all(_finite(r) for r in runs):
                    row["speedup_runs"], row["speedup_spread"] = runs, max(runs) - min(runs)
            report["rows"].append(row)
            if lossless_counts and row["lossless"] is not None:
                lossless_all.append(row["lossless"])
            for name in ("tau", "speedup_vs_ar", "speedup_vs_hf", "e2e_speedup", "tokens_per_s", "predicted_speedup",
                         "speedup_spread"):
                if _finite(row.get(name)):
                    report["metrics"][s.key(name, ds)] = float(row[name])
            for c, value in (row.get("throughput") or {}).items():
                report["metrics"][s.key(f"tokens_per_s_c{c}", ds)] = float(value)
                if c in row["speedup_at"]:
                    report["metrics"][s.key(f"speedup_c{c}", ds)] = float(row["speedup_at"][c])
            stats = _merged(batched.get((ds, s)))
            if s.head is not None and stats is not None:
                report["step_metrics"][s.key("accept_by_depth", ds)] = stats.per_depth_acceptance(
                    heads[s.head].head.config.depth)
                report["rank_acceptance"][f"{ds}/{s.method}/{setting_key(s.tree, s.temperature)}"] = {
                    f"{d},{r}": round(f, 6)
                    for (d, r), f in metrics.per_rank_acceptance(stats.accepted_ranks, stats.rounds).items()}
    if lossless_all:
        report["metrics"]["lossless"] = float(all(lossless_all))
    report["metrics"]["compile_s"] = run.compile_s  # graphs=compile: seconds compiling before the timed pass
    report["params"]["graphs_resolved"], report["params"]["graphs_reason"] = run.graphs  # what the decodes ran
    if cfg.vllm:
        _add_vllm_rows(report, target, {ds: ps[: max(1, cfg.timed_prompts)] for ds, ps in prompts.items()}, cfg)
    return report


def _add_vllm_rows(report: dict, target, prompts: dict, cfg: EvalConfig) -> None:
    """vLLM's AR (and DFlash chain) rows beside ours (`jetflow.vllm.baseline`): vLLM times generate() whole,
    so its tokens/s compare among its own rows. Same target folder, same precision as ours (fp32 on a CPU)."""
    from jetflow.decode import stop_token_ids
    from jetflow.vllm.baseline import vllm_rows
    from jetflow.vllm.engine import vllm_dtype

    rows = vllm_rows(target.model_id, prompts, sorted(stop_token_ids(target)), cfg.max_new_tokens,
                     exported_head=cfg.vllm_head or None, dtype=vllm_dtype(target.dtype))
    for row in rows:
        report["rows"].append(row)
        for name in ("tau", "tokens_per_s", "speedup_vs_vllm_ar"):
            if _finite(row.get(name)):
                report["metrics"][metric_key(name, row["dataset"], row["method"], None, 0.0)] = float(row[name])


def _configs(s: Setting, n: int, cfg: EvalConfig) -> list[DecodeConfig]:
    sampled = s.temperature > 0
    return [DecodeConfig(tree=s.tree or TreeSpec(budget=1), temperature=s.temperature,
                         max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + i if sampled else None) for i in range(n)]


# Greedy AR outputs of the batched pass, per target object (weakly held) and prompts: the lossless reference
# every evaluation of the same prompts shares (a sweep's trials reuse their worker process), decoded once.
_GREEDY_AR: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _batched_pass(target, heads, settings, prompts, cfg: EvalConfig, progress: bool):
    """{(set, setting): Generations of all its prompts} for our methods, and {(set, setting): {concurrency:
    Throughput}} when concurrency levels are asked for."""
    from tqdm.auto import tqdm

    from jetflow.eval.batched import decode_all, throughput

    ours = [s for s in settings if s.method not in HF_METHODS]  # our AR loop and the heads
    batched, thru = {}, {}
    with tqdm(total=len(ours) * len(prompts), desc="evaluate (batched)", disable=not progress) as bar:
        for ds, ids_list in prompts.items():
            for s in ours:
                head = heads[s.head].head if s.head is not None else None
                if s.method == "ar" and s.temperature == 0:  # deterministic: once per target and prompts
                    key = (cfg.max_new_tokens, cfg.batch_size, ds, tuple(map(tuple, ids_list)))
                    known = _GREEDY_AR.setdefault(target, {})
                    if key not in known:
                        known[key] = decode_all(target, None, ids_list, _configs(s, len(ids_list), cfg),
                                                cfg.batch_size, task=ds, graphs=cfg.graphs)
                    batched[(ds, s)] = known[key]
                else:
                    batched[(ds, s)] = decode_all(target, head, ids_list, _configs(s, len(ids_list), cfg),
                                                  cfg.batch_size, task=ds, graphs=cfg.graphs)
                if cfg.concurrency and s.temperature == 0:
                    thru[(ds, s)] = {c: throughput(target, head, ids_list, _configs(s, 1, cfg)[0], c,
                                                   graphs=cfg.graphs) for c in cfg.concurrency}
                bar.update(1)
    return batched, thru


def _speedup_vs_ar(t: _Tally | None, ar: _Tally | None) -> float:
    if t is None or ar is None or not t.decode_tokens:
        return math.nan
    return metrics.speedup(ar.decode_s_per_token, t.decode_s_per_token)


def _merged(gens) -> DecodeStats | None:
    if not gens:
        return None
    total = DecodeStats()
    for g in gens:
        total = total.merge(g.stats)
    return total


def _row(ds: str, s: Setting, tallies: dict, batched: dict, thru: dict, cfg: EvalConfig,
         curve: CostCurve | None, target, prompts: list[list[int]]) -> tuple[dict, bool]:
    """(the contract's row for one dataset × setting, whether its lossless flag counts overall)."""
    from jetflow.decode.lossless import greedy_equal

    nan = math.nan
    t = tallies.get((ds, s)) or _Tally()
    ar = tallies.get((ds, Setting("ar", None, s.temperature))) or _Tally()
    hf = tallies.get((ds, Setting("hf_generate", None, s.temperature)))
    gens = batched.get((ds, s))
    stats = _merged(gens)
    tau = stats.tau if stats is not None else metrics.tau_from_totals(t.tokens, t.forwards)
    spt = t.decode_s_per_token

    predicted = None
    if curve is not None and s.head is not None and t.stats is not None and t.stats.rounds:
        nodes = sum(t.stats.tree_nodes) / len(t.stats.tree_nodes)
        predicted = curve.predict_speedup(tau, nodes, draft_ms=t.draft_s / t.stats.rounds * 1000)

    lossless = None
    if cfg.check_lossless and s.temperature == 0:
        if s.method == "ar":
            if hf is not None:
                lossless = all(greedy_equal(target, p, ours, theirs)
                               for p, ours, theirs in zip(prompts, t.outputs, hf.outputs))
        elif s.method in HF_METHODS:
            lossless = all(greedy_equal(target, p, theirs, ours)
                           for p, theirs, ours in zip(prompts, t.outputs, ar.outputs)) if t.outputs else None
        else:
            reference = batched[(ds, Setting("ar", None, 0.0))]
            lossless = all(greedy_equal(target, p, g.token_ids, r.token_ids)
                           for p, g, r in zip(prompts, gens, reference))
    budget = (s.tree.budget if s.tree is not None
              else cfg.prompt_lookup_num_tokens + 1 if s.method == "hf_prompt_lookup" else 1)
    row = {
        "dataset": ds, "method": s.method, "algorithm": s.tree.algorithm if s.tree else None, "budget": budget,
        "width": s.tree.width if s.tree else 1, "temperature": s.temperature,
        "tree": s.tree.to_dict() if s.tree else None, "tau": tau,
        "tokens_per_s": t.decode_tokens / t.decode_s if t.decode_s > 0 else nan,
        "speedup_vs_ar": metrics.speedup(ar.decode_s_per_token, spt) if t.decode_tokens else nan,
        "speedup_vs_hf": metrics.speedup(hf.decode_s_per_token, spt) if hf is not None and t.decode_tokens else nan,
        "e2e_speedup": metrics.speedup(ar.total_s_per_token, t.total_s_per_token) if t.tokens else nan,
        "predicted_speedup": predicted, "lossless": lossless,
        "draft_ms": t.per_token_ms(t.draft_s), "verify_ms": t.per_token_ms(t.verify_s),
        "other_ms": t.per_token_ms(t.decode_s - t.draft_s - t.verify_s),
        "tokens": sum(len(g.token_ids) for g in gens) if gens else t.tokens,
        "prompts": len(gens) if gens else len(t.outputs), "timed_prompts": len(t.outputs),
        "work_digest": stats.work_digest() if stats is not None and s.head is not None else None,
    }
    measured = thru.get((ds, s))
    if measured:
        plain = thru.get((ds, Setting("ar", None, s.temperature)), {})
        # keyed by concurrency as text: the report is JSON
        row["throughput"] = {str(c): m.tokens_per_s for c, m in measured.items()}
        row["speedup_at"] = {str(c): m.tokens_per_s / plain[c].tokens_per_s for c, m in measured.items()
                             if c in plain and plain[c].tokens_per_s > 0}
    # NaN (e.g. vs HF with baselines off) becomes None, so the report stays strict JSON
    row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
    return row, s.method != "hf_prompt_lookup"
