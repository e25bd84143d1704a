"""The `graphs` setting — how a decoder, an engine, `jetflow generate`, an evaluation or a Serve replica runs its
steps — and what `auto` means on this host. No torch import here: option parsers read it.

- `off`: the eager reference path (HF's forward over the growing slot KV);
- `compile`: the step core (`jetflow.stepcore`) over a static slot KV, its graphs `torch.compile`d;
- `auto` (the default everywhere): on a GPU, `compile`. On a CPU, what this host's verdict says — `compile` where
  the compiled step was measured faster than the eager one by `PAYS_ABOVE` and its tokens equal the eager
  tokens, else `off`. With no verdict yet for this host (its processor, torch, device, target, dtype, threads and
  rows), the first engine that meets it calibrates (`jetflow.engine.calibrate`: compiles its graphs — which it
  keeps using — then decodes a few plain steps both ways, side by side, at its own rows; ~1-2 min, printed as it
  runs) and keeps the verdict in `$JETFLOW_HOME/cache/graphs.json`, so later processes read it.
  `jetflow graphs --measure` measures a whole decode (AR and a tree setting) and overwrites the verdict.

`JETFLOW_GRAPHS=compile|off` in the environment pins what `auto` resolves to (the test suite pins `off`).
"""

from __future__ import annotations

import json
import os
import platform as _platform
from pathlib import Path

from jetflow.errors import InvalidSettingError
from jetflow.paths import jetflow_home

GRAPHS = ("auto", "compile", "off")
ENV = "JETFLOW_GRAPHS"
PAYS_ABOVE = 1.05  # compiled / eager throughput a measurement must show for `auto` to compile


def check_graphs(value: str) -> str:
    if value not in GRAPHS:
        raise InvalidSettingError(f"graphs must be one of {', '.join(GRAPHS)}, got {value!r}")
    return value


def verdicts_file() -> Path:
    return jetflow_home() / "cache" / "graphs.json"


def host_key(device_type: str, model_id: str, dtype: str, threads: int, rows: int = 1) -> str:
    """What a measurement holds for: this host's processor, the torch build, the device kind, target and dtype,
    the intra-op threads (a verdict taken with 2 threads says nothing of 1) and the rows the engine runs at once
    (a single stream's step is bound by reading the weights, eight rows' partly by arithmetic)."""
    import torch

    cpu = cpu_model()
    return f"{cpu}|torch {torch.__version__}|{device_type}|{model_id}|{dtype}|{threads} threads|{rows} rows"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def read_verdict(key: str) -> dict | None:
    try:
        return json.loads(verdicts_file().read_text()).get(key)
    except (OSError, ValueError):
        return None


def record_verdict(key: str, verdict: dict) -> Path:
    """Keep a measurement's verdict for this host (atomic replace: several processes may write)."""
    path = verdicts_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[key] = verdict
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def target_key(target, rows: int = 1) -> str:
    """`host_key` of a loaded target on this host, with the process's current intra-op threads."""
    import torch

    return host_key(target.device.type, target.model_id, str(target.dtype).removeprefix("torch."),
                    torch.get_num_threads(), rows)


def verdict_choice(verdict: dict) -> tuple[str, str]:
    """A kept verdict → ("compile" | "off", why): compile only where it paid and its tokens equalled the eager ones."""
    ratio = float(verdict.get("ratio", 0.0))
    when = verdict.get("date", "?")
    if not verdict.get("lossless", True):
        return "off", f"auto: the compiled step's tokens differed from the eager ones on this host ({when})"
    choice = "compile" if ratio >= PAYS_ABOVE else "off"
    return choice, f"auto: measured compiled/eager {ratio:.2f} on this host ({when})"


def resolve_graphs(mode: str, key: str, device_type: str = "cpu") -> tuple[str, str]:
    """`mode` → ("compile" | "off" | "calibrate", why). "calibrate": auto on a CPU with no verdict for `key` yet —
    the caller measures (`jetflow.engine.calibrate`) and keeps the verdict."""
    check_graphs(mode)
    if mode != "auto":
        return mode, "asked for"
    pinned = os.environ.get(ENV, "").strip().lower()
    if pinned:
        if pinned not in ("compile", "off"):
            raise InvalidSettingError(f"{ENV}={pinned!r}: use compile or off")
        return pinned, f"{ENV}={pinned}"
    if device_type == "cuda":
        return "compile", "auto: a GPU compiles"
    verdict = read_verdict(key)
    if verdict is None:
        return "calibrate", "auto: no verdict on this host yet"
    return verdict_choice(verdict)
