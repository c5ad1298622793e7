"""Table helpers shared by ``bench/_tables.py`` and ``bench/_tables_jobs.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench import _stats as st
from bench._stats import MiB, stat

Doc = dict[str, Any]


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table (cells converted with ``str``)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def mib(values: Sequence[float]) -> str:
    """``median (min-max)`` in MiB."""
    return stat(st.scale(values, 1 / MiB), ".0f", " MiB")
