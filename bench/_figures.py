"""Figures declared once, tables made from the declarations (pure; no torch, no I/O).

A figure is a :class:`Fig`: its label, format spec, unit, how it is read from an item (a field
name or a function of the item) and how it is reduced (one value, ``median (min-max)`` of a
list, MiB, a count). Declared on a results dataclass field with :func:`fig`, it is read by
:func:`figs`; :func:`rows` makes a table with one row per item (the JSON's dicts or the
dataclasses), :func:`groups` one row per group of items (the figures' medians over the group).
The goals of a part are :class:`Goal` rows computed from the same figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bench import _stats as st

Item = Any


def _read(item: Item, key: str) -> Any:
    return item[key] if isinstance(item, dict) else getattr(item, key)


@dataclass(frozen=True)
class Fig:
    """One figure: a column of a table (or a row of a key-value table)."""

    label: str
    spec: str = ""  # A format spec; "" shows the value with str().
    unit: str = ""
    get: str | Callable[[Item], Any] = ""  # A key of the item, or item -> value.
    how: str = "one"  # one | stat (a list: median (min-max)) | mib (a list of bytes).

    def value(self, item: Item) -> Any:
        """The figure's raw value for ``item``."""
        return self.get(item) if callable(self.get) else _read(item, self.get)

    def show(self, v: Any) -> str:
        """A value as a cell."""
        if self.how == "stat":
            return st.stat(v, self.spec or ".2f", self.unit)
        if self.how == "mib":
            return mib(v)
        if not self.spec or isinstance(v, str):
            return str(v)
        return st.fmt(v, self.spec, self.unit)

    def cell(self, item: Item) -> str:
        """The cell of ``item``."""
        return self.show(self.value(item))

    def over(self, items: Sequence[Item]) -> str:
        """``median (min-max)`` of the figure over ``items``."""
        return st.stat([self.value(x) for x in items], self.spec or ".2f", self.unit)


def fig(
    label: str, spec: str = "", unit: str = "", *, how: str = "one", get: Any = ""
) -> dict[str, Fig]:
    """The metadata of a dataclass field that is a figure: ``field(metadata=fig(...))``."""
    return {"fig": Fig(label, spec, unit, get, how)}


def figs(cls: type, *names: str) -> list[Fig]:
    """The figures declared on ``cls``'s fields (only ``names``, in that order, if given)."""
    found = {
        f.name: dataclasses.replace(f.metadata["fig"], get=f.metadata["fig"].get or f.name)
        for f in dataclasses.fields(cls)
        if "fig" in f.metadata
    }
    return [found[n] for n in names] if names else list(found.values())


def table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table (cells converted with ``str``), then an empty line."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return [*out, *("| " + " | ".join(str(c) for c in row) + " |" for row in body), ""]


def rows(
    columns: Sequence[Fig | tuple[str, Callable[[Item], Any]]], items: Iterable[Item]
) -> list[str]:
    """One row per item, one column per figure (or (label, item -> cell) pair)."""
    cols = [c if isinstance(c, Fig) else Fig(c[0], get=c[1]) for c in columns]
    return table([c.label for c in cols], [[c.cell(x) for c in cols] for x in items])


def over(get: str | Callable[[Item], Any], spec: str = ".2f", unit: str = "") -> Callable:
    """A cell of a (name, items) pair: ``median (min-max)`` of the figure over the items."""
    return lambda nx: Fig("", spec, unit, get).over(nx[1])


def mib(values: Iterable[float]) -> str:
    """``median (min-max)`` of byte counts, in MiB."""
    return st.stat(st.scale(values, 1 / st.MiB), ".0f", " MiB")


def groups(first: str, columns: Sequence[Fig], by: dict[str, list[Item]]) -> list[str]:
    """One row per group (its name first); a ``stat`` column shows its median (min-max) over
    the group's items, any other takes the (name, items) pair."""
    body = [
        [name, *(c.over(xs) if c.how == "stat" else c.cell((name, xs)) for c in columns)]
        for name, xs in by.items()
    ]
    return table([first, *(c.label for c in columns)], body)


def kv(body: Iterable[Sequence[Any]], head: Sequence[str] = ("figure", "value")) -> list[str]:
    """A two-column table of (label, value) rows."""
    return table(head, body)


def ranks(key: str, spec: str = ".4f") -> Callable[[Item], str]:
    """A cell: one figure of every rank (or node) of a run, comma-separated."""
    return lambda x: ", ".join(st.fmt(v, spec) for v in _read(x, key).values())


@dataclass(frozen=True)
class Goal:
    """One goal checked on one run: a row of the goals table."""

    part: str
    goal: str
    threshold: str
    measured: str = "not measured"
    met: bool | None = None  # None: not measured (or not resolved, see `measured`).
    source: str = ""  # Which figures: the part and, where it matters, the state size.


def goal_rows(
    part: str, names: Sequence[tuple[str, str]], values: Sequence[tuple[str, bool | None]], src: str
) -> list[Goal]:
    """Goals of ``part`` from (goal, threshold) names and (measured, met) values."""
    return [Goal(part, g, t, m, ok, src) for (g, t), (m, ok) in zip(names, values, strict=True)]


STRADDLE = "no change beyond noise (pairs straddle 1)"


def le(x: float | None, limit: float) -> bool | None:
    """``x <= limit``, None if ``x`` is missing."""
    return None if x is None else x <= limit


def ge(x: float | None, limit: float) -> bool | None:
    """``x >= limit``, None if ``x`` is missing."""
    return None if x is None else x >= limit


def straddles(pairs: list[float]) -> bool | None:
    """Ratios of pairs that straddle 1 (no change beyond noise); None with fewer than two."""
    return None if len(pairs) < 2 else min(pairs) <= 1.0 <= max(pairs)


def job_step(x: Item) -> float | None:
    """A training job's step time: the median over its ranks of each rank's median."""
    return st.median(x["rank_median"].values())


def pair_ratios(runs: list[Item], a: str, b: str) -> list[float]:
    """Step-time ratios config ``b`` / config ``a`` of the ok runs of the same repeat."""
    by = {(x["config"], x["repeat"]): x for x in runs if x["ok"]}
    pairs = [(x, by.get((a, k))) for (c, k), x in by.items() if c == b]
    return [q for x, y in pairs if y and (q := st.ratio(job_step(x), job_step(y))) is not None]
