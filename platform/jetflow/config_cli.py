"""Typed dataclass configs on the command line — the one config surface of every entry point.

Every field becomes `--field-name` (plus any `metadata={"flags": (...)}` aliases), documented in `--help`
with the comment beside the field in the dataclass's source, and its default. A field whose type is itself
a dataclass (a `TreeSpec` inside `DecodeConfig`) contributes its own fields as flags; it is rebuilt with
the class's `from_options(**fields)` when it has one. One syntax for each kind of value:

- lists: one comma-separated value, `--budgets 4,8,16` (a list of free text, such as stop strings,
  marked `metadata={"split": False}`, takes one item per occurrence: `--stop A --stop B`);
- booleans: `--causal false`, `--causal` (= true) or `--no-causal`;
- everything else: the value as is, converted to the field's type.

Only the options a user gives override the base config (a preset, or the class defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from typing import Any

from jetflow.errors import InvalidSettingError


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


SPILL = "_words_after_flags"


class _BoolFlag(argparse.Action):
    """`--x`, `--x true|false`: a word after a bare flag that is not a boolean is not the flag's value; it is
    kept in `SPILL` for the positional arguments (`jetflow generate --json "a prompt"`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            setattr(namespace, self.dest, True)
            return
        try:
            setattr(namespace, self.dest, _parse_bool(values))
        except argparse.ArgumentTypeError:
            setattr(namespace, self.dest, True)
            getattr(namespace, SPILL, None) or setattr(namespace, SPILL, [])
            getattr(namespace, SPILL).append(values)


def spilled_words(args: argparse.Namespace) -> list[str]:
    """Words that followed a bare boolean flag (see `_BoolFlag`), in order: positional values."""
    return list(getattr(args, SPILL, None) or [])


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args`, refusing a non-boolean word after a boolean flag (for parsers without
    positional arguments to take it)."""
    args = parser.parse_args(argv)
    if spilled_words(args):
        parser.error(f"expected true/false after a flag, got {' '.join(map(repr, spilled_words(args)))}")
    return args


_FIELD = re.compile(r"^    (\w+)\s*:[^#]*?(?:#\s*(.*))?$")
_MORE = re.compile(r"^\s{5,}#\s*(.*)$")  # indented past the fields: a continuation, not a section title


def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} from the source of the class and of its dataclass bases: the comment after
    `name: type = default`, plus the comment-only lines right below it that are indented deeper than the
    fields (continuations). A subclass's comment wins over its base's."""
    out: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        last = None
        for line in inspect.getsource(klass).splitlines():
            if (m := _FIELD.match(line)) and m.group(1) in names:
                last = m.group(1)
                out[last] = (m.group(2) or "").strip()
            elif last and (m := _MORE.match(line)) and out[last]:
                out[last] += " " + m.group(1).strip()
            else:
                last = None
    return out


def _unwrap(hint: Any) -> Any:
    """`int | None` → int."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    return hint


def _list_item_type(hint: Any) -> type:
    (inner,) = {a for a in typing.get_args(hint) if a is not Ellipsis} or {str}
    return inner


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _fields(cls: type, skip: tuple[str, ...] = ()):
    """(field, resolved type hint, nested dataclass type or None) for the CLI-visible fields of `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        hint = _unwrap(hints[f.name])
        yield f, hint, hint if dataclasses.is_dataclass(hint) else None


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = (),
                       group=None) -> None:
    """Add a flag for every field of `cls` (nested dataclass fields: theirs, in the same group)."""
    group = group or parser.add_argument_group(title)
    comments = field_comments(cls)
    for f, hint, nested in _fields(cls, skip):
        if nested is not None:
            add_dataclass_args(parser, nested, title, group=group)
            continue
        default = _default(f)
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("flags", ())]
        shown = (",".join(map(str, default)) or "none") if isinstance(default, (list, tuple)) else default
        comment = comments.get(f.name, "")
        text = comment if ("(default" in comment or "(required" in comment) else f"{comment} (default {shown})".strip()
        text = text.replace("%", "%%")  # argparse formats help with %
        origin = typing.get_origin(hint)
        if hint is bool:
            negations = ", ".join("--no-" + flag.removeprefix("--") for flag in flags)
            group.add_argument(*flags, dest=f.name, action=_BoolFlag, nargs="?", default=None, metavar="BOOL",
                               help=f"{text}; {negations} = false")
            for flag in flags:
                group.add_argument("--no-" + flag.removeprefix("--"), dest=f.name, action="store_const",
                                   const=False, help=argparse.SUPPRESS)
        elif origin in (list, tuple) and not f.metadata.get("split", True):
            group.add_argument(*flags, dest=f.name, action="append", default=None, metavar="TEXT",
                               help=f"{text} (repeat the option for more)")
        elif origin in (list, tuple):
            group.add_argument(*flags, dest=f.name, default=None, metavar="A,B,...", help=text)
        else:
            group.add_argument(*flags, dest=f.name, type=hint if hint in (int, float) else str, default=None,
                               help=text)


def _convert_list(name: str, raw: str | list[str], hint: Any, split: bool = True) -> list:
    inner = _list_item_type(hint)
    items = [t.strip() for t in raw.split(",") if t.strip()] if split else list(raw)
    if not items:
        raise InvalidSettingError(f"--{name.replace('_', '-')} needs at least one value (comma-separated)")
    try:
        return [_parse_bool(t) if inner is bool else inner(t) for t in items]
    except (ValueError, argparse.ArgumentTypeError):
        raise InvalidSettingError(f"--{name.replace('_', '-')} takes comma-separated {inner.__name__} values, "
                                  f"got {raw!r}") from None


def overrides(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """{field: value} of the (non-nested) options the user gave, lists converted to their item type."""
    out = {}
    for f, hint, nested in _fields(cls, skip):
        value = getattr(args, f.name, None)
        if nested is None and value is not None:
            is_list = typing.get_origin(hint) in (list, tuple)
            out[f.name] = _convert_list(f.name, value, hint, f.metadata.get("split", True)) if is_list else value
    return out


def build_config(cls: type, args: argparse.Namespace, base: Any = None, skip: tuple[str, ...] = ()) -> Any:
    """An instance of `cls`: `base`'s values (default: the class defaults), overridden by the options given;
    nested dataclass fields are rebuilt the same way (with `from_options` when the class has one)."""
    values: dict[str, Any] = {}
    given = overrides(args, cls, skip)
    for f, _, nested in _fields(cls, skip):
        current = getattr(base, f.name) if base is not None else _default(f)
        if nested is not None:
            if current is None:
                current = nested()
            sub = build_config(nested, args, current)
            values[f.name] = sub
        elif f.name in given:
            values[f.name] = given[f.name]
        elif base is not None:
            values[f.name] = current
    if base is not None:
        keep = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls) if f.name not in values and f.init}
        values = {**keep, **values}
    maker = getattr(cls, "from_options", None) or cls
    return maker(**values)
