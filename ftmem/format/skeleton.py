"""The skeleton codec: a state's non-tensor structure as tagged JSON (no pickle, no torch).

A *skeleton* is a state dict whose tensors were replaced by markers: nested dicts (str or
int keys, order kept), lists and tuples of plain values (None, bool, int, float incl.
nan/inf, str, bytes, complex). Scalars are written as JSON scalars; everything else as an
object with one one-letter key::

    {"d": [[key, value], ...]}  dict     {"l": [...]}  list     {"t": [...]}  tuple
    {"b": "<base64>"}           bytes    {"c": [re, im]}  complex
    {"f": "nan" | "inf" | "-inf"}        {"x": [tag, value]}  an extension type

Extension types (the client's ``torch.Size`` and ``torch.dtype``) are handled by callables
the caller passes, which keeps this module free of torch. Decoding accepts nothing else, so
a skeleton another process wrote can never run code.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from typing import Any

from ftmem.errors import CorruptSnapshotError

MAX_DEPTH = 200
_FLAT = (str, int, bool, type(None))
"""Types written as JSON scalars as they are (floats need the nan/inf check)."""

ExtEncode = Callable[[Any], "tuple[str, Any] | None"]
"""An object the codec does not know -> (tag, JSON-ready value), or None to refuse it."""
ExtDecode = Callable[[str, Any], Any]
"""(tag, value) -> the object; raises ValueError for an unknown tag or a bad value."""


def _no_ext(obj: Any) -> tuple[str, Any] | None:
    return None


def _float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"f": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def encode_skeleton(skeleton: Any, ext: ExtEncode = _no_ext) -> bytes:
    """Encode ``skeleton`` (UTF-8 JSON).

    Raises:
        ValueError: a value the codec cannot hold (and ``ext`` refuses), a dict key that
            is not a str or int, or nesting deeper than MAX_DEPTH.
    """

    def enc(obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("skeleton nested too deeply")
        t = type(obj)
        if obj is None or t is bool or t is int or t is str:
            return obj
        if t is float:
            return _float(obj)
        if t is dict or isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if type(k) not in (str, int):
                    raise ValueError(f"skeleton key {k!r} must be str or int")
                items.append([k, enc(v, depth + 1)])
            return {"d": items}
        if t is list or t is tuple:
            tag = "l" if t is list else "t"
            # Fast path: a flat sequence of JSON scalars (tensor markers, parameter indices).
            if all(type(v) in _FLAT for v in obj):
                return {tag: list(obj)}
            return {tag: [enc(v, depth + 1) for v in obj]}
        if t is bytes:
            return {"b": base64.b64encode(obj).decode("ascii")}
        if t is complex:
            return {"c": [_float(obj.real), _float(obj.imag)]}
        got = ext(obj)
        if got is None:
            raise ValueError(f"cannot encode a {t.__name__} in a snapshot skeleton")
        return {"x": [got[0], enc(got[1], depth + 1)]}

    return json.dumps(enc(skeleton, 0), separators=(",", ":"), allow_nan=False).encode()


def _no_ext_decode(tag: str, value: Any) -> Any:
    raise ValueError(f"unknown extension type {tag!r}")


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def decode_skeleton(data: bytes, ext: ExtDecode = _no_ext_decode) -> Any:
    """Decode what :func:`encode_skeleton` wrote.

    Raises:
        CorruptSnapshotError: the bytes are not a valid skeleton.
    """

    def num(v: Any) -> float:
        if type(v) in (int, float):
            return float(v)
        if isinstance(v, dict) and set(v) == {"f"} and v["f"] in ("nan", "inf", "-inf"):
            return float(v["f"])
        raise ValueError("bad number")

    def dec(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("skeleton nested too deeply")
        if v is None or type(v) in (bool, int, float, str):
            return v
        if not isinstance(v, dict) or len(v) != 1:
            raise ValueError(f"unexpected {type(v).__name__} in a skeleton")
        ((tag, body),) = v.items()
        if tag == "d":
            out: dict[Any, Any] = {}
            for item in body:
                if not isinstance(item, list) or len(item) != 2 or type(item[0]) not in (str, int):
                    raise ValueError("bad dict item")
                out[item[0]] = dec(item[1], depth + 1)
            return out
        if tag in ("l", "t"):
            if not isinstance(body, list):
                raise ValueError("bad sequence")
            seq = [dec(x, depth + 1) for x in body]
            return seq if tag == "l" else tuple(seq)
        if tag == "f":
            return num(v)
        if tag == "b" and isinstance(body, str):
            return base64.b64decode(body.encode("ascii"), validate=True)
        if tag == "c" and isinstance(body, list) and len(body) == 2:
            return complex(num(body[0]), num(body[1]))
        if tag == "x" and isinstance(body, list) and len(body) == 2 and isinstance(body[0], str):
            return ext(body[0], dec(body[1], depth + 1))
        raise ValueError(f"unknown skeleton tag {tag!r}")

    try:
        doc = json.loads(data, parse_constant=_reject)
        out = dec(doc, 0)
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptSnapshotError(f"snapshot objects cannot be decoded: {exc!r}") from exc
    if not isinstance(out, dict):
        raise CorruptSnapshotError("snapshot objects are not a dict")
    return out
