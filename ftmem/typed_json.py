"""The one reader of the JSON documents ftmem receives: decoded JSON -> a typed dataclass.

Every message and document a process receives (a rank's request and its reply, a peer's
message, the SMP's STATUS, a flush job, a layout) is a dataclass whose field annotations are
its grammar; :func:`build` reads a decoded document into it and refuses anything else with
:class:`~ftmem.errors.ProtocolError`, and only that (never KeyError, TypeError, ValueError or
OverflowError). The annotations:

- ``int``: a real int (not a bool, not a float such as JSON's Infinity or NaN) within
  +-:data:`MAX_INT`, or within a :class:`Range`; with :class:`Digits` it travels as a decimal
  string (an object's key, a 64-bit checksum).
- ``float``: finite. ``str``, ``bool``: exactly that type; :class:`Most` bounds a string's
  length, :class:`Pattern` its form.
- ``list[T]``, ``tuple[T, ...]``, ``dict[K, V]``, ``Mapping[K, V]``: each item read as ``T``
  (or ``V``, keys as ``K``), at most :class:`Most` of them. ``tuple[A, B]``: a list of
  exactly those items, each read as its own type.
- an enum: one of its values. A dataclass: built the same way. ``X | None``: null or ``X``.
- ``Path``: a non-empty string without NUL of at most 4096 characters; ``timedelta``: a
  finite number of seconds >= 0 (settings files).

Readers are made once per annotation and field tables once per class.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from ftmem.errors import ProtocolError

T = TypeVar("T")

MAX_INT = (1 << 63) - 1
"""Largest magnitude of an integer field (what an int64 holds), in every JSON message."""


@dataclass(frozen=True, slots=True)
class Most:
    """A field's bound, in its annotation (``Annotated[str, Most(64)]``): at most ``n``
    characters of a string, items of a list or entries of an object."""

    n: int


@dataclass(frozen=True, slots=True)
class Range:
    """An integer field's bounds, in its annotation: ``lo <= value <= hi``."""

    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Digits:
    """An integer that travels as a decimal string of at most ``n`` digits (an object's key;
    a 64-bit checksum, which JSON readers that hold numbers as doubles would round)."""

    n: int


@dataclass(frozen=True, slots=True)
class Pattern:
    """A string field matches ``regex`` in full."""

    regex: str


Reader = Callable[[str, Any, bool], Any]
"""Reads one field: (its name, its decoded JSON value, strict) -> its value; ProtocolError."""


def _reader(tp: Any) -> Reader:
    """The reader of annotation ``tp`` (cached)."""
    read = _READERS.get(tp)
    if read is None:
        read = _READERS[tp] = _make_reader(tp)
    return read


_READERS: dict[Any, Reader] = {}


def _unwrap(tp: Any) -> tuple[Any, tuple[Any, ...], tuple[int, int]]:
    """An annotation's type, its ``Annotated`` extras and its integer :class:`Range`."""
    extras: tuple[Any, ...] = ()
    if typing.get_origin(tp) is typing.Annotated:
        tp, *rest = typing.get_args(tp)
        extras = tuple(rest)
    bounds = next(((e.lo, e.hi) for e in extras if isinstance(e, Range)), (-MAX_INT, MAX_INT))
    return tp, extras, bounds


def _make_reader(tp: Any) -> Reader:
    tp, extras, (lo, hi) = _unwrap(tp)
    most = next((e.n for e in extras if isinstance(e, Most)), None)
    digits = next((e.n for e in extras if isinstance(e, Digits)), None)
    pattern = next((re.compile(e.regex) for e in extras if isinstance(e, Pattern)), None)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        nullable = type(None) in args
        alts = [_reader(a) for a in args if a is not type(None)]

        def read_union(name: str, value: Any, strict: bool) -> Any:
            if value is None and nullable:
                return None
            for alt in alts:
                try:
                    return alt(name, value, strict)
                except ProtocolError:
                    continue
            raise ProtocolError(f"field {name!r} has the wrong type")

        return read_union
    if tp is Any:
        return lambda name, value, strict: value
    if tp is int and digits is not None:

        def read_digits(name: str, value: Any, strict: bool) -> int:
            if type(value) is not str or not 0 < len(value) <= digits or not value.isdigit():
                raise ProtocolError(f"field {name!r} must be a decimal string of {digits} digits")
            if not value.isascii() or not lo <= int(value) <= hi:
                raise ProtocolError(f"field {name!r} is out of range ({lo}..{hi})")
            return int(value)

        return read_digits
    if tp is int:

        def read_int(name: str, value: Any, strict: bool) -> int:
            if type(value) is not int:
                raise ProtocolError(f"field {name!r} must be an integer")
            if not lo <= value <= hi:
                raise ProtocolError(f"field {name!r} is out of range ({lo}..{hi})")
            return value

        return read_int
    if tp is float:

        def read_float(name: str, value: Any, strict: bool) -> float:
            if type(value) not in (int, float) or not math.isfinite(value):
                raise ProtocolError(f"field {name!r} must be a finite number")
            return float(value)

        return read_float
    if tp is Path:

        def read_path(name: str, value: Any, strict: bool) -> Path:
            if type(value) is not str or not 0 < len(value) <= 4096 or "\0" in value:
                raise ProtocolError(f"field {name!r} must be a path")
            return Path(value)

        return read_path
    if tp is timedelta:

        def read_seconds(name: str, value: Any, strict: bool) -> timedelta:
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                raise ProtocolError(f"field {name!r} must be a number of seconds >= 0")
            return timedelta(seconds=value)

        return read_seconds
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = {e.value: e for e in tp}

        def read_enum(name: str, value: Any, strict: bool) -> Any:
            if type(value) not in (str, int) or value not in members:
                raise ProtocolError(f"field {name!r} must be one of {list(members)}")
            return members[value]

        return read_enum
    if tp in (str, bool):
        bound = f" of at most {most} characters" if most is not None else ""

        def read_plain(name: str, value: Any, strict: bool) -> Any:
            if type(value) is not tp or (most is not None and len(value) > most):
                raise ProtocolError(f"field {name!r} must be {tp.__name__}{bound}")
            if pattern is not None and pattern.fullmatch(value) is None:
                raise ProtocolError(f"field {name!r} must match {pattern.pattern}")
            return value

        return read_plain
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        nested: type[Any] = tp

        def read_nested(name: str, value: Any, strict: bool) -> Any:
            try:
                return build(nested, value, strict=strict)
            except ProtocolError as exc:
                raise ProtocolError(f"field {name!r}: {exc}") from None

        return read_nested
    if origin is tuple and args and args[-1] is not Ellipsis:
        each_of = [_reader(a) for a in args]

        def read_fixed(name: str, value: Any, strict: bool) -> tuple[Any, ...]:
            if type(value) is not list or len(value) != len(each_of):
                raise ProtocolError(f"field {name!r} must be a list of {len(each_of)} items")
            return tuple(read(name, v, strict) for read, v in zip(each_of, value, strict=True))

        return read_fixed
    if origin in (list, tuple, dict, Mapping) or tp in (list, tuple, dict):
        mapping = origin in (dict, Mapping) or tp is dict
        kind = "an object" if mapping else "a list"
        want: type[Any] = dict if mapping else list
        item = (args[1] if mapping else args[0]) if args else Any
        each = None if item is Any else _reader(item)
        key = args[0] if mapping and args and args[0] not in (str, Any) else None
        read_key = None if key is None else _reader(key)  # e.g. Annotated[int, Digits(7)]
        as_tuple = origin is tuple or tp is tuple
        bound = f" of at most {most}" if most is not None else ""
        item_tp, item_extras, (low, high) = _unwrap(item)
        plain_ints = item_tp is int and not any(isinstance(e, Digits) for e in item_extras)
        if plain_ints and not mapping:  # a list of integers (shapes, steps): checked in one pass

            def read_ints(name: str, value: Any, strict: bool) -> Any:
                if type(value) is not list or (most is not None and len(value) > most):
                    raise ProtocolError(f"field {name!r} must be a list{bound}")
                for v in value:
                    if type(v) is not int or not low <= v <= high:
                        raise ProtocolError(f"field {name!r} must hold integers in {low}..{high}")
                return tuple(value) if as_tuple else value

            return read_ints

        def read_many(name: str, value: Any, strict: bool) -> Any:
            if type(value) is not want or (most is not None and len(value) > most):
                raise ProtocolError(f"field {name!r} must be {kind}{bound}")
            if read_key is not None:
                return {
                    read_key(name, k, strict): v if each is None else each(name, v, strict)
                    for k, v in value.items()
                }
            if each is None:
                return value
            if mapping:
                return {k: each(name, v, strict) for k, v in value.items()}
            items = [each(name, v, strict) for v in value]
            return tuple(items) if as_tuple else items

        return read_many
    raise TypeError(f"no JSON reader for the annotation {tp!r}")


_FIELDS: dict[type[Any], tuple[frozenset[str], list[tuple[str, bool, Reader]]]] = {}


def _fields(cls: type[Any]) -> tuple[frozenset[str], list[tuple[str, bool, Reader]]]:
    """The field names of dataclass ``cls`` and, per field, (name, has a default, reader)
    (cached)."""
    out = _FIELDS.get(cls)
    if out is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        known = [
            (
                f.name,
                f.default is not dataclasses.MISSING
                or f.default_factory is not dataclasses.MISSING,
                _reader(hints[f.name]),
            )
            for f in dataclasses.fields(cls)
        ]
        out = _FIELDS[cls] = (frozenset(name for name, _, _ in known), known)
    return out


def build(cls: type[Any], fields: Any, *, what: str = "", strict: bool = True) -> Any:
    """Build the dataclass ``cls`` from decoded JSON, every field read as its annotation says.

    ``strict=False`` reads a status report: fields ``cls`` does not know are ignored (a newer
    sender may report more), and a null field that has a default takes the default.

    Raises:
        ProtocolError: not an object, unknown (when strict) or missing fields, or a field of
            the wrong type.
    """
    if type(fields) is not dict:
        raise ProtocolError(f"{what or cls.__name__} must be a JSON object")
    names, known = _fields(cls)
    if strict and not names.issuperset(fields):
        unknown = sorted(str(k)[:32] for k in set(fields).difference(names))
        raise ProtocolError(f"unknown fields {unknown[:4]} for {what or cls.__name__}")
    out = {}
    get = fields.get
    for name, has_default, read in known:
        value = get(name, _ABSENT)
        if value is _ABSENT or (value is None and not strict):
            if has_default:
                continue
            if value is _ABSENT:
                raise ProtocolError(f"missing field {name!r} for {what or cls.__name__}")
        out[name] = read(name, value, strict)
    return cls(**out)


_ABSENT = object()


def loads(text: str | bytes, what: str, max_bytes: int | None = None) -> Any:
    """Decode JSON text of at most ``max_bytes`` (the one decoder of every received document).

    Raises:
        ProtocolError: too long, or not JSON (also an integer past Python's int-to-str limit,
            which ``json.loads`` refuses with a ValueError, and nesting too deep).
    """
    if max_bytes is not None and len(text) > max_bytes:
        raise ProtocolError(f"{what}: a line of {len(text)} bytes, more than {max_bytes}")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"{what} is not JSON: {str(exc)[:200]}") from exc


def parse(cls: type[T], text: str | bytes, *, what: str = "", strict: bool = True) -> T:
    """:func:`build` ``cls`` from JSON text.

    Raises:
        ProtocolError: not JSON (NaN and Infinity are no numbers here either), or not ``cls``.
    """
    got: T = build(cls, loads(text, what or cls.__name__), what=what, strict=strict)
    return got


def read(tp: Any, value: Any, what: str) -> Any:
    """One decoded JSON value read as annotation ``tp`` (e.g. a node index sent as an
    object's key). Raises ProtocolError."""
    return _reader(tp)(what, value, True)


def to_fields(payload: Any) -> dict[str, Any]:
    """Return the JSON-ready fields of a dataclass: nested dataclasses as objects, enums as
    their values, tuples as lists, paths as strings (what :func:`build` reads back)."""
    names = _FIELD_NAMES.get(type(payload))
    if names is None:
        names = _FIELD_NAMES[type(payload)] = tuple(f.name for f in dataclasses.fields(payload))
    return {name: _json_value(getattr(payload, name)) for name in names}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


_SCALARS = frozenset((str, int, float, bool, type(None)))
"""Types written as they are (exact types: an enum deriving from int or str is not one)."""


def _json_value(v: Any) -> Any:
    if type(v) in _SCALARS:  # most fields: the hot path of every message sent
        return v
    if isinstance(v, enum.Enum):
        return v.value
    if dataclasses.is_dataclass(v):
        return to_fields(v)
    if isinstance(v, list | tuple):
        return [_json_value(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v
