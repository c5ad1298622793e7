"""The ``ec-protect`` section of docs/benchmarks.md and its goals, rendered from the results
JSON of ``bench/ec_protect.py``: the channel alone, then per case (n, m, channel, encode
workers) the protect throughput, the per-node figures and the rebuild; the goals are the
encode throughput per SMP and the CPU of the tagged channel against CURVE. Nothing here
measures: ``bench/_render.py`` calls ``sections(result)`` and ``goals(result)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench._ec_node import CHANNELS
from bench._figures import Goal, rows
from bench._stats import GiB, MiB, gbps, median, stat
from bench.ec_protect import Doc, wall


def ec_encode(c: Doc) -> list[float]:
    """Encode GB/s per SMP (wall seconds inside ``encode_stripe``), every node and repeat."""
    return [x["enc_bytes"] / x["enc_s"] / 1e9 for rr in c["protect"] for x in rr if x["enc_s"]]


def _per(rows: Sequence[Doc], key: str, den: float, spec: str = ".2f", unit: str = "x") -> str:
    """``stat`` of ``x[key] / den`` over the rows."""
    return stat([x[key] / den for x in rows], spec, unit)


def _cpu_split(rows: Sequence[Doc], gib: float) -> str:
    """CPU-s per GiB of the main thread / of the other threads."""
    other = stat([(x["cpu_s"] - x["main_cpu_s"]) / gib for x in rows])
    return f"{stat([x['main_cpu_s'] / gib for x in rows])} / {other}"


def _gb_per(rows: Sequence[Doc], key: str) -> str:
    """``stat`` of GB encoded per second of ``key``."""
    return stat([x["enc_bytes"] / x[key] / 1e9 for x in rows if x[key]])


def _ec_case(c: Doc, size: int) -> Doc:
    """A case with its rows flattened: protect/rebuild rows and walls, busy cores, encode share."""
    prot = [x for rr in c["protect"] for x in rr]
    return {
        **c,
        "prot": prot,
        "walls": [wall(rr) for rr in c["protect"]],
        "reb": [x for rr in c["rebuild"] for x in rr],
        "rwalls": [wall(rr) for rr in c["rebuild"]],
        "srv": [x for rr in c["served"] for x in rr],
        "busy": [sum(x["cpu_s"] for x in rr) / wall(rr) for rr in c["protect"]],
        "enc_share": [100 * x["enc_cpu_s"] / x["cpu_s"] for x in prot if x["cpu_s"]],
        "size": size,
        "gib": size / GiB,
    }


def _alone(c: Doc) -> str:
    return f"{c['codec_alone'][0]:.2f} ({c['codec_alone'][1]:.2f})" if c["codec_alone"] else "-"


KEY = [
    ("n", lambda c: c["n"]),
    ("m", lambda c: c["m"]),
    ("channel", lambda c: c.get("mode", "curve")),
    ("encode workers", lambda c: c.get("workers", 0)),
]
EC_PROTECT = [
    *KEY,
    ("protect time", lambda c: stat(c["walls"], ".2f", " s")),
    ("protected GB/s per node", lambda c: stat(gbps(c["size"], c["walls"]), ".3f")),
    ("group GB/s", lambda c: stat(gbps(c["n"] * c["size"], c["walls"]), ".3f")),
    ("encode GB/s per SMP (wall)", lambda c: stat(ec_encode(c))),
    ("encode GB/s per CPU-s", lambda c: _gb_per(c["prot"], "enc_cpu_s")),
    ("encode + gather + parity send GB/s", lambda c: _gb_per(c["prot"], "gather_s")),
    ("encode_stripe alone", _alone),
    ("node processes' cores busy", lambda c: stat(c["busy"])),
    ("machine cores busy", lambda c: stat(c["machine_busy"])),
]
EC_NODE = [
    *KEY,
    ("parity held / own", lambda c: _per(c["prot"], "parity", c["size"], ".4f", "")),
    ("expected m/(n-m)", lambda c: f"{c['m'] / (c['n'] - c['m']):.4f}"),
    ("peer bytes sent / own", lambda c: _per(c["prot"], "sent", c["size"])),
    ("received / own", lambda c: _per(c["prot"], "recv", c["size"])),
    ("CPU s per GiB: protector thread / other threads", lambda c: _cpu_split(c["prot"], c["gib"])),
    (
        "CPU s per protected GiB (whole node)",
        lambda c: _per(c["prot"], "cpu_s", c["gib"], unit=" s"),
    ),
    ("encode share of node CPU", lambda c: stat(c["enc_share"], ".0f", " %")),
    ("peak RSS / own", lambda c: _per(c["prot"], "maxrss", c["size"])),
]
EC_REBUILD = [
    *KEY,
    ("lost", lambda c: ", ".join(map(str, c["lost"]))),
    ("rebuild time", lambda c: stat(c["rwalls"], ".2f", " s")),
    ("rebuilt GB/s", lambda c: stat(gbps(len(c["lost"]) * c["size"], c["rwalls"]), ".3f")),
    ("fetched per new node / own", lambda c: _per(c["reb"], "recv", c["size"])),
    ("served per survivor / own", lambda c: _per(c["srv"], "sent", c["size"])),
    ("new node CPU s per GiB: protector / other", lambda c: _cpu_split(c["reb"], c["gib"])),
    ("peak RSS of a new node", lambda c: _per(c["reb"], "maxrss", GiB, ".2f", " GiB")),
    ("machine cores busy", lambda c: stat(c["machine_busy_rebuild"])),
    ("new process up + reconnected", lambda c: stat(c["rebuild_spawn_s"], ".1f", " s")),
    ("bitwise equal", lambda c: f"{sum(c['rebuild_ok'])}/{len(c['rebuild_ok'])}"),
]
CHANNEL = [
    ("channel", lambda rr: rr[0]["mode"]),
    ("GiB/s", lambda rr: stat([x["gibps"] for x in rr])),
    ("sender CPU-s per GiB", lambda rr: stat([x["send_cpu"] for x in rr])),
    ("receiver CPU-s per GiB", lambda rr: stat([x["recv_cpu"] for x in rr])),
    ("both ends", lambda rr: stat([x["send_cpu"] + x["recv_cpu"] for x in rr])),
]


def sections(r: Doc) -> dict[str, list[str]]:
    """Section ``ec-protect``: channel alone, protect, per node and snapshot, rebuild."""
    size = r["size"]
    cases = [_ec_case(c, size) for c in r["cases"]]
    runs = r.get("channel") or []
    by_mode = [rr for mode in CHANNELS if (rr := [x for x in runs if x["mode"] == mode])]
    return {
        "ec-protect": [
            f"- one OS process per node on 127.0.0.1, `ZmqPeerTransport` (TCP + CURVE: libzmq {r['libzmq']}, "
            f"CURVE {'available' if r['curve'] else 'MISSING'}; channel 'tagged': snapshot bytes on the plain "
            "data channel with keyed BLAKE3 tags, 'curve': every message over CURVE, `--ftmem-ec-encrypt`) "
            f"and `GroupProtector` (timeout {r['timeout']:g} s), "
            f"`{r['ec_type']}`; a random snapshot of {size / MiB:g} MiB per node, stripes of {r['stripe'] / MiB:g} MiB; "
            f"median (min-max) over {r['repeats']} repeats; 'alone' = `encode_stripe` on {r['codec_bytes'] / MiB:g} MiB "
            "in a fresh process (GB/s; per CPU-s)",
            "",
            "### Channel alone (two processes, 1 MiB messages, the snapshot size each run)",
            "",
            "'zmq' is a bare DEALER to ROUTER (no tag, no checksum): the floor under both others.",
            "",
            *rows(CHANNEL, by_mode),
            "### Protect (every node protects the same step)",
            "",
            *rows(EC_PROTECT, cases),
            "Per node and snapshot (every node and repeat):",
            "",
            *rows(EC_NODE, cases),
            "### Rebuild (lost node processes SIGKILLed; fresh ones on new ports rebuild)",
            "",
            *rows(EC_REBUILD, cases),
        ]
    }


def _cpu_per_gib(c: Doc) -> float:
    """Median node CPU-seconds per protected GiB of its own snapshot."""
    gib = c["size"] / GiB
    return median([x["cpu_s"] / gib for rr in c["protect"] for x in rr]) or 0.0


def goals(r: Doc | None) -> list[Goal]:
    """Encoding inside protect, per SMP, at 1-4 MiB stripes; CPU per protected GiB of the
    tagged data channel against CURVE for everything (>= 5x less)."""
    p, t, x5 = "ec-protect", ">= 5 GB/s", ">= 5x less"
    cases = [c for c in (r or {}).get("cases", []) if c["protect"]]
    if not cases:
        return [
            Goal(p, "encode throughput per SMP (in protect)", t),
            Goal(p, "CPU per protected GiB, tagged channel vs CURVE", x5),
        ]

    def less(goal: str, tagged: float, curve: float, unit: str, src: str) -> Goal:
        text = f"{curve / tagged:.1f}x less ({tagged:.2f} vs {curve:.2f}{unit})"
        return Goal(p, goal, x5, text, curve / tagged >= 5.0, src)

    out = []
    for c in cases:
        mode, enc, w = c.get("mode", "curve"), ec_encode(c), c.get("workers", 0)
        goal = f"encode throughput per SMP (in protect), n={c['n']}, m={c['m']}, {mode}"
        goal += f", {w} encode worker{'s' if w > 1 else ''}" if w else ""
        src = f"ec-protect, {c['size'] / MiB:g} MiB per node, stripes of {c['stripe'] / MiB:g} MiB"
        out.append(Goal(p, goal, t, stat(enc, ".2f", " GB/s"), (median(enc) or 0.0) >= 5.0, src))
    runs = (r or {}).get("channel") or []
    both = {
        mode: median([x["send_cpu"] + x["recv_cpu"] for x in runs if x["mode"] == mode])
        for mode in CHANNELS
    }
    if both.get("tagged") and both.get("curve"):
        goal = "CPU per GiB moved, tagged vs CURVE (channel alone, both ends)"
        out.append(less(goal, both["tagged"], both["curve"], "", "ec-protect, channel alone"))
    by = {(c["n"], c["m"], c.get("mode", "curve")): c for c in cases if not c.get("workers")}
    for (n, m, mode), c in by.items():
        curve = by.get((n, m, "curve"))
        if mode == "tagged" and curve is not None and _cpu_per_gib(c):
            goal = f"CPU per protected GiB, tagged vs CURVE, n={n}, m={m}"
            src = f"ec-protect, same run, {c['size'] / MiB:g} MiB per node"
            out.append(less(goal, _cpu_per_gib(c), _cpu_per_gib(curve), " CPU-s", src))
    return out
