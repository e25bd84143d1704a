"""`StepRunner`: the step core's compiled graphs — the target's verify, its LM head, the head's draft — and the
host side that lays a step's rows out for them.

One graph each, with dynamic shapes (`torch.compile(fullgraph=True, dynamic=None)`, the token axis, the mask's
rows/queries and the key window marked dynamic): a graph holds its own packed copy of the weights it reads
(`jetflow.stepcore.inductor`), so the number of graphs is the memory, and one per role is the least. A graph break
is an error; a recompile after warm-up is a bug (`tests/test_stepcore.py` runs under dynamo's
`error_on_recompile`). `warm()` compiles all of them ahead of traffic on all-padding inputs (padding writes only
the KV's scratch position, so warming never disturbs a running request); every first call is timed into
`compile_s`. Inductor's artefacts go to `$JETFLOW_HOME/cache/inductor` (unless TORCHINDUCTOR_CACHE_DIR is set),
so a second process on the host compiles from its cache (`jetflow.stepcore.artifacts` carries them to other nodes).

A step's layout (`verify_arrays`): rows [0, R) of the slot KV, each padded to the widest tree N, tokens row-major
(T = R·N ≥ 2: a one-token step gets one padding node). Padding nodes write their keys/values to the KV's scratch
position, one past every window, and see only key 0; real nodes never see them: padding is masked both ways.

Acceptance: a step of at most `LM_HEAD_ALL` tokens runs the LM head on every node in one more graph call, and the
engine walks each greedy row with those argmaxes (no further LM-head work); a larger step leaves the LM head to
the walk, over the nodes it visits (`logits`). Host syncs per decode step: the draft's top-k (one copy), the
verify's argmaxes (one copy) or the walk's rounds.
"""

from __future__ import annotations

import time
import weakref
from typing import NamedTuple, Sequence

import numpy as np
import torch

from jetflow.stepcore import artifacts
from jetflow.stepcore.head import DraftStep
from jetflow.stepcore.inductor import apply_compile_settings, use_inductor_cache
from jetflow.stepcore.target import LMHead, TargetStep

LM_HEAD_ALL = 16      # a verify of at most this many tokens computes every node's argmax (see the docstring)
MIN_TOKENS = 2        # the token axis of a graph is never 1 (a size-1 axis would specialise the graph)
MAX_TOKENS = 1 << 16  # the token axis's upper bound (one bound for every engine: the graphs are shared)
MAX_SPAN = 1 << 20    # the mask's rows, queries and key window
DRAFT_TOP = 8         # the draft graph's top-k per depth (a wider tree compiles a graph for the next power of 2)
KEEP_DRAFTS = 2       # draft graphs kept per target in a process: the head served now and the one before it
RECOMPILE_LIMIT = 64  # dynamo's entries per step function: one per compiled module (frozen weights are guarded)


class _Graphs:
    """A process's compiled graphs, shared by every engine over the same target (and head): each engine of a
    cost-curve measurement, a replica's engine and the one that replaces it after a promotion compile nothing the
    process compiled before — a promotion only the new head's draft graph."""

    def __init__(self):
        # keys hold the model objects themselves (never their id(), which a later object may reuse)
        self.verify: dict[tuple, tuple] = {}    # (target module, layer_ids, backend) → (TargetStep, LMHead) graphs
        self.drafts: dict[tuple, torch.nn.Module] = {}  # (target module, head, backend, top) → DraftStep graph
        self.ran: weakref.WeakSet = weakref.WeakSet()  # graphs that ran once (compiled)


_SHARED = _Graphs()


class StepOut(NamedTuple):
    hidden: torch.Tensor         # (R, N, H) final-normed hidden states (the LM head's input)
    features: torch.Tensor       # (R, N, k·H) the tapped layers' outputs, concatenated (the head's context input)
    best: torch.Tensor | None    # (R, N) long: the target's argmax after every node (small steps), else None


def folded_mask(visible: np.ndarray, groups: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(R, N, W) bool visibility → (R, 1, groups·N, W) additive mask for `slot_attention`'s folded queries."""
    r, n, w = visible.shape
    mask = np.where(visible, np.float32(0), np.float32(torch.finfo(dtype).min))
    mask = np.broadcast_to(mask[:, None], (r, groups, n, w)).reshape(r, 1, groups * n, w)
    return torch.from_numpy(np.ascontiguousarray(mask)).to(device=device, dtype=dtype)


def verify_arrays(pasts: Sequence[int], drafts: Sequence, nodes: int, scratch: int) -> dict:
    """The host side of a verify step over rows [0, len(pasts)), each padded to `nodes`: (T,) ids, RoPE pos, row,
    write, and `visible` (R, N, W) bool — a node sees its row's prefix (keys < past) and its ancestors-or-self at
    their write positions; a padding node (its keys to `scratch`) only key 0."""
    rows = len(pasts)
    window = max(p + d.size for p, d in zip(pasts, drafts))
    ids = np.zeros((rows, nodes), dtype=np.int64)
    pos = np.zeros((rows, nodes), dtype=np.int64)
    write = np.full((rows, nodes), scratch, dtype=np.int64)
    visible = np.zeros((rows, nodes, window), dtype=bool)
    visible[:, :, 0] = True
    keys = np.arange(window)
    for r, (p, d) in enumerate(zip(pasts, drafts)):
        n = d.size
        ids[r, :n] = d.tokens
        pos[r, :n] = p + np.asarray(d.depths)
        pos[r, n:] = p
        write[r, :n] = p + np.arange(n)
        visible[r, :n] = keys[None, :] < p
        visible[r, :n, p: p + n] = d.ancestor_mask() if n > 1 else True
    row = np.repeat(np.arange(rows, dtype=np.int64), nodes)
    return dict(ids=ids.reshape(-1), pos=pos.reshape(-1), row=row, write=write.reshape(-1), visible=visible)


def draft_arrays(pasts: Sequence[int], anchors: Sequence[int], block: int, mask_id: int, causal: bool) -> dict:
    """The host side of a draft step: each row's block [anchor, MASK × D] at positions past..past+D (T = R·B),
    and its visibility (R, B, W): the row's context (keys < past) and the block causally (or whole)."""
    rows = len(pasts)
    past = np.asarray(pasts, dtype=np.int64)
    window = int(past.max()) + block
    offset = np.arange(block, dtype=np.int64)
    ids = np.full((rows, block), mask_id, dtype=np.int64)
    ids[:, 0] = anchors
    keys = np.arange(window)
    rel = keys[None, None, :] - past[:, None, None]                                   # (R, 1, W)
    inner = rel <= offset[None, :, None] if causal else rel < block
    visible = (rel < 0) | ((rel >= 0) & inner)
    depth_rows = (np.arange(rows)[:, None] * block + offset[None, 1:]).reshape(-1)
    if depth_rows.size < MIN_TOKENS:  # one row of a block-2 head: repeat its one drafted position
        depth_rows = np.repeat(depth_rows, MIN_TOKENS)
    return dict(ids=ids.reshape(-1), pos=(past[:, None] + offset).reshape(-1),
                row=np.repeat(np.arange(rows, dtype=np.int64), block), offset=np.tile(offset, rows),
                visible=visible, depth_rows=depth_rows)


class StepRunner:
    """The target's verify graph, its LM-head graph and the head's draft graph (see the module docstring)."""

    def __init__(self, target, head=None, layer_ids: Sequence[int] = (), max_rows: int = 1, compiled: bool = True,
                 backend: str = "inductor"):
        self.target, self.head, self.max_rows = target, head, max_rows
        self.device, self.dtype = target.device, target.dtype
        self.compiled, self.backend = compiled, backend
        self.lm_head_all = LM_HEAD_ALL  # steps of at most this many tokens compute every node's argmax
        self.carries = compiled and backend == "inductor" and artifacts.enabled()
        if compiled:
            apply_compile_settings(self.device, inductor=backend == "inductor")
            if self.carries:
                artifacts.restore(target)  # another node's compiled kernels, if cluster storage has them
            import torch._dynamo

            use_inductor_cache()
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        key = (target.model, tuple(layer_ids), backend)
        if key not in _SHARED.verify or not compiled:
            verify, lm = TargetStep(target, layer_ids).eval(), LMHead(target).eval()
            if compiled:
                verify, lm = self._compile(verify), self._compile(lm)
                _SHARED.verify[key] = (verify, lm)
        else:
            verify, lm = _SHARED.verify[key]
        self._verify, self._lm = verify, lm
        inner = getattr(verify, "_orig_mod", verify)
        self.groups = inner.heads // inner.kv_heads
        self._drafts: dict[int, torch.nn.Module] = {}
        self.compile_s = 0.0                      # seconds spent compiling (first calls), in all
        self.compile_log: dict[str, float] = {}  # graph → its compile seconds

    def _compile(self, module: torch.nn.Module):
        return torch.compile(module, fullgraph=True, dynamic=None, backend=self.backend)

    def _timed(self, graph: str, module, call):
        """Run `call` of `module`; the first run of a compiled graph in this process is its compilation, counted
        as such."""
        if not self.compiled:
            return call()
        if module in _SHARED.ran:
            return call()
        t0 = time.perf_counter()
        out = call()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        _SHARED.ran.add(module)
        self.compile_log[graph] = seconds
        self.compile_s += seconds
        return out

    def _tensor(self, array: np.ndarray, dynamic: Sequence[tuple[int, int, int]] = ()) -> torch.Tensor:
        """A host array on the device; `dynamic`: (dim, min, max) of each dimension marked dynamic."""
        t = torch.from_numpy(array).to(self.device)
        if self.compiled:
            for dim, lo, hi in dynamic:
                torch._dynamo.mark_dynamic(t, dim, min=lo, max=hi)
        return t

    def _mask(self, visible: np.ndarray, groups: int) -> torch.Tensor:
        mask = folded_mask(visible, groups, self.dtype, self.device)
        if self.compiled:
            for dim in (0, 2, 3):
                torch._dynamo.mark_dynamic(mask, dim, min=1, max=MAX_SPAN)
        return mask

    def publish(self) -> bool:
        """Put this node's compiled kernels in cluster storage for other nodes (`jetflow.stepcore.artifacts`)."""
        return self.carries and artifacts.publish(self.target)

    def ready(self, width: int = 0) -> bool:
        """Whether every graph this runner's steps run (with a draft of top-`width`, if any) was compiled."""
        graphs = [self._verify, self._lm]
        if width and self.head is not None:
            graphs.append(self._draft_graph(width)[1])
        return not self.compiled or all(g in _SHARED.ran for g in graphs)

    # ------------------------------------------------------------------ verify
    def verify(self, pasts: Sequence[int], drafts: Sequence, kv) -> StepOut:
        """One target step over running rows [0, len(pasts)) of `kv` (a StaticSlotKV): row r's tree `drafts[r]` at
        positions pasts[r]…, every row padded to the widest tree → StepOut with (R, N, …) tensors."""
        rows = len(pasts)
        nodes = max(d.size for d in drafts)
        if rows * nodes < MIN_TOKENS:
            nodes = MIN_TOKENS
        host = verify_arrays(pasts, drafts, nodes, kv.scratch)
        return self._run_verify(host, rows, nodes, kv)

    def _run_verify(self, host: dict, rows: int, nodes: int, kv) -> StepOut:
        span = (0, MIN_TOKENS, MAX_TOKENS),
        ids, pos, row, write = (self._tensor(host[k], span) for k in ("ids", "pos", "row", "write"))
        mask = self._mask(host["visible"], self.groups)
        hidden, features = self._timed("verify", self._verify,
                                       lambda: self._verify(ids, pos, row, write, mask, kv.keys, kv.values))
        best = None
        if rows * nodes <= self.lm_head_all:
            best = self.logits(hidden)[1].view(rows, nodes)
        return StepOut(hidden.view(rows, nodes, -1), features.view(rows, nodes, -1), best)

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, H) final-normed hidden → (logits (M, V) fp32, argmax (M,)) through the LM-head graph."""
        m = hidden.shape[0]
        if m < MIN_TOKENS:
            hidden = torch.cat([hidden, hidden[-1:].expand(MIN_TOKENS - m, -1)])
        if self.compiled:
            torch._dynamo.mark_dynamic(hidden, 0, min=MIN_TOKENS, max=MAX_TOKENS)
        logits, best = self._timed("lm_head", self._lm, lambda: self._lm(hidden))
        return logits[:m], best[:m]

    def warm_verify(self, kv) -> None:
        """Compile the verify and LM-head graphs now, on an all-padding step of two tokens (one row; they write
        only the scratch position)."""
        host = verify_arrays([1], [_Padding()], MIN_TOKENS, kv.scratch)
        host["write"][:] = kv.scratch
        self._run_verify(host, 1, MIN_TOKENS, kv)

    # ------------------------------------------------------------------ draft
    def _draft_graph(self, width: int) -> tuple[int, torch.nn.Module]:
        top = max(DRAFT_TOP, 1 << (width - 1).bit_length())
        if top not in self._drafts:
            key = (self.target.model, self.head, self.backend, top)
            graph = _SHARED.drafts.get(key) if self.compiled else None
            if graph is None:
                graph = DraftStep(self.head, self.target, top).eval()
                if self.compiled:
                    graph = _SHARED.drafts[key] = self._compile(graph)
                    heads = list(dict.fromkeys(k[1] for k in _SHARED.drafts if k[0] is key[0]))
                    for old in heads[: max(0, len(heads) - KEEP_DRAFTS)]:  # the oldest heads' graphs go
                        for k in [k for k in _SHARED.drafts if k[0] is key[0] and k[1] is old]:
                            _SHARED.drafts.pop(k)
            self._drafts[top] = graph
        return top, self._drafts[top]

    def draft(self, pasts: Sequence[int], anchors: Sequence[int], width: int, kv, shortcut: torch.Tensor,
              copies: Sequence | None = None) -> tuple[list, list]:
        """The head's block for running rows [0, len(pasts)) of the head's slot KV `kv`, each anchored at its
        past → per row, per depth 1..D, the top-`width` (log-probs, target token ids), as nested lists.
        shortcut: the slots' anchor context features (slots, H); copies: per row (embeds (1, B, H), lens (1, B))
        for copy_ngram heads."""
        packed = self._run_draft(pasts, anchors, width, kv, shortcut, copies)
        depth = self.head.config.block_size - 1
        values, tokens = packed[:, : len(pasts) * depth, :width].tolist()
        rows = len(pasts)
        return ([values[r * depth: (r + 1) * depth] for r in range(rows)],
                [[[int(t) for t in d] for d in tokens[r * depth: (r + 1) * depth]] for r in range(rows)])

    def _run_draft(self, pasts, anchors, width, kv, shortcut, copies) -> torch.Tensor:
        cfg = self.head.config
        top, graph = self._draft_graph(width)
        host = draft_arrays(pasts, anchors, cfg.block_size, cfg.mask_token_id, cfg.causal)
        span = (0, MIN_TOKENS, MAX_TOKENS),
        ids, pos, row, offset = (self._tensor(host[k], span) for k in ("ids", "pos", "row", "offset"))
        depth_rows = self._tensor(host["depth_rows"], span)
        mask = self._mask(host["visible"], cfg.num_attention_heads // cfg.num_key_value_heads)
        past = torch.as_tensor(pasts, device=self.device)
        short = (shortcut[: len(pasts)] * (past >= 1)[:, None].to(shortcut.dtype)).repeat_interleave(cfg.block_size, 0)
        if self.compiled:
            torch._dynamo.mark_dynamic(short, 0, min=MIN_TOKENS, max=MAX_TOKENS)
        embeds = lens = None
        if cfg.copy_ngram:
            embeds = torch.cat([e[0] for e, _ in copies]) if copies else short.new_zeros(short.shape)
            lens = torch.cat([n[0] for _, n in copies]) if copies else row.new_zeros(row.shape)
            if self.compiled:
                torch._dynamo.mark_dynamic(embeds, 0, min=MIN_TOKENS, max=MAX_TOKENS)
                torch._dynamo.mark_dynamic(lens, 0, min=MIN_TOKENS, max=MAX_TOKENS)
        return self._timed(f"draft top-{top}", graph, lambda: graph(ids, pos, row, offset, mask, short, depth_rows,
                                                                     kv.keys, kv.values, embeds, lens))

    def warm_draft(self, width: int, kv, shortcut: torch.Tensor) -> None:
        """Compile the draft graph for `width` now: one row drafting at the scratch position's past (its block's
        keys/values land at and beyond the scratch position, outside every row's window: writes beyond the
        buffer are clamped away below)."""
        block = self.head.config.block_size
        past = kv.capacity + 1 - block  # the block ends at the scratch position: nothing real is overwritten
        self._run_draft([past], [0], width, kv, shortcut, None if not self.head.config.copy_ngram else [])


class _Padding:
    """A stand-in tree of one node for warming the verify graph."""

    size = 1
    tokens = [0]
    depths = [0]
