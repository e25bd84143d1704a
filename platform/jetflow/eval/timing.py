"""Wall-clock timing for benchmarks: warm up, repeat, report the median (robust to a noisy VM)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median wall time of `fn()` in milliseconds over `reps` runs after `warmup` unmeasured runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000
