"""Command-line flags generated from typed dataclass configs.

A config field becomes a flag when it is declared with ``option(...)``: its name, type,
default and help live on the field, and argparse is built from them, so a flag cannot
drift from the value it sets. Flag names default to the field name with dashes (Megatron's
spelling); ``flag=`` overrides it for the few Megatron names that differ, and
``inverted=True`` is for Megatron's negative switches (``--disable-bias-linear`` sets
``add_bias_linear=False``). Fields declared without ``option`` are derived or internal
and never appear on the command line.

``FlagParser`` is the parser every command that takes these flags builds: a mistyped flag
or value is one line on stderr (the closest real flag named) and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megatron_weipipe.errors import EXIT_CONFIG, launcher_rank

_META = "megatron_weipipe.flag"
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # a value, as argparse reads it


@dataclass(frozen=True)
class FlagSpec:
    help: str
    flag: Optional[str] = None  # "--name"; None: from the field name
    choices: Optional[tuple] = None
    required: bool = False
    inverted: bool = False  # a bool switch that stores False (Megatron's --disable-x / --no-x)


def option(default: Any = dataclasses.MISSING, *, help: str, flag: Optional[str] = None,
           choices: Optional[Sequence] = None, required: bool = False, inverted: bool = False,
           default_factory: Any = dataclasses.MISSING):
    """A dataclass field that is also a command-line flag."""
    spec = FlagSpec(help=help, flag=flag, choices=tuple(choices) if choices else None, required=required,
                    inverted=inverted)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={_META: spec})
    return dataclasses.field(default=default, metadata={_META: spec})


def flag_spec(f: dataclasses.Field) -> Optional[FlagSpec]:
    return f.metadata.get(_META)


def flag_name(f: dataclasses.Field) -> str:
    spec = flag_spec(f)
    return (spec.flag if spec and spec.flag else "--" + f.name.replace("_", "-"))


def flag_fields(cls) -> list[tuple[dataclasses.Field, FlagSpec, Any]]:
    """(field, spec, resolved type) for every flag field of a dataclass, in declaration order
    (resolved once per class: a parse resolves every section's annotations otherwise)."""
    if cls not in _FLAG_FIELDS:
        hints = typing.get_type_hints(cls)
        _FLAG_FIELDS[cls] = [(f, flag_spec(f), hints[f.name]) for f in dataclasses.fields(cls)
                             if flag_spec(f) is not None]
    return list(_FLAG_FIELDS[cls])


_FLAG_FIELDS: dict = {}


def _base_type(tp):
    """int for Optional[int] / int | None; (list, str) for list[str]."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        return list, typing.get_args(tp)[0]
    return tp, None


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _dest(section: Optional[str], f: dataclasses.Field) -> str:
    return f"{section}.{f.name}" if section else f.name


def add_flags(parser: argparse.ArgumentParser, cls, section: Optional[str] = None, *, title: Optional[str] = None,
              require: bool = True) -> None:
    """Add one argument group holding the flags of dataclass ``cls``.

    ``section`` prefixes the argparse destinations ("model.hidden_size") so that several
    configs can share a parser; ``require=False`` drops required=True (the simulator needs
    no --train-iters).
    """
    group = parser.add_argument_group(title or section or cls.__name__)
    for f, spec, tp in flag_fields(cls):
        name, dest, default = flag_name(f), _dest(section, f), _default(f)
        kind, item = _base_type(tp)
        kwargs: dict[str, Any] = dict(dest=dest, help=spec.help)
        if kind is bool:
            kwargs.update(action="store_false" if spec.inverted else "store_true", default=default)
        else:
            if kind is list:
                kwargs.update(nargs="*", type=item)
            else:
                kwargs.update(type=kind)
            if not spec.choices:
                kwargs["metavar"] = f.name.upper()
            if spec.choices:
                kwargs["choices"] = list(spec.choices)
            if spec.required and require:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
            if default is not None and not spec.required:
                kwargs["help"] = f"{spec.help} (default: {default})"
        group.add_argument(name, **kwargs)


def from_args(args: argparse.Namespace, cls, section: Optional[str] = None, **extra):
    """An instance of ``cls`` from parsed flags (fields without a flag keep their defaults)."""
    values = {f.name: getattr(args, _dest(section, f)) for f, _, _ in flag_fields(cls)
              if hasattr(args, _dest(section, f))}
    values.update(extra)
    return cls(**values)


def to_flags(obj) -> list[str]:
    """The command line that reproduces the flag fields of ``obj`` that differ from their defaults."""
    out: list[str] = []
    for f, spec, tp in flag_fields(type(obj)):
        value, default = getattr(obj, f.name), _default(f)
        if value == default and not spec.required:
            continue
        if _base_type(tp)[0] is bool:
            out.append(flag_name(f))
        elif isinstance(value, (list, tuple)):
            out += [flag_name(f), *map(str, value)]
        elif value is not None:
            out += [flag_name(f), str(value)]
    return out


class FlagParser(argparse.ArgumentParser):
    """argparse, but a bad command line ends with one line on stderr and exit status 2.

    An unknown flag is named with the closest real one (``error: unknown flag --hiden-size
    (did you mean --hidden-size?)``) and is reported before anything else, since the flag
    it stands for then looks missing; a bad value is ``error: --num-layers: invalid int
    value: 'x'``. Under torchrun every rank parses the same command line, so only the
    launcher's rank 0 prints the line (the rule of every start-up error, cli.run_main) and
    the other ranks exit 2 silently: without it each rank would print the same line.
    """

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        unknown = self._unknown_flag(argv)
        if unknown is not None:
            self._refuse(f"unknown flag {unknown}{self._closest(unknown)}")
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            self._refuse(f"unexpected argument {extras[0]!r}")
        return parsed

    def error(self, message: str):
        """argparse's own complaints (a bad value, a missing flag), as one line."""
        self._refuse(message.strip().splitlines()[0].removeprefix("argument "))

    def _refuse(self, line: str):
        self.exit(EXIT_CONFIG, f"error: {line}\n" if launcher_rank() == 0 else None)

    def _option_strings(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings]

    def _unknown_flag(self, argv: Sequence[str]) -> Optional[str]:
        """The first token argparse would read as a flag it does not know (before ``--``)."""
        known = self._option_strings()
        for token in argv:
            if token == "--":
                return None
            if token[:1] not in self.prefix_chars or len(token) < 2 or " " in token or _NEGATIVE_NUMBER.match(token):
                continue
            name = token.split("=", 1)[0]
            if name in known or (self.allow_abbrev and any(s.startswith(name) for s in known)):
                continue
            return name
        return None

    def _closest(self, name: str) -> str:
        match = difflib.get_close_matches(name, self._option_strings(), n=1)
        return f" (did you mean {match[0]}?)" if match else ""
