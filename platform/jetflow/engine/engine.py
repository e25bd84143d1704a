"""The batched engine: continuous batching of tree speculation across requests.

One `step()` = admit waiting requests into free slots; feed one chunk of their prompts (a long prompt never
holds running streams for more than one chunk); then, for every running request at once: one batched head
forward (its context keys/values cached per slot), one tree per row (budgets may differ: rows are padded to
the step's largest tree), ONE batched target forward under a per-row 4-D mask (own prefix + own tree
ancestry; padding nodes see only themselves), the LM head only on the nodes the acceptance walks visit,
per-row acceptance, KV compaction, commit. Finished and cancelled requests leave at once; their slot is
reused. The reference `Decoder` (one sequence at a time) is what every request's tokens must equal.

Slots: running requests occupy slots [0, R), requests being prefilled [R, R + P), so every forward reads
contiguous rows of the slot KV (views, no copies).

`graphs` (EngineConfig): `off` runs the draft and the verify as above, the eager reference; `compile` runs them in
the step core (`jetflow.stepcore`: one compiled graph per role — verify, LM head, draft — with dynamic shapes,
over a `StaticSlotKV` reserved once; every running row drafted); `auto` compiles where this host's verdict says it
pays, measuring it on first use (`jetflow.engine.calibrate`). Prefill, the tree build, sampling, compaction and
commit stay here, the same code for both.

Host syncs per decode step on a GPU (greedy; counted in this file): the draft's top-k comes to the host once
(`_draft`: values and ids, 2 `.tolist()`), because the tree is built there; each round of the acceptance
walk's LM-head work brings its argmaxes (`_accept`: 1 `.tolist()` per round, rounds ≈ accepted depth ÷ the
row's lookahead, usually 1-2); nothing else reads a device value. The per-row inputs (positions, tree
tokens, masks, accepted paths) go host → device as a handful of small copies per step (built in numpy, one
copy each). A sampled row adds one `multinomial` draw per walked node; a row whose path_conditional_refresh
gate opens, its second head pass's top-k (`_redraft`: 2 `.tolist()`). Rows that asked for logprobs add, together,
2 `.tolist()` per step (and per prefill chunk for prompt logprobs), plus one LM-head GEMM over the path nodes
whose logits the walk did not compute (the step core's device-accepted greedy rows): nobody else pays.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from jetflow.decode import DecodeConfig, Generation, stop_token_ids, target_probs
from jetflow.decode.decoder import commit_tokens, finish_generation, request_tree_context, round_tree_context
from jetflow.decode.logprobs import token_logprobs
from jetflow.engine.kv import RELEASE_ABOVE, SlotKV, StaticSlotKV, TargetKV
from jetflow.engine.sequence import Event, Request, RequestCancelledError, RequestTimeoutError, Seq
from jetflow.errors import InvalidSettingError, PromptTooLongError
from jetflow.head import check_fits
from jetflow.head.copy import copy_inputs
from jetflow.stepcore.modes import check_graphs, resolve_graphs, target_key, verdict_choice
from jetflow.tree import MAX_BUDGET, DraftTree, build_tree, observe, walk, walker


STATIC_MAX_TREE = 512  # tree nodes per round of a graphs=compile engine: its static KV reserves this past max_len


@dataclass
class EngineConfig:
    max_slots: int = 8                   # requests decoded at once (more wait in the queue)
    max_model_len: int | None = None     # prompt + generated tokens per request (default: the target's positions)
    prefill_chunk: int = 128             # prompt tokens fed per request and step (chunked prefill); with a cost
                                         # curve and requests running, a prompt longer than prefill_tokens goes
                                         # in smaller chunks, each costing at most a decode step
    prefill_tokens: int = 256            # prompt tokens fed per step over all admitted requests (rows padded)
    policy: str = "fixed"                # fixed: each request's own tree; plain: no speculation; auto: load-aware
    cost_curve: object = None            # auto: the StepCostCurve of this device (jetflow.engine.cost)
    budget_table: dict | None = None     # auto: {concurrency: budget}, the budget sweep's best per level
    tau_prior: dict | None = None        # auto: {budget: τ} measured for the head, the starting estimates
    graphs: str = "auto"                 # off: the eager reference; compile: the step core's compiled graphs
                                         # (jetflow.stepcore); auto: compile where this host's measurement says
    graphs_backend: str = field(default_factory=lambda: os.environ.get("JETFLOW_GRAPHS_BACKEND", "inductor"))
                                         # torch.compile backend of graphs=compile (tests, debugging: eager,
                                         # aot_eager: dynamo's whole capture, no code generation)

    def __post_init__(self) -> None:
        for name in ("max_slots", "prefill_chunk", "prefill_tokens"):
            if getattr(self, name) < 1:
                raise InvalidSettingError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in ("fixed", "plain", "auto"):
            raise InvalidSettingError(f"policy must be fixed, plain or auto, got {self.policy!r}")
        check_graphs(self.graphs)


@dataclass
class StepTimes:
    """Seconds spent in the last step, by phase (the benchmark and the cost model read them)."""

    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    rows: int = 0
    nodes: int = 0                       # padded tree width of the verify forward
    committed: int = 0


class Engine:
    """Continuous batching of tree speculative decoding for one target and (optionally) one draft head.
    `add` and `cancel` may be called from any thread; `step` from one thread at a time."""

    def __init__(self, target, head=None, config: EngineConfig | None = None, policy=None):
        from jetflow.engine.policy import make_policy

        self.cfg = config or EngineConfig()
        if head is not None:
            check_fits(head.config, target)
            head = head.to(device=target.device, dtype=target.dtype).eval()
        self.target, self.head = target, head
        self.device, self.dtype = target.device, target.dtype
        self.stop_ids = stop_token_ids(target)
        self.max_len = min(self.cfg.max_model_len or target.max_positions, target.max_positions)
        self.layer_ids: tuple[int, ...] = tuple(head.config.target_layer_ids) if head is not None else ()
        if head is not None:
            self.last_ctx = torch.zeros((self.cfg.max_slots, head.config.hidden_size), dtype=self.dtype,
                                        device=self.device)
            self.mask_id = head.config.mask_token_id
        self.graphs, self.graphs_reason = resolve_graphs(self.cfg.graphs, target_key(target, self.cfg.max_slots),
                                                         self.device.type)
        self._build_steps(static=self.graphs in ("compile", "calibrate"))
        self.running: list[Seq] = []
        self.prefilling: list[Seq] = []
        self.waiting: deque[Request] = deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.policy = policy or make_policy(self.cfg.policy, self)
        self.times = StepTimes()
        self.steps = 0
        self.budget_steps: Counter[int] = Counter()  # decode steps by the step's largest tree budget (1: plain)
        self._decode_ms = 0.0                 # wall time of the last decode phase
        self._step_compile_s = 0.0            # seconds the last decode phase spent compiling graphs
        self._walked: list[dict] = []         # the last step's acceptance-walk logits per row (_path_logprobs)
        if self.graphs == "calibrate":  # graphs=auto, no verdict on this host yet: measure now, keep what pays
            from jetflow.engine.calibrate import calibrate_engine

            self.graphs, self.graphs_reason = verdict_choice(calibrate_engine(self))
            if self.graphs == "off":
                self._build_steps(static=False)

    def _build_steps(self, static: bool) -> None:
        """The slot KV and, for the step core (`static`), its runner: `StaticSlotKV` reserved once, fixed addresses,
        trees of at most STATIC_MAX_TREE nodes a round; else the eager reference's growing `SlotKV`."""
        target, head, slots = self.target, self.head, self.cfg.max_slots
        tc = target.config
        kv_heads = getattr(tc, "num_key_value_heads", tc.num_attention_heads)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        store = StaticSlotKV if static else SlotKV
        self.max_tree = STATIC_MAX_TREE if static else MAX_BUDGET  # tree nodes a row may verify past its length
        self.kv = store(target.num_layers, slots, kv_heads, head_dim, self.dtype, self.device,
                        self.max_len + self.max_tree)
        self.cache = TargetKV(self.kv)
        if head is not None:
            hc = head.config
            self.head_kv = store(hc.num_hidden_layers, slots, hc.num_key_value_heads, hc.head_dim, self.dtype,
                                 self.device, self.max_len + hc.block_size)
        self.runner = None
        if static:
            from jetflow.stepcore.runner import StepRunner

            self.runner = StepRunner(target, head, self.layer_ids, max_rows=slots, compiled=True,
                                     backend=self.cfg.graphs_backend)

    # ------------------------------------------------------------------ requests
    def add(self, prompt_ids: Sequence[int], config: DecodeConfig | None = None, request_id: str | None = None,
            deadline: float | None = None, task: str | None = None) -> str:
        """Queue a request; returns its id. PromptTooLongError when it cannot fit this engine. `task`: the
        prompt's label (a task or prompt-set name) for the prompt-adaptive tree algorithms."""
        config = config or DecodeConfig()
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise PromptTooLongError("the prompt is empty: give at least one token")
        depth = self.head.config.depth if self.head is not None else 0
        if self.head is not None and config.tree.budget > self.max_tree:
            raise InvalidSettingError(f"tree budget {config.tree.budget} exceeds the {self.max_tree} nodes a "
                                      "graphs=compile engine verifies per round; ask for a smaller budget or use "
                                      "graphs=off")
        need = len(ids) + config.max_new_tokens + depth + 1
        if need > self.max_len:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({config.max_new_tokens}) + draft depth ({depth}) "
                f"exceeds the {self.max_len} positions this engine holds per request; shorten the prompt or ask "
                "for fewer tokens")
        rid = request_id or f"req-{next(self._ids)}"
        with self._lock:
            self.waiting.append(Request(rid, ids, config, deadline, task=task))
        return rid

    def cancel(self, request_id: str) -> None:
        """Drop a request (queued or running) at the start of the next step; its slot is freed then."""
        with self._lock:
            self._cancelled.add(request_id)

    @property
    def active(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.prefilling or self.waiting)

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling step graphs so far (0 for the eager reference)."""
        return self.runner.compile_s if self.runner is not None else 0.0

    @property
    def compile_log(self) -> dict[str, float]:
        """Compiled step graphs so far → their compile seconds ({} for the eager reference)."""
        return dict(self.runner.compile_log) if self.runner is not None else {}

    def generate(self, prompts: Sequence[Sequence[int]], configs: DecodeConfig | Sequence[DecodeConfig],
                 tasks: Sequence[str | None] | None = None) -> list[Generation]:
        """Decode every prompt (all queued at once, `max_slots` at a time); Generations in prompt order.
        `tasks`: each prompt's label for the prompt-adaptive tree algorithms."""
        configs = [configs] * len(prompts) if isinstance(configs, DecodeConfig) else list(configs)
        tasks = list(tasks) if tasks is not None else [None] * len(prompts)
        order = [self.add(p, c, task=t) for p, c, t in zip(prompts, configs, tasks)]
        done: dict[str, Generation] = {}
        while len(done) < len(order):
            for event in self.step():
                if event.error is not None:
                    raise event.error
                if event.finished:
                    done[event.request_id] = event.generation
        return [done[rid] for rid in order]

    @torch.inference_mode()
    def warm_lm_head(self) -> None:
        """Pick the LM-head product's orientation (`jetflow.target.projection.RowProjector`) for every row count
        this engine's steps can meet — verify rows up to `max_slots × MAX_BUDGET`, draft rows up to
        `max_slots × block_size` — now, instead of inside the first requests that meet each count (a Serve
        replica calls this before it takes traffic; a slow host paid seconds of timing under a request's deadline)."""
        slots = self.cfg.max_slots
        self.target.warm_lm_head(slots * MAX_BUDGET)
        if self.head is not None:
            self.head.warm_lm_head(self.target, slots * self.head.config.block_size)

    @torch.inference_mode()
    def warm_graphs(self, width: int = 0) -> float:
        """Compile, now, the graphs this engine's steps run (graphs=compile; a no-op otherwise): the verify and
        LM-head graphs, and with `width` > 0 the draft's graph for top-`width`. One graph each serves every row
        count, tree size and key window (`jetflow.stepcore.runner`). Call it while the engine is idle (it drafts
        and verifies padding in slot 0); a Serve replica calls it before it takes traffic. → seconds spent."""
        if self.runner is None:
            return 0.0
        if self.has_work():
            raise RuntimeError("warm_graphs runs padding steps in slot 0: call it while the engine is idle")
        before = self.runner.compile_s
        self.runner.warm_verify(self.kv)
        if self.head is not None and width:
            self.runner.warm_draft(width, self.head_kv, self.last_ctx)
            self.head_kv.release()
        self.kv.release()
        seconds = self.runner.compile_s - before
        if seconds:
            self.runner.publish()  # for other nodes of a cluster (a no-op without cluster storage)
        return seconds

    def warm_decoding(self, config: DecodeConfig) -> float:
        """`warm_graphs` for requests of `config`: the draft graph of its tree's width when it speculates →
        seconds spent."""
        spec = self.head is not None and not config.tree.plain
        return self.warm_graphs(config.tree.width if spec else 0)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[Event]:
        events: list[Event] = []
        self.times = StepTimes()
        self._drop_cancelled_and_late(events)
        self._admit()
        if self.prefilling:
            t0 = time.perf_counter()
            self._prefill()
            self.times.prefill = self._now() - t0
        if self.running:
            self._decode(events)
        if not self.has_work() and (self.runner is not None or self.kv.capacity > RELEASE_ABOVE):
            self.kv.release()  # (static: pages back to the OS, addresses kept)
            if self.runner is not None and self.head is not None:
                self.head_kv.release()
        self.steps += 1
        return events

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ slots
    def _admit(self) -> None:
        with self._lock:
            while self.waiting and self.active < self.cfg.max_slots:
                seq = Seq(self.waiting.popleft(), self.device)
                seq.stats.graphs = self.graphs
                seq.tree_context = request_tree_context(self.head, self.target.tokenizer, seq.ids, seq.cfg,
                                                        seq.request.task)
                self.prefilling.append(seq)

    def _copy_slot(self, src: int, dst: int, length: int) -> None:
        self.kv.copy_slot(src, dst, length)
        if self.head is not None:
            self.head_kv.copy_slot(src, dst, length)
            self.last_ctx[dst] = self.last_ctx[src]

    def _swap_slots(self, a: int, b: int, length: int) -> None:
        self.kv.swap_slots(a, b, length)
        if self.head is not None:
            self.head_kv.swap_slots(a, b, length)
            self.last_ctx[[a, b]] = self.last_ctx[[b, a]]

    def _remove_running(self, i: int) -> None:
        """Free slot i of the running group; the groups stay contiguous."""
        last = len(self.running) - 1
        if i != last:
            self._copy_slot(last, i, self.running[last].past)
            self.running[i] = self.running[last]
        self.running.pop()
        if self.prefilling:  # the prefilling group moves down by one: its last row fills the hole
            hole = len(self.running)
            moved = self.prefilling.pop()
            self._copy_slot(hole + len(self.prefilling) + 1, hole, moved.prefilled)
            self.prefilling.insert(0, moved)

    def _remove_prefilling(self, j: int) -> None:
        lo = len(self.running)
        last = len(self.prefilling) - 1
        if j != last:
            self._copy_slot(lo + last, lo + j, self.prefilling[last].prefilled)
            self.prefilling[j] = self.prefilling[last]
        self.prefilling.pop()

    def _start_running(self, j: int) -> None:
        """Prefilling row j is done: it becomes the last running row."""
        lo = len(self.running)
        if j != 0:
            a, b = self.prefilling[0], self.prefilling[j]
            self._swap_slots(lo, lo + j, max(a.prefilled, b.prefilled))
            self.prefilling[0], self.prefilling[j] = b, a
        seq = self.prefilling.pop(0)
        seq.past = seq.prefilled
        seq.stats.prefill_s = time.monotonic() - seq.admitted
        self.running.append(seq)

    def _drop_cancelled_and_late(self, events: list[Event]) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            now = time.monotonic()
            late = {r.id for r in self.waiting if r.deadline is not None and r.deadline < now}
            for req in [r for r in self.waiting if r.id in cancelled or r.id in late]:
                self.waiting.remove(req)
                events.append(self._ended(req.id, req.id in late))
        late |= {s.id for s in self.running + self.prefilling if s.request.deadline is not None
                 and s.request.deadline < now}
        for group, remove in ((self.running, self._remove_running), (self.prefilling, self._remove_prefilling)):
            for i in reversed(range(len(group))):
                if group[i].id in cancelled or group[i].id in late:
                    events.append(self._ended(group[i].id, group[i].id in late))
                    remove(i)

    def _ended(self, rid: str, late: bool) -> Event:
        error = (RequestTimeoutError(f"request {rid} did not finish before its deadline") if late
                 else RequestCancelledError(f"request {rid} was cancelled"))
        return Event(rid, [], finished=True, error=error)

    # ------------------------------------------------------------------ prefill
    def _prefill(self) -> None:
        """Feed the next chunk of admitted prompts: FIFO rows while rows x widest chunk <= prefill_tokens."""
        self._promote_prefilled()  # a one-token prompt has nothing to feed
        lo = len(self.running)
        chunk, budget, long_chunk = self.cfg.prefill_chunk, self.cfg.prefill_tokens, self._long_prompt_chunk()
        rows, widths = [], []
        for seq in self.prefilling:
            left = seq.prefill_target - seq.prefilled
            n = min(left, long_chunk if left > budget else chunk)
            width = max(widths + [n])
            if rows and width * (len(rows) + 1) > budget:
                break
            rows.append(seq)
            widths.append(n)
        if not rows:
            return
        b, n_max = len(rows), max(widths)
        dev = self.device
        start = torch.tensor([s.prefilled for s in rows], device=dev)
        cols = torch.arange(n_max, device=dev)
        positions = start[:, None] + cols
        ids = torch.zeros((b, n_max), dtype=torch.long)
        for i, (seq, n) in enumerate(zip(rows, widths)):
            ids[i, :n] = torch.tensor(seq.request.prompt_ids[seq.prefilled: seq.prefilled + n])
        width = max(s.prefilled for s in rows) + n_max  # from host values: no device sync
        real = (cols[None, :] < torch.tensor(widths, device=dev)[:, None])               # (b, n)
        keys = torch.arange(width, device=dev)
        causal = keys[None, None, :] <= positions[:, :, None]                            # prefix + causal chunk
        self_only = keys[None, None, :] == positions[:, :, None]
        visible = torch.where(real[:, :, None], causal, self_only)
        out = self.target.forward_rows(ids.to(dev), positions, self.cache.plan(lo, lo + b, positions, width),
                                       self._additive(visible), self.layer_ids)
        if self.head is not None:
            self.head_kv.reserve(width)
            ctx = self.head.project_context(out.features)                                 # (b, n, H)
            for layer, (k, v) in enumerate(self.head.context_kv(ctx, positions)):
                self.head_kv.write(layer, lo, lo + b, positions, k, v)
            last = torch.tensor(widths, device=dev) - 1
            self.last_ctx[lo: lo + b] = ctx[torch.arange(b, device=dev), last]
        self._prompt_logprobs(rows, widths, out.hidden)
        for seq, n in zip(rows, widths):
            seq.prefilled += n
        self._promote_prefilled()

    def _long_prompt_chunk(self) -> int:
        """Prompt tokens fed this step to a request whose prompt left exceeds `prefill_tokens`. Prompts of at most
        `prefill_tokens` go in full chunks of `prefill_chunk` (an extra forward for a step or two per request:
        feeding them in small chunks would add a forward to many steps). While requests run, a longer prompt is
        fed in chunks sized so that a chunk's forward costs at most what the last decode step took (the cost
        curve's one-row time of n tokens): a running stream's gap between tokens at most doubles while a long
        prompt is admitted. Only the long prompt is held to that chunk: the short prompts admitted beside it go in
        full, as they would without it (the step's budget held every prompt to the long one's chunk before, and
        under a steady stream of requests — some long — admission crawled: 8 clients through Serve got half a
        plain replica's tokens/s, BENCHMARKS.md)."""
        chunk, curve = self.cfg.prefill_chunk, self.cfg.cost_curve
        if not self.running or curve is None or not self._decode_ms:
            return chunk
        n = 8
        while n * 2 <= chunk and curve.step_ms(1, n * 2) <= self._decode_ms:
            n *= 2
        return n

    def _promote_prefilled(self) -> None:
        while (j := next((j for j, s in enumerate(self.prefilling) if s.prefill_done), None)) is not None:
            self._start_running(j)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """(b, n, L) bool → (b, 1, n, L) additive float mask in the target's dtype."""
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min)[:, None]

    # ------------------------------------------------------------------ decode
    def _decode(self, events: list[Event]) -> None:
        rows = list(self.running)  # _commit removes finished rows from self.running
        compiled_before = self.compile_s
        t0 = time.perf_counter()
        trees = self.policy.choose(rows)
        self.budget_steps[max(t.budget for t in trees)] += 1
        drafts = [DraftTree.root_only(s.anchor) for s in rows]
        spec = [i for i, t in enumerate(trees) if self.head is not None and not t.plain]
        if spec:
            values, tokens = self._draft(spec, [trees[i] for i in spec])
            for j, i in enumerate(spec):
                drafts[i] = build_tree(trees[i], rows[i].anchor, values[j], tokens[j], self._round_context(i, trees[i]))
        t1 = self._now()
        out = self._verify(rows, drafts)
        accs = self._accept(rows, drafts, out)
        self._path_logprobs(rows, drafts, accs, out.hidden)
        t2 = self._now()
        self._step_compile_s = self.compile_s - compiled_before
        committed = self._commit(rows, drafts, accs, out.features, events, t2 - t0)
        t3 = self._now()
        self.times.draft, self.times.verify, self.times.commit = t1 - t0, t2 - t1, t3 - t2
        self.times.rows, self.times.nodes = len(drafts), max(d.size for d in drafts)
        self.times.committed = sum(committed)
        self._decode_ms = (t3 - t0) * 1000
        self.policy.observe(rows, trees, committed, self.times)

    def _round_context(self, i: int, tree):
        """Running row `i`'s tree context for this step (`round_tree_context`; the second head pass is
        `_redraft`, inside the step's draft time)."""
        seq = self.running[i]
        return round_tree_context(seq.tree_context, tree, seq.stats,
                                  lambda branches: self._redraft(i, tree.width, branches))

    def _draft(self, idx: list[int], trees: list) -> tuple[list, list]:
        """One batched head forward for running rows `idx` → per row the top-W (log-probs, tokens) of each
        depth, W = that row's tree width."""
        width = max(t.width for t in trees)
        if self.runner is not None:
            values, tokens = self._core_draft(width)
            values, tokens = [values[i] for i in idx], [tokens[i] for i in idx]
        else:
            rows = [self.running[i] for i in idx]
            ids = torch.full((len(rows), self.head.config.block_size), self.mask_id, dtype=torch.long,
                             device=self.device)
            ids[:, 0] = torch.tensor([s.anchor for s in rows], device=self.device)
            values, tokens = self._head_topk(idx, ids, width, first=1)
        return ([[d[: t.width] for d in v] for v, t in zip(values, trees)],
                [[d[: t.width] for d in k] for k, t in zip(tokens, trees)])

    def _core_draft(self, width: int) -> tuple[list, list]:
        """The step core's draft for every running row (rows the policy keeps plain are drafted too, and
        ignored: contiguous rows instead of a gather) → per row the top-`width` rows of depths 1..D."""
        rows = self.running
        pasts = [s.past for s in rows]
        self.head_kv.reserve(max(pasts) + self.head.config.block_size)
        copies = ([copy_inputs(self.head, self.target, s.ids, [s.past]) for s in rows]
                  if self.head.config.copy_ngram else None)
        return self.runner.draft(pasts, [s.anchor for s in rows], width, self.head_kv, self.last_ctx, copies)

    def _redraft(self, i: int, width: int, branches: Sequence[int]) -> tuple[list, list]:
        """path_conditional_refresh's second head pass for running row `i`: one forward of F blocks [anchor,
        c_r, MASK x (D-1)] over copies of the row's cached context → per depth-1 token c_r its top-`width`
        rows of depths 2..D."""
        f = len(branches)
        ids = torch.full((f, self.head.config.block_size), self.mask_id, dtype=torch.long, device=self.device)
        ids[:, 0] = self.running[i].anchor
        ids[:, 1] = torch.tensor(list(branches), device=self.device)
        return self._head_topk([i] * f, ids, width, first=2)

    def _head_topk(self, idx: list[int], ids: torch.Tensor, width: int, first: int) -> tuple[list, list]:
        """Head forward of blocks `ids` (b, B) at positions past..past+B-1 of running rows `idx` (a row may
        repeat), over their cached context keys/values → the top-`width` (log-probs, target ids) of block
        positions first..B-1, as nested lists (b, B - first, width)."""
        head, target, dev = self.head, self.target, self.device
        rows = [self.running[i] for i in idx]
        b, block = len(rows), head.config.block_size
        past = torch.tensor([s.past for s in rows], device=dev)
        cols = torch.arange(block, device=dev)
        positions = past[:, None] + cols
        window = max(s.past for s in rows) + block  # the keys attended: context + block
        self.head_kv.reserve(window)
        contiguous = idx == list(range(idx[0], idx[0] + b))
        if contiguous:  # views: the block's keys/values are written into the slots' scratch positions
            kv = [self.head_kv.rows(layer, idx[0], idx[0] + b, window) for layer in range(self.head_kv.num_layers)]
            shortcut = self.last_ctx[idx[0]: idx[0] + b]
        else:  # copies (a row drafted twice writes its block into each copy, never into the slot)
            sel = torch.tensor(idx, device=dev)
            kv = [(k.index_select(0, sel), v.index_select(0, sel))
                  for k, v in (self.head_kv.rows(layer, 0, self.cfg.max_slots, window)
                               for layer in range(self.head_kv.num_layers))]
            shortcut = self.last_ctx.index_select(0, sel)
        shortcut = shortcut * (past >= 1)[:, None].to(shortcut.dtype)  # a one-token prompt has no context yet
        keys = torch.arange(window, device=dev)
        offset = keys[None, None, :] - past[:, None, None]                                # (b, 1, L)
        inner = offset <= cols[None, :, None] if head.config.causal else offset < block
        visible = (keys[None, None, :] < past[:, None, None]) | ((offset >= 0) & inner)
        copy = None
        if head.config.copy_ngram:
            parts = [copy_inputs(head, target, s.ids, [s.past]) for s in rows]
            copy = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        h = head.forward_cached(target.embed(ids), positions, kv, positions, visible[:, None], copy, shortcut)
        logp = torch.log_softmax(head.output_logits(target, h[:, first:]).float(), dim=-1)
        top = torch.topk(logp, min(width, logp.shape[-1]), dim=-1)
        return top.values.tolist(), head.to_target_ids(top.indices).tolist()

    def _verify(self, rows: list[Seq], drafts: list[DraftTree]):
        """One target forward over every row's tree, padded to the widest: RoPE position = past + depth."""
        if self.runner is not None:
            pasts = [s.past for s in rows]
            self.kv.reserve(max(p + d.size for p, d in zip(pasts, drafts)))
            return self.runner.verify(pasts, drafts, self.kv)
        dev, b = self.device, len(rows)
        n_max = max(d.size for d in drafts)
        past = torch.tensor([s.past for s in rows], device=dev)
        ids = np.zeros((b, n_max), dtype=np.int64)
        depth = np.zeros((b, n_max), dtype=np.int64)
        tree_vis = np.zeros((b, n_max, n_max), dtype=bool)
        tree_vis[:, np.arange(n_max), np.arange(n_max)] = True                           # padding: only itself
        for i, d in enumerate(drafts):
            n = d.size
            ids[i, :n] = d.tokens
            depth[i, :n] = d.depths
            depth[i, n:] = np.arange(n, n_max)
            if n > 1:
                tree_vis[i, :n, :n] = d.ancestor_mask()
        cols = torch.arange(n_max, device=dev)
        write = past[:, None] + cols
        width = max(s.past for s in rows) + n_max
        keys = torch.arange(width, device=dev)
        visible = (keys[None, None, :] < past[:, None, None]).expand(b, n_max, width).clone()
        visible.scatter_(2, write[:, None, :].expand(b, n_max, n_max), torch.from_numpy(tree_vis).to(dev))
        positions = past[:, None] + torch.from_numpy(depth).to(dev)
        return self.target.forward_rows(torch.from_numpy(ids).to(dev), positions,
                                        self.cache.plan(0, b, write, width), self._additive(visible), self.layer_ids)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, H) final-normed hidden → (M, V) logits: the step core's LM-head graph, or the target's own."""
        return self.runner.logits(hidden)[0] if self.runner is not None else self.target.logits(hidden)

    def _accept(self, rows: list[Seq], drafts: list[DraftTree], out) -> list:
        """Every row's acceptance walk, side by side: each round of LM-head work computes, in one GEMM, the
        logits of every node some walk waits for (plus its likeliest continuation, `lookahead` long). Where the
        step core brought every node's argmax with a small step (`out.best`), greedy rows walk those, in one copy."""
        hidden = out.hidden
        walks = [walker(d) for d in drafts]
        accs: list = [None] * len(rows)
        if self.runner is not None and out.best is not None:  # every node's argmax came with the step
            best = out.best.tolist()
            for r in range(len(rows)):
                if rows[r].cfg.greedy:
                    accs[r] = walk(drafts[r], best[r].__getitem__)
        need = [next(w) for w in walks]
        known: list[dict[int, tuple[torch.Tensor, int]]] = [{} for _ in rows]
        spine = []
        for d in drafts:
            first = {}
            for i in range(1, d.size):
                if d.ranks[i] == 0:
                    first.setdefault(d.parents[i], i)
            spine.append(first)
        pending = {r for r in range(len(rows)) if accs[r] is None}
        while pending:
            want_r, want_n = [], []
            for r in sorted(pending):
                if need[r] in known[r]:
                    continue
                chain = [need[r]]
                while len(chain) < max(1, round(rows[r].lookahead)) and chain[-1] in spine[r]:
                    chain.append(spine[r][chain[-1]])
                want_r += [r] * len(chain)
                want_n += chain
            if want_r:
                dev = hidden.device
                logits = self._logits(hidden[torch.tensor(want_r, device=dev), torch.tensor(want_n, device=dev)])
                best = logits.argmax(-1).tolist()
                for k, (r, n) in enumerate(zip(want_r, want_n)):
                    known[r][n] = (logits[k], best[k])
            for r in sorted(pending):
                cfg, seq = rows[r].cfg, rows[r]
                try:
                    while need[r] in known[r]:
                        logits, best = known[r][need[r]]
                        tok = best if cfg.greedy else int(torch.multinomial(
                            target_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p), 1, generator=seq.rng))
                        need[r] = walks[r].send(tok)
                except StopIteration as done:
                    accs[r] = done.value
                    pending.discard(r)
        self._walked = known  # the logits the walks computed, per row {node: (logits, argmax)}: _path_logprobs
        return accs

    def _commit(self, rows: list[Seq], drafts: list[DraftTree], accs: list, features: torch.Tensor,
                events: list[Event], seconds: float) -> list[int]:
        """Keep KV and head context for root + accepted nodes only, commit tokens, finish rows; → tokens
        committed per row."""
        dev, b = self.device, len(rows)
        paths = [a.path for a in accs]
        k_max = max(len(p) for p in paths)
        src = torch.tensor([p + [p[-1]] * (k_max - len(p)) for p in paths], device=dev)
        past = torch.tensor([s.past for s in rows], device=dev)
        if any(p != list(range(len(p))) for p in paths):
            self.kv.keep(0, past, src, k_max)
        if self.head is not None:
            feats = features.gather(1, src[:, :, None].expand(-1, -1, features.shape[-1]))
            ctx = self.head.project_context(feats)                                        # (b, k, H)
            positions = past[:, None] + torch.arange(k_max, device=dev)
            self.head_kv.reserve(max(s.past for s in rows) + k_max)
            for layer, (k, v) in enumerate(self.head.context_kv(ctx, positions)):
                self.head_kv.write(layer, 0, b, positions, k, v)
            self.last_ctx[:b] = ctx[torch.arange(b, device=dev), torch.tensor([len(p) - 1 for p in paths], device=dev)]
        per_row = []
        finished = []
        now = time.monotonic()
        for i, (seq, tree, acc) in enumerate(zip(rows, drafts, accs)):
            seq.past += len(acc.path)
            seq.anchor = acc.bonus
            tokens = [tree.tokens[j] for j in acc.path[1:]] + [acc.bonus]
            before = len(seq.generated)
            committed, seq.finish_reason = commit_tokens(seq.generated, tokens, seq.cfg, self.stop_ids,
                                                         self.target.tokenizer)
            seq.ids += seq.generated[before:]
            per_row.append(committed)
            st = seq.stats
            st.rounds += 1
            st.decode_s += seconds
            st.compile_s += self._step_compile_s
            st.tree_nodes.append(tree.size)
            st.committed_per_round.append(committed)
            st.accepted_depths[acc.accepted] += 1
            for j in acc.path[1:]:
                st.accepted_ranks[(tree.depths[j], tree.ranks[j])] += 1
            seq.lookahead = 0.9 * seq.lookahead + 0.1 * len(acc.path)
            if seq.tree_context is not None:  # the online algorithms learn from every verified round
                observe(seq.tree_context.state, tree, acc)
            if seq.started is None:
                seq.started = now
            event = Event(seq.id, seq.generated[before:], **self._event_logprobs(seq, committed))
            if seq.finish_reason is not None:
                event.finished = True
                event.generation = finish_generation(self.target.tokenizer, seq.generated, seq.finish_reason,
                                                     seq.cfg, st, seq.logprobs, seq.prompt_logprobs)
                finished.append(i)
            events.append(event)
        for i in reversed(finished):
            self._remove_running(i)
        return per_row

    # ------------------------------------------------------------------ logprobs (only rows that ask pay)
    def _prompt_logprobs(self, rows: list[Seq], widths: list[int], hidden: torch.Tensor) -> None:
        """Prompt log-probabilities of this prefill chunk for the rows that asked (echo), in one LM-head GEMM:
        hidden state j of a row's chunk starting at prompt index p predicts prompt token p + j + 1."""
        want = [(i, s, n) for i, (s, n) in enumerate(zip(rows, widths)) if s.prompt_logprobs is not None]
        if not want:
            return
        logits = self._logits(torch.cat([hidden[i, :n] for i, _, n in want]))
        tokens, ks = [], []
        for _, seq, n in want:
            tokens += seq.request.prompt_ids[seq.prefilled + 1: seq.prefilled + n + 1]
            ks += [seq.cfg.prompt_logprobs] * n
        out = token_logprobs(logits, tokens, ks)
        for _, seq, n in want:
            seq.prompt_logprobs += out[:n]
            out = out[n:]

    def _path_logprobs(self, rows: list[Seq], drafts: list[DraftTree], accs: list, hidden: torch.Tensor) -> None:
        """For the rows that asked for logprobs, the target's log-probabilities of the tokens this step may commit
        (the accepted drafts, then the bonus) → `seq.step_logprobs`. Token j comes from the logits at path node j:
        the acceptance walk's own rows where it computed them (every visited node on the eager path), else one
        LM-head GEMM over those nodes' hidden states (the step core accepts greedy rows on the device)."""
        want = [r for r, s in enumerate(rows) if s.logprobs is not None]
        if not want:
            return
        walked = self._walked if len(self._walked) == len(rows) else [{} for _ in rows]
        missing = [(r, n) for r in want for n in accs[r].path if n not in walked[r]]
        computed = {}
        if missing:
            dev = hidden.device
            logits = self._logits(hidden[torch.tensor([r for r, _ in missing], device=dev),
                                               torch.tensor([n for _, n in missing], device=dev)])
            computed = {key: logits[k] for k, key in enumerate(missing)}
        stacked, tokens, ks = [], [], []
        for r in want:
            path = accs[r].path
            stacked += [walked[r][n][0] if n in walked[r] else computed[(r, n)] for n in path]
            tokens += [drafts[r].tokens[j] for j in path[1:]] + [accs[r].bonus]
            ks += [rows[r].cfg.logprobs] * len(path)
        out = token_logprobs(torch.stack(stacked), tokens, ks)
        for r in want:
            k = len(accs[r].path)
            rows[r].step_logprobs, out = out[:k], out[k:]

    @staticmethod
    def _event_logprobs(seq: Seq, committed: int) -> dict:
        """A step event's logprob fields: those of its `committed` tokens (a stop or max_new_tokens may cut the
        path; kept for the Generation), and on the request's first event its prompt's."""
        out = {}
        if seq.prompt_logprobs is not None and seq.stats.rounds == 1:
            out["prompt_logprobs"] = seq.prompt_logprobs
        if seq.logprobs is not None and seq.step_logprobs is not None:
            out["logprobs"], seq.step_logprobs = seq.step_logprobs[:committed], None
            seq.logprobs += out["logprobs"]
        return out
