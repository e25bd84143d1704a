"""Which heads an evaluation compares, and where they came from: a head folder or name, a registry URI
(`models:/NAME@ALIAS`, `models:/NAME/VERSION`), or a random init (`random`, `random-bidirectional`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jetflow.errors import InvalidSettingError

RANDOM_HEADS = {"random": True, "random-bidirectional": False}  # name → causal
REGISTRY_SCHEME = "models:/"


@dataclass
class EvalHead:
    """A loaded head plus its origin, as the report's `head` entry describes it."""

    head: object                      # jetflow.head.DraftHead
    path: Path | None = None          # local folder (also for a registry head: where it was resolved to)
    uri: str | None = None            # the registry URI it was given as, if any
    provenance: dict | None = None    # provenance.json beside the checkpoint, if present
    name: str = ""                    # what the user passed (for tables and messages)

    @property
    def causal(self) -> bool:
        return bool(self.head.config.causal)

    def describe(self) -> dict:
        """{"path", "uri", "config", "provenance"}: the report contract's head entry."""
        return {"path": str(self.path) if self.path is not None else None, "uri": self.uri,
                "config": self.head.config.to_dict(), "provenance": self.provenance}


def resolve_head_spec(spec: str) -> tuple[Path | None, str | None]:
    """(local folder, registry URI) for a head spec, without loading the target or the weights, so a
    missing head fails at once. Random heads give (None, None). Raises HeadNotFoundError."""
    from jetflow.head import resolve_head_path

    if spec in RANDOM_HEADS:
        return None, None
    if spec.startswith(REGISTRY_SCHEME):
        try:
            from jetflow.tracking.registry import resolve_head_uri
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("jetflow.tracking"):
                raise InvalidSettingError(
                    f"{spec}: registry URIs need jetflow.tracking.registry, which this install lacks; "
                    "pass the head's folder instead") from None
            raise
        return Path(resolve_head_uri(spec)), spec
    return resolve_head_path(spec), None


def spec_is_causal(spec: str) -> bool:
    """Whether a head spec names a causal head, read from its config.json (no weights, no target)."""
    from jetflow.head import HeadConfig

    if spec in RANDOM_HEADS:
        return RANDOM_HEADS[spec]
    path, _ = resolve_head_spec(spec)
    try:
        return HeadConfig.from_dflash_dict(json.loads((path / "config.json").read_text())).causal
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return True  # unreadable: load_head reports what is wrong with the checkpoint


def load_eval_head(spec: str, target, seed: int = 0) -> EvalHead:
    """Load a head spec (see `resolve_head_spec`) onto `target`'s device and dtype."""
    import torch

    from jetflow.head import DraftHead, HeadConfig, load_head

    if spec in RANDOM_HEADS:
        torch.manual_seed(seed)
        head = DraftHead(HeadConfig.for_target(target, causal=RANDOM_HEADS[spec]))
        return EvalHead(head.to(device=target.device, dtype=target.dtype).eval(), name=spec)
    path, uri = resolve_head_spec(spec)
    head = load_head(path, device=target.device, dtype=target.dtype)
    prov_file = path / "provenance.json"
    try:
        provenance = json.loads(prov_file.read_text()) if prov_file.is_file() else None
    except json.JSONDecodeError:
        provenance = None  # a damaged provenance record must not block an evaluation
    return EvalHead(head, path=path, uri=uri, provenance=provenance, name=spec)
