"""Typed dataclass configs on the command line: every field becomes `--field-name`, documented in
`--help` with its type and default; only the options a user gives override the preset."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        flag = "--" + f.name.replace("_", "-")
        origin = typing.get_origin(hint)
        if hint is bool:
            group.add_argument(flag, type=_parse_bool, default=None, metavar="BOOL", help=f"(default {default})")
        elif origin in (list, tuple):
            (inner,) = {a for a in typing.get_args(hint) if a is not Ellipsis} or {str}
            group.add_argument(flag, type=inner, nargs="+", default=None, help=f"(default {default})")
        else:
            group.add_argument(flag, type=hint, default=None, help=f"(default {default})")


def overrides(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and getattr(args, f.name, None) is not None}
