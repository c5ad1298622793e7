"""Table helpers shared by ``bench/_tables.py`` and ``bench/_tables_jobs.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bench import _stats as st
from bench._stats import MiB, stat

Doc = dict[str, Any]
Column = tuple[str, Callable[[Any], Any]]


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table (cells converted with ``str``)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def columns(specs: Sequence[Column], items: Iterable[Any]) -> list[str]:
    """A table with one row per item: each column is (header, item -> cell)."""
    return table([h for h, _ in specs], [[f(x) for _, f in specs] for x in items])


def kv(rows: Iterable[Sequence[Any]], head: Sequence[str] = ("figure", "value")) -> list[str]:
    """A two-column table of (label, value) rows."""
    return table(head, rows)


def mib(values: Sequence[float]) -> str:
    """``median (min-max)`` in MiB."""
    return stat(st.scale(values, 1 / MiB), ".0f", " MiB")
