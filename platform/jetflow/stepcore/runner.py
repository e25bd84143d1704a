"""`StepRunner`: the step core's entries per bucket, fed by persistent buffers, compiled or eager.

One entry per bucket (`jetflow.stepcore.buckets`): a verify entry per (rows, nodes, key window) and a draft
entry per (rows, block, key window, width). A step runs in the smallest compiled bucket that holds it (padding
up to a compiled size costs compute, never a compile), else in its natural bucket, compiled there and then.
Each bucket owns its input tensors, allocated once and filled in place every step (so a CUDA graph captured
around an entry later reads the same addresses); the KV buffers are the engine's `StaticSlotKV`, reserved once
and written in place inside the entry.

Compiled (`compiled=True`): `torch.compile(fullgraph=True, dynamic=False)` — a graph break is an error, every
bucket its own static graph. `warm_verify` / `warm_draft` compile a bucket ahead of traffic: one call on
all-padding inputs (padding writes only the scratch position, so warming never disturbs a running request).
Every first call of a bucket is timed into `compile_s`. Inductor's artefacts go to `$JETFLOW_HOME/cache/inductor`
(unless TORCHINDUCTOR_CACHE_DIR is set), so a second process on the host compiles from its cache.

Host syncs per decode step: the draft's (2, R, D, W) top-W comes to the host in one copy (the tree is built
there, by the registered tree algorithms) and, with device acceptance, the verify's (R, 2) greedy acceptance in
one more (with the walk: one per round of the walk's LM-head work, as in the eager engine, usually 1-2).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from jetflow.paths import jetflow_home
from jetflow.stepcore.buckets import bucket_label, key_window, next_pow2, row_bucket
from jetflow.stepcore.head import HeadCore
from jetflow.stepcore.target import StepOut, TargetCore, decoder_layer

RECOMPILE_LIMIT = 256  # dynamo's per-function cache entries: every bucket is one (its default, 8, is too few)
UNITS = ("step", "layer")


def default_accept(device: torch.device) -> str:
    """`JETFLOW_GRAPHS_ACCEPT=device|walk` if set, else device acceptance on a GPU and the walk on a CPU."""
    return os.environ.get("JETFLOW_GRAPHS_ACCEPT") or ("walk" if device.type == "cpu" else "device")


def use_inductor_cache() -> str:
    """Point inductor's on-disk cache at `$JETFLOW_HOME/cache/inductor` unless the environment chose another
    place. (Importing torch._dynamo already wrote inductor's default, /tmp/torchinductor_<user>, into
    TORCHINDUCTOR_CACHE_DIR; that value is replaced, as if unset. Inductor reads the variable at every use.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(jetflow_home() / "cache" / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(jetflow_home() / "cache" / "triton"))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


@dataclass
class VerifyInputs:
    """A verify bucket's persistent inputs (shapes (R, N) unless said)."""

    ids: torch.Tensor
    pos: torch.Tensor
    write: torch.Tensor
    past: torch.Tensor        # (R,)
    anc: torch.Tensor         # (R, N, N) bool
    parent: torch.Tensor
    eligible: torch.Tensor    # bool

    @classmethod
    def allocate(cls, rows: int, nodes: int, device) -> "VerifyInputs":
        z = lambda *s, dtype=torch.long: torch.zeros(s, dtype=dtype, device=device)  # noqa: E731
        return cls(z(rows, nodes), z(rows, nodes), z(rows, nodes), z(rows), z(rows, nodes, nodes, dtype=torch.bool),
                   z(rows, nodes), z(rows, nodes, dtype=torch.bool))


def verify_arrays(pasts: Sequence[int], drafts: Sequence, rows: int, nodes: int, scratch: int) -> dict:
    """The host side of a verify bucket: every real row's tree, padding rows and nodes around them (their keys
    and values go to `scratch`; each sees only itself in `anc`, and is never eligible)."""
    ids = np.zeros((rows, nodes), dtype=np.int64)
    pos = np.zeros((rows, nodes), dtype=np.int64)
    write = np.full((rows, nodes), scratch, dtype=np.int64)
    past = np.zeros(rows, dtype=np.int64)
    anc = np.zeros((rows, nodes, nodes), dtype=bool)
    anc[:, np.arange(nodes), np.arange(nodes)] = True
    parent = np.zeros((rows, nodes), dtype=np.int64)
    eligible = np.zeros((rows, nodes), dtype=bool)
    for r, (p, d) in enumerate(zip(pasts, drafts)):
        n = d.size
        ids[r, :n] = d.tokens
        pos[r, :n] = p + np.asarray(d.depths)
        pos[r, n:] = p
        write[r, :n] = p + np.arange(n)
        past[r] = p
        if n > 1:
            anc[r, :n, :n] = d.ancestor_mask()
            parent[r, 1:n] = d.parents[1:]
            kids = d.children
            eligible[r, 1:n] = [kids[d.parents[j]][d.tokens[j]] == j for j in range(1, n)]
    return dict(ids=ids, pos=pos, write=write, past=past, anc=anc, parent=parent, eligible=eligible)


@dataclass
class DraftInputs:
    ids: torch.Tensor                 # (R, B)
    past: torch.Tensor                # (R,)
    write: torch.Tensor               # (R, B)
    copy_embeds: torch.Tensor | None  # (R, B, H)
    copy_lens: torch.Tensor | None    # (R, B)


class StepRunner:
    """The target's verify entry and the head's draft entry, per bucket (see the module docstring)."""

    def __init__(self, target, head=None, layer_ids: Sequence[int] = (), max_rows: int = 1, compiled: bool = True,
                 backend: str = "inductor", unit: str = "step", accept: str | None = None):
        """unit: what one compiled graph holds — `step`, the whole verify step (embeddings to acceptance); `layer`,
        one decoder layer (one graph per bucket serves every layer: ~1/L of the compile time), beside the step's
        prologue and epilogue, called from a Python loop. accept: greedy acceptance on the device (`device`, the
        default on a GPU) or by the engine's walk over the returned hidden states (`walk`, the default on a CPU;
        `jetflow.stepcore.target`'s docstring says why)."""
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        self.target, self.head, self.max_rows = target, head, max_rows
        self.device, self.dtype = target.device, target.dtype
        self.compiled, self.backend, self.unit = compiled, backend, unit
        self.target_core = TargetCore(target, layer_ids, accept or default_accept(target.device))
        self.head_core = HeadCore(head, target) if head is not None else None
        self._verify_fn = self.target_core.step
        self._draft_fn = self.head_core.step if self.head_core is not None else None
        if compiled:
            import torch._dynamo

            use_inductor_cache()
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            compile = functools.partial(torch.compile, fullgraph=True, dynamic=False, backend=backend)
            if unit == "step":
                self._verify_fn = compile(self._verify_fn)
            else:
                core = self.target_core
                core.prologue, core.epilogue = compile(core.prologue), compile(core.epilogue)
                self._verify_fn = functools.partial(core.step, layer=compile(decoder_layer))
            if self._draft_fn is not None:
                self._draft_fn = compile(self._draft_fn)
        self._verify_in: dict[tuple, VerifyInputs] = {}   # bucket → its persistent inputs
        self._draft_in: dict[int, DraftInputs] = {}       # rows → the draft's persistent inputs
        self._compiled: dict[str, set[tuple]] = {"verify": set(), "draft": set()}
        self.compile_s = 0.0                   # seconds spent compiling buckets (first calls), in all
        self.compile_log: dict[str, float] = {}  # bucket label → its compile seconds

    # ------------------------------------------------------------------ buckets
    def _choose(self, kind: str, need: tuple[int, ...], natural: tuple[int, ...]) -> tuple[int, ...]:
        """The bucket a step runs in: the smallest one already compiled that holds `need` in every dimension
        (padding up to a compiled size costs compute, never a compile), else `natural` (compiled on the spot)."""
        fits = [b for b in self._compiled[kind] if all(have >= want for have, want in zip(b, need))]
        return min(fits, key=lambda b: (b[0] * b[1], b[2:])) if fits else natural

    def _timed(self, kind: str, key: tuple[int, ...], call):
        """Run `call`; the first run of a compiled bucket is its compilation, and is counted as such."""
        if not self.compiled or key in self._compiled[kind]:
            return call()
        t0 = time.perf_counter()
        out = call()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self._compiled[kind].add(key)
        self.compile_log[f"{kind} {bucket_label(key)}"] = seconds
        self.compile_s += seconds
        return out

    # ------------------------------------------------------------------ verify
    def verify(self, pasts: Sequence[int], drafts: Sequence, kv) -> StepOut:
        """One target step over running rows [0, len(pasts)) of `kv` (a StaticSlotKV): row r's tree `drafts[r]`
        at positions pasts[r]…. → StepOut of the padded bucket (rows beyond len(pasts) are padding)."""
        sizes = [d.size for d in drafts]
        need = (len(pasts), max(sizes), max(p + n for p, n in zip(pasts, sizes)))
        key = self._choose("verify", need, (row_bucket(need[0], self.max_rows), next_pow2(need[1]), key_window(need[2])))
        return self._run_verify(key, pasts, drafts, kv)

    def _run_verify(self, key: tuple[int, int, int], pasts: Sequence[int], drafts: Sequence, kv) -> StepOut:
        rows, nodes, window = key
        inputs = self._verify_in.get(key)
        if inputs is None:
            inputs = self._verify_in[key] = VerifyInputs.allocate(rows, nodes, self.device)
        for name, array in verify_arrays(pasts, drafts, rows, nodes, kv.scratch).items():
            getattr(inputs, name).copy_(torch.from_numpy(array))
        return self._timed("verify", key, lambda: self._verify_fn(
            inputs.ids, inputs.pos, inputs.write, inputs.past, inputs.anc, inputs.parent, inputs.eligible,
            kv.keys, kv.values, window))

    def warm_verify(self, rows: int, nodes: int, window: int, kv) -> None:
        """Compile the verify bucket holding (rows, nodes, window) now, on all-padding inputs (they write only
        the scratch position: warming never disturbs a running request)."""
        key = (row_bucket(rows, self.max_rows), next_pow2(nodes), key_window(window))
        if key[2] > kv.capacity:
            raise ValueError(f"key window {key[2]} exceeds the KV's capacity {kv.capacity}")
        self._run_verify(key, [], [], kv)

    # ------------------------------------------------------------------ draft
    def _draft_inputs(self, rows: int) -> DraftInputs:
        inputs = self._draft_in.get(rows)
        if inputs is None:
            b, dev = self.head.config.block_size, self.device
            copy = self.head.config.copy_ngram
            inputs = self._draft_in[rows] = DraftInputs(
                torch.zeros((rows, b), dtype=torch.long, device=dev), torch.zeros(rows, dtype=torch.long, device=dev),
                torch.zeros((rows, b), dtype=torch.long, device=dev),
                torch.zeros((rows, b, self.target.hidden_size), dtype=self.dtype, device=dev) if copy else None,
                torch.zeros((rows, b), dtype=torch.long, device=dev) if copy else None)
        return inputs

    def _run_draft(self, key: tuple[int, int, int, int], pasts: Sequence[int], anchors: Sequence[int], kv,
                   shortcut: torch.Tensor, copies: Sequence | None) -> torch.Tensor:
        rows, block, window, width = key
        inputs = self._draft_inputs(rows)
        ids = np.full((rows, block), self.head.config.mask_token_id, dtype=np.int64)
        ids[: len(anchors), 0] = anchors
        past = np.zeros(rows, dtype=np.int64)
        past[: len(pasts)] = pasts
        write = np.full((rows, block), kv.scratch, dtype=np.int64)
        write[: len(pasts)] = past[: len(pasts), None] + np.arange(block)
        inputs.ids.copy_(torch.from_numpy(ids))
        inputs.past.copy_(torch.from_numpy(past))
        inputs.write.copy_(torch.from_numpy(write))
        if inputs.copy_embeds is not None:
            inputs.copy_embeds.zero_()
            inputs.copy_lens.zero_()
            for i, (embeds, lens) in enumerate(copies or ()):
                inputs.copy_embeds[i] = embeds[0]
                inputs.copy_lens[i] = lens[0]
        return self._timed("draft", key, lambda: self._draft_fn(
            inputs.ids, inputs.past, inputs.write, shortcut[:rows], inputs.copy_embeds, inputs.copy_lens,
            kv.keys, kv.values, window, width))

    def draft(self, pasts: Sequence[int], anchors: Sequence[int], width: int, kv, shortcut: torch.Tensor,
              copies: Sequence | None = None) -> tuple[list, list]:
        """The head's block for running rows [0, len(pasts)) of the head's slot KV `kv`, each anchored at its
        past → per row, per depth 1..D, the top-`width` (log-probs, target token ids), as nested lists.
        shortcut: the slots' anchor context features (slots, H); copies: per row (embeds (1, B, H), lens (1, B))
        for copy_ngram heads."""
        block = self.head.config.block_size
        need = (len(pasts), block, max(pasts) + block, width)
        key = self._choose("draft", need, (row_bucket(need[0], self.max_rows), block, key_window(need[2]), width))
        packed = self._run_draft(key, pasts, anchors, kv, shortcut, copies)
        values, tokens = packed[:, : len(pasts), :, :width].tolist()
        return values, [[[int(t) for t in depth] for depth in row] for row in tokens]

    def warm_draft(self, rows: int, window: int, width: int, kv, shortcut: torch.Tensor) -> None:
        block = self.head.config.block_size
        key = (row_bucket(rows, self.max_rows), block, key_window(window), width)
        self._run_draft(key, [], [], kv, shortcut, None)
