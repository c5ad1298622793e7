"""Erasure-coded peer exchange benchmark: GroupProtector protect and rebuild between node processes.

    python bench/ec_protect.py                 # 2 GiB per node, 1 MiB stripes, 3 repeats
    python bench/ec_protect.py --quick         # 256 MiB per node, 2 repeats (1-2 minutes)
    python bench/ec_protect.py --size-mib 1024 --stripe-mib 4 --no-write
    python bench/ec_protect.py --quick --modes curve   # CURVE for every message only
    python bench/ec_protect.py --quick --encode-workers 0,1,2

Each case runs with the tagged data channel (the default) and with CURVE for every message
(``--ftmem-ec-encrypt``) in the same run, and with the tagged channel and each count of encode
worker processes per node in ``--encode-workers`` (default 0,1; 0: the protector's thread
encodes). Each node is a "spawn" child process (bench/_ec_node.py).

How it measures: docs/benchmarks.md, "How the parts measure". Section
``bench:ec-protect``, rendered by ``bench/ec_protect_tables.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/ec_protect.py

from bench import _render, _results
from bench._ec_node import (
    CHANNELS,
    MODES,
    channel_end,
    codec,
    node_main,
    run_child,
    sleep_until,
)
from bench._stats import GiB, MiB
from ftmem.exchange import keys
from ftmem.exchange.codec import EC_TYPE

PART = "ec-protect"
CASES = {"3:1": (3, 1, frozenset({2})), "4:2": (4, 2, frozenset({1, 3}))}  # n, m, nodes lost
GO_DELAY_S = 0.5  # start-time barrier: now + this, handed to every node

logger = logging.getLogger("bench.ec_protect")

Doc = dict[str, Any]


def wall(answers: Sequence[Doc]) -> float:
    """Seconds from the first node's start to the last node's end."""
    return float(max(x["t_end"] for x in answers) - min(x["t_start"] for x in answers))


# ------------------------------------------------------------------------------ parent side


class NodeFailed(RuntimeError):
    """A node process reported an error, died, or did not answer in time."""


@dataclass
class Node:
    """A child process and the parent's end of its pipe."""

    name: int
    proc: BaseProcess
    conn: Connection


def _spawn(ctx: Any, name: int, target: Callable[..., None], *args: Any) -> Node:
    """A child process running ``target(conn, *args)`` (see :func:`run_child`)."""
    parent, child = ctx.Pipe()
    args = (child, target, *args)
    proc = ctx.Process(target=run_child, args=args, name=f"ec-node-{name}", daemon=True)
    proc.start()
    child.close()
    return Node(name, proc, parent)


def _collect(nodes: Sequence[Node], timeout_s: float, what: str) -> list[Any]:
    """One answer from every node, in node order, within ``timeout_s`` overall; NodeFailed as
    soon as a node reports an error or dies (its pipe closes), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    answers: dict[int, Any] = {}
    while len(answers) < len(nodes):
        pending = {nd.conn: i for i, nd in enumerate(nodes) if i not in answers}
        left = deadline - time.monotonic()
        if left <= 0:
            late = [nodes[i].name for i in pending.values()]
            raise NodeFailed(f"nodes {late}: no answer to {what} within {timeout_s:.0f} s")
        for conn in wait(list(pending), timeout=left):
            nd = nodes[i := pending[conn]]
            try:
                kind, answers[i] = nd.conn.recv()
            except (EOFError, OSError) as exc:
                nd.proc.join(2.0)
                code = nd.proc.exitcode
                raise NodeFailed(f"node {nd.name} died during {what} (exit code {code})") from exc
            if kind == "error":
                raise NodeFailed(str(answers[i]))
    return [answers[i] for i in range(len(nodes))]


def _ask(nodes: Sequence[Node], cmd: str, arg: Any, timeout_s: float) -> list[Any]:
    """Send ``(cmd, arg)`` to every node, then collect every answer."""
    for nd in nodes:
        nd.conn.send((cmd, arg))
    return _collect(nodes, timeout_s, cmd)


def _machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, as /proc/stat counts them."""
    t = psutil.cpu_times()
    return sum(t[:8]) - t.idle - t.iowait, sum(t[:8])


def _at_once(nodes: Sequence[Node], cmd: str, arg: tuple, timeout_s: float) -> tuple[list, float]:
    """Send ``(cmd, (*arg, go))`` to every node, go being a start-time barrier, and collect the
    answers; (answers, busy cores of the whole machine from go to the last answer)."""
    go = time.monotonic() + GO_DELAY_S
    for nd in nodes:
        nd.conn.send((cmd, (*arg, go)))
    sleep_until(go)
    start = _machine_cpu()
    answers = _collect(nodes, timeout_s, cmd)
    busy, total = (b - a for a, b in zip(start, _machine_cpu(), strict=True))
    return answers, busy / total * (os.cpu_count() or 1) if total > 0 else float("nan")


def _stop(nodes: Sequence[Node], *, polite: bool = True) -> None:
    """Stop every node process by pid: ask, then SIGTERM, then SIGKILL, each join bounded."""
    for nd in nodes:
        if polite and nd.proc.is_alive():
            with contextlib.suppress(OSError, ValueError):
                nd.conn.send(("stop", None))
    for nd in nodes:
        nd.proc.join(5.0 if polite else 0.1)
        for end in (nd.proc.terminate, nd.proc.kill):
            if nd.proc.is_alive():
                end()
                nd.proc.join(5.0)
        if nd.proc.is_alive():
            logger.error("node %d (pid %s) did not exit", nd.name, nd.proc.pid)
        nd.conn.close()


def _codec_alone(ctx: Any, k: int, m: int, stripe: int, nbytes: int, tmo: float) -> Any:
    """(GB/s wall, GB/s per CPU-s) of :func:`bench.ec.encode_alone` in a fresh process."""
    node = _spawn(ctx, -1, codec, k, m, stripe, nbytes, 3)
    try:
        return _collect([node], tmo, "encode_stripe alone")[0]
    finally:
        _stop([node], polite=False)


def _channel_alone(ctx: Any, keys_json: str, mode: str, nbytes: int, tmo: float) -> Doc:
    """'Channel alone' over ``mode`` between two fresh processes: GiB/s, each end's CPU-s/GiB."""
    ends = [_spawn(ctx, -2 - i, channel_end, keys_json, mode, nbytes, i == 1) for i in (0, 1)]
    recv_end, send_end = ends
    try:
        b, a = _collect(ends, tmo, "channel start")
        for nd in ends:
            nd.conn.send({"b": b, "a": a or b})
        rcpu, seconds = _collect([recv_end], tmo, "channel receive")[0]
        send_end.conn.send("done")
        scpu, _ = _collect([send_end], tmo, "channel send")[0]
        gib = nbytes / GiB
        return {
            "mode": mode,
            "gibps": gib / seconds,
            "send_cpu": scpu / gib,
            "recv_cpu": rcpu / gib,
        }
    finally:
        _stop(ends, polite=False)


@dataclass
class CaseResult:
    """Everything measured for one (n, m) configuration and channel mode."""

    n: int
    m: int
    lost: list[int]
    size: int
    stripe: int
    mode: str = "curve"  # Results written before the data channel were all CURVE.
    workers: int = 0  # Encode worker processes per node (0: the protector's thread).
    protect: list[list[dict[str, Any]]] = field(default_factory=list)  # Per repeat, per node.
    rebuild: list[list[dict[str, Any]]] = field(default_factory=list)  # Per repeat, new node.
    served: list[list[dict[str, Any]]] = field(default_factory=list)  # Per repeat, survivor.
    rebuild_ok: list[bool] = field(default_factory=list)
    rebuild_spawn_s: list[float] = field(default_factory=list)
    machine_busy: list[float] = field(default_factory=list)  # Busy cores during each protect.
    machine_busy_rebuild: list[float] = field(default_factory=list)
    codec_alone: tuple[float, float] | None = None  # (GB/s wall, GB/s per CPU-second)
    digests: dict[int, int] = field(default_factory=dict)  # Of each original node's snapshot.
    gen_s: float = 0.0
    error: str | None = None


def run_case(
    ctx: Any,
    n: int,
    m: int,
    lost: frozenset[int],
    args: Any,
    keys_json: str,
    mode: str,
    workers: int = 0,
) -> CaseResult:
    """Protect ``args.repeats`` steps on n node processes, then rebuild ``lost`` as often;
    ``mode`` is one of :data:`MODES`; ``workers`` encode processes per node."""
    size, stripe, tmo, reps = args.size, args.stripe, args.timeout + 60.0, args.repeats
    res = CaseResult(n=n, m=m, lost=sorted(lost), size=size, stripe=stripe, mode=mode)
    res.workers = workers
    cfg = dict(n=n, m=m, size=size, stripe=stripe, keys=keys_json, timeout=args.timeout)
    cfg |= {"encrypt": mode == "curve", "idle": args.timeout + 600.0, "workers": workers}
    nodes: list[Node] = []
    eps: dict[str, str] = {}
    tag = f"n={n} m={m} {mode} workers={workers}"

    def start(names: list[int], replacement: bool, timeout_s: float) -> list[Any]:
        """Node processes ``names`` (into ``nodes``); their start reports (endpoints: ``eps``)."""
        more = {"replacement": replacement}
        new = [
            _spawn(ctx, i, node_main, {**cfg, "node": i, "seed": 1000 + i, **more}) for i in names
        ]
        nodes.extend(new)
        infos = _collect(new, timeout_s, "start")
        eps.update({str(i): info["endpoint"] for i, info in zip(names, infos, strict=True)})
        return infos

    try:
        res.codec_alone = _codec_alone(ctx, n - m, m, stripe, args.codec_bytes, tmo)
        logger.info("%s: encode_stripe alone %.2f GB/s", tag, res.codec_alone[0])
        t0 = time.monotonic()
        infos = start(list(range(n)), False, tmo + size / 1e8)
        res.digests = {i: info["digest"] for i, info in enumerate(infos)}
        res.gen_s = max(info["gen_s"] for info in infos)
        logger.info("%s: %d node processes up in %.1f s", tag, n, time.monotonic() - t0)
        for cmd, arg in (("connect", eps), ("warmup", 0), ("forget", 0)):
            _ask(nodes, cmd, arg, tmo)
        for step in range(1, reps + 1):
            if step > 1:
                _ask(nodes, "forget", step - 1, tmo)
            answers, busy = _at_once(nodes, "protect", (step,), tmo)
            res.protect.append(answers)
            res.machine_busy.append(busy)
            logger.info("%s protect #%d: %.2f s", tag, step - 1, wall(answers))
        parity = _ask(nodes, "parity_digest", reps, tmo)
        survivors = [nd for nd in nodes if nd.name not in lost]
        for r in range(reps):
            victims = [nd for nd in nodes if nd.name in lost]
            for nd in victims:  # a crash: SIGKILL by pid, bounded join
                nd.proc.kill()
                nd.proc.join(10.0)
            _stop(victims, polite=False)
            nodes[:] = survivors
            t0 = time.monotonic()
            start(sorted(lost), True, tmo)
            fresh = nodes[len(survivors) :]
            _ask(survivors, "serve", eps, tmo)
            _ask(fresh, "connect", eps, tmo)
            res.rebuild_spawn_s.append(time.monotonic() - t0)
            answers, busy = _at_once(fresh, "rebuild", (reps, res.lost, survivors[0].name), tmo)
            res.machine_busy_rebuild.append(busy)
            res.served.append(_ask(survivors, "served", None, tmo))
            ok = all(
                (x["digest"], x["parity_digest"], x["nbytes"])
                == (res.digests[nd.name], parity[nd.name], size)
                for nd, x in zip(fresh, answers, strict=True)
            )
            res.rebuild.append(answers)
            res.rebuild_ok.append(ok)
            verdict = "bitwise equal" if ok else "MISMATCH"
            logger.info(
                "%s rebuild #%d of %s: %.2f s, %s", tag, r, res.lost, wall(answers), verdict
            )
    except NodeFailed as exc:
        res.error = str(exc)
        logger.error("%s failed: %s", tag, exc)
    finally:
        _stop(nodes)
    return res


@dataclass(kw_only=True)
class EcProtectResult(_results.PartResult):
    """The erasure-coding part's results: one :class:`CaseResult` per (n, m) and mode."""

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
    p.add_argument(
        "--encode-workers",
        default="0,1",
        help="encode worker processes per node to run (tagged channel; 0 runs every mode)",
    )
    return p


def _subset(p: argparse.ArgumentParser, flag: str, text: str, allowed: Sequence[str]) -> Any:
    """The comma-separated names of ``text``, all in ``allowed`` (else a usage error)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(x not in allowed for x in names):
        p.error(f"{flag}: a comma-separated subset of {', '.join(allowed)}")
    return names


def run(argv: list[str]) -> EcProtectResult:
    """Parse ``argv``; run 'channel alone' and every case."""
    p = get_args_parser()
    args = p.parse_args(argv)
    size_mib = args.size_mib or (256 if args.quick else 2048)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if size_mib < 8 or args.repeats < 1 or args.stripe_mib <= 0:
        p.error("need --size-mib >= 8, --repeats >= 1, --stripe-mib > 0")
    args.size = size_mib * MiB
    args.stripe = int(args.stripe_mib * MiB)
    # A bound on hangs, not an expectation: protect time grows faster than linearly with size.
    args.timeout = args.timeout or max(300.0, 600.0 * args.size / GiB)
    args.codec_bytes = (64 if args.quick or size_mib < 256 else 256) * MiB
    cases = _subset(p, "--cases", args.cases, list(CASES))
    modes = _subset(p, "--modes", args.modes, MODES)
    counts = _subset(p, "--encode-workers", args.encode_workers, [str(i) for i in range(9)])
    variants = [(mode, 0) for mode in modes if "0" in counts]
    variants += [("tagged", int(w)) for w in counts if w != "0"]
    same = {k: getattr(args, k) for k in ("size", "stripe", "repeats", "timeout", "codec_bytes")}
    zmq_info = {"libzmq": zmq.zmq_version(), "curve": bool(zmq.has("curve"))}
    machine = _results.machine()
    res = EcProtectResult(argv=argv, machine=machine, ec_type=EC_TYPE, **same, **zmq_info)
    keys_json = keys.generate().to_json()
    ctx = mp.get_context("spawn")
    for _ in range(args.repeats):
        for mode in CHANNELS:
            try:
                res.channel.append(_channel_alone(ctx, keys_json, mode, args.size, args.timeout))
            except NodeFailed as exc:
                res.errors.append(f"channel alone, {mode}: {exc}")
    for (n, m, lost), (mode, w) in [(CASES[c], v) for c in cases for v in variants]:
        logger.info(
            "n=%d m=%d %s, %d encode workers: %d MiB per node, %d repeats",
            *(n, m, mode, w, size_mib, args.repeats),
        )
        res.cases.append(run_case(ctx, n, m, lost, args, keys_json, mode, w))
    for r in res.cases:
        if r.error or not all(r.rebuild_ok):
            why = (r.error or "rebuild not bitwise equal").strip().splitlines()[-1]
            res.errors.append(f"n={r.n}, m={r.m}, {r.mode}, {r.workers} workers: {why}")
    _results.finish(res.machine)
    return res


if __name__ == "__main__":
    sys.exit(_render.script_main(PART, run))
