"""Which draft head a replica serves, with which tree settings — or plain decoding, and why.

Order: an explicit `head` (folder, head name, `models:/` URI, 'random', 'none'); else the head the
registry holds under `alias` (default "champion") together with the tree config the budget sweep
stored on that version. No such alias — or no registry at all — is not an error: the replica serves
plain decoding and says so (`HeadChoice.note`) at start, in /v1/models and in every response.
Tree settings: explicit config values, else the registered tree config, else `DEFAULT_TREE`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jetflow.errors import HeadNotFoundError, InvalidSettingError
from jetflow.serving.config import DEFAULT_TREE, ServeConfig
from jetflow.serving.schema import TreeSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadChoice:
    head: object | None            # a DraftHead, or None for plain decoding
    label: str | None              # what usage.jetflow.head shows: URI, folder, "random"; None when plain
    tree: TreeSettings | None      # None when plain
    note: str | None = None        # said plainly when not speculating (or when something was overridden)

    @property
    def speculative(self) -> bool:
        return self.head is not None and self.tree is not None and self.tree.budget > 1


def _tree(cfg: ServeConfig, registered: dict | None) -> TreeSettings:
    """Explicit config values win over the registered tree config, which wins over the defaults."""
    merged = {**DEFAULT_TREE, **{k: v for k, v in (registered or {}).items() if k in DEFAULT_TREE}}
    for key in DEFAULT_TREE:
        if getattr(cfg, key) is not None:
            merged[key] = getattr(cfg, key)
    tree = TreeSettings(**merged)
    from jetflow.decode import DecodeConfig

    # the decoder's own validation (algorithm known, budget and width in range) before any request
    DecodeConfig(budget=tree.budget, width=tree.width, algorithm=tree.algorithm)
    return tree


def choose_head(cfg: ServeConfig, target) -> HeadChoice:
    """Load the head `cfg` asks for (or the registry's `cfg.alias` head) for `target` (a TargetModel).

    Raises HeadNotFoundError / HeadMismatchError for an explicit head that is missing or does not fit;
    never raises for a missing alias or an unreachable registry (plain decoding, with a note).
    """
    choice = _choose(cfg, target)
    if choice.head is not None and not choice.speculative:  # a budget-1 tree drafts nothing
        return HeadChoice(choice.head, choice.label, choice.tree,
                          note=f"tree budget 1: head {choice.label} is loaded but decoding is plain")
    return choice


def _choose(cfg: ServeConfig, target) -> HeadChoice:
    from jetflow.cli import RANDOM_HEADS, load_head_arg
    from jetflow.head import load_head

    spec = cfg.head
    if spec is not None and spec.lower() == "none":
        return HeadChoice(None, None, None, note="speculation disabled (head: none): plain decoding")
    if spec in RANDOM_HEADS:
        return HeadChoice(load_head_arg(spec, target, cfg.seed), spec, _tree(cfg, None))
    if spec is not None and spec.startswith("models:/"):
        registry = _registry()
        if registry is None:
            raise HeadNotFoundError(f"cannot resolve {spec}: the model registry (jetflow.tracking) is not installed")
        return HeadChoice(load_head(registry.resolve_head_uri(spec)), spec, _tree(cfg, None))
    if spec is not None:
        return HeadChoice(load_head(spec), str(spec), _tree(cfg, None))
    return _registered(cfg, target)


def check_head_exists(cfg: ServeConfig) -> None:
    """Fail fast (HeadNotFoundError) on a head folder or name that does not exist, before any replica
    starts: a replica constructor that raises is retried by Serve, which would only delay the error."""
    from jetflow.cli import RANDOM_HEADS
    from jetflow.head import resolve_head_path

    spec = cfg.head
    if spec is None or spec.lower() == "none" or spec in RANDOM_HEADS or spec.startswith("models:/"):
        return
    resolve_head_path(spec)


def _registry():
    try:
        from jetflow.tracking import registry
    except ImportError:
        return None
    return registry


def _registered(cfg: ServeConfig, target) -> HeadChoice:
    from jetflow.head import load_head

    registry = _registry()
    if registry is None:
        return HeadChoice(None, None, None, note="no model registry (jetflow.tracking is not installed): "
                                                 "no champion, plain decoding")
    name = registry.registered_model_name(target.model_id)
    try:
        found = registry.resolve_alias(target.model_id, cfg.alias)
    except Exception as exc:  # an unreachable or broken tracking store must not stop serving
        log.warning("registry lookup of %s@%s failed: %r", name, cfg.alias, exc)
        return HeadChoice(None, None, None, note=f"registry lookup of {name}@{cfg.alias} failed "
                                                 f"({exc.__class__.__name__}: {exc}): plain decoding")
    if found is None:
        return HeadChoice(None, None, None, note=f"no champion registered: registered model {name!r} has no "
                                                 f"alias {cfg.alias!r}; plain decoding (promote a head with "
                                                 "jobs/promote.py to serve speculatively)")
    try:
        tree = _tree(cfg, found.tree_config)
    except InvalidSettingError as exc:
        log.warning("ignoring the stored tree config of %s/%s: %s", found.name, found.version, exc)
        tree = _tree(cfg, None)
    return HeadChoice(load_head(found.path), f"models:/{found.name}/{found.version}", tree)
