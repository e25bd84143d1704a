"""Which draft head a replica serves, with which tree setting — or plain decoding, and why.

Order: an explicit `head` (any `HeadRef`: folder, head name, `models:/` URI, 'random', 'none'); else the
head the registry holds under `alias` (default "champion") together with the tree setting the main job
stored on that version. No such alias is not an error: the replica serves plain decoding and says so
(`HeadChoice.note`) at start, in /v1/models and in every response. A registry that cannot be read (a tracking
server down or out of reach of the replica's node) is: the replica fails to start with the reason, and Serve
reports the deployment unhealthy — never a replica that silently decodes plain.
Tree setting: the config's explicit `tree`, else the registered one, else `TreeSpec()`.
With `head` unset a replica keeps following the alias (`jetflow.serving.champion`): `alias_version` is what
it polls, `choose_head` what it loads when the version moved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jetflow.head import HeadRef, LoadedHead, load_head
from jetflow.serving.config import ServeConfig
from jetflow.tree import TreeSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadChoice:
    loaded: LoadedHead | None      # the head and where it came from; None for plain decoding
    tree: TreeSpec | None          # None when plain
    note: str | None = None        # said plainly when not speculating (or when something was overridden)
    budget_table: dict | None = None   # {concurrency: budget} the main job measured for this head (auto policy)
    tau_prior: dict | None = None      # {budget: τ} measured for this head (the auto policy's first estimates)
    version: str | None = None         # the registry version served ("3"); None for a folder, random or plain

    @property
    def head(self):
        return self.loaded.head if self.loaded is not None else None

    @property
    def label(self) -> str | None:
        """What usage.jetflow.head shows: "models:/NAME/VERSION", a folder, "random"; None when plain."""
        return self.loaded.label if self.loaded is not None else None

    @property
    def speculative(self) -> bool:
        return self.loaded is not None and self.tree is not None and not self.tree.plain


def choose_head(cfg: ServeConfig, target, device=None) -> HeadChoice:
    """Load the head `cfg` asks for (or the registry's `cfg.alias` head) for `target` (a TargetModel).
    `device`: where a registry head's weights load (default the target's; a replica loading a new champion
    beside running requests loads it on the CPU, and its engine thread moves it).

    Raises HeadNotFoundError / HeadMismatchError for an explicit head that is missing or does not fit,
    RegistryUnavailableError for a registry that cannot be read; a missing alias is plain decoding, with a note.
    """
    choice = _choose(cfg, target, device)
    if choice.loaded is not None and not choice.speculative:  # a budget-1 tree drafts nothing
        return HeadChoice(choice.loaded, choice.tree, version=choice.version,
                          note=f"tree budget 1: head {choice.label} is loaded but decoding is plain")
    return choice


def _choose(cfg: ServeConfig, target, device=None) -> HeadChoice:
    if cfg.head is None:
        return _registered(cfg, target, device)
    ref = HeadRef.parse(cfg.head)
    if ref.kind == "none":
        return HeadChoice(None, None, note="speculation disabled (head: none): plain decoding")
    loaded = ref.load(target, cfg.seed)
    version = loaded.path.name if ref.kind == "registry" and loaded.path is not None else None
    return HeadChoice(loaded, cfg.tree or TreeSpec(), version=version if version and version.isdigit() else None)


def check_head_exists(cfg: ServeConfig) -> None:
    """Fail fast (HeadNotFoundError) on a head folder or name that does not exist, before any replica
    starts: a replica constructor that raises is retried by Serve, which would only delay the error. On a
    multi-node cluster a folder of this node's disk is refused too (InvalidSettingError: replicas on other
    nodes could not load it; register it or put it in cluster storage)."""
    from jetflow.cluster import is_multi_node

    ref = HeadRef.parse(cfg.head)
    if ref.kind == "local":
        ref.resolve()
        if is_multi_node():
            ref.portable()


class RegistryUnavailableError(RuntimeError):
    """The registry could not be read where a replica starts: the replica does not start (Serve reports the
    deployment unhealthy with this message) rather than serve plain decoding unannounced."""


def _probe_server(timeout_s: float = 10.0) -> None:
    """A tracking server that does not answer its /health fails at once (OSError), not after the MLflow
    client's minutes of connection retries: a replica's start says why without that wait."""
    from urllib.parse import urlparse
    from urllib.request import urlopen

    from jetflow.tracking.store import tracking_uri

    uri = tracking_uri()
    if urlparse(uri).scheme in ("http", "https"):
        with urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            pass


def _unavailable(lookup: str, exc: Exception) -> RegistryUnavailableError:
    from jetflow.tracking.store import tracking_uri

    return RegistryUnavailableError(
        f"registry lookup of {lookup} at {tracking_uri()} failed on this replica's node "
        f"({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the replica does not "
        "start rather than serve plain decoding. Check that the tracking server is up and reachable from "
        "every node (mlflow server --host 0.0.0.0), or pass head=none for plain decoding")


def check_registry_reachable(cfg: ServeConfig) -> None:
    """RegistryUnavailableError, before a replica loads its target, when its head comes from the registry and
    the tracking server does not answer: Serve retries a failing constructor (three times a replica), and
    each try would load the weights first."""
    if cfg.head is not None:
        return
    try:
        _probe_server()
    except ImportError:  # no jetflow.tracking: `_registered` says so
        return
    except Exception as exc:  # noqa: BLE001  (the reason goes into the replica's error)
        raise _unavailable(f"the {cfg.alias!r} head", exc) from None


def alias_version(cfg: ServeConfig, target_id: str) -> str | None:
    """The version `cfg.alias` points at now (None: no such alias); RegistryUnavailableError when the registry
    cannot be read. One registry read: what a replica polls every `champion_poll_s`."""
    from jetflow.tracking import registry

    try:
        _probe_server()
        return registry.alias_version(target_id, cfg.alias)
    except Exception as exc:  # noqa: BLE001  (the reason goes into the error)
        raise _unavailable(f"{registry.registered_model_name(target_id)}@{cfg.alias}", exc) from None


def _registered(cfg: ServeConfig, target, device=None) -> HeadChoice:
    try:
        from jetflow.tracking import registry
    except ImportError:
        return HeadChoice(None, None, note="no model registry (jetflow.tracking is not installed): "
                                           "no champion, plain decoding")
    name = registry.registered_model_name(target.model_id)
    try:
        _probe_server()
        found = registry.resolve_alias(target.model_id, cfg.alias)
    except Exception as exc:  # an unreachable or broken tracking store: this replica cannot serve what was asked
        raise _unavailable(f"{name}@{cfg.alias}", exc) from None
    if found is None:
        return HeadChoice(None, None, note=f"no champion registered: registered model {name!r} has no "
                                           f"alias {cfg.alias!r}; plain decoding (promote a head with "
                                           "jobs/promote.py to serve speculatively)")
    note = None
    if found.tree_config_error:
        log.warning("ignoring the stored tree config of %s/%s: %s", found.name, found.version,
                    found.tree_config_error)
        note = f"stored tree config ignored ({found.tree_config_error})"
    ref = HeadRef.parse(f"models:/{found.name}/{found.version}")
    head = load_head(found.path, device=device or target.device, dtype=target.dtype)
    tree = cfg.tree or found.tree_config or TreeSpec()
    table = found.budget_table if cfg.tree is None else None  # measured for the stored tree, not another
    return HeadChoice(LoadedHead(head, ref, found.path), tree, note=note, budget_table=table,
                      tau_prior=found.tau_by_budget, version=found.version)
