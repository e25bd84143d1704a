"""Compiled step graphs carried between nodes: inductor's on-disk cache, kept in cluster storage.

Compiling the step core's graphs costs a minute or two on a CPU; most of it is building their C++ kernels and
timing the GEMM template's choices, which inductor keeps in its cache folder (`$JETFLOW_HOME/cache/inductor`,
`jetflow.stepcore.inductor.use_inductor_cache`) — a second process on the same node compiles in a fraction of the
time. (`torch.compiler.save_cache_artifacts` carries inductor's FX-graph cache, which graphs with frozen weights
bypass: the kernels and timings are what a frozen graph reuses, and they live in that folder.) A node that never
compiled has none of it: a replica autoscaled onto it would start cold.

So a process that compiled its graphs `publish`es the folder, packed, to cluster storage under a key of
everything the kernels depend on — torch's version, the processor model (its ISA: the kernels are built for it),
the device kind, the target and dtype — and a process starting on another node `restore`s it before it compiles.
Unset `JETFLOW_STORAGE` (one machine): nothing to carry, both are no-ops.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
from pathlib import Path

from jetflow.stepcore.inductor import use_inductor_cache

log = logging.getLogger(__name__)

FOLDER = "compiled"  # in cluster storage: compiled/<key>.tar.gz


def artifact_key(target) -> str:
    """What the cached kernels hold for: torch, the processor (or GPU), the device kind, the target, the dtype."""
    import torch

    from jetflow.stepcore.modes import cpu_model

    device = target.device
    chip = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    ident = f"{torch.__version__}|{chip}|{device.type}|{target.model_id}|{target.revision}|{target.dtype}"
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def _cache_dir() -> Path:
    return Path(use_inductor_cache())


def restore(target) -> bool:
    """Fill this node's inductor cache from cluster storage, when storage holds an archive for `target` and this
    node has not restored it before → whether anything was restored."""
    from jetflow.storage import is_configured, storage

    if not is_configured():
        return False
    rel = f"{FOLDER}/{artifact_key(target)}.tar.gz"
    cache = _cache_dir()
    marker = cache / f".restored-{artifact_key(target)}"
    store = storage()
    if marker.exists() or not store.exists(rel):
        return False
    # (pyarrow undoes a .gz itself on read: "r:*" takes the archive compressed or not)
    with tarfile.open(fileobj=io.BytesIO(store.read_bytes(rel)), mode="r:*") as tar:
        tar.extractall(cache, filter="data")  # files only, inside the cache folder
    marker.touch()
    log.info("compiled step graphs: inductor's cache restored from %s", store.uri_for(rel))
    return True


def publish(target) -> bool:
    """Pack this node's inductor cache into cluster storage for `target` (once: an archive already there stays)
    → whether it was written."""
    from jetflow.storage import is_configured, storage

    if not is_configured():
        return False
    rel = f"{FOLDER}/{artifact_key(target)}.tar.gz"
    store = storage()
    if store.exists(rel):
        return False
    cache = _cache_dir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(cache.rglob("*")):
            if path.is_file() and not path.name.startswith((".restored-", ".")) and "lock" not in path.suffix:
                tar.add(path, arcname=str(path.relative_to(cache)))
    store.write_bytes(rel, buffer.getvalue())
    log.info("compiled step graphs: inductor's cache (%.1f MB) published to %s", buffer.tell() / 1e6,
             store.uri_for(rel))
    return True


def enabled() -> bool:
    """`JETFLOW_COMPILED_ARTIFACTS=0` turns carrying them off."""
    return os.environ.get("JETFLOW_COMPILED_ARTIFACTS", "1") != "0"
