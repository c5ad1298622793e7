"""The ``flush`` section of docs/benchmarks.md and its goals, rendered from the results JSON of
``bench/flush.py``: per state size the throughput of each system against ``dcp.save``, every
repeat, export_dcp's phases and the one-off figures; then the step time while flushing, per
configuration and per run. Nothing here measures: ``bench/_render.py`` calls
``sections(result)`` and ``goals(result)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import _figures as fg
from bench import _stats as st
from bench._stats import GiB, MiB, fmt, stat
from bench.flush import CONFIGS, DCP, EXPORT, FLUSH, PART, SYSTEMS

Doc = dict[str, Any]


def _size_section(r: Doc) -> list[str]:
    """One state size: per system, per repeat, export_dcp's phases, the one-off figures."""
    per = r["per_repeat"]

    def sec(key: str) -> Callable[[int], str]:
        return lambda i: fmt(per[i].get(key), ".2f", " s")

    def vs_dcp(system: str) -> Callable[[int], str]:
        return lambda i: fmt(st.ratio(per[i].get(DCP), per[i].get(system)), ".2f", "x")

    def kilo(values: list[int]) -> str:
        return stat(st.scale(values, 1e-3), ".0f", " k")

    by_system = [
        ("system", lambda s: s),
        ("time", lambda s: stat(r["times"][s], ".2f", " s")),
        ("throughput", lambda s: stat(st.gbps(r["nbytes"], r["times"][s]), ".3f", " GB/s")),
        ("CPU s (writer process)", lambda s: stat(r["cpu"].get(s, []), ".2f")),
        ("minor page faults", lambda s: kilo(r["faults"].get(s, []))),
        ("peak memory added (RssAnon)", lambda s: fg.mib(r["mem"].get(s, []))),
        ("on disk", lambda s: f"{r['disk_bytes'].get(s, 0) / MiB:.0f} MiB"),
    ]
    by_repeat = [
        ("repeat", lambda i: i),
        ("order", lambda i: " > ".join(r["orders"][i])),
        ("dcp.save", sec(DCP)),
        ("export_dcp", sec(EXPORT)),
        ("export/dcp throughput", vs_dcp(EXPORT)),
        (
            "FLUSH (request to reply; SMP's own figure)",
            lambda i: f"{sec(FLUSH)(i)}; {sec('flush_smp_s')(i)}",
        ),
        ("FLUSH/dcp throughput", vs_dcp(FLUSH)),
    ]
    out = [f"#### {r['nbytes'] / GiB:.2f} GiB state (requested {r['size_gib']:g} GiB)", ""]
    out += fg.rows(by_system, [s for s in SYSTEMS if s in r["times"]])
    out += fg.rows(by_repeat, range(len(per)))
    if r["phases"]:
        total = st.median(r["times"][EXPORT])
        ph = [
            [k, stat(v, ".3f", " s"), fmt(st.ratio(st.median(v), total), ".0%")]
            for k, v in r["phases"].items()
        ]
        ph.append(["export_dcp's own dcp.save: CPU s", stat(r["inner_cpu"]), "-"])
        ph.append(["export_dcp's own dcp.save: minor page faults", kilo(r["inner_faults"]), "-"])
        out += fg.table(["phase of export_dcp", "time", "share"], ph)
    out += fg.kv([[k, fmt(v, ".2f")] for k, v in r["once"].items()], ("one-off figure", "seconds"))
    return out + [f"- {n}" for n in r["notes"]] + ([""] if r["notes"] else [])


def _during(x: Doc) -> list[Any]:
    """The flushes of a run that ended before its last commit."""
    return [f for f in x["flushes"] if x["train_end"] is not None and f[0] <= x["train_end"]]


def _share(x: Doc) -> float | None:
    span = (x["train_end"] or 0) - (x["train_start"] or 0)
    return sum(f[2] for f in _during(x)) / span if span > 0 else None


def _flushed_steps(x: Doc) -> str:
    after = x["train_end"]
    return " ".join(f"{f[1]}{'*' if after and f[0] > after else ''}" for f in x["flushes"]) or "-"


FLUSH_RUNS = [
    ("repeat", lambda x: x["repeat"]),
    ("config", lambda x: x["config"]),
    ("load", lambda x: fmt(x["load_start"])),
    ("median step (ranks)", fg.ranks("rank_median")),
    ("mean step (ranks)", fg.ranks("rank_mean")),
    ("flushed steps (* = after the last step)", _flushed_steps),
    ("STATUS flushes / skipped", lambda x: f"{x['status_flushes']} / {sum(x['skipped'].values())}"),
    ("wall", lambda x: f"{x['wall_s']:.0f} s"),
    ("status", lambda x: x["error"] or "; ".join(x["failed"]) or "ok"),
]


def sections(r: Doc) -> dict[str, list[str]]:
    """Section ``flush``: throughput per size, then step time while flushing."""
    out = [
        f"- throughput: {r['repeats']} repeats per size, systems in an order rotated each repeat; "
        "GB/s = state bytes / wall time; every write fsync'd and removed before the next",
        f"- `import torch.distributed.checkpoint` after `import torch`, fresh process: {fmt(r['dcp_import_s'])} s",
        "",
        "### Throughput",
        "",
    ]
    for size in r["sizes"]:
        out += _size_section(size)
    if not r["train"]:
        return {"flush": out}
    ok = [x for x in r["train"] if x["ok"]]
    flushing = [x for x in ok if x["config"] != "no flush"]
    by = {"no flush": [x for x in ok if x["config"] == "no flush"], "flush every 5": flushing}
    ratios = fg.pair_ratios(r["train"], *CONFIGS)

    def fl(f: Callable[[list[Doc]], str]) -> Callable[[tuple[str, list[Doc]]], str]:
        return lambda cx: "-" if cx[0] == "no flush" else f(cx[1])

    per_flush = fl(lambda xs: stat([f[2] for x in xs for f in x["flushes"]], ".2f", " s"))
    by_config = [
        ("config", lambda cx: cx[0]),
        ("step time", fg.over(fg.job_step, ".4f", " s")),
        ("vs no flush (per pair)", lambda cx: "1" if cx[0] == "no flush" else stat(ratios, ".3f")),
        ("flushes during training", fl(lambda xs: stat([len(_during(x)) for x in xs], ".0f"))),
        ("flushes in all", fl(lambda xs: stat([len(x["flushes"]) for x in xs], ".0f"))),
        ("seconds per flush", per_flush),
        (
            "flushing's share of training",
            fl(lambda xs: stat(st.scale(map(_share, xs), 100), ".0f", "%")),
        ),
        ("snapshots skipped", fg.over(lambda x: sum(x["skipped"].values()), ".0f")),
    ]
    out += [
        "### Step time while flushing",
        "",
        f"`ftmem-launch --nproc-per-node {r['nproc']} --ftmem-slots 3 [--ftmem-flush-dir D "
        f"--ftmem-flush-every {r['flush_every']}] {' '.join(r['example_args'])}`: a snapshot "
        "after every step; a run's step time = the median over its ranks of each rank's median",
        "",
        *fg.rows(by_config, by.items()),
        *fg.rows(FLUSH_RUNS, r["train"]),
    ]
    return {"flush": out}


def goals(r: Doc | None) -> list[fg.Goal]:
    """Flush throughput against dcp.save (largest state), and step time while flushing."""
    names = {
        FLUSH: "flush throughput / dcp.save's (SMP worker)",
        EXPORT: "flush throughput / dcp.save's (export_dcp in process)",
    }
    sizes = [s for s in (r or {}).get("sizes", []) if s["per_repeat"]]
    if not sizes:
        return [fg.Goal(PART, g, ">= 1.5x") for g in names.values()]
    big = max(sizes, key=lambda s: s["nbytes"])
    src = f"flush, {big['nbytes'] / GiB:.2f} GiB"
    out = []
    for system, g in names.items():
        rat = [st.ratio(x.get(DCP), x.get(system)) for x in big["per_repeat"]]
        out.append(
            fg.Goal(PART, g, ">= 1.5x", stat(rat, ".2f", "x"), fg.ge(st.median(rat), 1.5), src)
        )
    if pairs := fg.pair_ratios(r["train"], *CONFIGS):
        g = "step time while flushing, flush / no flush"
        met, src = fg.straddles(pairs), f"flush, {len(pairs)} pairs"
        out.append(fg.Goal(PART, g, fg.STRADDLE, stat(pairs, ".3f"), met, src))
    return out
