"""Regenerate training responses with the target itself (METHOD.md §2: the single biggest factor).

Prompts are cut into fixed shards; each shard is answered in left-padded batches and written
atomically as one Parquet file, so a killed job resumes where it stopped: finished shards are
skipped, nothing is lost or duplicated. Shards can be spread over Ray actors, one CPU and one target
copy each (two measured 1.74× one; BENCHMARKS.md).
A manifest records target id/revision, chat template, settings, counts and a content hash.

Where: the folder `data/regen/<model>-<key>` of cluster storage (`jetflow.storage`; `$JETFLOW_HOME` on one
machine). On a multi-node cluster the shards are answered by Ray actors on worker nodes (never by the
driver, which loads no target), each shard published to storage as it is written; the driver writes the
manifest from what storage holds, so a rerun answers only the shards storage lacks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from jetflow.data.prompts import PromptItem, load_prompts, normalize_text
from jetflow.data.regen_config import BACKENDS, RegenConfig  # noqa: F401  (their old import path)
from jetflow.data.shards import SCHEMA, cut_at_stop, encode_shard, write_shard

MANIFEST = "manifest.json"
# Other engines answer a shard through a plug-in, imported when first used, so that this module depends on
# nothing downstream of it: backend → module with `check()` (raises when the engine is missing) and
# `regenerate_shard(cfg, items, path, target)` (the same contract as `regenerate_shard` here).
PLUGINS = {"vllm": "jetflow.vllm.regenerate"}
log = logging.getLogger(__name__)


def select_prompts(cfg: RegenConfig) -> list[PromptItem]:
    """Round-robin over the training splits of cfg.prompt_sets, first num_prompts items, each text once
    (sets may overlap, e.g. ``sharegpt-code`` is part of ``sharegpt``). Deterministic."""
    pools = [load_prompts(name, split="train") for name in cfg.prompt_sets]
    out: list[PromptItem] = []
    seen: set[str] = set()
    i = 0
    while len(out) < cfg.num_prompts and any(i < len(p) for p in pools):
        for item in (p[i] for p in pools if i < len(p)):
            key = normalize_text(item.text)
            if key not in seen:
                seen.add(key)
                out.append(item)
        i += 1
    return out[: cfg.num_prompts]


def data_rel(cfg: RegenConfig, revision: str) -> str:
    """The output's folder in cluster storage: content-keyed, so every node and rerun finds the same one."""
    return f"data/regen/{Path(cfg.model).name}-{cfg.key(revision)}"


def default_output_dir(cfg: RegenConfig, revision: str) -> Path:
    from jetflow.storage import storage

    return storage().staging(data_rel(cfg, revision))


def _shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.parquet"


def _plugin(backend: str):
    import importlib

    return importlib.import_module(PLUGINS[backend])


def regenerate_shard(cfg: RegenConfig, items: list[PromptItem], path: Path, target=None) -> dict:
    """Answer one shard of prompts and write it atomically. Returns counts."""
    if cfg.backend in PLUGINS:
        return _plugin(cfg.backend).regenerate_shard(cfg, items, path, target)
    import torch

    from jetflow.data.batchgen import generate_batch
    from jetflow.decode.prompt import stop_token_ids
    target = target or cfg.load_target()
    tok = target.tokenizer
    rows = {name: [] for name in SCHEMA.names}
    encoded, skipped = encode_shard(items, tok, cfg.max_prompt_tokens)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = stop_token_ids(target)  # the same stops the decoder uses
    gen_tokens = 0
    # sampling is seeded per shard, so a resumed job regenerates a lost shard exactly
    generator = torch.Generator().manual_seed(int(hashlib.sha256(path.name.encode()).hexdigest()[:8], 16))
    for b in range(0, len(encoded), cfg.batch_size):
        batch = encoded[b : b + cfg.batch_size]
        answers = generate_batch(target, [ids for _, ids in batch], cfg.max_new_tokens, eos, pad,
                                 temperature=cfg.temperature, generator=generator)
        for (pid, ids), generated in zip(batch, answers):
            resp, finish = cut_at_stop(generated, eos)
            rows["prompt_id"].append(pid)
            rows["prompt_ids"].append(ids)
            rows["response_ids"].append(resp)
            rows["finish_reason"].append(finish)
            gen_tokens += len(resp)
    write_shard(rows, path)
    return {"prompts": len(encoded), "skipped": skipped, "response_tokens": gen_tokens}


def target_info(target) -> dict:
    """What the manifest records of the target that answered (so the driver need not load one)."""
    return {"model_id": target.model_id, "revision": target.revision,
            "chat_template_sha256": hashlib.sha256((target.tokenizer.chat_template or "").encode()).hexdigest()[:16]}


class _ShardWorker:
    """A Ray actor holding one target copy (loaded once, not once per shard), placed and answered where it runs
    (its device resolved on its node); one CPU (and one GPU when the work wants one) each."""

    def __init__(self, cfg: RegenConfig):
        self.cfg, self.target = cfg, cfg.load_target()

    def ready(self) -> bool:
        """Answers once the actor is placed and its target loaded."""
        return True

    def info(self) -> dict:
        return target_info(self.target)

    def run(self, items: list[PromptItem], path: str, rel: str | None = None) -> dict:
        """Answer a shard into `path` (one machine), or into folder `rel` of cluster storage (published)."""
        if rel is None:
            return regenerate_shard(self.cfg, items, Path(path), target=self.target)
        from jetflow.storage import storage

        counts = regenerate_shard(self.cfg, items, storage().staging(rel) / path, target=self.target)
        storage().publish(rel, [path])
        return counts


def map_on_started_actors(actors: list, ready: Callable[[Any], Any], run: Callable[[Any, Any], Any],
                          jobs: list) -> Iterator:
    """Hand `jobs` to Ray `actors` as each one starts and frees up, yielding results as they finish.
    `ready(actor)` and `run(actor, job)` return object refs. An actor Ray cannot place yet (more actors than
    CPUs; on an autoscaling cluster, no node yet) takes no job until it starts — handing shards out up front
    (ActorPool) left them waiting forever on actors that never ran. Unstarted actors are killed at the end.
    An actor that dies (its node lost) is dropped and its job handed to the next free one; only when none is
    left does the error propagate (what finished is kept: a rerun does the rest)."""
    import ray
    from ray.exceptions import RayActorError

    starting = {ready(a): a for a in actors}
    running: dict = {}  # ref -> (actor, job)
    idle: list = []
    queue = list(jobs)
    lost: list[BaseException] = []
    try:
        while queue or running:
            while queue and idle:
                actor, job = idle.pop(0), queue.pop(0)
                running[run(actor, job)] = (actor, job)
            if not starting and not running:
                raise lost[-1] if lost else RuntimeError("no actor to run the jobs")  # every actor died
            (ref,), _ = ray.wait([*starting, *running], num_returns=1)
            if ref in starting:
                actor = starting.pop(ref)
                try:
                    ray.get(ref)  # an actor that failed to start raises here
                except RayActorError as exc:
                    lost.append(exc)
                    continue
                idle.append(actor)
                continue
            actor, job = running.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError as exc:  # its node died, or the actor: another actor takes the job
                log.warning("regeneration: an actor was lost (%s); its shard goes to another actor",
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                lost.append(exc)
                queue.insert(0, job)
                continue
            idle.append(actor)
            yield result
    finally:
        for a in actors:
            ray.kill(a)


def _start_actors(cfg: RegenConfig, n: int) -> list:
    """`n` shard actors (one CPU each; a GPU each when the work wants one — decided from the cluster, not
    from this driver's node)."""
    import ray

    from jetflow.cluster import wants_gpu

    actor = ray.remote(num_cpus=1, num_gpus=1 if wants_gpu(cfg.device) else 0)(_ShardWorker)
    actors = [actor.remote(cfg) for _ in range(n)]  # starts a local Ray if none is running
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if n > cpus:
        log.warning("regeneration: %d workers but Ray has %d CPUs (one per worker): %d start now, the rest "
                    "when CPUs free up or nodes join", n, cpus, cpus)
    return actors


def regenerate(cfg: RegenConfig, out: Path | None = None, progress: bool = True,
               max_shards: int | None = None) -> Path:
    """Run (or resume) regeneration; returns the output folder holding shards + manifest.json (on a multi-node
    cluster: this node's view of the folder in cluster storage, whose manifest is here too).
    `max_shards` stops after that many new shards (time-boxing; a rerun continues)."""
    if cfg.backend in PLUGINS:
        _plugin(cfg.backend).check()  # the engine is there: before minutes of target loading, not after
    from jetflow.cluster import is_multi_node

    if cfg.workers > 1 or is_multi_node():
        return _regenerate_on_actors(cfg, out, progress, max_shards)
    target = cfg.load_target()
    out = out or default_output_dir(cfg, target.revision)
    out.mkdir(parents=True, exist_ok=True)
    items = select_prompts(cfg)
    shards = [items[i : i + cfg.shard_size] for i in range(0, len(items), cfg.shard_size)]
    todo = [i for i in range(len(shards)) if not _shard_path(out, i).exists()]
    complete = len(todo) <= (max_shards if max_shards is not None else len(todo))
    todo = todo[:max_shards] if max_shards is not None else todo
    t0 = time.perf_counter()
    if todo:
        from tqdm import tqdm

        done = (regenerate_shard(cfg, shards[i], _shard_path(out, i), target=target) for i in todo)
        for _ in tqdm(done, total=len(todo), desc="regenerate", unit="shard", disable=not progress):
            pass
    seconds = time.perf_counter() - t0
    if not complete:
        return out  # no manifest until every shard exists
    return write_manifest(cfg, out, target_info(target), len(shards), seconds if todo else None)


def _regenerate_on_actors(cfg: RegenConfig, out: Path | None, progress: bool, max_shards: int | None) -> Path:
    """Shards spread over `max(1, cfg.workers)` Ray actors; this process loads no target (the first actor to
    start says which revision answers). On a multi-node cluster every shard goes to cluster storage and the
    manifest is written from what storage holds."""
    import ray

    items = select_prompts(cfg)
    shards = [items[i : i + cfg.shard_size] for i in range(0, len(items), cfg.shard_size)]
    actors = _start_actors(cfg, min(max(1, cfg.workers), len(shards)))
    try:
        return _answer_on(actors, cfg, shards, out, progress, max_shards)
    finally:
        for a in actors:
            ray.kill(a)


def _first_info(actors: list) -> dict:
    """`target_info` from the first actor that starts (one that dies starting — its node lost — is passed over;
    the error of the last is raised when none starts)."""
    import ray
    from ray.exceptions import RayActorError

    pending = [a.info.remote() for a in actors]
    while True:
        (ref,), pending = ray.wait(pending, num_returns=1)
        try:
            return ray.get(ref)
        except RayActorError:
            if not pending:
                raise


def _answer_on(actors: list, cfg: RegenConfig, shards: list, out: Path | None, progress: bool,
               max_shards: int | None) -> Path:
    import ray

    from jetflow.cluster import is_multi_node
    from jetflow.storage import storage

    info = _first_info(actors)
    shared = is_multi_node()
    store = storage()
    if out is None:
        rel = data_rel(cfg, info["revision"])
        out = store.staging(rel)
    else:
        rel = store.rel(out) if shared else None  # one machine: the folder as given
    if shared:
        present = set(store.files(rel))
        done_shards = {i for i in range(len(shards)) if _shard_path(out, i).name in present}
    else:
        out.mkdir(parents=True, exist_ok=True)
        done_shards = {i for i in range(len(shards)) if _shard_path(out, i).exists()}
    todo = [i for i in range(len(shards)) if i not in done_shards]
    complete = len(todo) <= (max_shards if max_shards is not None else len(todo))
    todo = todo[:max_shards] if max_shards is not None else todo
    jobs = [(shards[i], _shard_path(out, i).name if shared else str(_shard_path(out, i))) for i in todo]
    t0 = time.perf_counter()
    from tqdm import tqdm

    done = map_on_started_actors(actors, lambda a: a.ready.remote(),
                                 lambda a, job: a.run.remote(job[0], job[1], rel if shared else None), jobs)
    for _ in tqdm(done, total=len(jobs), desc="regenerate", unit="shard", disable=not progress):
        pass
    seconds = time.perf_counter() - t0
    if not complete:
        return out
    return write_manifest(cfg, out, info, len(shards), seconds if todo else None, rel=rel if shared else None)


def write_manifest(cfg: RegenConfig, out: Path, info: dict, num_shards: int, seconds: float | None,
                   rel: str | None = None) -> Path:
    """The manifest of `num_shards` shards in `out` — or, with `rel`, of the shards in that folder of cluster
    storage, written there and into `out` (this node's view of it). `info`: `target_info` of the target (or
    the target itself)."""
    from jetflow.storage import storage

    if not isinstance(info, dict):
        info = target_info(info)

    store = storage()

    def table(i: int):
        if rel is None:
            return pq.read_table(_shard_path(out, i))
        return pq.read_table(store.path(f"{rel}/{_shard_path(out, i).name}"), filesystem=store.filesystem)

    digest = hashlib.sha256()
    prompts = tokens = stop = 0
    for i in range(num_shards):
        t = table(i)
        for pid, resp in zip(t["prompt_id"].to_pylist(), t["response_ids"].to_pylist()):
            digest.update(pid.encode())
            digest.update(json.dumps(resp).encode())
            tokens += len(resp)
        prompts += t.num_rows
        stop += sum(1 for f in t["finish_reason"].to_pylist() if f == "stop")
    old = json.loads((out / MANIFEST).read_text()) if (out / MANIFEST).exists() else {}
    manifest = {
        "target_model_id": info["model_id"],
        "target_revision": info["revision"],
        "chat_template_sha256": info["chat_template_sha256"],
        "settings": {**asdict(cfg), "dtype": cfg.target_dtype()},  # resolved: the key reads the same anywhere
        "shards": num_shards,
        "sequences": prompts,
        "response_tokens": tokens,
        "finished_with_eos": stop,
        "content_sha256": digest.hexdigest(),
        "seconds": seconds if seconds is not None else old.get("seconds"),
    }
    if versions := cfg.prompt_set_versions():
        manifest["prompt_set_versions"] = versions
    if seconds:
        manifest["response_tokens_per_s"] = tokens / seconds
    if rel is not None and not store.is_object_store:
        store.write_json(f"{rel}/{MANIFEST}", manifest)  # out is that folder
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if rel is not None:
        store.write_json(f"{rel}/{MANIFEST}", manifest)
    return out


def load_regenerated(out: Path):
    """The regenerated sequences as a `datasets.Dataset` (prompt_ids, response_ids, ...)."""
    from datasets import Dataset

    manifest = json.loads((out / MANIFEST).read_text())
    files = [str(_shard_path(out, i)) for i in range(manifest["shards"])]
    return Dataset.from_parquet(files)
