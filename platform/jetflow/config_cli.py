"""Typed dataclass configs on the command line: every field becomes `--field-name`, documented in
`--help` with the comment beside the field in the dataclass's source, and its default; only the options a
user gives override the preset."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from typing import Any


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


_FIELD = re.compile(r"^    (\w+)\s*:[^#]*?(?:#\s*(.*))?$")
_MORE = re.compile(r"^\s{5,}#\s*(.*)$")  # indented past the fields: a continuation, not a section title


def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} from the class source: the comment after `name: type = default`, plus the
    comment-only lines right below it that are indented deeper than the fields (continuations)."""
    out: dict[str, str] = {}
    last = None
    for line in inspect.getsource(cls).splitlines():
        if (m := _FIELD.match(line)) and m.group(1) in {f.name for f in dataclasses.fields(cls)}:
            last = m.group(1)
            out[last] = (m.group(2) or "").strip()
        elif last and (m := _MORE.match(line)) and out[last]:
            out[last] += " " + m.group(1).strip()
        else:
            last = None
    return out


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        flag = "--" + f.name.replace("_", "-")
        text = f"{comments[f.name]} (default {default})" if comments.get(f.name) else f"(default {default})"
        text = text.replace("%", "%%")  # argparse formats help with %
        origin = typing.get_origin(hint)
        if hint is bool:
            group.add_argument(flag, type=_parse_bool, default=None, metavar="BOOL", help=text)
        elif origin in (list, tuple):
            (inner,) = {a for a in typing.get_args(hint) if a is not Ellipsis} or {str}
            group.add_argument(flag, type=inner, nargs="+", default=None, help=text)
        else:
            group.add_argument(flag, type=hint, default=None, help=text)


def overrides(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and getattr(args, f.name, None) is not None}
