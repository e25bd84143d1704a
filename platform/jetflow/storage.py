"""Cluster storage: where what more than one node must read lives — regenerated data and its manifest, feature
caches, Ray Tune and Train results and checkpoints, trained heads.

`JETFLOW_STORAGE` is one URI: a path every node mounts (`/mnt/cluster_storage`: NFS, EFS) or an object store
(`s3://bucket/prefix`; `JETFLOW_STORAGE_ENDPOINT=http://host:port` for an S3-compatible store such as MinIO,
Ceph or moto, else the AWS endpoint), reached through `pyarrow.fs`, the filesystem layer Ray Tune and Train use
for `storage_path` / `storage_filesystem`. Credentials are the node's own (the AWS environment variables, its
config files or its instance role). Unset, storage is `$JETFLOW_HOME` itself: on one machine everything stays
where it always was, and nothing is copied.

`$JETFLOW_HOME` stays each node's own cache. A folder of storage is read through `local(rel)`: on a mounted
filesystem that is the folder itself; from an object store it is a copy under
`$JETFLOW_HOME/storage/<store>/<rel>`, filled file by file on demand, each file written to a temporary name
and renamed, so several processes on one node can fill it at once. The folders are content-addressed where
the data is (data and feature keys, registry versions, checkpoint paths): a folder never changes under a
reader. Writers write into `staging(rel)` (the same places) and `publish(rel)` what they wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

from jetflow.errors import InvalidSettingError
from jetflow.paths import jetflow_home

STORAGE_ENV = "JETFLOW_STORAGE"
ENDPOINT_ENV = "JETFLOW_STORAGE_ENDPOINT"
OBJECT_SCHEMES = ("s3",)
CACHE_DIR = "storage"  # $JETFLOW_HOME/storage/<store hash>/<rel>: an object store's folders on this node


@dataclass(frozen=True)
class Storage:
    """One storage root: `uri` is an absolute path or `s3://bucket/prefix`; `endpoint` overrides the S3 endpoint."""

    uri: str
    endpoint: str | None = None

    def __post_init__(self) -> None:
        scheme = urlparse(self.uri).scheme
        if scheme and scheme not in OBJECT_SCHEMES and scheme != "file":
            raise InvalidSettingError(f"{STORAGE_ENV}={self.uri!r}: use an absolute path (a mount every node "
                                      f"shares) or s3://bucket/prefix")
        if not scheme and not Path(self.uri).is_absolute():
            raise InvalidSettingError(f"{STORAGE_ENV}={self.uri!r} must be absolute (a path every node mounts "
                                      "at the same place) or s3://bucket/prefix")
        if scheme in OBJECT_SCHEMES and not urlparse(self.uri).netloc:
            raise InvalidSettingError(f"{STORAGE_ENV}={self.uri!r} names no bucket: s3://bucket/prefix")

    # ------------------------------------------------------------------ what it is
    @property
    def is_object_store(self) -> bool:
        return urlparse(self.uri).scheme in OBJECT_SCHEMES

    @property
    def root(self) -> Path | None:
        """The storage folder on this machine's filesystem (None for an object store)."""
        if self.is_object_store:
            return None
        return Path(urlparse(self.uri).path if self.uri.startswith("file:") else self.uri).resolve()

    @cached_property
    def _fs(self):
        """(pyarrow filesystem, base path inside it)."""
        import pyarrow.fs as pafs

        if not self.is_object_store:
            return pafs.LocalFileSystem(), str(self.root)
        parsed = urlparse(self.uri)
        kwargs = {"region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
        endpoint = self.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            ep = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
            kwargs.update(endpoint_override=ep.netloc, scheme=ep.scheme)
        return pafs.S3FileSystem(**kwargs), f"{parsed.netloc}{parsed.path}".rstrip("/")

    @property
    def filesystem(self):
        """The `pyarrow.fs.FileSystem` storage is on (what Ray's `storage_filesystem` takes)."""
        return self._fs[0]

    def path(self, rel: str = "") -> str:
        """`rel` as a path inside `filesystem` (for an object store: bucket/prefix/rel)."""
        base = self._fs[1]
        return f"{base}/{_clean(rel)}" if rel else base

    def uri_for(self, rel: str = "") -> str:
        """`rel` as a URI a person can read back: s3://bucket/prefix/rel, or the absolute path."""
        if self.is_object_store:
            return f"{self.uri.rstrip('/')}/{_clean(rel)}" if rel else self.uri
        return str(self.root / _clean(rel)) if rel else str(self.root)

    def ray_storage(self, rel: str = "ray_results") -> tuple[str, object | None]:
        """(storage_path, storage_filesystem) for Ray's `RunConfig`: a plain absolute path on a mounted
        filesystem; on an object store the path inside the bucket with our filesystem (its endpoint)."""
        if not self.is_object_store:
            return str(self.root / rel), None
        return self.path(rel), self.filesystem

    # ------------------------------------------------------------------ files
    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self.filesystem.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def files(self, rel: str) -> dict[str, int]:
        """Every file under folder `rel`, recursively: {path relative to rel: size in bytes}; {} when absent."""
        import pyarrow.fs as pafs

        base = self.path(rel)
        infos = self.filesystem.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return {i.path[len(base) + 1:]: i.size for i in infos if i.type == pafs.FileType.File}

    def read_bytes(self, rel: str) -> bytes:
        with self.filesystem.open_input_stream(self.path(rel)) as fh:
            return fh.read()

    def read_json(self, rel: str) -> dict:
        return json.loads(self.read_bytes(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write one file whole: readers see the old content or the new, never a part (a temporary name and a
        rename on a filesystem; an object store's PUT is atomic)."""
        if not self.is_object_store:
            _atomic_write(self.root / _clean(rel), data)
            return
        with self.filesystem.open_output_stream(self.path(rel)) as fh:
            fh.write(data)

    def write_json(self, rel: str, obj) -> None:
        self.write_bytes(rel, (json.dumps(obj, indent=2) + "\n").encode())

    def delete(self, rel: str) -> None:
        """Remove folder or file `rel` (no error when absent)."""
        import pyarrow.fs as pafs

        info = self.filesystem.get_file_info(self.path(rel))
        if info.type == pafs.FileType.Directory:
            self.filesystem.delete_dir(self.path(rel))
        elif info.type == pafs.FileType.File:
            self.filesystem.delete_file(self.path(rel))

    # ------------------------------------------------------------------ folders on this node
    def staging(self, rel: str) -> Path:
        """Where a writer on this node writes folder `rel` before `publish` (created): the folder itself on a
        mounted filesystem, the node's copy of it for an object store."""
        folder = self.root / _clean(rel) if not self.is_object_store else self._cache / _clean(rel)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def publish(self, rel: str, names: list[str] | None = None) -> None:
        """Upload what `staging(rel)` holds (or only `names`, paths relative to it) to storage; files already
        there with the same size are skipped. A no-op on a mounted filesystem (staging is the folder)."""
        if not self.is_object_store:
            return
        local = self.staging(rel)
        present = self.files(rel)
        todo = names if names is not None else [str(p.relative_to(local)) for p in local.rglob("*")
                                                  if p.is_file() and not p.name.startswith(".")]
        for name in todo:
            src = local / name
            if present.get(name) == src.stat().st_size:
                continue
            with open(src, "rb") as fh, self.filesystem.open_output_stream(self.path(f"{rel}/{name}")) as out:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    out.write(chunk)

    def local(self, rel: str, required: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> Path:
        """Folder `rel` readable on this node: itself on a mounted filesystem; from an object store a copy in
        this node's cache, every file not yet there (or of another size) downloaded to a temporary name and
        renamed (`only`: just these files). `required`: files that must exist (FileNotFoundError naming the
        URI otherwise)."""
        if not self.is_object_store:
            folder = self.root / _clean(rel)
        else:
            folder = self._cache / _clean(rel)
            for name, size in self.files(rel).items():
                if only is not None and name not in only:
                    continue
                dest = folder / name
                if dest.is_file() and dest.stat().st_size == size:
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
                try:
                    with os.fdopen(fd, "wb") as out, self.filesystem.open_input_stream(self.path(f"{rel}/{name}")) as src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
                    os.replace(tmp, dest)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
        missing = [n for n in required if not (folder / n).exists()]
        if missing:
            raise FileNotFoundError(f"{self.uri_for(rel)} has no {', '.join(missing)}")
        return folder

    def rel(self, path: str | Path) -> str:
        """The storage-relative name of folder `path` on this node (what `staging` / `local` gave);
        InvalidSettingError for a folder outside storage, which no other node can read."""
        base = self.root if not self.is_object_store else self._cache
        try:
            return str(Path(path).resolve().relative_to(base.resolve()))
        except ValueError:
            raise InvalidSettingError(f"{path} is not in cluster storage ({self.describe()}): no other node can "
                                      "read it; leave the location to JetFlow, or put it under that storage") from None

    @property
    def _cache(self) -> Path:
        return jetflow_home() / CACHE_DIR / hashlib.sha1(self.uri.encode()).hexdigest()[:10]

    def describe(self) -> str:
        where = f" (endpoint {self.endpoint})" if self.endpoint else ""
        return f"{self.uri_for()}{where}"


def _clean(rel: str) -> str:
    rel = str(rel).strip("/")
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise InvalidSettingError(f"not a storage-relative path: {rel!r}")
    return rel


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_CACHED: dict[tuple, Storage] = {}


def storage() -> Storage:
    """The storage of this process: `$JETFLOW_STORAGE` (with `$JETFLOW_STORAGE_ENDPOINT`), else `$JETFLOW_HOME`."""
    key = (os.environ.get(STORAGE_ENV, "").strip(), os.environ.get(ENDPOINT_ENV, "").strip(), str(jetflow_home()))
    if key not in _CACHED:
        _CACHED[key] = Storage(key[0] or key[2], key[1] or None)
    return _CACHED[key]


def is_configured() -> bool:
    """Whether `JETFLOW_STORAGE` names a storage (unset: `$JETFLOW_HOME`, which only this machine sees)."""
    return bool(os.environ.get(STORAGE_ENV, "").strip())


def storage_env() -> dict[str, str]:
    """The variables that give another process (a Ray worker) this process's storage."""
    env = {}
    if is_configured():
        env[STORAGE_ENV] = os.environ[STORAGE_ENV].strip()
        if os.environ.get(ENDPOINT_ENV, "").strip():
            env[ENDPOINT_ENV] = os.environ[ENDPOINT_ENV].strip()
    return env


@dataclass(frozen=True)
class TuneLocation:
    """A Ray Tune experiment's folder — `storage_path`/`name` on `filesystem` (None: this machine's), what
    `RunConfig`, `Tuner.can_restore` and `Tuner.restore` take — and the small JSON files kept beside Tune's
    state (a sweep's MLflow parent run), read and written through the same filesystem."""

    storage_path: str
    filesystem: object | None
    name: str

    @property
    def path(self) -> str:
        return f"{self.storage_path}/{self.name}"

    def _fs(self):
        import pyarrow.fs as pafs

        return self.filesystem or pafs.LocalFileSystem()

    def read_json(self, file: str) -> dict | None:
        """The JSON file `file` of the experiment's folder, or None when absent or unreadable."""
        try:
            with self._fs().open_input_stream(f"{self.path}/{file}") as fh:
                return json.loads(fh.read())
        except (OSError, ValueError):
            return None

    def write_json(self, file: str, obj) -> None:
        data = (json.dumps(obj) + "\n").encode()
        if self.filesystem is None:
            _atomic_write(Path(self.path) / file, data)
            return
        with self.filesystem.open_output_stream(f"{self.path}/{file}") as fh:
            fh.write(data)

    def can_restore(self) -> bool:
        from ray import tune

        return tune.Tuner.can_restore(self.path, storage_filesystem=self.filesystem)

    def describe(self) -> str:
        fs = self.filesystem
        return f"{fs.type_name}://{self.path}" if fs is not None else self.path


def tune_location(name: str, override: str = "") -> TuneLocation:
    """Where experiment `name` keeps its state: `override` (an absolute folder) when given, else cluster storage's
    `ray_results` (`$JETFLOW_HOME/ray_results` on one machine)."""
    if override:
        return TuneLocation(str(Path(override).resolve()), None, name)
    path, fs = storage().ray_storage()
    return TuneLocation(path, fs, name)
