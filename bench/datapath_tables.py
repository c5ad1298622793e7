"""The ``datapath`` and ``gpu`` sections of docs/benchmarks.md and their goals, rendered from
the results JSON of ``bench/datapath.py`` (without and with ``--gpu``): per state size the
derived per-GiB figures (CPU against a memcpy, stall, time to safe, restore, ``dcp.async_save``)
with the rank's raw figures and the hash table; for a CUDA state, the pinned copies, the stall,
D2H to commit and the restore. Nothing here measures: ``bench/_render.py`` calls
``sections(result)`` and ``goals(result, part)``.
"""

from __future__ import annotations

from typing import Any

from bench import _stats as st
from bench._figures import Goal, goal_rows, kv, le, rows, table
from bench._stats import GiB, MiB, fmt, stat
from bench.datapath import PART

Doc = dict[str, Any]


def flatten(d: Any, prefix: str = "") -> list[list[str]]:
    """Every raw figure of a nested dict as (path, value) rows; lists of numbers as stat()."""
    if isinstance(d, dict):
        return [row for k, v in d.items() for row in flatten(v, f"{prefix}.{k}" if prefix else k)]
    if isinstance(d, list) and d and all(type(x) in (int, float) for x in d):
        return [[prefix, f"{stat(d, '.4g')} (n={len(d)})"]]
    return [[prefix, f"{d:.4g}" if isinstance(d, float) else str(d)]]


DATAPATH_ROWS = (  # label, keys of datapath_figures() (shown "a / b"), format
    ("CPU: rank process per snapshotted GiB", "rank_cpu_per_gib", ".3f"),
    ("CPU: SMP process + children per snapshotted GiB", "smp_cpu_per_gib", ".3f"),
    ("CPU: total per snapshotted GiB", "total_cpu_per_gib", ".3f"),
    ("CPU: of which SMP idle housekeeping", "smp_idle_share", ".3f"),
    ("memcpy of the same bytes: CPU-s per GiB", "memcpy_cpu_per_gib", ".3f"),
    ("memcpy: GB/s (one thread)", "memcpy_gbps", ".2f"),
    ("total CPU / memcpy's", "cpu_ratio", ".2f"),
    ("stall: first save() (s)", "first_save", ".4f"),
    ("stall: save() median / max over the saves (s)", "save_med save_max", ".4f"),
    ("stall limit: 1 ms + 0.005 s/GiB (s)", "stall_limit", ".4f"),
    ("time to safe: save() to commit, median / min / max (s)", "safe_med safe_min safe_max", ".3f"),
    ("synchronous memcpy of the same bytes (s)", "memcpy_wall", ".3f"),
    ("time to safe / memcpy", "safe_ratio", ".2f"),
    ("restore in place: median (s)", "restore_med", ".3f"),
    ("restore: s/GiB", "restore_per_gib", ".3f"),
    ("restore CPU (rank + SMP) per GiB", "restore_cpu_per_gib", ".3f"),
    (
        "dcp.async_save: blocking / until staged / until written (s)",
        "dcp_blocking dcp_staged dcp_done",
        ".3f",
    ),
    ("dcp.async_save: process CPU per GiB saved", "dcp_cpu_per_gib", ".3f"),
    ("ftmem total CPU / dcp.async_save's", "ftmem_over_dcp_cpu", ".2f"),
)


def _datapath(r: Doc) -> list[str]:
    out = [
        f"- profile `{r['profile']}`: K = {r['saves']} saves, {r['repeats']} repeats of the memcpy "
        f"and the restore, compute stand-in {r['compute_ms']:g} ms, dcp.async_save "
        f"{r['dcp_saves']} saves; {r['slots']} slots per rank; loose fraction "
        f"{r['loose_frac']:g}; SMP: {r['smp_note']}",
        "",
    ]
    figs = [datapath_figures(s) for s in r["sizes"] if s["data"].get("nbytes")]
    body = [
        [label, *(" / ".join(fmt(f.get(k), spec) for k in keys.split()) for f in figs)]
        for label, keys, spec in DATAPATH_ROWS
    ]
    out += table(["figure", *(f"{f['gib']:.2f} GiB" for f in figs)], body)
    for s in r["sizes"]:
        raw = [["skipped", s["skipped"]]] if s["skipped"] else flatten(s["data"])
        raw += [["note", n] for n in s["notes"]]
        out += [f"<details><summary>Raw figures, {s['size_gib']:g} GiB</summary>", ""]
        out += [*kv(raw, ("measurement", "value")), "</details>", ""]
    if hashes := r["hashes"]:
        base = st.median(hashes[0]["cpu"])
        columns = [
            ("function", lambda h: h["name"]),
            ("GB/s", lambda h: stat(st.gbps(h["bytes"], h["wall"]))),
            ("CPU-s per GiB", lambda h: stat(st.per_gib(h["cpu"], h["bytes"]), ".3f")),
            ("x memcpy", lambda h: fmt(st.ratio(st.median(h["cpu"]), base), ".2f", "x")),
        ]
        mib = hashes[0]["bytes"] / MiB
        out += [f"### Hash functions: CPU per GiB on {mib:.0f} MiB, one thread", ""]
        out += rows(columns, hashes)
    return out


def _gpu_rows(x: Doc) -> list[list[Any]]:
    n, cuda, first, saves = x["nbytes"], x["cuda_bytes"], x["first"], x["save_s"]
    snap = len(x["safe_s"]) * n / GiB
    skipped = f" (skipped: {first.get('reason')})" if first.get("skipped") else ""
    cpu = [fmt(st.ratio(x[k], snap), ".3f") for k in ("proc_cpu", "smp_cpu")]
    restore = f" = {stat(st.per_gib(x['restore_s'], n), '.3f', ' s/GiB')}"
    return [
        [
            "pinned D2H of the same tensors (side stream): the link's limit",
            stat(st.gbps(cuda, x["pinned_d2h"]), ".1f", " GB/s"),
        ],
        ["pinned H2D back", stat(st.gbps(cuda, x["pinned_h2d"]), ".1f", " GB/s")],
        ["stall: first `save()`", fmt(first.get("save_s"), ".4f", " s") + skipped],
        [f"`save()` over the {len(saves)} saves", stat(saves, ".4f", " s")],
        ["first save to commit", fmt(first.get("safe_s"), ".3f", " s")],
        [
            "D2H by ftmem: bytes / (`save()` to commit)",
            stat(st.gbps(n, x["safe_s"]), ".1f", " GB/s"),
        ],
        ["save to commit", stat(x["safe_s"], ".3f", " s")],
        ["saves skipped in save()", x["skipped"]],
        [
            "SMP verified the last step, after its commit",
            f"{fmt(x['verify_wait_s'], '.3f', ' s')} ({x['verified']})",
        ],
        ["CPU per snapshotted GiB: this process / SMP", " / ".join(cpu)],
        ["restore (`load` in place, H2D)", stat(x["restore_s"], ".3f", " s") + restore],
        ["restore check (clobber a weight, load, compare)", x["restore_check"]],
    ]


def _gpu(r: Doc) -> list[str]:
    if r["device"] is None:
        no_cuda = f"(`torch.cuda.is_available()` is False; CUDA build {r['cuda_build']})."
        return [f"**skipped: no CUDA** {no_cuda}", ""]
    out = [f"- device: {r['device']}; profile `{r['profile']}`; SMP: {r['smp_note']}", ""]
    for x in r["sizes"]:
        out += [
            f"### {x['nbytes'] / GiB:.2f} GiB state ({x['layers']}, {x['tensors']} tensors)",
            "",
        ]
        if x["error"] or x["not_run"]:
            out += [f"not measured: {x['error'] or x['not_run']}", ""]
        else:
            out += [*kv(_gpu_rows(x)), *(f"- {note}" for note in x["notes"]), ""]
    return out


def datapath_figures(size: Doc) -> dict[str, Any]:
    """The per-GiB figures of one data path size from the rank's raw figures (None: missing)."""
    d = size["data"]
    nbytes = int(d.get("nbytes") or 0)
    gib = nbytes / GiB
    f: dict[str, Any] = {"gib": gib, "nbytes": nbytes}
    if not gib:
        return f
    mc, sv, rs, dc = (d.get(k) or {} for k in ("memcpy", "saves", "restore", "dcp"))
    f["memcpy_wall"], f["memcpy_cpu"] = (st.median(mc.get(k) or []) for k in ("wall", "cpu"))
    f["memcpy_cpu_per_gib"] = st.ratio(f["memcpy_cpu"], gib)
    f["memcpy_gbps"] = st.ratio(nbytes / 1e9, f["memcpy_wall"])
    if n := int(sv.get("committed") or 0):
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
    saves = sv.get("save_s") or []
    f["save_med"], f["save_max"] = st.median(saves), st.high(saves)
    f["stall_worst"] = st.high([f["first_save"], f["save_max"]])
    f["restore_med"] = st.median(rs.get("wall") or [])
    f["restore_per_gib"] = st.ratio(f["restore_med"], gib)
    cpu = zip(rs.get("rank_cpu") or [], rs.get("smp_cpu") or [], strict=False)
    f["restore_cpu_per_gib"] = st.ratio(st.median(a + b for a, b in cpu), gib)
    if dc.get("blocking"):
        f["dcp_blocking"], f["dcp_staged"], f["dcp_done"] = (
            st.median(dc[k]) for k in ("blocking", "staged", "done")
        )
        f["dcp_cpu_per_gib"] = dc["cpu"] / (len(dc["blocking"]) * gib) if "cpu" in dc else None
        f["ftmem_over_dcp_cpu"] = st.ratio(f.get("total_cpu_per_gib"), f["dcp_cpu_per_gib"])
    return f


DATAPATH_GOALS = (
    ("data path: CPU per snapshotted GiB (rank + SMP) / a memcpy's", "<= 2x"),
    ("data path: stall per save(), the first included", "<= 1 ms + 0.005 s/GiB"),
    ("data path: time to safe (save() to commit) / a memcpy of the same bytes", "<= 1x"),
    ("data path: restore in place", "<= 0.1 s/GiB"),
)
GPU_GOAL = ("GPU: stall per save(), the first included", "<= 1 ms + 0.005 s/GiB")


def _datapath_goals(r: Doc | None) -> list[Goal]:
    sizes = [s for s in (r or {}).get("sizes", []) if s["data"].get("nbytes")]
    if not sizes:
        return [Goal(PART, g, t) for g, t in DATAPATH_GOALS]
    f = datapath_figures(max(sizes, key=lambda s: s["data"]["nbytes"]))
    g = {k: fmt(f.get(k), ".3f") for k in ("total_cpu_per_gib", "memcpy_cpu_per_gib")}
    g |= {k: fmt(f.get(k), ".4f", " s") for k in ("first_save", "save_med", "save_max")}
    g |= {k: fmt(f.get(k), ".3f", " s") for k in ("safe_med", "memcpy_wall")}
    g |= {k: fmt(f.get(k)) for k in ("cpu_ratio", "safe_ratio")}
    values = [
        (
            f"{g['total_cpu_per_gib']} CPU-s/GiB = {g['cpu_ratio']}x memcpy's "
            f"{g['memcpy_cpu_per_gib']}",
            le(f.get("cpu_ratio"), 2.0),
        ),
        (
            f"first {g['first_save']}, median {g['save_med']}, max {g['save_max']}; "
            f"limit {f['stall_limit']:.4f} s",
            le(f["stall_worst"], f["stall_limit"]),
        ),
        (
            f"{g['safe_med']} vs memcpy {g['memcpy_wall']} = {g['safe_ratio']}x",
            le(f.get("safe_ratio"), 1.0),
        ),
        (fmt(f.get("restore_per_gib"), ".3f", " s/GiB"), le(f.get("restore_per_gib"), 0.1)),
    ]
    return goal_rows(PART, DATAPATH_GOALS, values, f"datapath, {f['gib']:.2f} GiB")


def _gpu_goals(r: Doc | None) -> list[Goal]:
    sizes = [x for x in (r or {}).get("sizes", []) if x["nbytes"] and x["save_s"]]
    out = [] if sizes else [Goal("gpu", *GPU_GOAL)]
    for x in sizes:
        worst = st.high([x["first"].get("save_s"), *x["save_s"]])
        limit = 0.001 + 0.005 * x["nbytes"] / GiB
        m = (f"{fmt(worst, '.4f')} s; limit {limit:.4f} s", le(worst, limit))
        out += goal_rows("gpu", [GPU_GOAL], [m], f"gpu, {x['nbytes'] / GiB:.2f} GiB")
    return out


def sections(r: Doc) -> dict[str, list[str]]:
    """Section ``gpu`` (a result with a ``device``: per size, the pinned copies, stall, D2H to
    commit, restore) or ``datapath`` (derived figures per size, the raw ones, the hashes)."""
    return {"gpu": _gpu(r)} if "device" in r else {"datapath": _datapath(r)}


def goals(r: Doc | None, part: str = PART) -> list[Goal]:
    """The goals of part ``gpu`` (the stall per save(), per size) or ``datapath`` (CPU, stall,
    time to safe, restore, on the largest state)."""
    return _gpu_goals(r) if part == "gpu" else _datapath_goals(r)
