"""`backend: vllm`: the same OpenAI application — routes, API key, /healthz, champion polling, usage — with vLLM
decoding: plain AR, or vLLM's `dflash` speculative method with the head exported (`jetflow export --to vllm`, a
chain of the head's block, argmax per depth; tree search stays JetFlow's).

Why our app around vLLM's async engine (`vllm.v1.engine.async_llm.AsyncLLM`, `AsyncLLMEngine` in 0.32/0.33) and
not `ray.serve.llm`: both run the same AsyncLLM in a replica, so decoding speed is the engine's either way; what
differs is everything around it, which is what this app is —
- `ray.serve.llm` fixes the model and its `speculative_config` in the deployment's LLMConfig: a promotion (moving
  the registry's alias with jobs/promote.py, against MLflow, knowing nothing of Serve) would need a controller that
  redeploys. Here each replica polls the alias and builds the new engine beside the running one, as the JetFlow
  backend does (`jetflow.serving.champion`);
- its ingress is a second deployment (requests hop ingress → LLMServer) with its own routes and bodies: no
  `usage.jetflow`, no `/healthz` saying what runs, no API-key middleware, no `/tokenize` as we answer it;
- the export, the refusal of heads vLLM cannot run, and both backends' one-line start-up errors stay in one place.

Per replica: `VllmTarget` (the tokenizer and config, no weights: vLLM loads its own), `VllmEngine` (one AsyncLLM
with `GenerationEngine`'s interface: requests become the app's `Event`s and `Generation`s), `VllmEngines` (the
`EngineLoop` interface over the serving engine and, after a promotion, the previous one until its last request
ends, then shut down). `check_vllm_backend` runs where the application is built, before any replica starts.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import AsyncIterator

from jetflow.decode import DecodeConfig, DecodeStats, Generation, stop_token_ids
from jetflow.decode.logprobs import TokenLogprob
from jetflow.engine import RequestTimeoutError
from jetflow.errors import ExportUnsupportedError, InvalidSettingError, VllmUnavailableError
from jetflow.serving.config import ServeConfig
from jetflow.serving.engine import EngineCounts, Event, QueueFullError, RequestShaping, request_error
from jetflow.serving.selection import HeadChoice
from jetflow.tree import TreeSpec

log = logging.getLogger("ray.serve")

# Each engine's share of a GPU: a promotion runs the new engine beside the old one until the old one drains.
GPU_MEMORY_UTILIZATION = 0.45


# ------------------------------------------------------------------------------- build time (the driver)
def check_vllm_backend(cfg: ServeConfig) -> None:
    """One line, before any replica starts, when `backend: vllm` cannot serve `cfg`: no importable vLLM here
    (VllmUnavailableError), a head that has no weights on disk ('random') or that vLLM would run differently
    (ExportUnsupportedError), each with what to run instead."""
    try:
        importlib.import_module("vllm")
    except ImportError as exc:
        why = f"{sys.executable} has none ({exc.__class__.__name__}: {exc})"
    except (RuntimeError, OSError) as exc:  # installed, but CUDA builds of torchvision & co. beside a CPU torch
        why = (f"{sys.executable} has it but it fails to import ({_first_line(exc)}; with vLLM's CPU build: "
               "pip uninstall -y torchvision torchaudio torchcodec)")
    else:
        why = None
    if why:
        raise VllmUnavailableError(
            f"backend: vllm needs vLLM in the Python that runs Serve and its replicas, and {why}: run serve from "
            ".venv-vllm/bin/python after `make setup-vllm` (a GPU node: pip install -e '.[vllm]'), or use backend: "
            "jetflow")
    path, label = _served_head(cfg)
    if path is None:
        return
    from jetflow.head.config import HeadConfig
    from jetflow.head.io import CONFIG
    from jetflow.vllm.export import exportable

    try:
        exportable(HeadConfig.from_dflash_dict(json.loads((Path(path) / CONFIG).read_text())))
    except ExportUnsupportedError as exc:
        raise ExportUnsupportedError(f"backend: vllm cannot run head {label}: {exc}; or serve it with backend: "
                                     "jetflow") from None


def _served_head(cfg: ServeConfig) -> tuple[Path | None, str | None]:
    """(the folder of the head the replicas would serve, its label); (None, None) for plain decoding — or when the
    registry cannot be read here (the replicas then say so themselves, as with the JetFlow backend)."""
    from jetflow.head import HeadRef

    if cfg.head is not None:
        ref = HeadRef.parse(cfg.head)
        if ref.kind == "none":
            return None, None
        if ref.kind == "random":
            raise InvalidSettingError(
                "backend: vllm cannot serve head random (a random-init head has no weights on disk to export for "
                "vLLM): give a head vLLM runs (jobs/train.py --preset demo-vllm), head: none for vLLM's plain AR, "
                "or use backend: jetflow")
        return ref.resolve(), cfg.head
    try:
        from jetflow.tracking import registry

        with _tracking(cfg.tracking_uri):
            found = registry.resolve_alias(target_identity(cfg.model)[0], cfg.alias)
    except Exception as exc:  # noqa: BLE001 - a replica reports an unreadable registry with its own reason
        log.warning("backend vllm: could not read the %r alias here to check its head (%s)", cfg.alias, exc)
        return None, None
    if found is None:
        return None, None
    return Path(found.path), f"models:/{found.name}/{found.version} (the {cfg.alias!r} alias)"


@contextmanager
def _tracking(uri: str | None):
    before = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        yield
    finally:
        if uri:
            if before is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = before


# ------------------------------------------------------------------------------- the target, without its weights
def target_identity(name: str) -> tuple[str, str, str]:
    """(model id the registry knows the target by, revision, what vLLM loads) for a bundled name, folder or hub id —
    as `jetflow.target.TargetModel.load` names them, without loading anything."""
    from jetflow.target.bundled import BUNDLED, MANIFEST
    from jetflow.vllm.regenerate import model_source

    source = model_source(name)
    manifest = Path(source) / MANIFEST
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        return (name if name in BUNDLED else data.get("name", name)), data.get("revision", "unknown"), source
    return name, "unknown", source


@dataclass
class VllmTarget:
    """What a vLLM replica needs of its target: the tokenizer (chat template, token ids), the config (head checks)
    and, for a draft-vocabulary head's export, the LM head read from the checkpoint. vLLM loads the weights."""

    model_id: str
    revision: str
    source: str                              # what vLLM loads
    tokenizer: object
    config: object
    model: object = None                     # .generation_config only (`jetflow.decode.stop_token_ids` reads it)
    device: object = None
    dtype: object = None

    @classmethod
    def load(cls, name: str) -> "VllmTarget":
        import torch
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        model_id, revision, source = target_identity(name)
        local = Path(source).is_dir()
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
        config = AutoConfig.from_pretrained(source, local_files_only=local)
        try:
            generation = GenerationConfig.from_pretrained(source, local_files_only=local)
        except OSError:
            generation = None
        return cls(model_id, revision, source, tokenizer, config, SimpleNamespace(generation_config=generation),
                   torch.device("cpu"), torch.float32)  # heads load on the CPU: vLLM reads their export

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def lm_head(self):
        """(LM-head weight (V, H), bias or None) from the checkpoint's safetensors (tied: the input embedding)."""
        from safetensors import safe_open

        files = sorted(Path(self.source).glob("*.safetensors")) if Path(self.source).is_dir() else []
        for key in ("lm_head.weight", "model.embed_tokens.weight"):
            for f in files:
                with safe_open(str(f), framework="pt") as st:
                    if key in st.keys():  # noqa: SIM118 (safe_open is no dict)
                        bias = st.get_tensor("lm_head.bias") if "lm_head.bias" in st.keys() else None  # noqa: SIM118
                        return st.get_tensor(key).float(), bias
        raise ExportUnsupportedError(f"no LM head in {self.source}'s safetensors: a draft-vocabulary head cannot be "
                                     "exported for vLLM here")


# ------------------------------------------------------------------------------- one engine
@dataclass
class _Request:
    """One request's progress: what vLLM streamed so far."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    per_output: list[int] = field(default_factory=list)     # tokens per streamed output (≈ per engine step)
    first_t: float | None = None
    last_t: float | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    started: bool = False


class VllmEngine(RequestShaping):
    """One vLLM AsyncLLM serving `choice`: plain AR, or `dflash` with the head exported into
    $JETFLOW_HOME/vllm-heads/<registered name>/<version> (`jetflow.vllm.export.export_cached`). Building it starts
    vLLM's engine processes (~20-60 s on a CPU); the serving one keeps answering meanwhile."""

    backend = "vllm"

    def __init__(self, target: VllmTarget, choice: HeadChoice, cfg: ServeConfig, engines: "VllmEngines"):
        from jetflow.vllm import require_vllm
        from jetflow.vllm.engine import engine_kwargs, on_cpu, vllm_dtype
        from jetflow.vllm.generate import dflash_config

        self._vllm = require_vllm("backend: vllm")
        self.target, self.cfg, self.engines = target, cfg, engines
        self.exported: Path | None = None
        depth = 0
        if choice.speculative:
            from jetflow.vllm.baseline import exported_depth
            from jetflow.vllm.export import export_cached

            label = choice.label or ""
            key = label.removeprefix("models:/") if label.startswith("models:/") else None
            self.exported = export_cached(choice.loaded.path, key, lm_head=target.lm_head)
            depth = exported_depth(self.exported)
            choice = replace(choice, tree=TreeSpec("chain", budget=depth + 1, width=1))  # what vLLM drafts
        self.choice, self.depth = choice, depth
        cpu = on_cpu()
        # vLLM's default (compiled) unless graphs: off. On a CPU compiled starts ~3x slower (~100 s the first time,
        # vLLM caches the compile) and decodes ~1.5x faster (BENCHMARKS.md)
        self.eager = cfg.graphs == "off"
        kwargs = engine_kwargs(target.source, dtype=vllm_dtype(cfg.dtype or ("fp32" if cpu else "bf16")),
                               max_model_len=cfg.max_prompt_tokens + cfg.max_tokens + depth + 1,
                               speculative_config=dflash_config(self.exported, depth) if self.exported else None,
                               enforce_eager=self.eager, gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
        kwargs["max_num_seqs"] = cfg.max_slots
        args_cls, llm_cls = _async_classes()
        if self.exported and "per_request_spec_decode_metrics" in getattr(args_cls, "__dataclass_fields__", {}):
            kwargs["per_request_spec_decode_metrics"] = "summary"  # each request's acceptance (usage.jetflow.tau)
        t0 = time.perf_counter()
        self.llm = llm_cls.from_engine_args(args_cls(**kwargs))
        self.start_s = time.perf_counter() - t0
        self._stops = sorted(stop_token_ids(target))
        self._inflight = 0
        self._ids = itertools.count()
        self.retired = False
        engines.attach(self)

    def describe(self) -> str:
        """What this engine runs (/healthz `runs`, the start line)."""
        how = f"vLLM {self._vllm.__version__} ({'eager' if self.eager else 'compiled'})"
        if self.exported is not None:
            return (f"{how}: dflash with head {self.choice.label} exported to {self.exported}, "
                    f"{self.depth} speculative tokens")
        return f"{how}: plain AR" + (f" ({self.choice.note})" if self.choice.note else "")

    def graphs_info(self) -> dict:
        return {"graphs": "off" if self.eager else "compile", "graphs_reason": f"vLLM enforce_eager={self.eager}",
                "graphs_ready": True, "compiled_graphs": 0, "compile_s": 0.0, "vllm_version": self._vllm.__version__,
                "engine_start_s": round(self.start_s, 1)}

    @property
    def active(self) -> int:
        return min(self._inflight, self.cfg.max_slots)

    @property
    def queued(self) -> int:
        return max(0, self._inflight - self.cfg.max_slots)

    @property
    def busy(self) -> bool:
        return self._inflight > 0

    def _params(self, cfg: DecodeConfig):
        from vllm.sampling_params import RequestOutputKind

        return self._vllm.SamplingParams(
            n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed,
            stop=list(cfg.stop) or None, stop_token_ids=self._stops, max_tokens=cfg.max_new_tokens,
            logprobs=cfg.logprobs, prompt_logprobs=cfg.prompt_logprobs, skip_special_tokens=True,
            output_kind=RequestOutputKind.DELTA)

    async def events(self, request_id: str, ids: list[int], cfg: DecodeConfig) -> AsyncIterator[Event]:
        """`GenerationEngine.events` on vLLM: text deltas as vLLM streams them, the last event with the
        Generation. QueueFullError past slots + queue, RequestTimeoutError past `request_timeout_s`; closing the
        iterator early (a client that left) aborts the request in vLLM."""
        if self._inflight >= self.cfg.max_slots + self.cfg.max_queued_requests:
            raise QueueFullError(f"this replica is full: {self.cfg.max_slots} requests running and {self.queued} "
                                 "waiting; retry later")
        timeout = self.cfg.request_timeout_s
        deadline = time.monotonic() + timeout if timeout else None
        try:
            params = self._params(cfg)
        except ValueError as exc:
            raise request_error(InvalidSettingError, f"vLLM refused the request: {_first_line(exc)}", None) from None
        self._inflight += 1
        stream = self.llm.generate(self._vllm.TokensPrompt(prompt_token_ids=list(ids)), params,
                                   f"{request_id}-{next(self._ids)}")  # unique even when a client repeats its id
        req = _Request(prompt=list(ids))
        try:
            while True:
                try:
                    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                    out = await asyncio.wait_for(anext(stream), wait)
                except asyncio.TimeoutError:
                    raise RequestTimeoutError(f"the request did not finish within {timeout:g} s (request_timeout_s); "
                                              "ask for fewer tokens or retry") from None
                except StopAsyncIteration:
                    raise RuntimeError("vLLM ended a request without its final output") from None
                except ValueError as exc:  # vLLM's own validation (VLLMValidationError is a ValueError)
                    raise request_error(InvalidSettingError, f"vLLM refused the request: {_first_line(exc)}",
                                        None) from None
                self.engines.outputs += 1
                event = self._event(req, out, cfg)
                yield event
                if event.done is not None:
                    return
        finally:
            await stream.aclose()  # a request still running is aborted in vLLM
            self._inflight -= 1
            self.engines.request_ended(self)

    def _event(self, req: _Request, out, cfg: DecodeConfig) -> Event:
        o = out.outputs[0]
        new = list(o.token_ids)
        now = time.perf_counter()
        if new:
            req.first_t = req.first_t if req.first_t is not None else now
            req.last_t = now
            req.per_output.append(len(new))
        req.ids += new
        req.text += o.text
        lps = _logprobs(new, o.logprobs, cfg.logprobs) if cfg.logprobs is not None else None
        if lps:
            req.logprobs += lps
        plp = None
        if not req.started:
            req.started = True
            if cfg.prompt_logprobs is not None:
                plp = req.prompt_logprobs = _logprobs(req.prompt[1:], (out.prompt_logprobs or [None])[1:],
                                                      cfg.prompt_logprobs)
        if not out.finished:
            return Event(o.text, len(req.ids), logprobs=lps, prompt_logprobs=plp)
        gen = Generation(token_ids=req.ids, text=req.text, finish_reason=o.finish_reason or "stop",
                         stats=self._stats(req, o), logprobs=req.logprobs if cfg.logprobs is not None else None,
                         prompt_logprobs=req.prompt_logprobs)
        return Event(o.text, len(req.ids), done=gen, logprobs=lps, prompt_logprobs=plp)

    def _stats(self, req: _Request, o) -> DecodeStats:
        """DecodeStats of one vLLM request: rounds and tokens per round from vLLM's per-request speculative
        metrics (its prefill's first token, then each verify step's accepted + 1), else per streamed output;
        decode tokens/s over first → last token (vLLM's prefill yields the first)."""
        n = len(req.ids)
        spec = getattr(o, "spec_decode_metrics", None)
        if spec is not None and getattr(spec, "histogram", None):
            committed = [1] + [j + 1 for j, count in enumerate(spec.histogram) for _ in range(count)]
            while sum(committed) > n and committed:  # the last step's accepted tokens past max_tokens / a stop
                committed[-1] -= 1
                if committed[-1] <= 0:
                    committed.pop()
        else:
            committed = list(req.per_output) if self.exported is not None else [1] * n
        span = (req.last_t - req.first_t) if req.first_t is not None and req.last_t is not None else 0.0
        decode_s = span * n / (n - 1) if n > 1 and span > 0 else 0.0  # n - 1 intervals: scaled to n tokens
        return DecodeStats(prompt_tokens=len(req.prompt), new_tokens=n, rounds=len(committed),
                           committed_per_round=committed, decode_s=decode_s)

    def retire(self) -> None:
        """New requests go to the next engine; this one shuts down once its last request ends."""
        self.retired = True
        self.engines.request_ended(self)

    def shutdown(self) -> None:
        try:
            self.llm.shutdown()
        except Exception:  # noqa: BLE001 - shutting down: nothing left to serve
            log.exception("vLLM engine shutdown")


def _async_classes():
    """vLLM's (AsyncEngineArgs, async engine) — AsyncLLM in 0.32 / 0.33 (AsyncLLMEngine is its alias there)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # pragma: no cover - a release without the v1 module path
        from vllm import AsyncLLMEngine as AsyncLLM
    return AsyncEngineArgs, AsyncLLM


def _logprobs(tokens, entries, k: int) -> list[TokenLogprob]:
    """vLLM's per-position {token: Logprob(logprob, rank)} (the token itself plus the k likeliest) → TokenLogprobs
    with the k likeliest, most likely first. vLLM's default logprobs are the raw model's (before temperature,
    top-k, top-p), as JetFlow's."""
    out = []
    for token, entry in zip(tokens, entries or []):
        entry = entry or {}
        chosen = entry.get(token)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda item: item[1].rank)[:k]
        out.append(TokenLogprob(int(token), float(chosen.logprob) if chosen is not None else float("-inf"),
                                tuple((int(t), float(lp.logprob)) for t, lp in top)))
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{exc.__class__.__name__}: {text.splitlines()[0]}" if text else exc.__class__.__name__


# ------------------------------------------------------------------------------- the replica's engines
class VllmEngines(EngineCounts):
    """`EngineLoop`'s interface over a replica's vLLM engines: the serving one and, after a promotion, the previous
    one until its last request ends (then shut down, on a thread of its own: it takes seconds)."""

    def __init__(self):
        self._engines: list[VllmEngine] = []
        self._lock = threading.Lock()
        self.outputs = 0            # streamed outputs (≈ engine steps that produced tokens), /healthz `steps`

    def attach(self, engine: VllmEngine) -> None:
        with self._lock:
            self._engines.append(engine)

    def request_ended(self, engine: VllmEngine) -> None:
        with self._lock:
            done = engine.retired and not engine.busy and engine in self._engines
            if done:
                self._engines.remove(engine)
        if done:
            threading.Thread(target=engine.shutdown, name="jetflow-vllm-shutdown", daemon=True).start()

    def healthy(self) -> tuple[bool, str]:
        for engine in list(self._engines):
            if getattr(engine.llm, "errored", False):
                return False, f"the vLLM engine died ({getattr(engine.llm, 'dead_error', None)!r})"
        return (True, "ok") if self._engines else (False, "no vLLM engine")

    @property
    def steps(self) -> int:
        return self.outputs

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines), []
        for engine in engines:
            engine.shutdown()
