"""Package exports imported on first use.

A package such as `jetflow.decode` re-exports names from modules that import torch, MLflow or Ray. Importing
the package for one light submodule (an options class, read by every entry point's `--help`) must not pay for
those: its `__init__` declares where each name lives, and the module is imported when the name is first used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]]) -> tuple[Callable, Callable]:
    """`(__getattr__, __dir__)` for `package`'s `__init__`: `exports` maps a submodule (".decoder") to the
    names it provides. A submodule not imported yet is also reachable as an attribute, as it was when the
    `__init__` imported everything."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name in where:
            value = getattr(importlib.import_module(where[name], package), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
