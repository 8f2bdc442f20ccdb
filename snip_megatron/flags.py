"""Command-line flags generated from config dataclasses: one flag per field, with the field's type,
default and docstring (the string literal under it, as our configs write them) as its help, so a
config and its flags never drift apart. Argparse and the standard library only."""

from __future__ import annotations

import argparse
import ast
import inspect
import textwrap
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from functools import lru_cache


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, whitespace collapsed} for `cls` and its dataclass bases (a
    subclass's docstring wins). Fields without one are absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not hasattr(klass, "__dataclass_fields__"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (a generated class)
            continue
        body = ast.parse(source).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise ValueError(f"field {f.name!r} has no default: it cannot be an optional flag")


def add_dataclass_flags(group, cls: type, *, flag_of: Callable[[str], str] | None = None,
                        only: Iterable[str] | None = None, exclude: Iterable[str] = (),
                        defaults: Mapping | None = None, choices: Mapping | None = None,
                        metavars: Mapping | None = None,
                        check: Callable[[str, object], None] | None = None) -> dict[str, str]:
    """Add one flag per field of `cls` to `group` (a parser or argument group); returns
    {field name: argparse dest}. `flag_of(name)` names the flag (default `--<name-with-dashes>`);
    `defaults` replaces a field's default on the command line; `choices` lists valid values.

    bool fields become switches (`--x` for a False default, `--no-x` for a True one); `list[str]`
    fields take a comma list (the config parses it); `X | None` takes X. `check(field name, value)`,
    when given, runs in each flag's argparse `type`, so a bad value is refused as the command line
    is parsed (its ValueError is argparse's error message); the dataclass then validates how the
    values combine.
    """
    flag_of = flag_of or (lambda name: "--" + name.replace("_", "-"))
    only = set(only) if only is not None else None
    defaults, choices, metavars = dict(defaults or {}), dict(choices or {}), dict(metavars or {})
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    dests = {}
    for f in fields(cls):
        if f.name in exclude or (only is not None and f.name not in only):
            continue
        hint, doc = hints[f.name], docs.get(f.name, "").replace("%", "%%")
        default = defaults[f.name] if f.name in defaults else _default(f)
        flag = flag_of(f.name)
        if hint is bool:
            if default:
                flag = "--no-" + flag[2:]
            dest = flag[2:].replace("-", "_")
            group.add_argument(flag, dest=dest, action="store_false" if default else "store_true",
                               help=doc)
            dests[f.name] = dest
            continue
        base = hint
        if type(None) in typing.get_args(hint):  # X | None -> X
            base = next(a for a in typing.get_args(hint) if a is not type(None))
        comma_list = typing.get_origin(base) is list
        if comma_list:
            base, default = str, None if default is None else ",".join(default)
            if f.name in choices:
                doc += f" A comma list of {', '.join(choices[f.name])}."
        kwargs: dict = {"type": base if check is None else _checked(base, f.name, check), "default": default}
        if f.name in choices and not comma_list:
            kwargs["choices"] = choices[f.name]
        else:
            kwargs["metavar"] = metavars.get(f.name) or {int: "N", float: "X"}.get(base, "TEXT")
        dest = flag[2:].replace("-", "_")
        group.add_argument(flag, dest=dest, help=f"{doc} (default: {'none' if default is None else default})",
                           **kwargs)
        dests[f.name] = dest
    return dests


def _checked(parse: Callable, name: str, check: Callable) -> Callable:
    """An argparse `type`: `parse(text)`, then `check(name, value)`; a ValueError of the check is
    the message argparse prints (one of `parse` stays argparse's own "invalid float value")."""
    def parse_and_check(text):
        value = parse(text)
        try:
            check(name, value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    parse_and_check.__name__ = getattr(parse, "__name__", "value")  # argparse names the type with it
    return parse_and_check


def one_line_errors(parser: argparse.ArgumentParser, prefix: str) -> None:
    """An argparse error about one of the flags starting with `prefix` is one line,
    `<prog>: error: <flag and what to give>`, exit 2, without argparse's usage (which, for
    Megatron-LM's parser, lists hundreds of flags). Other errors are argparse's own."""
    import re

    original = parser.error
    pattern = re.compile(rf"argument ({re.escape(prefix)}[\w-]*)(?:/[^:]*)?: (.*)", re.S)

    def error(message: str):
        found = pattern.match(message)
        if found is None:
            return original(message)
        flag, text = found.groups()
        parser.exit(2, f"{parser.prog}: error: {text if text.startswith(flag) else f'{flag}: {text}'}\n")

    parser.error = error


def values_of(args: argparse.Namespace, dests: Mapping[str, str]) -> dict:
    """{field name: parsed value} for the flags `add_dataclass_flags` added."""
    return {name: getattr(args, dest) for name, dest in dests.items()}
