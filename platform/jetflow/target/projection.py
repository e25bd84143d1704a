"""The LM-head product `x @ W^T` for a few rows, in the orientation this machine runs fastest.

On a CPU the verify step and the draft multiply a handful of hidden rows by a large frozen matrix (the LM head,
(V, H)), and which of three equal products MKL runs fastest depends on the row count, the thread count and the
host: on one 2-core Intel host with one thread, 2 rows cost 8.3 ms as `F.linear`, 10.9 ms as `x @ W^T` with a
contiguous transposed copy and 16.8 ms as `(W @ x^T)^T`, while at 16 rows the last is fastest
(`benchmarks/lm_head.py`). A `RowProjector` times the three once per row-count bucket, at first use, and keeps
the fastest; the choices are kept per host (CPU model, torch version, thread count, weight shape and dtype) in
`$JETFLOW_HOME/cache/lm_head_forms.json`, so later processes on the host (trials, replicas, tests) read them
instead of timing again (timing every bucket costs ~10 s with one thread on a 2-core AMD EPYC host). Off the
CPU the product is `(W @ x^T)^T`, as before. `JETFLOW_LM_HEAD_FORM` pins one form.

The target's one-row product (every AR step) stays `transposed`, untimed: the forms round differently, and a
greedy near-tie that AR resolves one way must be resolved the same way in every process (AR equals HF's
`generate` in the tests with this form). The verify rows (2+) were always another form than AR's one row.

The forms differ only in floating-point summation order (fp32 results agree to ~1e-6 relative), as the
one-row and many-row paths always have; decoding stays lossless where the tests check it, on the real target.
"""

from __future__ import annotations

import json
import os
import platform
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from jetflow.errors import InvalidSettingError
from jetflow.paths import jetflow_home
from jetflow.storage import _atomic_write

FORMS = ("linear", "transposed", "swapped")  # F.linear(x, W) · x @ W^T (a contiguous copy) · (W @ x^T)^T
ENV = "JETFLOW_LM_HEAD_FORM"
# a row count is timed as the smallest bucket >= it (larger: the last). Up to 8 rows each count is its own: MKL's
# choice changes from one count to the next (3 rows: linear fastest, 4 rows: transposed, on one host).
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
_REPEATS = 5


def pinned_form() -> str | None:
    """`JETFLOW_LM_HEAD_FORM` (one of FORMS, or `auto`/unset: None)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in FORMS:
        raise InvalidSettingError(f"{ENV}={value!r}: use one of auto, {', '.join(FORMS)}")
    return value


def choices_file() -> Path:
    return jetflow_home() / "cache" / "lm_head_forms.json"


@lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        model = ""
    return model or platform.processor() or platform.machine()


def _host_key() -> str:
    """What the choices hold for: the CPU, torch's build and the thread count now."""
    return f"{_cpu_model()}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def _read_choices() -> dict:
    try:
        return json.loads(choices_file().read_text())
    except (OSError, ValueError):
        return {}  # none yet, or a file being replaced: time again


def bucket(rows: int) -> int:
    return next((b for b in BUCKETS if rows <= b), BUCKETS[-1])


class RowProjector:
    """`x (..., H) → x @ W^T (..., V)` for a fixed `weight` (V, H), on CPU in the fastest of FORMS per row-count
    bucket (timed once, at the first call of each bucket, by the fastest of 5 interleaved runs; `choices` says
    what was picked). `timer` is the clock the choice is timed with; `store` reads and keeps the choices in the
    host's file (`choices_file()`)."""

    def __init__(self, weight: torch.Tensor, timer: Callable[[], float] = time.perf_counter,
                 fixed: dict[int, str] | None = None, store: bool = True):
        self.weight = weight
        self.choices: dict[int, str] = dict(fixed or {})  # `fixed` buckets are never timed
        self._transposed: torch.Tensor | None = None
        self._timer = timer
        # `store`: read and keep the host's choices, under (host, weight shape and dtype)
        self._keys = (_host_key(), f"{tuple(weight.shape)}|{weight.dtype}") \
            if store and weight.device.type == "cpu" else None
        if self._keys is not None:
            host, shape = self._keys
            for b, form in _read_choices().get(host, {}).get(shape, {}).items():
                if form in FORMS and int(b) in BUCKETS:
                    self.choices.setdefault(int(b), form)

    def _remember(self, b: int, form: str) -> None:
        if self._keys is None:
            return
        host, shape = self._keys
        data = _read_choices()
        data.setdefault(host, {}).setdefault(shape, {})[str(b)] = form
        try:
            _atomic_write(choices_file(), json.dumps(data, indent=1, sort_keys=True).encode())
        except OSError:
            pass  # a read-only home: this process keeps its choice, the next one times again

    def form_for(self, rows: int, sample: torch.Tensor | None = None) -> str:
        pinned = pinned_form()
        if pinned is not None:
            return pinned
        if self.weight.device.type != "cpu":
            return "swapped"
        b = bucket(rows)
        if b not in self.choices:
            x = sample if sample is not None and sample.shape[0] == b else \
                torch.randn(b, self.weight.shape[1], dtype=self.weight.dtype)
            self.choices[b] = self._fastest(x)
            self._remember(b, self.choices[b])
        return self.choices[b]

    def warm(self, max_rows: int) -> None:
        """Time every bucket up to `max_rows`'s now, so that no later call (a request's first verify step in a
        Serve replica, under its deadline) pays for the timing."""
        for b in BUCKETS:
            if b > bucket(max_rows):
                break
            self.form_for(b)

    def _fastest(self, x: torch.Tensor) -> str:
        with torch.no_grad():
            times: dict[str, list[float]] = {f: [] for f in FORMS}
            for rep in range(_REPEATS + 1):  # interleaved; the first pass warms up (and makes the transposed copy)
                for form in FORMS:
                    t0 = self._timer()
                    self.apply(x, form)
                    if rep:
                        times[form].append(self._timer() - t0)
        best = min(FORMS, key=lambda f: (min(times[f]), FORMS.index(f)))  # the least-disturbed run of each
        if best != "transposed" and "transposed" not in self.choices.values():
            self._transposed = None  # a copy of the weight no bucket uses
        return best

    def apply(self, flat: torch.Tensor, form: str) -> torch.Tensor:
        """`flat` (m, H) @ W^T in `form`."""
        w = self.weight.detach()
        if form == "linear":
            return F.linear(flat, w)
        if form == "transposed":
            stale = self._transposed is None or self._transposed.dtype != w.dtype or self._transposed.device != w.device
            if stale or (self._transposed.is_inference() and not torch.is_inference_mode_enabled()):
                # (a copy made under inference mode cannot enter autograd: training makes its own)
                self._transposed = w.T.contiguous()
            return flat @ self._transposed
        return (w @ flat.T).T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.apply(flat, self.form_for(flat.shape[0], flat))
        return out.reshape(*x.shape[:-1], out.shape[-1])
