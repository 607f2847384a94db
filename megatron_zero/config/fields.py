"""Typed sections whose fields declare their own flags, so a field and its flag cannot drift.

    @section("parallel layout and batch")             # --help's group title (a field may name another)
    class ParallelConfig:
        tensor_model_parallel_size: int = flag("ranks each layer's matrices are split over", 1)
        data_parallel_size: int = derived("world / (TP x PP x CP), set by the layout check")

    add_section_flags(parser, ParallelConfig)         # the argparse declarations, generated from the fields
    add_field_flag(parser, CheckpointConfig, "verify_checkpoint")   # one field's flag on another parser (tools/)
    ParallelConfig.from_args(args)                    # the frozen section, from the checked namespace

A field is one of
    flag(help, default, names=..., **argparse)   a command-line flag: its option strings (default --the-name),
                                                 help, default and argparse behaviour (action, choices, nargs,
                                                 metavar, const, type); the parse type comes from the field's
                                                 annotation (int, float, str; Optional[X] and List[X] as X)
                                                 unless `type` says otherwise (a flag parsed from text into
                                                 something else by its check); also=(...): more flags of the
                                                 same destination (--no-X, an alias storing a constant); a list
                                                 default is copied for each parse
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
class _Derived:
    doc: str
    value: Optional[Callable]


def flag(help: str, default=None, *, names: tuple = (), group: Optional[str] = None, also: tuple = (),
         **argparse_kwargs):
    """A field declaring a flag (see the module's docstring). `also`: other flags of the same destination (a
    --no-X beside --X, an alias that stores a constant), each a dict of `names`, `help` and argparse keywords."""
    metadata = {_KIND: _Flag(help, tuple(names), group, dict(argparse_kwargs), tuple(also))}
    if isinstance(default, list):  # a dataclass field's mutable default: a fresh copy each time
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def derived(doc: str, value: Optional[Callable] = None):
    """A field without a flag: the checks' derived value of that name, or `value(args)`."""
    return dataclasses.field(default=None, metadata={_KIND: _Derived(doc, value)})


def _declaration(f: dataclasses.Field):
    return f.metadata.get(_KIND)


def section(title: str):
    """Class decorator: a frozen dataclass whose every field is a flag (with help) or a derived
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


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _declare(target, f: dataclasses.Field, hints: dict) -> None:
    """The argparse declaration(s) of flag field `f` on `target` (a parser or an argument group)."""
    kind = _declaration(f)
    kwargs = dict(kind.argparse)
    if kwargs.get("action") not in _SWITCHES:
        kwargs.setdefault("type", _parse_type(hints[f.name]))
    target.add_argument(*_names(kind, f.name), dest=f.name, default=_default(f), help=kind.help, **kwargs)
    for other in kind.also:
        other = dict(other)
        target.add_argument(*other.pop("names"), dest=f.name, **other)


def _names(kind: _Flag, name: str) -> tuple:
    return kind.names or ("--" + name.replace("_", "-"),)


def add_section_flags(parser: argparse.ArgumentParser, *classes) -> None:
    """Declare the flags of the sections `classes` on `parser`, in the fields' order, in argument groups by title
    (the section's, or the one a field names; one group per title)."""
    groups = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _declaration(f)
            if isinstance(kind, _Flag):
                title = kind.group or cls.TITLE
                if title not in groups:
                    groups[title] = parser.add_argument_group(title)
                _declare(groups[title], f, hints)


def add_field_flag(parser, cls, name: str) -> None:
    """Declare the flag of `cls`'s field `name` alone on `parser` (a parser or group of another program)."""
    _declare(parser, next(f for f in dataclasses.fields(cls) if f.name == name), typing.get_type_hints(cls))


def flag_fields(cls) -> list:
    """The names of `cls`'s fields that are flags."""
    return [f.name for f in dataclasses.fields(cls) if isinstance(_declaration(f), _Flag)]


def computed_fields(cls) -> list:
    """The names of `cls`'s derived fields computed from other values (`derived(doc, value)`): not recorded."""
    return [f.name for f in dataclasses.fields(cls) if isinstance(_declaration(f), _Derived) and _declaration(f).value]


def flag_spelling(cls, name: str) -> str:
    """The first option string of `cls`'s flag field `name` (its own names, or --the-name)."""
    return _names(_declaration(next(f for f in dataclasses.fields(cls) if f.name == name)), name)[0]
