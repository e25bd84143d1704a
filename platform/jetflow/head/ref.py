"""Head references: what a user writes for a draft head — nothing (plain decoding), `random` or
`random-bidirectional` (random init, for checking losslessness), a head folder, a name under
`$JETFLOW_HOME/heads`, a published head's hub id (`z-lab/Qwen3-8B-DFlash-b16`, where a hub is reachable), a
registry URI `models:/NAME@ALIAS` / `models:/NAME/VERSION`, or a folder in cluster storage
(`s3://bucket/prefix/…`, e.g. a Ray Train checkpoint) — parsed and resolved here, in one place, for the
CLI, evaluation, sweeps and serving alike.

Across nodes only references travel: a registry URI or a storage URI is resolved on the node that loads
the head (downloaded into its own `$JETFLOW_HOME`); a folder of one node's disk is not (`portable`).

Registry URIs are resolved by a plugged-in resolver (`URI_RESOLVERS`): by default
`jetflow.tracking.registry.resolve_head_uri`, imported on first use, so this package depends on nothing
downstream of it.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from jetflow.errors import HeadNotFoundError, InvalidSettingError
from jetflow.paths import heads_dir

RANDOM_HEADS = {"random": True, "random-bidirectional": False}  # name → causal
NO_HEAD = "none"
REGISTRY_SCHEME = "models:/"
STORAGE_SCHEMES = ("s3://",)
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")   # org/name, as the hub spells repositories
MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))/?$")
# scheme → resolver (URI → local head folder), or "module:function" imported when first needed
URI_RESOLVERS: dict[str, str | Callable[[str], Path]] = {
    REGISTRY_SCHEME: "jetflow.tracking.registry:resolve_head_uri",
}
_TRAIN_HINT = "train one (jobs/train.py) or pass --head random"


def register_resolver(scheme: str, resolver: Callable[[str], Path]) -> None:
    """Plug in how URIs of `scheme` become local head folders (e.g. another registry)."""
    URI_RESOLVERS[scheme] = resolver


def parse_models_uri(uri: str) -> tuple[str, str]:
    """`models:/NAME@ALIAS` → (NAME, ALIAS); `models:/NAME/VERSION` → (NAME, VERSION)."""
    m = MODELS_URI.match(uri.strip())
    if m is None:
        raise HeadNotFoundError(f"{uri!r} is not a registry URI; use models:/NAME@ALIAS or models:/NAME/VERSION "
                                "(e.g. models:/smollm2-135m-jetflow-head@champion)")
    return m["name"], m["alias"] or m["version"]


def hub_head_path(repo_id: str) -> Path:
    """The folder of a head published on a model hub (config.json + safetensors): the local hub cache first,
    the hub itself where one is reachable. HeadNotFoundError when neither has it."""
    from huggingface_hub import snapshot_download

    errors = []
    for local_only in (True, False):
        try:
            return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"],
                                          local_files_only=local_only))
        except (OSError, ValueError) as exc:  # not cached / no hub / no such repository
            errors.append(f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    raise HeadNotFoundError(f"no head folder {repo_id!r}, and no hub head of that id in the local hub cache or "
                            f"on a reachable hub ({'; '.join(errors)}); {_TRAIN_HINT}")


def local_head_path(name_or_path: str | Path) -> Path:
    """A head folder path, a bare name under `$JETFLOW_HOME/heads/`, or a hub id `org/name` (downloaded once
    into the hub cache). HeadNotFoundError otherwise."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p.resolve()
    if not p.is_absolute() and HUB_ID.fullmatch(str(name_or_path)):
        return hub_head_path(str(name_or_path))
    if p.is_absolute() or len(p.parts) > 1:
        raise HeadNotFoundError(f"no head at {p}; {_TRAIN_HINT}")
    named = heads_dir() / str(name_or_path)
    if named.exists():
        return named
    raise HeadNotFoundError(f"no head named {name_or_path!r} ({named} does not exist) and no such path; {_TRAIN_HINT}")


def storage_head_path(uri: str) -> Path:
    """A head folder in cluster storage (`s3://…/<folder>`: config.json + model.safetensors at its top), copied
    into this node's cache (its top-level files: a checkpoint's optimizer states stay behind)."""
    from jetflow.storage import storage

    st = storage()
    prefix = st.uri_for().rstrip("/") + "/"
    if not uri.startswith(prefix):
        raise HeadNotFoundError(f"{uri} is not in this node's cluster storage ({st.describe()}): set "
                                "JETFLOW_STORAGE to the store that holds it")
    rel = uri[len(prefix):].rstrip("/")
    top = tuple(name for name in st.files(rel) if "/" not in name)
    try:
        return st.local(rel, required=("config.json", "model.safetensors"), only=top)
    except FileNotFoundError as exc:
        raise HeadNotFoundError(f"no head at {uri} ({exc})") from None


@dataclass(frozen=True)
class HeadRef:
    """A parsed head reference. kind: "none", "random", "registry" (text is the URI), "storage" (a folder in
    cluster storage, text is its URI) or "local" (a folder, a name or a hub id; text as given)."""

    kind: str
    text: str | None = None

    @classmethod
    def parse(cls, text: "str | Path | HeadRef | None") -> "HeadRef":
        if isinstance(text, HeadRef):
            return text
        if text is None or (isinstance(text, str) and text.strip().lower() in ("", NO_HEAD)):
            return cls("none")
        text = str(text).strip()
        if text in RANDOM_HEADS:
            return cls("random", text)
        if text.startswith(REGISTRY_SCHEME):
            parse_models_uri(text)
            return cls("registry", text)
        if text.startswith(STORAGE_SCHEMES):
            return cls("storage", text)
        return cls("local", text)

    def __str__(self) -> str:
        return self.text or NO_HEAD

    @property
    def uri(self) -> str | None:
        return self.text if self.kind == "registry" else None

    def resolve(self) -> Path | None:
        """The local head folder (a registry version downloaded once); None for none / random.
        Raises HeadNotFoundError for a missing folder, name, model, alias or version."""
        if self.kind in ("none", "random"):
            return None
        if self.kind == "local":
            return local_head_path(self.text)
        if self.kind == "storage":
            return storage_head_path(self.text)
        resolver = URI_RESOLVERS[REGISTRY_SCHEME]
        if isinstance(resolver, str):
            module, _, fn = resolver.partition(":")
            try:
                resolver = getattr(importlib.import_module(module), fn)
            except ModuleNotFoundError as exc:
                raise InvalidSettingError(f"{self.text}: registry URIs need {module} ({exc}); pass the head's "
                                          "folder instead") from None
            URI_RESOLVERS[REGISTRY_SCHEME] = resolver
        return Path(resolver(self.text))

    def portable(self) -> "HeadRef":
        """This reference as a process on another node can resolve it: none, random, registry and storage
        references as they are; a folder only when every node sees it (inside cluster storage on a mounted
        filesystem). InvalidSettingError otherwise, saying what to do."""
        if self.kind != "local":
            return self
        from jetflow.storage import storage

        st = storage()
        path = Path(self.text).expanduser()
        if st.root is not None and path.is_absolute() and path.resolve().is_relative_to(st.root):
            return self
        raise InvalidSettingError(
            f"head {self.text!r} is a folder on this node's disk, which other nodes of the cluster do not see: "
            "register it (jobs/register.py --head … → models:/NAME/VERSION) or put it in cluster storage "
            f"({st.describe()}) and pass that URI")

    def is_causal(self) -> bool:
        """Whether the head is causal, from its config.json alone (no weights, no target)."""
        from jetflow.head.config import HeadConfig

        if self.kind == "random":
            return RANDOM_HEADS[self.text]
        if self.kind == "none":
            raise InvalidSettingError("no head given")
        path = self.resolve()
        try:
            return HeadConfig.from_dflash_dict(json.loads((path / "config.json").read_text())).causal
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return True  # unreadable: load_head reports what is wrong with the checkpoint

    def load(self, target, seed: int = 0) -> "LoadedHead | None":
        """The head on `target`'s device and dtype, fitted to it (HeadMismatchError otherwise); None for none."""
        import torch

        from jetflow.head.config import HeadConfig
        from jetflow.head.io import check_fits, load_head
        from jetflow.head.model import DraftHead

        if self.kind == "none":
            return None
        if self.kind == "random":
            torch.manual_seed(seed)
            head = DraftHead(HeadConfig.for_target(target, causal=RANDOM_HEADS[self.text]))
            return LoadedHead(head.to(device=target.device, dtype=target.dtype).eval(), self)
        path = self.resolve()
        head = load_head(path, device=target.device, dtype=target.dtype)
        check_fits(head.config, target)
        prov_file = path / "provenance.json"
        try:
            provenance = json.loads(prov_file.read_text()) if prov_file.is_file() else None
        except json.JSONDecodeError:
            provenance = None  # a damaged provenance record must not block decoding
        return LoadedHead(head, self, path, provenance)


@dataclass
class LoadedHead:
    """A loaded head and where it came from."""

    head: object                          # jetflow.head.DraftHead
    ref: HeadRef
    path: Path | None = None              # local folder (for a registry head: where it was downloaded)
    provenance: dict | None = field(default=None, repr=False)   # provenance.json beside the checkpoint

    @property
    def causal(self) -> bool:
        return bool(self.head.config.causal)

    @property
    def label(self) -> str:
        """What responses and tables show: the URI, the folder, or "random"."""
        if self.ref.kind == "storage":
            return str(self.ref)
        return self.ref.uri or (str(self.path) if self.path is not None else str(self.ref))

    def describe(self) -> dict:
        """{"path", "uri", "config", "provenance"}: the evaluation report's head entry."""
        return {"path": str(self.path) if self.path is not None else None, "uri": self.ref.uri,
                "config": self.head.config.to_dict(), "provenance": self.provenance}
