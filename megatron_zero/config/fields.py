"""Typed sections whose fields declare their own flags, so a field and its flag cannot drift.

    @section("parallel layout and batch")             # --help's group title (a field may name another)
    class ParallelConfig:
        tensor_model_parallel_size: int = flag("ranks each layer's matrices are split over", 1)
        data_parallel_size: int = derived("world / (TP x PP x CP), set by the layout check")

    add_section_flags(parser, ParallelConfig)         # the argparse declarations, generated from the fields
    ParallelConfig.from_args(args)                    # the frozen section, from the checked namespace

A field is one of
    flag(help, default, names=..., **argparse)   a command-line flag: its option strings (default --the-name),
                                                 help, default and argparse behaviour (action, choices, nargs,
                                                 metavar, const, type); the parse type comes from the field's
                                                 annotation (int, float, str; Optional[X] and List[X] as X)
                                                 unless `type` says otherwise (a flag parsed from text into
                                                 something else by its check); also=(...): more flags of the
                                                 same destination (--no-X, an alias storing a constant)
    shared(declare, doc)                         a flag declared by a function other parsers share (tools/);
                                                 the section calls it in the field's place
    derived(doc, value=None)                     no flag: a value the checks fill in on the namespace (read
                                                 by its name), or `value(args)` computed from it
and `section` refuses a field that is none of these or a flag without help (TypeError at import).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Callable, Optional

_KIND = "megatron_zero.config"
_SWITCHES = ("store_true", "store_false", "store_const")


@dataclasses.dataclass(frozen=True)
class _Flag:
    help: str
    names: tuple
    group: Optional[str]
    argparse: dict
    also: tuple  # more declarations of the same destination: dicts of names, help and argparse keywords


@dataclasses.dataclass(frozen=True)
class _Shared:
    declare: Callable
    doc: str


@dataclasses.dataclass(frozen=True)
class _Derived:
    doc: str
    value: Optional[Callable]


def flag(help: str, default=None, *, names: tuple = (), group: Optional[str] = None, also: tuple = (),
         **argparse_kwargs):
    """A field declaring a flag (see the module's docstring). `also`: other flags of the same destination (a
    --no-X beside --X, an alias that stores a constant), each a dict of `names`, `help` and argparse keywords."""
    return dataclasses.field(default=default, metadata={
        _KIND: _Flag(help, tuple(names), group, dict(argparse_kwargs), tuple(also))})


def shared(declare: Callable, doc: str, default=None):
    """A field whose flag `declare(parser_or_group)` declares (the same function other parsers call)."""
    return dataclasses.field(default=default, metadata={_KIND: _Shared(declare, doc)})


def derived(doc: str, value: Optional[Callable] = None):
    """A field without a flag: the checks' derived value of that name, or `value(args)`."""
    return dataclasses.field(default=None, metadata={_KIND: _Derived(doc, value)})


def _declaration(f: dataclasses.Field):
    return f.metadata.get(_KIND)


def section(title: str):
    """Class decorator: a frozen dataclass whose every field is a flag (with help), a shared flag or a derived
    value; `from_args(args)` builds it from a checked namespace."""
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        for f in dataclasses.fields(cls):
            kind = _declaration(f)
            if kind is None:
                raise TypeError(f"{cls.__name__}.{f.name} is neither a flag(...) nor derived(...): declare its flag "
                                "and help, or say how it is derived")
            if isinstance(kind, _Flag) and not all(h.strip() for h in [kind.help] + [a["help"] for a in kind.also]):
                raise TypeError(f"{cls.__name__}.{f.name}'s flag has no help text")
        cls.TITLE = title
        cls.from_args = classmethod(_from_args)
        return cls
    return wrap


def _from_args(cls, args):
    values = {}
    for f in dataclasses.fields(cls):
        kind = _declaration(f)
        values[f.name] = kind.value(args) if isinstance(kind, _Derived) and kind.value else getattr(args, f.name)
    return cls(**values)


def _parse_type(annotation):
    """int / float / str from the field's annotation (Optional[X], List[X], Tuple[X, ...] read as X)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _parse_type(annotation)
    if origin in (list, tuple):
        return _parse_type(typing.get_args(annotation)[0])
    return annotation


def add_section_flags(parser: argparse.ArgumentParser, cls) -> None:
    """Declare `cls`'s flags on `parser`, in the fields' order, in argument groups by title."""
    hints = typing.get_type_hints(cls)
    groups = {}

    def group(title):
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        return groups[title]

    for f in dataclasses.fields(cls):
        kind = _declaration(f)
        if isinstance(kind, _Shared):
            kind.declare(group(cls.TITLE))
        elif isinstance(kind, _Flag):
            kwargs = dict(kind.argparse)
            if kwargs.get("action") not in _SWITCHES:
                kwargs.setdefault("type", _parse_type(hints[f.name]))
            names = kind.names or ("--" + f.name.replace("_", "-"),)
            target = group(kind.group or cls.TITLE)
            target.add_argument(*names, dest=f.name, default=f.default, help=kind.help, **kwargs)
            for other in kind.also:
                other = dict(other)
                target.add_argument(*other.pop("names"), dest=f.name, **other)


def flag_fields(cls) -> list:
    """The names of `cls`'s fields that are flags (its own or shared)."""
    return [f.name for f in dataclasses.fields(cls) if isinstance(_declaration(f), (_Flag, _Shared))]


def flag_spelling(cls, name: str) -> str:
    """The first option string of `cls`'s flag field `name` (its own names, or --the-name)."""
    kind = _declaration(next(f for f in dataclasses.fields(cls) if f.name == name))
    names = getattr(kind, "names", ())
    return names[0] if names else "--" + name.replace("_", "-")
