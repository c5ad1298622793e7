"""The tables of each part's section, made from its results JSON (used by ``bench/_render.py``).

``BODIES[part](doc)`` gives, per section the part makes, the lines between the section's
head (title, command, machine) and its tail (goals, errors). Figures only: the reading of
them is hand-written in docs/benchmarks.md, outside the markers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench import _goals
from bench import _stats as st
from bench._stats import GiB, MiB, fmt, stat
from bench._tables_base import Doc, mib, table
from bench._tables_jobs import ec_overhead, flush, overhead, recovery

# ------------------------------------------------------------------------------ snapshot


def _figure_row(f: Doc, nbytes: int) -> list[str]:
    v = f["values"]
    rng = f"{fmt(st.low(v), '.4f')}-{fmt(st.high(v), '.4f')}"
    if f["unit"] == "GB/s":
        med = st.median(v)
        rng = f"{fmt(st.low(v))}-{fmt(st.high(v))}"
        return [
            f["system"],
            f["metric"],
            fmt(med, ".2f", " GB/s"),
            rng,
            fmt(med and med / 1.073741824, ".2f", " GiB/s"),
        ]
    med = st.median(v)
    return [
        f["system"],
        f["metric"],
        fmt(med, ".4f", " s"),
        rng,
        fmt(med and med * GiB / nbytes, ".4f", " s/GiB"),
    ]


def snapshot(doc: Doc) -> dict[str, list[str]]:
    """Sections ``snapshot`` and ``memory``."""
    r = doc["result"]
    out = [
        f"- each figure: median of {r['repeats']} repeats, with min-max; per GiB divides the "
        "median by the state size (params + AdamW exp_avg + exp_avg_sq, fp32)",
        "- forward/backward stand-in between a save and `optimizer.step()`: "
        + (
            f"{r['fwd_bwd_s']:g} s of 256x256 matmuls on the main thread"
            if r["simulate"] == "compute"
            else f"time.sleep({r['fwd_bwd_s']:g})"
        ),
        "",
    ]
    for s in r["sizes"]:
        out += [f"### {s['nbytes'] / GiB:.2f} GiB state (requested {s['size_gib']:g} GiB)", ""]
        rows = [_figure_row(f, s["nbytes"]) for f in s["figures"]]
        out += table(["system", "metric", "median", "min-max", "per GiB"], rows)
        once = [
            [k, fmt(v, ".3f", " s") if "skipped" not in k else bool(v)]
            for k, v in s["once"].items()
        ]
        once.append(
            ["ftmem restore check (clobber a weight and a moment, load, compare)", s["restore_ok"]]
        )
        once.append(["ftmem timed snapshots skipped or not committed", s["skipped"]])
        out += table(["one-off figure", "value"], once)
        if s["stats_after"]:
            out += [f"`ftmem.stats()` after the last save: `{s['stats_after']}`", ""]
    mem = {**doc, "result": {**r, "sizes": [s["memory"] for s in r["sizes"] if s.get("memory")]}}
    return {"snapshot": out, "memory": memory(mem)["memory"]}


def memory(doc: Doc) -> dict[str, list[str]]:
    """Section ``memory``: one row per state size."""
    out = [
        "- one rank (this process) snapshots the benchmark state into an SMP; read after every "
        "committed snapshot once both slots hold one; median (min-max) over those readings",
        "- memory per node = shared memory (/dev/shm) + SMP RssAnon + the rank's added RssAnon",
        "",
    ]
    rows = []
    for m in doc["result"]["sizes"]:
        n = m["state_bytes"]
        total = [
            a + b + c for a, b, c in zip(m["shm"], m["smp_anon"], m["rank_anon_added"], strict=True)
        ]
        rows.append(
            [
                f"{n / GiB:.2f} GiB",
                m["slots"],
                f"{mib(m['shm'])} ({stat(st.scale(m['shm'], 1 / n), '.2f', 'x')})",
                mib(m["smp_rss"]),
                mib(m["smp_shmem"]),
                mib(m["smp_anon"]),
                mib(m["rank_anon_added"]),
                f"{mib(total)} ({stat(st.scale(total, 1 / n), '.2f', 'x')})",
            ]
        )
    head = ["state", "slots per rank", "shared memory (x state)", "SMP RSS", "SMP RssShmem"]
    head += ["SMP RssAnon", "rank RssAnon added", "memory per node (x state)"]
    return {"memory": out + table(head, rows)}


HEADLINE = (
    (
        "torch.save (disk, fsync)",
        ("torch.save", "disk+fsync"),
        ("torch.load", "+ load_state_dict (/dev/shm)"),
    ),
    ("dcp.save (disk, fsync)", ("dcp.save", "disk+fsync"), ("dcp.load", "in place (/dev/shm)")),
    ("dcp.async_save, tuned: blocking call", ("dcp.async_save (async staging)", "blocking"), None),
    (
        "dcp.async_save, tuned: + staging wait",
        ("dcp.async_save (async staging)", "stall with fence"),
        None,
    ),
    (
        "**ftmem** (save + fence; load in place)",
        ("ftmem", "stall (save + fence)"),
        ("ftmem", "load in place"),
    ),
)


def headline(docs: dict[str, Doc]) -> list[str]:
    """The summary's headline table: stall and restore per GiB on the largest state."""
    big = _goals.largest(docs.get("snapshot"))
    if big is None:
        return []
    n = big["nbytes"]
    rows = []
    for label, stall, restore in HEADLINE:
        s = st.per_gib(_goals.figure(big, *stall), n)
        r = st.per_gib(_goals.figure(big, *restore), n) if restore else []
        rows.append([label, stat(s, ".4f", " s/GiB"), stat(r, ".3f", " s/GiB")])
    title = f"### Headline: {n / GiB:.2f} GiB of model + AdamW state, one process"
    return [title, "", *table(["system", "stall per snapshot", "restore"], rows)]


def _wall(rows: Sequence[Doc]) -> float:
    return float(max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows))


def ec_encode(c: Doc) -> list[float]:
    """Encode GB/s per SMP (wall seconds inside ``encode_stripe``), every node and repeat."""
    return [x["enc_bytes"] / x["enc_s"] / 1e9 for rows in c["protect"] for x in rows if x["enc_s"]]


def ec_protect(doc: Doc) -> dict[str, list[str]]:
    """Section ``ec-protect``: protect, per node and snapshot, rebuild."""
    r = doc["result"]
    size = r["size"]
    out = [
        f"- one OS process per node on 127.0.0.1, `ZmqPeerTransport` (TCP + CURVE: libzmq {r['libzmq']}, "
        f"CURVE {'available' if r['curve'] else 'MISSING'}) and `GroupProtector` (timeout {r['timeout']:g} s), "
        f"`{r['ec_type']}`; a random snapshot of {size / MiB:g} MiB per node, stripes of {r['stripe'] / MiB:g} MiB; "
        f"median (min-max) over {r['repeats']} repeats; 'alone' = `encode_stripe` on {r['codec_bytes'] / MiB:g} MiB "
        "in a fresh process (GB/s; per CPU-s)",
        "",
        "### Protect (every node protects the same step)",
        "",
    ]
    prot, node, reb = [], [], []
    for c in r["cases"]:
        n, m, gib = c["n"], c["m"], size / GiB
        alone = (
            f"{c['codec_alone'][0]:.2f} ({c['codec_alone'][1]:.2f})" if c["codec_alone"] else "-"
        )
        rows = [x for rr in c["protect"] for x in rr]
        walls = [_wall(rr) for rr in c["protect"]]
        prot.append(
            [
                n,
                m,
                stat(walls, ".2f", " s"),
                stat(st.gbps(size, walls), ".3f"),
                stat(st.gbps(n * size, walls), ".3f"),
                stat(ec_encode(c)),
                stat([x["enc_bytes"] / x["enc_cpu_s"] / 1e9 for x in rows if x["enc_cpu_s"]]),
                stat([x["enc_bytes"] / x["gather_s"] / 1e9 for x in rows if x["gather_s"]]),
                alone,
                stat([sum(x["cpu_s"] for x in rr) / _wall(rr) for rr in c["protect"]]),
                stat(c["machine_busy"]),
            ]
        )
        node.append(
            [
                n,
                m,
                stat([x["parity"] / size for x in rows], ".4f"),
                f"{m / (n - m):.4f}",
                stat([x["sent"] / size for x in rows], ".2f", "x"),
                stat([x["recv"] / size for x in rows], ".2f", "x"),
                f"{stat([x['main_cpu_s'] / gib for x in rows])} / {stat([(x['cpu_s'] - x['main_cpu_s']) / gib for x in rows])}",
                stat([100 * x["enc_cpu_s"] / x["cpu_s"] for x in rows if x["cpu_s"]], ".0f", " %"),
                stat([x["maxrss"] / size for x in rows], ".2f", "x"),
            ]
        )
        rrows = [x for rr in c["rebuild"] for x in rr]
        rw = [_wall(rr) for rr in c["rebuild"]]
        reb.append(
            [
                n,
                m,
                ", ".join(map(str, c["lost"])),
                stat(rw, ".2f", " s"),
                stat(st.gbps(len(c["lost"]) * size, rw), ".3f"),
                stat([x["recv"] / size for x in rrows], ".2f", "x"),
                stat([x["sent"] / size for rr in c["served"] for x in rr], ".2f", "x"),
                f"{stat([x['main_cpu_s'] / gib for x in rrows])} / {stat([(x['cpu_s'] - x['main_cpu_s']) / gib for x in rrows])}",
                stat([x["maxrss"] / GiB for x in rrows], ".2f", " GiB"),
                stat(c["machine_busy_rebuild"]),
                stat(c["rebuild_spawn_s"], ".1f", " s"),
                f"{sum(c['rebuild_ok'])}/{len(c['rebuild_ok'])}",
            ]
        )
    head = [
        "n",
        "m",
        "protect time",
        "protected GB/s per node",
        "group GB/s",
        "encode GB/s per SMP (wall)",
    ]
    head += [
        "encode GB/s per CPU-s",
        "encode + gather + parity send GB/s",
        "encode_stripe alone",
        "node processes' cores busy",
        "machine cores busy",
    ]
    out += table(head, prot)
    head = [
        "n",
        "m",
        "parity held / own",
        "expected m/(n-m)",
        "peer bytes sent / own",
        "received / own",
    ]
    head += [
        "CPU s per GiB: protector thread / other threads",
        "encode share of node CPU",
        "peak RSS / own",
    ]
    out += ["Per node and snapshot (every node and repeat):", "", *table(head, node)]
    head = [
        "n",
        "m",
        "lost",
        "rebuild time",
        "rebuilt GB/s",
        "fetched per new node / own",
        "served per survivor / own",
    ]
    head += [
        "new node CPU s per GiB: protector / other",
        "peak RSS of a new node",
        "machine cores busy",
        "new process up + reconnected",
        "bitwise equal",
    ]
    out += [
        "### Rebuild (lost node processes SIGKILLed; fresh ones on new ports rebuild)",
        "",
        *table(head, reb),
    ]
    return {"ec-protect": out}


def flatten(d: Any, prefix: str = "") -> list[list[str]]:
    """Every raw figure of a nested dict as (path, value) rows; lists of numbers as stat()."""
    rows: list[list[str]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            rows += flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif (
        isinstance(d, list)
        and d
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in d)
    ):
        rows.append([prefix, f"{stat(d, '.4g')} (n={len(d)})"])
    elif isinstance(d, float):
        rows.append([prefix, f"{d:.4g}"])
    else:
        rows.append([prefix, str(d)])
    return rows


DATAPATH_ROWS = (
    ("CPU: rank process per snapshotted GiB", "rank_cpu_per_gib", ".3f"),
    ("CPU: SMP process + children per snapshotted GiB", "smp_cpu_per_gib", ".3f"),
    ("CPU: total per snapshotted GiB", "total_cpu_per_gib", ".3f"),
    ("CPU: of which SMP idle housekeeping", "smp_idle_share", ".3f"),
    ("memcpy of the same bytes: CPU-s per GiB", "memcpy_cpu_per_gib", ".3f"),
    ("memcpy: GB/s (one thread)", "memcpy_gbps", ".2f"),
    ("total CPU / memcpy's", "cpu_ratio", ".2f"),
    ("stall: first save() (s)", "first_save", ".4f"),
    ("stall: save() median / max over the saves (s)", ("save_med", "save_max"), ".4f"),
    ("stall limit: 1 ms + 0.005 s/GiB (s)", "stall_limit", ".4f"),
    (
        "time to safe: save() to commit, median / min / max (s)",
        ("safe_med", "safe_min", "safe_max"),
        ".3f",
    ),
    ("synchronous memcpy of the same bytes (s)", "memcpy_wall", ".3f"),
    ("time to safe / memcpy", "safe_ratio", ".2f"),
    ("restore in place: median (s)", "restore_med", ".3f"),
    ("restore: s/GiB", "restore_per_gib", ".3f"),
    ("restore CPU (rank + SMP) per GiB", "restore_cpu_per_gib", ".3f"),
    (
        "dcp.async_save: blocking / until staged / until written (s)",
        ("dcp_blocking", "dcp_staged", "dcp_done"),
        ".3f",
    ),
    ("dcp.async_save: process CPU per GiB saved", "dcp_cpu_per_gib", ".3f"),
    ("ftmem total CPU / dcp.async_save's", "ftmem_over_dcp_cpu", ".2f"),
)


def datapath(doc: Doc) -> dict[str, list[str]]:
    """Section ``datapath``: derived figures per size, the raw figures, the hash functions."""
    from bench._goals import datapath_figures

    r = doc["result"]
    out = [
        f"- profile `{r['profile']}`: K = {r['saves']} saves, {r['repeats']} repeats of the memcpy and "
        f"the restore, compute stand-in {r['compute_ms']:g} ms, dcp.async_save {r['dcp_saves']} saves; "
        f"{r['slots']} slots per rank; loose fraction {r['loose_frac']:g}; SMP: {r['smp_note']}",
        "",
    ]
    sizes = [s for s in r["sizes"] if s["data"].get("nbytes")]
    figs = [datapath_figures(s) for s in sizes]
    rows = []
    for label, key, spec in DATAPATH_ROWS:
        keys = (key,) if isinstance(key, str) else key
        rows.append([label, *[" / ".join(fmt(f.get(k), spec) for k in keys) for f in figs]])
    out += table(["figure", *[f"{f['gib']:.2f} GiB" for f in figs]], rows)
    for s in r["sizes"]:
        raw = (s["skipped"] and [["skipped", s["skipped"]]]) or flatten(s["data"])
        out += [f"<details><summary>Raw figures, {s['size_gib']:g} GiB</summary>", ""]
        out += [
            *table(["measurement", "value"], [*raw, *[["note", n] for n in s["notes"]]]),
            "</details>",
            "",
        ]
    if r["hashes"]:
        base = st.median(r["hashes"][0]["cpu"])
        hrows = [
            [
                h["name"],
                stat(st.gbps(h["bytes"], h["wall"])),
                stat(st.per_gib(h["cpu"], h["bytes"]), ".3f"),
                fmt(st.ratio(st.median(h["cpu"]), base), ".2f", "x"),
            ]
            for h in r["hashes"]
        ]
        mib = r["hashes"][0]["bytes"] / MiB
        out += [f"### Hash functions: CPU per GiB on {mib:.0f} MiB, one thread", ""]
        out += table(["function", "GB/s", "CPU-s per GiB", "x memcpy"], hrows)
    return {"datapath": out}


def gpu(doc: Doc) -> dict[str, list[str]]:
    """Section ``gpu``: per size, the pinned copies, stall, D2H to commit, restore."""
    r = doc["result"]
    if r["device"] is None:
        return {
            "gpu": [
                f"**skipped: no CUDA** (`torch.cuda.is_available()` is False; CUDA build {r['cuda_build']}).",
                "",
            ]
        }
    out = [f"- device: {r['device']}; profile `{r['profile']}`; SMP: {r['smp_note']}", ""]
    for x in r["sizes"]:
        n, cuda = x["nbytes"], x["cuda_bytes"]
        out += [f"### {n / GiB:.2f} GiB state ({x['layers']}, {x['tensors']} tensors)", ""]
        if x["error"] or x["not_run"]:
            out += [f"not measured: {x['error'] or x['not_run']}", ""]
            continue
        snap = len(x["safe_s"]) * n / GiB
        first = x["first"]
        rows = [
            [
                "pinned D2H of the same tensors (side stream): the link's limit",
                stat(st.gbps(cuda, x["pinned_d2h"]), ".1f", " GB/s"),
            ],
            ["pinned H2D back", stat(st.gbps(cuda, x["pinned_h2d"]), ".1f", " GB/s")],
            [
                "stall: first `save()`",
                fmt(first.get("save_s"), ".4f", " s")
                + (f" (skipped: {first.get('reason')})" if first.get("skipped") else ""),
            ],
            [f"`save()` over the {len(x['save_s'])} saves", stat(x["save_s"], ".4f", " s")],
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
            [
                "CPU per snapshotted GiB: this process / SMP",
                f"{fmt(st.ratio(x['proc_cpu'], snap), '.3f')} / {fmt(st.ratio(x['smp_cpu'], snap), '.3f')}",
            ],
            [
                "restore (`load` in place, H2D)",
                stat(x["restore_s"], ".3f", " s")
                + f" = {stat(st.per_gib(x['restore_s'], n), '.3f', ' s/GiB')}",
            ],
            ["restore check (clobber a weight, load, compare)", x["restore_check"]],
        ]
        out += table(["figure", "value"], rows) + [f"- {note}" for note in x["notes"]] + [""]
    return {"gpu": out}


def sharding(doc: Doc) -> dict[str, list[str]]:
    """Section ``sharding``: per D and mode, held bytes, stall, copy, restore."""
    r = doc["result"]
    out = [
        f"- state {r['size_gib']:g} GiB per rank, {r['repeats']} repeats after one warm-up, modes "
        f"alternating; compute stand-in {r['compute_s']:g} s (sleep); medians over ranks and repeats",
        "",
    ]
    rows = []
    for w in r["worlds"]:
        full = w["modes"].get("full")
        for mode, m in w["modes"].items():
            rows.append(
                [
                    w["world"],
                    mode,
                    mib([m["held"]]),
                    stat(m["stall"], ".4f", " s"),
                    stat(m["copy"], ".3f", " s"),
                    stat(m["restore"], ".3f", " s"),
                    fmt(st.ratio(st.median(m["copy"]), full and st.median(full["copy"]))),
                    fmt(st.ratio(m["held"], full and full["held"]), ".3f"),
                ]
            )
    head = [
        "D",
        "mode",
        "held per rank",
        "stall",
        "copy",
        "restore",
        "copy vs full",
        "held vs full",
    ]
    return {"sharding": out + table(head, rows)}


def ec_codec(doc: Doc) -> dict[str, list[str]]:
    """Section ``ec``: the codec's throughput (GB/s of data) per case and malloc setting."""
    r = doc["result"]
    out = [
        f"- `{r['ec_type']}`, one thread, {r['data_mib']} MiB of data per pass, median of {r['repeats']}; "
        "each case and malloc setting in a fresh interpreter",
        "",
    ]
    rows = [
        [
            x["n"],
            x["m"],
            f"{x['stripe_mib']} MiB",
            "tuned" if x["tuned"] else "default",
            fmt(x["pyeclib"], ".1f"),
            fmt(x["encode_stripe"], ".1f"),
            fmt(x["encode"], ".1f"),
            fmt(x["rebuild"], ".1f"),
            fmt(x["ms_per_stripe"]),
        ]
        for x in sorted(r["rows"], key=lambda x: (x["n"], x["stripe_mib"], not x["tuned"]))
    ]
    head = [
        "n",
        "m",
        "stripe",
        "malloc",
        "pyeclib encode",
        "encode_stripe (+xxh3)",
        "encode (gather k chunks)",
    ]
    return {"ec": out + table([*head, "rebuild m lost", "ms/stripe (GIL held)"], rows)}


BODIES: dict[str, Callable[[Doc], dict[str, list[str]]]] = {
    "snapshot": snapshot,
    "memory": memory,
    "overhead": overhead,
    "flush": flush,
    "recovery": recovery,
    "ec-overhead": ec_overhead,
    "ec-protect": ec_protect,
    "datapath": datapath,
    "gpu": gpu,
    "sharding": sharding,
    "ec": ec_codec,
}
