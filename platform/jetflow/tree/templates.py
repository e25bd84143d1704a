"""`ShapeTemplates`: the tree-shape templates of the prompt-adaptive routers and the template bandit — config,
not code. The shipped set is `templates/shapes.json` (the paper's class templates, task aliases and reasoning
markers, plus our prompt-set aliases and bandit arms); a file of the same form replaces it
(`TreeContext(templates=ShapeTemplates.load(path))`).

A template is a list of per-depth fanout caps, depth 1 first; depths past its end take 1 (a chain) and every
cap is clamped to 1..width (`expand_template`), as the paper's routers read theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from jetflow.errors import InvalidSettingError

SHIPPED = Path(__file__).with_name("templates") / "shapes.json"
Template = tuple[int, ...]


def expand_template(template: Sequence[int], depths: int, width: int) -> list[int]:
    """A template stretched to `depths` caps: missing depths take 1, each cap clamped to 1..width."""
    return [max(1, min(int(template[d]) if d < len(template) else 1, width)) for d in range(depths)]


def _template(where: str, value: Any) -> Template:
    if (not isinstance(value, (list, tuple)) or not value
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in value)):
        raise InvalidSettingError(f"tree template {where} must be a non-empty list of fanout caps >= 1, got {value!r}")
    return tuple(value)


def _words(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or any(not isinstance(v, str) or not v for v in value):
        raise InvalidSettingError(f"tree templates: {where} must be a list of non-empty strings, got {value!r}")
    return tuple(value)


@dataclass(frozen=True, eq=False)
class ShapeTemplates:
    """Router classes → templates, the labels a caller may give (`PromptInfo.task`) → class, the reasoning
    router's open-ended template and detection vocabulary, the bandit's arms (name → template, in order)."""

    classes: Mapping[str, Template]
    default_class: str                      # an unknown label, or a fingerprint in between, lands here
    task_aliases: Mapping[str, str]         # lower-case label → class
    open_ended: Template                    # reasoning_router's shape for a prompt that is not reasoning
    reasoning_modes: frozenset[str]         # PromptInfo.mode values that mean step-by-step reasoning
    reasoning_labels: frozenset[str]        # PromptInfo.task values that do
    reasoning_markers: tuple[str, ...]      # case-insensitive substrings of the prompt text that do
    bandit_arms: tuple[tuple[str, Template], ...]

    def class_of(self, label: str) -> str:
        """The class a caller's task label names (the default class for a label nobody aliased)."""
        return self.task_aliases.get(label.lower(), self.default_class)

    def template(self, cls: str) -> Template:
        return self.classes.get(cls, self.classes[self.default_class])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ShapeTemplates":
        known = {"about", "classes", "default_class", "task_aliases", "reasoning", "bandit_arms"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidSettingError(f"unknown tree template fields {unknown}; known: {', '.join(sorted(known))}")
        missing = sorted({"classes", "default_class", "reasoning", "bandit_arms"} - set(d))
        if missing:
            raise InvalidSettingError(f"tree templates lack the fields {missing}")
        for name in ("classes", "task_aliases", "reasoning", "bandit_arms"):
            if not isinstance(d.get(name, {}), Mapping):
                raise InvalidSettingError(f"tree templates: {name} must be a JSON object, got {d[name]!r}")
        classes = {str(k): _template(f"classes.{k}", v) for k, v in d["classes"].items()}
        default = d["default_class"]
        aliases = {str(k).lower(): str(v) for k, v in d.get("task_aliases", {}).items()}
        reasoning = d["reasoning"]
        arms = tuple((str(k), _template(f"bandit_arms.{k}", v)) for k, v in d["bandit_arms"].items())
        if default not in classes:
            raise InvalidSettingError(f"tree templates: default_class {default!r} is not one of the classes "
                                      f"{sorted(classes)}")
        stray = sorted({v for v in aliases.values() if v not in classes})
        if stray:
            raise InvalidSettingError(f"tree templates: task_aliases name unknown classes {stray}")
        return cls(classes=classes, default_class=default, task_aliases=aliases,
                   open_ended=_template("reasoning.open_ended", reasoning.get("open_ended")),
                   reasoning_modes=frozenset(w.lower() for w in _words("reasoning.modes", reasoning.get("modes", []))),
                   reasoning_labels=frozenset(w.lower() for w in _words("reasoning.labels",
                                                                         reasoning.get("labels", []))),
                   reasoning_markers=tuple(w.lower() for w in _words("reasoning.markers",
                                                                      reasoning.get("markers", []))),
                   bandit_arms=arms)

    def to_dict(self) -> dict[str, Any]:
        return {"classes": {k: list(v) for k, v in self.classes.items()}, "default_class": self.default_class,
                "task_aliases": dict(self.task_aliases),
                "reasoning": {"open_ended": list(self.open_ended), "modes": sorted(self.reasoning_modes),
                              "labels": sorted(self.reasoning_labels), "markers": list(self.reasoning_markers)},
                "bandit_arms": {k: list(v) for k, v in self.bandit_arms}}

    @classmethod
    def load(cls, path: str | Path) -> "ShapeTemplates":
        path = Path(path).expanduser()
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise InvalidSettingError(f"no tree template file at {path}") from None
        except json.JSONDecodeError as exc:
            raise InvalidSettingError(f"tree template file {path} is not JSON ({exc.msg})") from None

    @staticmethod
    @lru_cache(maxsize=1)
    def shipped() -> "ShapeTemplates":
        """The templates that ship with JetFlow (`templates/shapes.json`), read once."""
        return ShapeTemplates.load(SHIPPED)
