"""vLLM timed beside JetFlow, for the budget sweep: vLLM AR as the baseline users would pick (the fastest plain
decoding installed), and vLLM AR / DFlash closed loops for its backend comparison.

Where vLLM runs: in this process when `vllm` imports here (a GPU node's `[vllm]` extra, or a job run from
.venv-vllm), else in a child process of the vLLM venv's Python (`make setup-vllm` → .venv-vllm/bin/python; the main
.venv never has vLLM: its transformers pin is newer than vLLM's), as `python -m jetflow.vllm.timing REQUEST OUT`.
Without either, `run_timing` says why and nothing is measured: the caller falls back to JetFlow's AR.

What is timed, on the caller's token-id prompts, greedy, with the target's stop ids and the caller's token budget:
- per prompt, batch 1, `repeats` passes: decode tokens/s, vLLM's own per-request timestamps — (tokens - 1) over
  first→last token, since vLLM's prefill yields the first token — what JetFlow's decode-only tokens/s measures;
- closed loops of `concurrency` clients (that many requests in the engine at all times, the prompts cycled until
  max(clients, prompts) are done): tokens/s of the whole run, prefill included, as `jetflow.eval.batched.throughput`.
One engine per request, in vLLM's default mode (compiled: the baseline as users run it; its compile cache makes
later starts shorter), warmed up before the clock starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jetflow.vllm import vllm_available

VLLM_PYTHON_ENV = "JETFLOW_VLLM_PYTHON"   # the Python of a vLLM venv, when not the checkout's .venv-vllm
CHILD_TIMEOUT_S = 1800.0


@dataclass
class TimingRequest:
    model: str                          # what vLLM loads: a folder or hub id (`jetflow.vllm.regenerate.model_source`)
    prompts: dict[str, list[list[int]]]  # per prompt set: token ids (chat template applied); one engine for all
    max_new_tokens: int
    stop_ids: list[int]
    dtype: str = "float32"              # vLLM's name (the target's precision: vLLM's "auto" downcasts fp32)
    repeats: int = 1                    # per-prompt passes (batch 1); 0: none
    concurrency: list[int] = field(default_factory=list)  # closed loops of that many clients, per set
    exported_head: str | None = None    # a `jetflow export --to vllm` folder: DFlash chain instead of AR
    enforce_eager: bool = False         # vLLM's default (compiled), as users run it; eager runs ~3-4x slower on a CPU

    @property
    def mode(self) -> str:
        return "dflash" if self.exported_head else "ar"


def time_vllm(req: TimingRequest) -> dict:
    """Run `req` on this process's vLLM (built once per settings, `jetflow.vllm.engine`). → {"mode", "vllm_version",
    "startup_s", "num_speculative_tokens", "sets": {set: {"passes": [{"tokens", "decode_tokens", "decode_s",
    "tokens_per_s"}], "tokens_per_s" (decode, pooled over passes), "token_ids" (the first pass's, per prompt),
    "throughput" ({clients: tokens/s}), "mean_acceptance_length" (DFlash: vLLM's counters over the set's
    requests)}}}."""
    from jetflow.vllm import require_vllm
    from jetflow.vllm.engine import engine

    vllm = require_vllm("vLLM timing")
    # vLLM's CPU build pins its compute threads to cores it picks by itself ("auto"): two sweep trials timing at once
    # would both pin to the same core. Unpinned, it runs at the caller's threads (OMP_NUM_THREADS: Ray sets a
    # trial's CPUs), under the same conditions as JetFlow's timing in that trial. $VLLM_CPU_OMP_THREADS_BIND wins.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from jetflow.vllm.baseline import exported_depth
    from jetflow.vllm.generate import dflash_config

    depth = exported_depth(req.exported_head) if req.exported_head else 0
    spec = dflash_config(req.exported_head, depth) if req.exported_head else None
    longest = max(len(p) for ps in req.prompts.values() for p in ps)
    t0 = time.perf_counter()
    llm = engine(req.model, dtype=req.dtype, max_model_len=longest + req.max_new_tokens + depth + 1,
                 speculative_config=spec, enforce_eager=req.enforce_eager)
    import torch

    out = {"mode": req.mode, "vllm_version": vllm.__version__, "python": sys.executable,
           "threads": torch.get_num_threads(), "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
           "startup_s": time.perf_counter() - t0, "num_speculative_tokens": depth, "sets": {},
           "compiled": not req.enforce_eager}
    first = next(p for ps in req.prompts.values() for p in ps)
    llm.generate([vllm.TokensPrompt(prompt_token_ids=list(first))], vllm.SamplingParams(
        temperature=0.0, max_tokens=req.max_new_tokens, detokenize=False), use_tqdm=False)  # warm-up
    for name, prompts in req.prompts.items():
        out["sets"][name] = _time_set(vllm, llm, [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts], req)
    return out


def _time_set(vllm, llm, batch: list, req: TimingRequest) -> dict:
    from jetflow.vllm.engine import spec_counters

    params = vllm.SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens, stop_token_ids=list(req.stop_ids),
                                 detokenize=False)
    out: dict = {"passes": [], "throughput": {}}
    before = spec_counters(llm)
    for _ in range(req.repeats):
        tokens = decode_tokens = 0
        decode_s, ids = 0.0, []
        for prompt in batch:
            t = time.perf_counter()
            result = llm.generate([prompt], params, use_tqdm=False)[0]
            wall = time.perf_counter() - t
            n = len(result.outputs[0].token_ids)
            ids.append(list(result.outputs[0].token_ids))
            m = result.metrics
            if m is not None and n > 1 and m.last_token_ts > m.first_token_ts:
                decode_tokens, decode_s = decode_tokens + n - 1, decode_s + m.last_token_ts - m.first_token_ts
            else:  # no per-request timestamps: generate() whole, prefill included (slower than decode-only)
                decode_tokens, decode_s = decode_tokens + n, decode_s + wall
            tokens += n
        out["passes"].append({"tokens": tokens, "decode_tokens": decode_tokens, "decode_s": decode_s,
                              "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None})
        out.setdefault("token_ids", ids)
    if out["passes"]:
        total = sum(p["decode_s"] for p in out["passes"])
        out["tokens_per_s"] = sum(p["decode_tokens"] for p in out["passes"]) / total if total > 0 else None
    for clients in req.concurrency:
        out["throughput"][str(clients)] = _closed_loop(vllm, llm, batch, req, clients)
    after = spec_counters(llm)
    drafts = after["num_drafts"] - before["num_drafts"]
    out["mean_acceptance_length"] = (1 + (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / drafts
                                     if drafts else None)
    return out


def _closed_loop(vllm, llm, batch: list, req: TimingRequest, clients: int) -> float:
    """Tokens/s of `clients` requests kept in the engine until max(clients, prompts) are done (prefill included)."""
    from vllm.sampling_params import RequestOutputKind

    params = vllm.SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens, stop_token_ids=list(req.stop_ids),
                                 detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    llm.generate(batch[:1] * clients, vllm.SamplingParams(temperature=0.0, max_tokens=2, detokenize=False),
                 use_tqdm=False)  # warm-up at this batch size
    core, tag = llm.llm_engine, uuid.uuid4().hex[:8]  # request ids unique across calls
    total = max(clients, len(batch))
    queue = [batch[i % len(batch)] for i in range(total)]
    tokens = done = 0
    added = min(clients, total)
    t0 = time.perf_counter()
    for i in range(added):
        core.add_request(f"loop-{tag}-{i}", queue.pop(0), params)
    while done < total:
        for result in core.step():
            if not result.finished:
                continue
            done += 1
            tokens += len(result.outputs[0].token_ids)
            if queue:
                core.add_request(f"loop-{tag}-{added}", queue.pop(0), params)
                added += 1
    seconds = time.perf_counter() - t0
    return tokens / seconds if seconds > 0 else 0.0


# ------------------------------------------------------------------------- where vLLM runs
def project_vllm_python() -> Path:
    """The checkout's vLLM venv Python (`make setup-vllm`): <project root>/.venv-vllm/bin/python."""
    return Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def vllm_runner(python: str = "") -> tuple[str | None, str]:
    """How vLLM would run here: ("in-process", why), (a vLLM venv's Python, why), or (None, why not). `python`
    (else $JETFLOW_VLLM_PYTHON, else the checkout's .venv-vllm/bin/python) is used when this interpreter has no
    vLLM."""
    if not python and vllm_available():
        return "in-process", f"vLLM imports in this process ({sys.executable})"
    candidate = python or os.environ.get(VLLM_PYTHON_ENV) or str(project_vllm_python())
    if Path(candidate).is_file() and os.access(candidate, os.X_OK):
        return candidate, f"vLLM in a child process of {candidate}"
    return None, (f"no vLLM: {sys.executable} has none and {candidate} does not exist (`make setup-vllm` builds "
                  f"the vLLM venv; ${VLLM_PYTHON_ENV} names another)")


def run_timing(req: TimingRequest, python: str = "") -> dict:
    """`time_vllm(req)` where vLLM runs (`vllm_runner`). Never raises for vLLM's sake: a missing vLLM, a child that
    fails or an engine that does not start comes back as {"error": one line}; the result carries "runner"."""
    runner, why = vllm_runner(python)
    if runner is None:
        return {"error": why, "runner": None}
    if runner == "in-process":
        try:
            return {**time_vllm(req), "runner": runner}
        except Exception as exc:  # noqa: BLE001 - the caller falls back to JetFlow's AR, saying why
            return {"error": f"vLLM failed in this process ({exc.__class__.__name__}: {_first_line(exc)})",
                    "runner": runner}
    with tempfile.TemporaryDirectory(prefix="jetflow-vllm-timing-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps(asdict(req)))
        try:
            proc = subprocess.run([runner, "-m", "jetflow.vllm.timing", str(request), str(result)],
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=_child_env())
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"error": f"vLLM child {runner} did not finish ({exc.__class__.__name__}: {_first_line(exc)})",
                    "runner": runner}
        if proc.returncode != 0 or not result.is_file():
            tail = [line for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip()]
            last = tail[-1].strip() if tail else "?"
            hint = (" (a vLLM venv without this project, e.g. an interrupted `make setup-vllm`: run it again)"
                    if "No module named 'jetflow'" in last else "")
            return {"error": f"vLLM child {runner} exited {proc.returncode}: {last}{hint}", "runner": runner}
        return {**json.loads(result.read_text()), "runner": runner}


def _child_env() -> dict:
    """The caller's environment minus what would make the vLLM venv import the wrong packages."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # e.g. an overlay of another transformers (make test-compat)
    env.pop("PYTHONHOME", None)
    return env


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


def main(argv: list[str] | None = None) -> int:
    """The child process: REQUEST.json (a TimingRequest) → OUT.json (`time_vllm`'s result)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m jetflow.vllm.timing REQUEST.json OUT.json", file=sys.stderr)
        return 2
    from jetflow.vllm.engine import close_engines

    req = TimingRequest(**json.loads(Path(args[0]).read_text()))
    try:
        result = time_vllm(req)
    except Exception as exc:  # noqa: BLE001 - one line for the parent, which reads stderr's last line
        print(f"{exc.__class__.__name__}: {_first_line(exc)}", file=sys.stderr)
        return 1
    finally:
        close_engines()
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # vLLM's engine spawns workers: the guard keeps them from running this again
    sys.exit(main())
