"""The goals of the benchmarks, checked on a run's results (pure: JSON documents in, rows out).

Each goal is a row (goal, threshold, measured, met, from) computed from the figures of one
run; a part that did not run gives "not measured", never a figure of another run. What the
figures mean, and why a goal is met or missed, is hand-written in docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import _stats as st

Doc = dict[str, Any]
STRADDLE = "no change beyond noise (pairs straddle 1)"


@dataclass(frozen=True, kw_only=True)
class Goal:
    """One goal checked on one run."""

    part: str
    goal: str
    threshold: str
    measured: str = "-"
    met: bool | None = None  # None: not measured (or not resolved, see `measured`).
    source: str = ""  # Which figures: the part and, where it matters, the state size.


def _missing(part: str, goal: str, threshold: str) -> Goal:
    return Goal(part=part, goal=goal, threshold=threshold, measured="not measured")


def _le(x: float | None, limit: float) -> bool | None:
    return None if x is None else x <= limit


def _ge(x: float | None, limit: float) -> bool | None:
    return None if x is None else x >= limit


def _straddles(pairs: list[float]) -> bool | None:
    """Ratios of pairs that straddle 1 (no change beyond noise); None with fewer than two."""
    return None if len(pairs) < 2 else min(pairs) <= 1.0 <= max(pairs)


def _rows(
    p: str, names: list[tuple[str, str]], values: list[tuple[str, bool | None]], src: str
) -> list[Goal]:
    """Goals of part ``p`` from (goal, threshold) names and (measured, met) values."""
    return [
        Goal(part=p, goal=g, threshold=t, measured=m, met=ok, source=src)
        for (g, t), (m, ok) in zip(names, values, strict=True)
    ]


# ------------------------------------------------------------------------------ snapshot


def figure(size: Doc, system: str, metric: str) -> list[float]:
    """The per-repeat values of one metric of one system ([] if not measured)."""
    for f in size["figures"]:
        if f["system"] == system and f["metric"].strip() == metric:
            return list(f["values"])
    return []


def largest(doc: Doc | None) -> Doc | None:
    """The largest state size of a snapshot result with figures."""
    sizes = [s for s in (doc or {}).get("result", {}).get("sizes", []) if s.get("figures")]
    return max(sizes, key=lambda s: s["nbytes"]) if sizes else None


def snapshot_goals(doc: Doc | None) -> list[Goal]:
    """Stall, stall against a tuned dcp.async_save, background copy, restore, restore speed-up."""
    p = "snapshot"
    names = [
        ("stall per snapshot (save + fence)", "<= 0.01 s/GiB"),
        ("stall, ftmem / tuned dcp.async_save (blocking; + staging wait)", "<= 0.2 (both)"),
        ("background copy", ">= 10 GB/s"),
        ("restore in place (ftmem.load)", "<= 0.1 s/GiB"),
        ("restore, dcp.load / ftmem.load", ">= 6x"),
    ]
    big = largest(doc)
    if big is None:
        return [_missing(p, g, t) for g, t in names]
    gib, src = big["nbytes"] / st.GiB, f"snapshot, {big['nbytes'] / st.GiB:.2f} GiB"
    stall = figure(big, "ftmem", "stall (save + fence)")
    dcp = [
        figure(big, "dcp.async_save (async staging)", m) for m in ("blocking", "stall with fence")
    ]
    rat = [st.ratio(st.median(stall), st.median(d)) for d in dcp]
    copy = figure(big, "ftmem", "background copy")
    load = figure(big, "ftmem", "load in place")
    speed = st.ratio(st.median(figure(big, "dcp.load", "in place (/dev/shm)")), st.median(load))

    both = None if None in rat else max(r for r in rat if r is not None) <= 0.2
    values: list[tuple[str, bool | None]] = [
        (
            st.stat(st.per_gib(stall, big["nbytes"]), ".4f", " s/GiB"),
            _le(st.median(stall), 0.01 * gib),
        ),
        (" ; ".join(st.fmt(r, ".2f", "x") for r in rat), both),
        (st.stat(copy, ".2f", " GB/s"), None if not copy else (st.median(copy) or 0.0) >= 10.0),
        (
            st.stat(st.per_gib(load, big["nbytes"]), ".4f", " s/GiB"),
            _le(st.median(load), 0.1 * gib),
        ),
        (st.fmt(speed, ".1f", "x"), _ge(speed, 6.0)),
    ]
    return _rows(p, names, values, src)


def overhead_verdict(r: Doc) -> tuple[bool | None, str]:
    """(met, how it was decided) of "overhead <= 3% with a snapshot every step".

    The wall-clock figure decides when it is farther from 3% than the A/A control's largest
    deviation (this run's noise); else the rank's CPU time decides if every cycle is on the
    same side of 3%; else it is not resolved (None).
    """
    wall = (st.median(r["ratio"].get("ftmem every step", [])) or 1.0) - 1
    noise = max((abs(c - 1) for c in r["ratio"].get("none again (A/A control)", [])), default=0.0)
    if abs(wall - 0.03) > noise:
        return wall <= 0.03, f"wall, beyond the A/A noise {noise:.1%}"
    cpu = [c - 1 for c in r["cpu_ratio"].get("ftmem every step", [])]
    if cpu and min(cpu) > 0.03:
        return False, f"rank CPU in every cycle (wall within the A/A noise {noise:.1%})"
    if cpu and max(cpu) <= 0.03:
        return True, f"rank CPU in every cycle (wall within the A/A noise {noise:.1%})"
    return None, f"not resolved: wall and CPU within the A/A noise {noise:.1%}"


def overhead_goals(doc: Doc | None) -> list[Goal]:
    """Overhead of a snapshot every step, on the 2-rank example."""
    p, g, t = "overhead", "overhead with a snapshot every step", "<= 3%"
    r = (doc or {}).get("result")
    if not r or not r["ratio"].get("ftmem every step"):
        return [_missing(p, g, t)]
    met, how = overhead_verdict(r)
    wall, cpu = (st.pct(r[k]["ftmem every step"]) for k in ("ratio", "cpu_ratio"))
    m = f"{wall} (wall); {cpu} (rank CPU); decided by {how}"
    return _rows(p, [(g, t)], [(m, met)], f"overhead, {len(r['ratio']['ftmem every step'])} cycles")


def flush_goals(doc: Doc | None) -> list[Goal]:
    """Flush throughput against dcp.save (largest state), and step time while flushing."""
    p, t = "flush", ">= 1.5x"
    names = {
        "ftmem FLUSH (SMP worker)": "flush throughput / dcp.save's (SMP worker)",
        "ftmem export_dcp": "flush throughput / dcp.save's (export_dcp in process)",
    }
    sizes = [s for s in (doc or {}).get("result", {}).get("sizes", []) if s["per_repeat"]]
    if not sizes:
        return [_missing(p, g, t) for g in names.values()]
    big = max(sizes, key=lambda s: s["nbytes"])
    rats = [[st.ratio(x.get("dcp.save"), x.get(s)) for x in big["per_repeat"]] for s in names]
    values = [(st.stat(rat, ".2f", "x"), _ge(st.median(rat), 1.5)) for rat in rats]
    src = f"flush, {big['nbytes'] / st.GiB:.2f} GiB"
    out = _rows(p, [(g, t) for g in names.values()], values, src)
    from bench._tables import pair_ratios

    if pairs := pair_ratios(doc["result"]["train"], "no flush", "flush every 5"):
        g = ("step time while flushing, flush / no flush", STRADDLE)
        out += _rows(
            p, [g], [(st.stat(pairs, ".3f"), _straddles(pairs))], f"flush, {len(pairs)} pairs"
        )
    return out


def recovery_goals(doc: Doc | None) -> list[Goal]:
    """Time lost per failure against torchrun + DCP, restart time, detection, time to start."""
    p = "recovery"
    names = [
        ("time lost per failure, ftmem-launch + standbys / torchrun + DCP", "<= 0.33"),
        ("rank death -> all ranks stepping, standbys", "<= 1.5 s"),
        ("detection (rank death -> detected)", "<= 0.1 s (DLRover)"),
        ("detection -> new ranks started (stop + rendezvous + start)", "<= 0.02 s (DLRover)"),
    ]
    runs = (doc or {}).get("result", {}).get("runs", [])
    sb = [x for x in runs if x["system"] == "ftmem-launch + standbys"]
    dc = [x for x in runs if x["system"] == "torchrun + DCP"]
    if not sb or not dc:
        return [_missing(p, g, t) for g, t in names]
    lost = [st.median(x["time_lost_s"] for x in xs) for xs in (sb, dc)]
    ratio = st.ratio(*lost)
    restart = st.median(x["death_to_resumed_s"] for x in sb)
    detect = st.median(x["phases"].get("detect") for x in sb)
    to_start = st.median(
        sum(x["phases"].get(k) or 0.0 for k in ("stop", "rendezvous", "start"))
        for x in sb
        if x["phases"].get("start") is not None
    )
    values = [
        (f"{st.fmt(lost[0])} s / {st.fmt(lost[1])} s = {st.fmt(ratio)}", _le(ratio, 1 / 3)),
        (st.fmt(restart, ".2f", " s"), _le(restart, 1.5)),
        (st.fmt(detect, ".2f", " s"), _le(detect, 0.1)),
        (st.fmt(to_start, ".2f", " s"), _le(to_start, 0.02)),
    ]
    return _rows(p, names, values, f"recovery, {len(sb)} runs per system")


def ec_overhead_goals(doc: Doc | None) -> list[Goal]:
    """Step time with erasure-coded protection on against off (adjacent runs)."""
    from bench._tables import pair_ratios

    p, g = "ec-overhead", "step time, EC protection on / off"
    rat = pair_ratios(doc["result"]["runs"], "off", "on") if doc else []
    if not rat:
        return [_missing(p, g, STRADDLE)]
    return _rows(
        p,
        [(g, STRADDLE)],
        [(st.stat(rat, ".3f"), _straddles(rat))],
        f"ec-overhead, {len(rat)} pairs",
    )


def ec_protect_goals(doc: Doc | None) -> list[Goal]:
    """Encoding inside protect, per SMP, at 1-4 MiB stripes."""
    from bench._tables import ec_encode

    p, t = "ec-protect", ">= 5 GB/s"
    cases = [c for c in (doc or {}).get("result", {}).get("cases", []) if c["protect"]]
    if not cases:
        return [_missing(p, "encode throughput per SMP (in protect)", t)]
    return [
        g
        for c in cases
        for g in _rows(
            p,
            [(f"encode throughput per SMP (in protect), n={c['n']}, m={c['m']}", t)],
            [(st.stat(ec_encode(c), ".2f", " GB/s"), (st.median(ec_encode(c)) or 0.0) >= 5.0)],
            f"ec-protect, {c['size'] / st.MiB:g} MiB per node, stripes of {c['stripe'] / st.MiB:g} MiB",
        )
    ]


def datapath_figures(size: Doc) -> dict[str, Any]:
    """The per-GiB figures of one data path size from the rank's raw figures (None: missing)."""
    d = size["data"]
    nbytes = int(d.get("nbytes") or 0)
    gib = nbytes / st.GiB
    f: dict[str, Any] = {"gib": gib, "nbytes": nbytes}
    if not gib:
        return f
    mc, sv, rs, dc = (d.get(k) or {} for k in ("memcpy", "saves", "restore", "dcp"))
    f["memcpy_wall"], f["memcpy_cpu"] = (
        st.median(mc.get("wall") or []),
        st.median(mc.get("cpu") or []),
    )
    f["memcpy_cpu_per_gib"] = st.ratio(f["memcpy_cpu"], gib)
    f["memcpy_gbps"] = st.ratio(nbytes / 1e9, f["memcpy_wall"])
    n = f["committed"] = int(sv.get("committed") or 0)
    if n:
        f["rank_cpu_per_gib"] = sv["rank_cpu"] / (n * gib)
        f["smp_cpu_per_gib"] = sv["smp_cpu"] / (n * gib)
        f["total_cpu_per_gib"] = f["rank_cpu_per_gib"] + f["smp_cpu_per_gib"]
        idle = d.get("smp_idle_cpu_per_s")
        f["smp_idle_share"] = None if idle is None else idle * sv.get("window_s", 0.0) / (n * gib)
        f["cpu_ratio"] = st.ratio(f["total_cpu_per_gib"], f["memcpy_cpu_per_gib"])
        safe = sv.get("safe_s") or []
        f["safe_med"], f["safe_min"], f["safe_max"] = st.median(safe), st.low(safe), st.high(safe)
        f["safe_ratio"] = st.ratio(f["safe_med"], f["memcpy_wall"])
    f["stall_limit"] = 0.001 + 0.005 * gib
    f["first_save"] = (d.get("first") or {}).get("save_s")
    f["save_med"], f["save_max"] = (
        st.median(sv.get("save_s") or []),
        st.high(sv.get("save_s") or []),
    )
    f["stall_worst"] = st.high([f["first_save"], f["save_max"]])
    f["restore_med"] = st.median(rs.get("wall") or [])
    f["restore_per_gib"] = st.ratio(f["restore_med"], gib)
    cpu = st.median(
        a + b for a, b in zip(rs.get("rank_cpu") or [], rs.get("smp_cpu") or [], strict=False)
    )
    f["restore_cpu_per_gib"] = st.ratio(cpu, gib)
    if dc.get("blocking"):
        f["dcp_blocking"], f["dcp_staged"], f["dcp_done"] = (
            st.median(dc[k]) for k in ("blocking", "staged", "done")
        )
        f["dcp_cpu_per_gib"] = dc["cpu"] / (len(dc["blocking"]) * gib) if "cpu" in dc else None
        f["ftmem_over_dcp_cpu"] = st.ratio(f.get("total_cpu_per_gib"), f["dcp_cpu_per_gib"])
    return f


def datapath_goals(doc: Doc | None) -> list[Goal]:
    """CPU per snapshotted GiB, stall, time to safe and restore, on the largest state."""
    p = "datapath"
    names = [
        ("data path: CPU per snapshotted GiB (rank + SMP) / a memcpy's", "<= 2x"),
        ("data path: stall per save(), the first included", "<= 1 ms + 0.005 s/GiB"),
        ("data path: time to safe (save() to commit) / a memcpy of the same bytes", "<= 1x"),
        ("data path: restore in place", "<= 0.1 s/GiB"),
    ]
    sizes = [s for s in (doc or {}).get("result", {}).get("sizes", []) if s["data"].get("nbytes")]
    if not sizes:
        return [_missing(p, g, t) for g, t in names]
    f = datapath_figures(max(sizes, key=lambda s: s["data"]["nbytes"]))
    fm = st.fmt
    values = [
        (
            f"{fm(f.get('total_cpu_per_gib'), '.3f')} CPU-s/GiB = {fm(f.get('cpu_ratio'))}x memcpy's {fm(f.get('memcpy_cpu_per_gib'), '.3f')}",
            _le(f.get("cpu_ratio"), 2.0),
        ),
        (
            f"first {fm(f['first_save'], '.4f', ' s')}, median {fm(f['save_med'], '.4f', ' s')}, max {fm(f['save_max'], '.4f', ' s')}; limit {f['stall_limit']:.4f} s",
            _le(f["stall_worst"], f["stall_limit"]),
        ),
        (
            f"{fm(f.get('safe_med'), '.3f', ' s')} vs memcpy {fm(f.get('memcpy_wall'), '.3f', ' s')} = {fm(f.get('safe_ratio'))}x",
            _le(f.get("safe_ratio"), 1.0),
        ),
        (fm(f.get("restore_per_gib"), ".3f", " s/GiB"), _le(f.get("restore_per_gib"), 0.1)),
    ]
    return _rows(p, names, values, f"datapath, {f['gib']:.2f} GiB")


def gpu_goals(doc: Doc | None) -> list[Goal]:
    """The stall per ``save()`` of a CUDA state, the first included."""
    p, g, t = "gpu", "GPU: stall per save(), the first included", "<= 1 ms + 0.005 s/GiB"
    sizes = [
        x for x in (doc or {}).get("result", {}).get("sizes", []) if x["nbytes"] and x["save_s"]
    ]
    if not sizes:
        return [_missing(p, g, t)]
    out = []
    for x in sizes:
        worst = st.high([x["first"].get("save_s"), *x["save_s"]])
        limit = 0.001 + 0.005 * x["nbytes"] / st.GiB
        m = (f"{st.fmt(worst, '.4f')} s; limit {limit:.4f} s", _le(worst, limit))
        out += _rows(p, [(g, t)], [m], f"gpu, {x['nbytes'] / st.GiB:.2f} GiB")
    return out


def sharding_goals(doc: Doc | None) -> list[Goal]:
    """Bytes held per rank with sharding on: 1/D of the full snapshot."""
    p = "sharding"
    out = []
    for w in (doc or {}).get("result", {}).get("worlds", []):
        full, sh = w["modes"].get("full"), w["modes"].get("sharded")
        if full and sh:
            rat = st.ratio(sh["held"], full["held"])
            g = (
                f"bytes held per rank, sharded / full, D={w['world']}",
                f"~1/D = {1 / w['world']:.3f}",
            )
            out += _rows(p, [g], [(st.fmt(rat, ".3f"), _le(rat, 1.05 / w["world"]))], "sharding")
    return out


GOALS: dict[str, Callable[[Doc | None], list[Goal]]] = {
    "snapshot": snapshot_goals,
    "overhead": overhead_goals,
    "flush": flush_goals,
    "recovery": recovery_goals,
    "ec-overhead": ec_overhead_goals,
    "ec-protect": ec_protect_goals,
    "datapath": datapath_goals,
    "gpu": gpu_goals,
    "sharding": sharding_goals,
}
"""Part -> its goals (filled by each part's goal function)."""


def goals(docs: dict[str, Doc]) -> list[Goal]:
    """Every goal of every part, from the parts' results (missing parts: not measured)."""
    return [g for part, fn in GOALS.items() for g in fn(docs.get(part))]
