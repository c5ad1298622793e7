"""Erasure-coded peer exchange benchmark: GroupProtector protect and rebuild between node processes.

    python bench/ec_protect.py                 # 2 GiB per node, 1 MiB stripes, 3 repeats
    python bench/ec_protect.py --quick         # 256 MiB per node, 2 repeats (1-2 minutes)
    python bench/ec_protect.py --size-mib 1024 --stripe-mib 4 --no-write
    python bench/ec_protect.py --quick --modes curve   # CURVE for every message only

Each case runs with the tagged data channel (the default) and with CURVE for every message
(``--ftmem-ec-encrypt``), in the same run, so their CPU per protected GiB compare.

How it measures: docs/benchmarks.md, "How the parts measure".
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/ec_protect.py

from bench import _results
from bench import _stats as st
from bench._ec_node import CHANNELS, CpuSampler, channel_end, codec_alone, node_main, sleep_until
from bench._figures import (
    Goal,
    goal_rows,
    rows,
)
from bench._stats import GiB, MiB, stat

PART = "ec-protect"
CASES: dict[str, tuple[int, int, frozenset[int]]] = {
    "3:1": (3, 1, frozenset({2})),
    "4:2": (4, 2, frozenset({1, 3})),
}
DEFAULT_SIZE_MIB = 2048
MODES = ("tagged", "curve")
"""tagged: snapshot bytes on the plain data channel with keyed tags; curve: all over CURVE."""
GO_DELAY_S = 0.5  # start-time barrier: now + this, handed to every node

logger = logging.getLogger("bench.ec_protect")


# ------------------------------------------------------------------------------ parent side


class NodeFailed(RuntimeError):
    """A node process reported an error, died, or did not answer in time."""


@dataclass
class Node:
    """A node process and the parent's end of its pipe."""

    name: int
    proc: BaseProcess
    conn: Connection
    endpoint: str = ""


def _spawn(ctx: Any, name: int, args: Any, *, target: Any = node_main) -> Node:
    """A node process running ``target(conn, *args)``, its pipe's parent end."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), name=f"ec-node-{name}", daemon=True)
    proc.start()
    child.close()
    return Node(name=name, proc=proc, conn=parent)


def _answer(node: Node, what: str) -> Any:
    """The answer waiting on ``node``'s pipe; NodeFailed on an error report or a dead pipe."""
    try:
        kind, val = node.conn.recv()
    except (EOFError, OSError) as exc:
        node.proc.join(2.0)
        raise NodeFailed(
            f"node {node.name} died during {what} (exit code {node.proc.exitcode})"
        ) from exc
    if kind == "error":
        raise NodeFailed(str(val))
    return val


def _collect(nodes: Sequence[Node], timeout_s: float, what: str) -> list[Any]:
    """One answer from every node, in node order, within ``timeout_s`` overall.

    Fails fast: the first node that reports an error or dies raises NodeFailed at once,
    whatever the others are still waiting for.
    """
    deadline = time.monotonic() + timeout_s
    answers: dict[int, Any] = {}
    while len(answers) < len(nodes):
        left = deadline - time.monotonic()
        if left <= 0:
            late = [nd.name for i, nd in enumerate(nodes) if i not in answers]
            raise NodeFailed(f"nodes {late}: no answer to {what} within {timeout_s:.0f} s")
        pending = {nd.conn: i for i, nd in enumerate(nodes) if i not in answers}
        for conn in mp_connection.wait(list(pending), timeout=min(left, 0.5)):
            i = pending[conn]  # type: ignore[index]
            answers[i] = _answer(nodes[i], what)
        for i, nd in enumerate(nodes):
            if i not in answers and not nd.proc.is_alive() and not nd.conn.poll():
                raise NodeFailed(f"node {nd.name} died during {what} (exit {nd.proc.exitcode})")
    return [answers[i] for i in range(len(nodes))]


def _recv(node: Node, timeout_s: float, what: str) -> Any:
    """``node``'s next answer within ``timeout_s`` (see :func:`_collect`)."""
    return _collect([node], timeout_s, what)[0]


def _ask(nodes: Sequence[Node], cmd: str, arg: Any, timeout_s: float) -> list[Any]:
    """Send ``(cmd, arg)`` to every node, then collect every answer (bounded)."""
    for nd in nodes:
        nd.conn.send((cmd, arg))
    return _collect(nodes, timeout_s, cmd)


def _at_once(
    nodes: Sequence[Node], cmd: str, arg: Any, timeout_s: float
) -> tuple[list[Any], float]:
    """Send ``(cmd, arg(go))`` to every node, go being a start-time barrier; collect every
    answer. Returns (answers, busy cores of the machine from go to the last answer)."""
    go = time.monotonic() + GO_DELAY_S
    for nd in nodes:
        nd.conn.send((cmd, arg(go)))
    sleep_until(go)
    cpu = CpuSampler()
    cpu.start()
    rows = _collect(nodes, timeout_s, cmd)
    return rows, cpu.stop()


def _codec_alone(
    ctx: Any, k: int, m: int, stripe: int, nbytes: int, timeout_s: float
) -> tuple[float, float]:
    node = _spawn(ctx, -1, (k, m, stripe, nbytes, 3), target=codec_alone)
    try:
        best = _recv(node, timeout_s, "encode_stripe alone")
        return float(best[0]), float(best[1])
    finally:
        _stop([node], polite=False)


def _channel_alone(ctx: Any, keys_json: str, mode: str, nbytes: int, timeout_s: float) -> Doc:
    """'Channel alone': ``nbytes`` in 1 MiB messages between two fresh processes over
    ``mode`` (one of CHANNELS); GiB/s and each end's CPU-s per GiB."""
    recv_end = _spawn(ctx, -2, (keys_json, mode, nbytes, False), target=channel_end)
    send_end = _spawn(ctx, -3, (keys_json, mode, nbytes, True), target=channel_end)
    try:
        eps = {"b": _recv(recv_end, timeout_s, "channel start")}
        eps["a"] = _recv(send_end, timeout_s, "channel start") or eps["b"]
        for nd in (recv_end, send_end):
            nd.conn.send(eps)
        rcpu, wall = _recv(recv_end, timeout_s, "channel receive")
        send_end.conn.send("done")
        scpu, _ = _recv(send_end, timeout_s, "channel send")
        gib = nbytes / GiB
        return {"mode": mode, "gibps": gib / wall, "send_cpu": scpu / gib, "recv_cpu": rcpu / gib}
    finally:
        _stop([recv_end, send_end], polite=False)


def _stop(nodes: Sequence[Node], *, polite: bool = True) -> None:
    """Stop every node process by pid: ask, then SIGTERM, then SIGKILL, each join bounded."""
    for nd in nodes:
        if polite and nd.proc.is_alive():
            with contextlib.suppress(OSError, ValueError):
                nd.conn.send(("stop", None))
    for nd in nodes:
        nd.proc.join(5.0 if polite else 0.1)
        if nd.proc.is_alive():
            nd.proc.terminate()
            nd.proc.join(5.0)
        if nd.proc.is_alive():
            nd.proc.kill()
            nd.proc.join(5.0)
        if nd.proc.is_alive():
            logger.error("node %d (pid %s) did not exit", nd.name, nd.proc.pid)
        nd.conn.close()


@dataclass
class CaseResult:
    """Everything measured for one (n, m) configuration."""

    n: int
    m: int
    lost: list[int]
    size: int
    stripe: int
    mode: str = "curve"  # Results written before the data channel were all CURVE.
    protect: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per repeat, per node (in node order)."""
    rebuild: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per repeat, per new node (in lost-node order)."""
    served: list[list[dict[str, Any]]] = field(default_factory=list)  # Per repeat, per survivor.
    rebuild_ok: list[bool] = field(default_factory=list)
    rebuild_spawn_s: list[float] = field(default_factory=list)
    machine_busy: list[float] = field(default_factory=list)
    """Busy cores of the whole machine during each protect (all processes)."""
    machine_busy_rebuild: list[float] = field(default_factory=list)
    codec_alone: tuple[float, float] | None = None
    """encode_stripe alone in a fresh process: (GB/s wall, GB/s per CPU-second)."""
    digests: dict[int, int] = field(default_factory=dict)
    """xxh3-64 of each original node's snapshot."""
    gen_s: float = 0.0
    error: str | None = None


def run_case(
    ctx: Any,
    n: int,
    m: int,
    lost: frozenset[int],
    args: argparse.Namespace,
    keys_json: str,
    mode: str,
) -> CaseResult:
    """Protect ``args.repeats`` steps on n node processes, then rebuild ``lost`` as often;
    ``mode`` is one of :data:`MODES`."""
    size, stripe = args.size, args.stripe
    res = CaseResult(n=n, m=m, lost=sorted(lost), size=size, stripe=stripe, mode=mode)
    cfg = dict(n=n, m=m, size=size, stripe=stripe, keys=keys_json, timeout=args.timeout)
    cfg["encrypt"] = mode == "curve"
    cfg["idle"] = args.timeout + 600.0
    tmo = args.timeout + 60.0
    nodes: list[Node] = []

    def node_cfg(name: int, replacement: bool) -> dict[str, Any]:
        return {**cfg, "node": name, "seed": 1000 + name, "replacement": replacement}

    try:
        res.codec_alone = _codec_alone(ctx, n - m, m, stripe, args.codec_bytes, tmo)
        logger.info("n=%d m=%d: encode_stripe alone %.2f GB/s", n, m, res.codec_alone[0])
        t0 = time.monotonic()
        nodes = [_spawn(ctx, i, (node_cfg(i, False),)) for i in range(n)]
        for nd, info in zip(nodes, _collect(nodes, tmo + size / 1e8, "start"), strict=True):
            nd.endpoint, res.digests[nd.name] = info["endpoint"], info["digest"]
            res.gen_s = max(res.gen_s, info["gen_s"])
        logger.info("n=%d m=%d: %d node processes up in %.1f s", n, m, n, time.monotonic() - t0)
        eps = {str(nd.name): nd.endpoint for nd in nodes}
        _ask(nodes, "connect", eps, tmo)
        _ask(nodes, "warmup", 0, tmo)
        _ask(nodes, "forget", 0, tmo)
        step = 0
        for r in range(args.repeats):
            if step:
                _ask(nodes, "forget", step, tmo)
            step = r + 1
            rows, busy = _at_once(nodes, "protect", lambda go, s=step: (s, go), tmo)
            res.machine_busy.append(busy)
            res.protect.append(rows)
            wall = max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows)
            logger.info("n=%d m=%d protect #%d: %.2f s", n, m, r, wall)
        names = [nd.name for nd in nodes]
        parity_digests = dict(zip(names, _ask(nodes, "parity_digest", step, tmo), strict=True))
        survivors = [nd for nd in nodes if nd.name not in lost]
        source = survivors[0].name
        for r in range(args.repeats):
            victims = [nd for nd in nodes if nd.name in lost]
            for nd in victims:  # a crash: SIGKILL by pid, bounded join
                nd.proc.kill()
                nd.proc.join(10.0)
            _stop(victims, polite=False)
            nodes = [nd for nd in nodes if nd.name not in lost]
            t0 = time.monotonic()
            fresh = [_spawn(ctx, i, (node_cfg(i, True),)) for i in sorted(lost)]
            nodes += fresh
            for nd, info in zip(fresh, _collect(fresh, tmo, "start"), strict=True):
                nd.endpoint = info["endpoint"]
            eps = {str(nd.name): nd.endpoint for nd in nodes}
            _ask(survivors, "serve", eps, tmo)
            _ask(fresh, "connect", eps, tmo)
            res.rebuild_spawn_s.append(time.monotonic() - t0)
            lost_list = sorted(lost)
            rebuild = (step, lost_list, source)
            rows, busy = _at_once(fresh, "rebuild", lambda go, a=rebuild: (*a, go), tmo)
            res.machine_busy_rebuild.append(busy)
            res.served.append(_ask(survivors, "served", None, tmo))
            ok = True
            for nd, row in zip(fresh, rows, strict=True):
                ok &= row["digest"] == res.digests[nd.name]
                ok &= row["parity_digest"] == parity_digests[nd.name]
                ok &= row["nbytes"] == size
            res.rebuild.append(rows)
            res.rebuild_ok.append(ok)
            wall = max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows)
            verdict = "bitwise equal" if ok else "MISMATCH"
            logger.info(
                "n=%d m=%d rebuild #%d of %s: %.2f s, %s", n, m, r, lost_list, wall, verdict
            )
    except NodeFailed as exc:
        res.error = str(exc)
        logger.error("n=%d m=%d failed: %s", n, m, exc)
    finally:
        _stop(nodes)
    return res


@dataclass(kw_only=True)
class EcProtectResult(_results.PartResult):
    """The erasure-coding part's results: one :class:`CaseResult` per (n, m)."""

    size: int  # Snapshot bytes per node.
    stripe: int
    repeats: int
    timeout: float
    codec_bytes: int  # Bytes 'encode_stripe alone' encodes in a fresh process.
    libzmq: str
    curve: bool
    ec_type: str
    cases: list[CaseResult] = field(default_factory=list)
    channel: list[dict[str, Any]] = field(default_factory=list)
    """'Channel alone' runs: mode, GiB/s, CPU-s per GiB at each end."""


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = _results.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="256 MiB per node, 2 repeats")
    p.add_argument("--size-mib", type=int, default=None, help="snapshot per node (default 2048)")
    p.add_argument("--stripe-mib", type=float, default=1.0, help="data per stripe (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 2)")
    p.add_argument("--timeout", type=float, default=None, help="protocol timeout per wait (s)")
    p.add_argument("--cases", default=",".join(CASES), help="n:m configurations to run")
    p.add_argument("--modes", default=",".join(MODES), help=f"channels to run: {MODES}")
    return p


def run(argv: list[str]) -> EcProtectResult:
    """Parse ``argv`` and run every case."""
    import zmq

    from ftmem.exchange import keys
    from ftmem.exchange.codec import EC_TYPE

    p = get_args_parser()
    args = p.parse_args(argv)
    size_mib = args.size_mib or (256 if args.quick else DEFAULT_SIZE_MIB)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if size_mib < 8 or args.repeats < 1 or args.stripe_mib <= 0:
        p.error("need --size-mib >= 8, --repeats >= 1, --stripe-mib > 0")
    args.size = size_mib * MiB
    args.stripe = int(args.stripe_mib * MiB)
    # A bound on hangs, not an expectation: protect time grows faster than linearly with size.
    args.timeout = args.timeout or max(300.0, 600.0 * args.size / GiB)
    args.codec_bytes = (64 if args.quick or size_mib < 256 else 256) * MiB
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        p.error(f"--cases: a comma-separated subset of {', '.join(CASES)}")
    modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    if not modes or any(x not in MODES for x in modes):
        p.error(f"--modes: a comma-separated subset of {', '.join(MODES)}")
    same = {k: getattr(args, k) for k in ("size", "stripe", "repeats", "timeout", "codec_bytes")}
    zmq_info = {"libzmq": zmq.zmq_version(), "curve": bool(zmq.has("curve"))}
    res = EcProtectResult(
        argv=argv, machine=_results.machine(), ec_type=EC_TYPE, **same, **zmq_info
    )
    keys_json = keys.generate().to_json()
    ctx = mp.get_context("spawn")
    for _ in range(args.repeats):
        for mode in CHANNELS:
            try:
                res.channel.append(_channel_alone(ctx, keys_json, mode, args.size, args.timeout))
            except NodeFailed as exc:
                res.errors.append(f"channel alone, {mode}: {exc}")
    for name in cases:
        n, m, lost = CASES[name]
        for mode in modes:
            logger.info(
                "n=%d m=%d %s: %d MiB per node, %d repeats",
                n,
                m,
                mode,
                args.size // MiB,
                args.repeats,
            )
            res.cases.append(run_case(ctx, n, m, lost, args, keys_json, mode))
    for r in res.cases:
        if r.error or not all(r.rebuild_ok):
            why = (r.error or "rebuild not bitwise equal").strip().splitlines()[-1]
            res.errors.append(f"n={r.n}, m={r.m}, {r.mode}: {why}")
    _results.finish(res.machine)
    return res


# ------------------------------------------------------------------------------ the section

Doc = dict[str, Any]


def _wall(rows: Sequence[Doc]) -> float:
    return float(max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows))


def ec_encode(c: Doc) -> list[float]:
    """Encode GB/s per SMP (wall seconds inside ``encode_stripe``), every node and repeat."""
    return [x["enc_bytes"] / x["enc_s"] / 1e9 for rows in c["protect"] for x in rows if x["enc_s"]]


def _per(rows: Sequence[Doc], key: str, den: float, spec: str = ".2f", unit: str = "x") -> str:
    """``stat`` of ``x[key] / den`` over the rows."""
    return stat([x[key] / den for x in rows], spec, unit)


def _cpu_split(rows: Sequence[Doc], gib: float) -> str:
    main = stat([x["main_cpu_s"] / gib for x in rows])
    return f"{main} / {stat([(x['cpu_s'] - x['main_cpu_s']) / gib for x in rows])}"


def _ec_case(c: Doc, size: int) -> Doc:
    """A case with its rows flattened: protect/rebuild rows and walls, busy cores, encode share."""
    prot = [x for rr in c["protect"] for x in rr]
    return {
        **c,
        "prot": prot,
        "walls": [_wall(rr) for rr in c["protect"]],
        "reb": [x for rr in c["rebuild"] for x in rr],
        "rwalls": [_wall(rr) for rr in c["rebuild"]],
        "srv": [x for rr in c["served"] for x in rr],
        "busy": [sum(x["cpu_s"] for x in rr) / _wall(rr) for rr in c["protect"]],
        "enc_share": [100 * x["enc_cpu_s"] / x["cpu_s"] for x in prot if x["cpu_s"]],
        "size": size,
        "gib": size / GiB,
    }


def _alone(c: Doc) -> str:
    return f"{c['codec_alone'][0]:.2f} ({c['codec_alone'][1]:.2f})" if c["codec_alone"] else "-"


def _gb_per(rows: Sequence[Doc], key: str) -> str:
    return stat([x["enc_bytes"] / x[key] / 1e9 for x in rows if x[key]])


EC_PROTECT = [
    ("n", lambda c: c["n"]),
    ("m", lambda c: c["m"]),
    ("channel", lambda c: c.get("mode", "curve")),
    ("protect time", lambda c: stat(c["walls"], ".2f", " s")),
    ("protected GB/s per node", lambda c: stat(st.gbps(c["size"], c["walls"]), ".3f")),
    ("group GB/s", lambda c: stat(st.gbps(c["n"] * c["size"], c["walls"]), ".3f")),
    ("encode GB/s per SMP (wall)", lambda c: stat(ec_encode(c))),
    ("encode GB/s per CPU-s", lambda c: _gb_per(c["prot"], "enc_cpu_s")),
    ("encode + gather + parity send GB/s", lambda c: _gb_per(c["prot"], "gather_s")),
    ("encode_stripe alone", _alone),
    ("node processes' cores busy", lambda c: stat(c["busy"])),
    ("machine cores busy", lambda c: stat(c["machine_busy"])),
]
EC_NODE = [
    ("n", lambda c: c["n"]),
    ("m", lambda c: c["m"]),
    ("channel", lambda c: c.get("mode", "curve")),
    ("parity held / own", lambda c: _per(c["prot"], "parity", c["size"], ".4f", "")),
    ("expected m/(n-m)", lambda c: f"{c['m'] / (c['n'] - c['m']):.4f}"),
    ("peer bytes sent / own", lambda c: _per(c["prot"], "sent", c["size"])),
    ("received / own", lambda c: _per(c["prot"], "recv", c["size"])),
    ("CPU s per GiB: protector thread / other threads", lambda c: _cpu_split(c["prot"], c["gib"])),
    (
        "CPU s per protected GiB (whole node)",
        lambda c: _per(c["prot"], "cpu_s", c["gib"], ".2f", " s"),
    ),
    ("encode share of node CPU", lambda c: stat(c["enc_share"], ".0f", " %")),
    ("peak RSS / own", lambda c: _per(c["prot"], "maxrss", c["size"])),
]
EC_REBUILD = [
    ("n", lambda c: c["n"]),
    ("m", lambda c: c["m"]),
    ("channel", lambda c: c.get("mode", "curve")),
    ("lost", lambda c: ", ".join(map(str, c["lost"]))),
    ("rebuild time", lambda c: stat(c["rwalls"], ".2f", " s")),
    ("rebuilt GB/s", lambda c: stat(st.gbps(len(c["lost"]) * c["size"], c["rwalls"]), ".3f")),
    ("fetched per new node / own", lambda c: _per(c["reb"], "recv", c["size"])),
    ("served per survivor / own", lambda c: _per(c["srv"], "sent", c["size"])),
    ("new node CPU s per GiB: protector / other", lambda c: _cpu_split(c["reb"], c["gib"])),
    ("peak RSS of a new node", lambda c: _per(c["reb"], "maxrss", GiB, ".2f", " GiB")),
    ("machine cores busy", lambda c: stat(c["machine_busy_rebuild"])),
    ("new process up + reconnected", lambda c: stat(c["rebuild_spawn_s"], ".1f", " s")),
    ("bitwise equal", lambda c: f"{sum(c['rebuild_ok'])}/{len(c['rebuild_ok'])}"),
]


def _channel_rows(r: Doc) -> list[str]:
    """The 'channel alone' table: one row per channel."""
    runs = r.get("channel") or []
    out = [
        "| channel | GiB/s | sender CPU-s per GiB | receiver CPU-s per GiB | both ends |",
        "|---|---|---|---|---|",
    ]
    for mode in CHANNELS:
        rr = [x for x in runs if x["mode"] == mode]
        if rr:
            both = [x["send_cpu"] + x["recv_cpu"] for x in rr]
            out.append(
                f"| {mode} | {stat([x['gibps'] for x in rr])} | "
                f"{stat([x['send_cpu'] for x in rr])} | {stat([x['recv_cpu'] for x in rr])} | "
                f"{stat(both)} |"
            )
    return [*out, ""]


def sections(r: Doc) -> dict[str, list[str]]:
    """Section ``ec-protect``: protect, per node and snapshot, rebuild."""
    size = r["size"]
    cases = [_ec_case(c, size) for c in r["cases"]]
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
            *_channel_rows(r),
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
    return st.median([x["cpu_s"] / gib for rr in c["protect"] for x in rr]) or 0.0


def goals(r: Doc | None) -> list[Goal]:
    """Encoding inside protect, per SMP, at 1-4 MiB stripes; CPU per protected GiB of the
    tagged data channel against CURVE for everything (>= 5x less)."""

    p, t = "ec-protect", ">= 5 GB/s"
    cases = [c for c in (r or {}).get("cases", []) if c["protect"]]
    if not cases:
        return [
            Goal(p, "encode throughput per SMP (in protect)", t),
            Goal(p, "CPU per protected GiB, tagged channel vs CURVE", ">= 5x less"),
        ]
    out = [
        g
        for c in cases
        for g in goal_rows(
            p,
            [
                (
                    f"encode throughput per SMP (in protect), n={c['n']}, m={c['m']}, "
                    f"{c.get('mode', 'curve')}",
                    t,
                )
            ],
            [(st.stat(ec_encode(c), ".2f", " GB/s"), (st.median(ec_encode(c)) or 0.0) >= 5.0)],
            f"ec-protect, {c['size'] / st.MiB:g} MiB per node, stripes of {c['stripe'] / st.MiB:g} MiB",
        )
    ]
    runs = (r or {}).get("channel") or []
    both = {
        mode: st.median([x["send_cpu"] + x["recv_cpu"] for x in runs if x["mode"] == mode])
        for mode in CHANNELS
    }
    if both.get("tagged") and both.get("curve"):
        ratio = both["curve"] / both["tagged"]
        out += goal_rows(
            p,
            [("CPU per GiB moved, tagged vs CURVE (channel alone, both ends)", ">= 5x less")],
            [(f"{ratio:.1f}x less ({both['tagged']:.2f} vs {both['curve']:.2f})", ratio >= 5.0)],
            "ec-protect, channel alone",
        )
    by = {(c["n"], c["m"], c.get("mode", "curve")): c for c in cases}
    for (n, m, mode), c in by.items():
        curve = by.get((n, m, "curve"))
        if mode != "tagged" or curve is None or not _cpu_per_gib(c):
            continue
        ratio = _cpu_per_gib(curve) / _cpu_per_gib(c)
        out += goal_rows(
            p,
            [(f"CPU per protected GiB, tagged vs CURVE, n={n}, m={m}", ">= 5x less")],
            [
                (
                    f"{ratio:.1f}x less ({_cpu_per_gib(c):.2f} vs {_cpu_per_gib(curve):.2f} CPU-s)",
                    ratio >= 5.0,
                )
            ],
            f"ec-protect, same run, {c['size'] / st.MiB:g} MiB per node",
        )
    return out


if __name__ == "__main__":
    sys.exit(_results.script_main(PART, run))
