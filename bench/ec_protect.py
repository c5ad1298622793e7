"""Erasure-coded peer exchange benchmark: GroupProtector protect and rebuild between node processes.

Usage (from the repository root; ftmem importable, e.g. ``pip install -e .``):

    python bench/ec_protect.py                 # 2 GiB per node, 1 MiB stripes, 3 repeats
    python bench/ec_protect.py --quick         # 256 MiB per node, 2 repeats (1-2 minutes)
    python bench/ec_protect.py --size-mib 1024 --stripe-mib 4 --no-write

For n=3, m=1 (one node lost) and n=4, m=2 (two nodes lost at once) it starts one OS process
per node ("spawn" context), all on 127.0.0.1, each with its own
:class:`~ftmem.exchange.zmq_transport.ZmqPeerTransport` (TCP + CURVE, one key pair for the
job) and :class:`~ftmem.exchange.protector.GroupProtector`, as the SMPs of a group run them.
Every node process calls :func:`~ftmem.exchange.codec.tune_malloc` and holds a random snapshot
(``--size-mib``). Measured, median (min-max) over ``--repeats``:

* **protect**: every node calls ``protect`` for the same step from a start-time barrier (the
  parent hands every node the same ``time.monotonic()`` instant, a system-wide clock on Linux);
  the wall time runs to the last node protected. A 4 MiB protect first opens the connections
  (CURVE handshakes) and is not timed. Before each step the previous one is forgotten.
* **encode per SMP**: ``StripeCodec.encode_stripe`` (pyeclib ISA-L + xxh3 of the k+m
  fragments) is wrapped in each node process and timed there: data bytes encoded / seconds
  inside it. "with gather" times the protector's whole ``_encode`` (columns copied into the
  stripe buffer, encode, parity forwarded to the other holders).
* **parity** bytes held per node (``parity_bytes``) over its own bytes, against m/(n-m);
  **peer bytes sent** per node and snapshot (``GroupProtector.sent_bytes``: buffers only, the
  JSON headers are left out).
* **rebuild**: the lost nodes' processes are SIGKILLed; fresh processes with empty protectors
  and NEW transports (new ports, same node names) start, the survivors reconnect to them and
  ``serve()``, and the new nodes call ``rebuild()`` from a start-time barrier; the wall time
  runs to the last node rebuilt. Each rebuilt snapshot's xxh3-64 is compared with the lost
  node's original (computed in the node processes, never copied across) and so is the digest of
  its parity fragments. Every repeat kills the previous replacements again.

The markdown goes to stdout and, unless ``--no-write``, into ``--out`` between
``<!-- bench:ec-protect:start -->`` and ``<!-- bench:ec-protect:end -->`` (rest kept).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

try:
    from bench import _report
except ImportError:  # run as a script: bench/ is sys.path[0]
    import _report  # type: ignore[no-redef]

REPO = _report.REPO
SECTION = "ec-protect"
START_MARK, END_MARK = _report.markers(SECTION)
MiB = 1 << 20
GiB = 1 << 30
CASES: dict[str, tuple[int, int, frozenset[int]]] = {
    "3:1": (3, 1, frozenset({2})),
    "4:2": (4, 2, frozenset({1, 3})),
}
WARMUP_BYTES = 4 * MiB
DEFAULT_SIZE_MIB = 2048
GOAL_ENCODE_GBPS = 5.0
GO_DELAY_S = 0.5  # start-time barrier: now + this, handed to every node

logger = logging.getLogger("bench.ec_protect")


# ------------------------------------------------------------------------------ node process


@dataclass
class _Counters:
    enc_s: float = 0.0
    enc_cpu_s: float = 0.0
    enc_bytes: int = 0
    enc_calls: int = 0
    gather_s: float = 0.0
    recv_bytes: int = 0

    def reset(self) -> None:
        self.enc_s = self.enc_cpu_s = self.gather_s = 0.0
        self.enc_bytes = self.enc_calls = self.recv_bytes = 0


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(min(delay, 10.0))


def _parity_digest(prot: Any, step: int) -> int:
    import xxhash

    h = xxhash.xxh3_64()
    st = prot.steps.get(step)
    for key in sorted(st.parity) if st is not None else []:
        h.update(key[0].to_bytes(8, "little") + key[1].to_bytes(4, "little"))
        h.update(st.parity[key])
    return h.intdigest()


def node_main(conn: Connection, cfg: dict[str, Any]) -> None:
    """Entry point of a node process: report, then obey the parent's commands."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s node %(name)s: %(message)s")
    try:
        _node(conn, cfg)
    except BaseException:
        try:
            conn.send(
                ("error", f"node {cfg['node']} (pid {os.getpid()}):\n{traceback.format_exc()}")
            )
        except (OSError, ValueError):
            pass
        raise SystemExit(1) from None


def _node(conn: Connection, cfg: dict[str, Any]) -> None:
    import numpy as np
    import xxhash

    from ftmem.exchange.codec import tune_malloc
    from ftmem.exchange.keys import CurveKeyPair
    from ftmem.exchange.placement import plan_group
    from ftmem.exchange.protector import GroupProtector
    from ftmem.exchange.zmq_transport import ZmqPeerTransport

    if not tune_malloc():
        logger.warning("tune_malloc() is not in effect in node %s", cfg["node"])
    me, n, m = int(cfg["node"]), int(cfg["n"]), int(cfg["m"])
    data: Any = None
    digest = None
    t0 = time.monotonic()
    if not cfg["replacement"]:
        # PCG64 raw output: random (incompressible) bytes at a few GB/s, every page written.
        data = np.random.PCG64(cfg["seed"]).random_raw(cfg["size"] // 8).view(np.uint8)
        digest = xxhash.xxh3_64_intdigest(data)
    gen_s = time.monotonic() - t0
    transport = ZmqPeerTransport(str(me), CurveKeyPair.from_json(cfg["keys"]))
    prot = GroupProtector(
        me, plan_group(list(range(n)), m), transport, cfg["stripe"], timeout_s=cfg["timeout"]
    )
    c = _Counters()
    codec_encode = prot.codec.encode_stripe
    protector_encode = prot._encode
    transport_recv = transport.recv

    def timed_encode_stripe(stripe: Any, lengths: Sequence[int]) -> Any:
        t, cpu = time.perf_counter(), time.thread_time()
        out = codec_encode(stripe, lengths)
        c.enc_s += time.perf_counter() - t
        c.enc_cpu_s += time.thread_time() - cpu
        c.enc_bytes += sum(lengths)
        c.enc_calls += 1
        return out

    def timed_protector_encode(step: int, s: Any) -> None:
        t = time.perf_counter()
        protector_encode(step, s)
        c.gather_s += time.perf_counter() - t

    def counted_recv(timeout_s: float) -> Any:
        msg = transport_recv(timeout_s)
        if msg is not None:
            c.recv_bytes += sum(b.nbytes for b in msg.buffers)
        return msg

    prot.codec.encode_stripe = timed_encode_stripe  # type: ignore[method-assign]
    prot._encode = timed_protector_encode  # type: ignore[method-assign]
    transport.recv = counted_recv  # type: ignore[method-assign]
    try:
        endpoint = transport.start()
        conn.send(("ok", {"endpoint": endpoint, "digest": digest, "gen_s": gen_s}))
        _serve_parent(conn, cfg, prot, transport, data, c)
    finally:
        transport.close()


def _serve_parent(
    conn: Connection, cfg: dict[str, Any], prot: Any, transport: Any, data: Any, c: _Counters
) -> None:
    import xxhash

    idle_s = float(cfg["idle"])
    while True:
        if not conn.poll(idle_s):
            raise TimeoutError(f"no command from the parent in {idle_s} s")
        cmd, arg = conn.recv()
        if cmd == "stop":
            conn.send(("ok", None))
            return
        if cmd == "connect":
            transport.connect(arg)
            conn.send(("ok", None))
        elif cmd == "warmup":
            prot.protect(arg, memoryview(data)[:WARMUP_BYTES])
            conn.send(("ok", None))
        elif cmd == "forget":
            prot.forget(arg)
            conn.send(("ok", None))
        elif cmd == "protect":
            step, t_go = arg
            c.reset()
            sent0 = prot.sent_bytes
            _sleep_until(t_go)
            t = time.monotonic()
            cpu, main_cpu = time.process_time(), time.thread_time()
            prot.protect(step, memoryview(data))
            t_end = time.monotonic()
            res = {
                "t_start": t,
                "t_end": t_end,
                "cpu_s": time.process_time() - cpu,
                "main_cpu_s": time.thread_time() - main_cpu,
                "enc_cpu_s": c.enc_cpu_s,
                "sent": prot.sent_bytes - sent0,
                "recv": c.recv_bytes,
                "parity": prot.parity_bytes(step),
                "enc_s": c.enc_s,
                "enc_bytes": c.enc_bytes,
                "enc_calls": c.enc_calls,
                "gather_s": c.gather_s,
                "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
            conn.send(("ok", res))
        elif cmd == "parity_digest":
            conn.send(("ok", _parity_digest(prot, arg)))
        elif cmd == "serve":
            # Reconnect (new endpoints of the replaced nodes), acknowledge, then answer peers
            # until the parent's next command arrives.
            transport.connect(arg)
            sent0 = prot.sent_bytes
            cpu = time.process_time()
            conn.send(("ok", None))
            until = time.monotonic() + float(cfg["idle"])
            prot.serve(lambda u=until: conn.poll() or time.monotonic() > u, poll_s=0.05)
            if time.monotonic() > until:
                raise TimeoutError("served peers until the deadline without a parent command")
            cmd2, _ = conn.recv()
            if cmd2 == "stop":
                conn.send(("ok", None))
                return
            if cmd2 != "served":
                raise RuntimeError(f"expected 'served' after 'serve', got {cmd2!r}")
            conn.send(("ok", {"sent": prot.sent_bytes - sent0, "cpu_s": time.process_time() - cpu}))
        elif cmd == "rebuild":
            step, lost, source, t_go = arg
            c.reset()
            _sleep_until(t_go)
            t = time.monotonic()
            cpu, main_cpu = time.process_time(), time.thread_time()
            out = prot.rebuild(step, set(lost), source)
            t_end = time.monotonic()
            res = {
                "t_start": t,
                "t_end": t_end,
                "cpu_s": time.process_time() - cpu,
                "main_cpu_s": time.thread_time() - main_cpu,
                "nbytes": out.nbytes,
                "digest": xxhash.xxh3_64_intdigest(out),
                "parity_digest": _parity_digest(prot, step),
                "parity": prot.parity_bytes(step),
                "recv": c.recv_bytes,
                "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
            conn.send(("ok", res))
        else:
            raise ValueError(f"unknown command {cmd!r}")


def codec_alone(conn: Connection, k: int, m: int, stripe: int, nbytes: int, repeats: int) -> None:
    """Reference in a fresh process, before the nodes start: encode_stripe alone, one thread.

    Same chunk size as the protector's stripes; parity is kept for the whole pass (as held
    parity is), so its page faults are in. Sends the best (GB/s wall, GB/s per CPU-second).
    """
    try:
        import numpy as np

        from ftmem.exchange.codec import StripeCodec, tune_malloc
        from ftmem.exchange.placement import chunk_bytes_for

        tune_malloc()
        chunk = chunk_bytes_for(k, stripe)
        data = np.random.PCG64(7).random_raw(nbytes // 8).view(np.uint8)
        count = data.nbytes // (k * chunk)
        views = [memoryview(data[i * k * chunk : (i + 1) * k * chunk]) for i in range(count)]
        codec = StripeCodec(k, m)
        lengths = [chunk] * k
        best = (0.0, 0.0)
        for _ in range(repeats + 1):  # the first pass is a warm-up
            held = []
            t, cpu = time.perf_counter(), time.thread_time()
            for v in views:
                held.append(codec.encode_stripe(v, lengths).parity)
            wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
            done = count * k * chunk / 1e9
            best = max(best, (done / wall, done / max(cpu, 1e-9)))
            del held
        conn.send(("ok", best))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class CpuSampler:
    """Busy cores of the whole machine between :meth:`start` and :meth:`stop` (/proc/stat)."""

    def __init__(self) -> None:
        self._t0: tuple[int, int] | None = None

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v[:8]) - idle, sum(v[:8])

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> float:
        """Mean busy cores over the window (nan if /proc/stat is not readable)."""
        t1 = self._read()
        if self._t0 is None or t1 is None or t1[1] <= self._t0[1]:
            return float("nan")
        return (t1[0] - self._t0[0]) / (t1[1] - self._t0[1]) * (os.cpu_count() or 1)


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


def _spawn(ctx: Any, name: int, cfg: dict[str, Any], *, replacement: bool) -> Node:
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=node_main,
        args=(child, {**cfg, "node": name, "seed": 1000 + name, "replacement": replacement}),
        name=f"ec-node-{name}",
        daemon=True,
    )
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


def _codec_alone(
    ctx: Any, k: int, m: int, stripe: int, nbytes: int, timeout_s: float
) -> tuple[float, float]:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=codec_alone, args=(child, k, m, stripe, nbytes, 3), daemon=True)
    proc.start()
    child.close()
    node = Node(name=-1, proc=proc, conn=parent)
    try:
        best = _recv(node, timeout_s, "encode_stripe alone")
        return float(best[0]), float(best[1])
    finally:
        _stop([node], polite=False)


def _stop(nodes: Sequence[Node], *, polite: bool = True) -> None:
    """Stop every node process by pid: ask, then SIGTERM, then SIGKILL, each join bounded."""
    for nd in nodes:
        if polite and nd.proc.is_alive():
            try:
                nd.conn.send(("stop", None))
            except (OSError, ValueError):
                pass
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
    lost: frozenset[int]
    size: int
    stripe: int
    protect: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per repeat, per node (in node order)."""
    rebuild: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per repeat, per new node (in lost-node order)."""
    served: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per repeat, per survivor."""
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
    ctx: Any, n: int, m: int, lost: frozenset[int], args: argparse.Namespace, keys_json: str
) -> CaseResult:
    """Protect ``args.repeats`` steps on n node processes, then rebuild ``lost`` as often."""
    size, stripe = args.size, args.stripe
    res = CaseResult(n=n, m=m, lost=lost, size=size, stripe=stripe)
    cfg = {
        "n": n,
        "m": m,
        "size": size,
        "stripe": stripe,
        "keys": keys_json,
        "timeout": args.timeout,
        "idle": args.timeout + 600.0,
    }
    tmo = args.timeout + 60.0
    nodes: list[Node] = []
    try:
        res.codec_alone = _codec_alone(ctx, n - m, m, stripe, args.codec_bytes, tmo)
        logger.info("n=%d m=%d: encode_stripe alone %.2f GB/s", n, m, res.codec_alone[0])
        t0 = time.monotonic()
        nodes = [_spawn(ctx, i, cfg, replacement=False) for i in range(n)]
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
            go = time.monotonic() + GO_DELAY_S
            for nd in nodes:
                nd.conn.send(("protect", (step, go)))
            _sleep_until(go)
            cpu = CpuSampler()
            cpu.start()
            rows = _collect(nodes, tmo, "protect")
            res.machine_busy.append(cpu.stop())
            res.protect.append(rows)
            wall = max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows)
            logger.info("n=%d m=%d protect #%d: %.2f s", n, m, r, wall)
        parity_digests = dict(
            zip(
                [nd.name for nd in nodes],
                _ask(nodes, "parity_digest", step, tmo),
                strict=True,
            )
        )
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
            fresh = [_spawn(ctx, i, cfg, replacement=True) for i in sorted(lost)]
            nodes += fresh
            for nd, info in zip(fresh, _collect(fresh, tmo, "start"), strict=True):
                nd.endpoint = info["endpoint"]
            eps = {str(nd.name): nd.endpoint for nd in nodes}
            _ask(survivors, "serve", eps, tmo)
            _ask(fresh, "connect", eps, tmo)
            res.rebuild_spawn_s.append(time.monotonic() - t0)
            go = time.monotonic() + GO_DELAY_S
            lost_list = sorted(lost)
            for nd in fresh:
                nd.conn.send(("rebuild", (step, lost_list, source, go)))
            _sleep_until(go)
            cpu = CpuSampler()
            cpu.start()
            rows = _collect(fresh, tmo, "rebuild")
            res.machine_busy_rebuild.append(cpu.stop())
            res.served.append(_ask(survivors, "served", None, tmo))
            ok = True
            for nd, row in zip(fresh, rows, strict=True):
                ok &= row["digest"] == res.digests[nd.name]
                ok &= row["parity_digest"] == parity_digests[nd.name]
                ok &= row["nbytes"] == size
            res.rebuild.append(rows)
            res.rebuild_ok.append(ok)
            wall = max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows)
            logger.info(
                "n=%d m=%d rebuild #%d of %s: %.2f s, %s",
                n,
                m,
                r,
                lost_list,
                wall,
                "bitwise equal" if ok else "MISMATCH",
            )
    except NodeFailed as exc:
        res.error = str(exc)
        logger.error("n=%d m=%d failed: %s", n, m, exc)
    finally:
        _stop(nodes)
    return res


# ------------------------------------------------------------------------------ report


def _stat(values: Sequence[float], digits: int = 2, unit: str = "") -> str:
    """``median (min-max)``."""
    vals = [v for v in values if v == v]
    if not vals:
        return "n/a"
    med = statistics.median(vals)
    if len(vals) == 1 or min(vals) == max(vals):
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def _wall(rows: Sequence[dict[str, Any]]) -> float:
    return float(max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows))


def _size(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:g} GiB"
    return f"{nbytes / MiB:g} MiB"


@dataclass
class Summary:
    """Medians of one case, for the reading."""

    protect_s: float
    node_gbps: float
    enc_gbps: float
    enc_cpu_gbps: float
    enc_share: float
    main_cpu_gib: float
    other_cpu_gib: float
    cores_busy: float
    machine_busy: float
    rebuild_s: float | None
    rebuild_gbps: float | None
    fetched_x: float | None
    rss_x: float | None


def _med(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def protect_rows(r: CaseResult) -> list[dict[str, Any]]:
    """Every node's protect figures of every repeat."""
    return [x for rows in r.protect for x in rows]


def summarize(r: CaseResult) -> Summary | None:
    """Medians over repeats (walls) and over nodes x repeats (per-node figures)."""
    if not r.protect:
        return None
    gib = r.size / GiB
    walls = [_wall(rows) for rows in r.protect]
    pr = protect_rows(r)
    rb = [_wall(rows) for rows in r.rebuild]
    rrows = [x for rows in r.rebuild for x in rows]
    return Summary(
        protect_s=_med(walls),
        node_gbps=_med([r.size / w / 1e9 for w in walls]),
        enc_gbps=_med([x["enc_bytes"] / x["enc_s"] / 1e9 for x in pr if x["enc_s"]]),
        enc_cpu_gbps=_med([x["enc_bytes"] / x["enc_cpu_s"] / 1e9 for x in pr if x["enc_cpu_s"]]),
        enc_share=_med([x["enc_cpu_s"] / x["cpu_s"] for x in pr if x["cpu_s"]]),
        main_cpu_gib=_med([x["main_cpu_s"] / gib for x in pr]),
        other_cpu_gib=_med([(x["cpu_s"] - x["main_cpu_s"]) / gib for x in pr]),
        cores_busy=_med([sum(x["cpu_s"] for x in rows) / _wall(rows) for rows in r.protect]),
        machine_busy=_med(r.machine_busy),
        rebuild_s=_med(rb) if rb else None,
        rebuild_gbps=len(r.lost) * r.size / _med(rb) / 1e9 if rb else None,
        fetched_x=_med([x["recv"] / r.size for x in rrows]) if rrows else None,
        rss_x=_med([x["maxrss"] / r.size for x in rrows]) if rrows else None,
    )


def render(
    results: list[CaseResult], args: argparse.Namespace, machine: dict[str, str], run_s: float
) -> str:
    """The markdown section (both markers included)."""
    cmd = args.command
    out = [
        START_MARK,
        "## Erasure-coded peer exchange: protect and rebuild between node processes",
        "",
        *_report.generated_by("ec_protect.py", cmd),
        f"- date: {machine['date']}; the whole run took {run_s / 60:.1f} min",
        f"- CPU: {machine['cpu']}; memory {machine['mem']}",
        f"- {machine['versions']}",
        f"- 1-minute load average at start / end: {machine['load']} (the machine may be "
        "shared: the 'machine cores busy' column counts every process on it)",
        f"- one OS process per node (multiprocessing 'spawn'), all on 127.0.0.1, each with its "
        f"own `ZmqPeerTransport` (TCP + CURVE, one key pair for the job, default HWM and send "
        f"timeout) and `GroupProtector` (protocol timeout {args.timeout:g} s); `tune_malloc()` "
        f"in every node; a random snapshot of {_size(args.size)} per node, stripes of "
        f"{_size(args.stripe)} of data (k chunks of stripe/k); median (min-max) over "
        f"{args.repeats} repeats",
    ]
    if args.size != DEFAULT_SIZE_MIB * MiB:
        out.append(
            f"- size: {_size(args.size)} per node, not the default "
            f"{_size(DEFAULT_SIZE_MIB * MiB)} (`--size-mib`)" + _default_size_note(results)
        )
    out += [
        "",
        "### Protect (every node protects the same step)",
        "",
        "| n | m | per node | protect time | protected GB/s per node | group GB/s "
        "| encode GB/s per SMP (wall) | encode GB/s per CPU-second "
        "| encode + gather + parity send (wall) | encode_stripe alone (fresh process) "
        "| node processes' cores busy | machine cores busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        alone = (
            f"{r.codec_alone[0]:.2f} ({r.codec_alone[1]:.2f} per CPU-s)" if r.codec_alone else ""
        )
        if not r.protect:
            out.append(f"| {r.n} | {r.m} | {_size(r.size)} | failed | | | | | | {alone} | | |")
            continue
        walls = [_wall(rows) for rows in r.protect]
        pr = protect_rows(r)
        enc = [x["enc_bytes"] / x["enc_s"] / 1e9 for x in pr if x["enc_s"]]
        enc_cpu = [x["enc_bytes"] / x["enc_cpu_s"] / 1e9 for x in pr if x["enc_cpu_s"]]
        gat = [x["enc_bytes"] / x["gather_s"] / 1e9 for x in pr if x["gather_s"]]
        busy = [sum(x["cpu_s"] for x in rows) / _wall(rows) for rows in r.protect]
        out.append(
            f"| {r.n} | {r.m} | {_size(r.size)} | {_stat(walls, 2, ' s')} | "
            f"{_stat([r.size / w / 1e9 for w in walls], 3)} | "
            f"{_stat([r.n * r.size / w / 1e9 for w in walls], 3)} | {_stat(enc, 2)} | "
            f"{_stat(enc_cpu, 2)} | {_stat(gat, 2)} | {alone} | {_stat(busy, 2)} | "
            f"{_stat(r.machine_busy, 2)} |"
        )
    out += [
        "",
        "Per node and snapshot (over every node and repeat):",
        "",
        "| n | m | parity held / own bytes | expected m/(n-m) | peer bytes sent "
        "| peer bytes received | CPU s per GiB protected: protector thread / other threads "
        "| encode share of node CPU | peak RSS / own bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.protect:
            continue
        rows = protect_rows(r)
        gib = r.size / GiB
        out.append(
            f"| {r.n} | {r.m} | {_stat([x['parity'] / r.size for x in rows], 4)} | "
            f"{r.m / (r.n - r.m):.4f} | "
            f"{_stat([x['sent'] / GiB for x in rows], 2, ' GiB')} = "
            f"{_stat([x['sent'] / r.size for x in rows], 2, 'x')} own | "
            f"{_stat([x['recv'] / r.size for x in rows], 2, 'x')} own | "
            f"{_stat([x['main_cpu_s'] / gib for x in rows], 2)} / "
            f"{_stat([(x['cpu_s'] - x['main_cpu_s']) / gib for x in rows], 2)} | "
            f"{_stat([100 * x['enc_cpu_s'] / x['cpu_s'] for x in rows if x['cpu_s']], 0, ' %')} | "
            f"{_stat([x['maxrss'] / r.size for x in rows], 2, 'x')} |"
        )
    out += [
        "",
        "### Rebuild (lost node processes SIGKILLed; fresh ones with new ports rebuild)",
        "",
        "| n | m | lost | rebuild time | rebuilt GB/s | fetched per new node "
        "| served per survivor | new node CPU s per GiB rebuilt: protector thread / other threads "
        "| peak RSS of a new node | machine cores busy | new process up + reconnected "
        "| bitwise equal (data and parity) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lost = f"{len(r.lost)} ({', '.join(map(str, sorted(r.lost)))})"
        if not r.rebuild:
            out.append(f"| {r.n} | {r.m} | {lost} | failed | | | | | | | | |")
            continue
        walls = [_wall(rows) for rows in r.rebuild]
        rows = [x for rr in r.rebuild for x in rr]
        gib = r.size / GiB
        served = [x["sent"] / r.size for rr in r.served for x in rr]
        out.append(
            f"| {r.n} | {r.m} | {lost} | {_stat(walls, 2, ' s')} | "
            f"{_stat([len(r.lost) * r.size / w / 1e9 for w in walls], 3)} | "
            f"{_stat([x['recv'] / r.size for x in rows], 2, 'x')} own | "
            f"{_stat(served, 2, 'x')} own | "
            f"{_stat([x['main_cpu_s'] / gib for x in rows], 2)} / "
            f"{_stat([(x['cpu_s'] - x['main_cpu_s']) / gib for x in rows], 2)} | "
            f"{_stat([x['maxrss'] / GiB for x in rows], 2, ' GiB')} | "
            f"{_stat(r.machine_busy_rebuild, 2)} | {_stat(r.rebuild_spawn_s, 1, ' s')} | "
            f"{sum(r.rebuild_ok)}/{len(r.rebuild_ok)} |"
        )
    errors = [r for r in results if r.error]
    if errors:
        out += ["", "Failures:", ""]
        for r in errors:
            out.append(f"- n={r.n}, m={r.m}: `{_last_line(r.error)}`")
    out += ["", "### Reading", "", reading(results, args), "", "### How it is measured", ""]
    out += [
        "- protect time: the parent hands every node the same start instant "
        "(`time.monotonic()`, system-wide on Linux, now + 0.5 s); the time runs from the "
        "earliest node's start to the last node's return from `protect` (all nodes hold their "
        "parity and saw HELD from the whole group). A 4 MiB protect first opens the "
        "connections (CURVE handshakes), untimed; the first timed repeat also page-faults the "
        "parity memory. Protected GB/s per node = snapshot bytes / protect time; group GB/s = "
        "n x that.",
        "- encode per SMP: each node process wraps its protector's "
        "`StripeCodec.encode_stripe` (pyeclib ISA-L encode + xxh3 of the k+m fragments) and "
        "divides the real data bytes of the stripes it encoded by the wall seconds spent inside "
        "(preemption by the other processes included) and by the CPU seconds of the encoding "
        "thread (`time.thread_time`, page faults of the new parity included); "
        "'encode + gather + parity send' times the protector's `_encode` instead "
        "(zero-filling and copying the received columns into the stripe buffer, encode, "
        "forwarding parity to the other holders). Each node encodes the stripes whose first "
        "parity holder it is: about 1/n of the group's data. 'encode_stripe alone': before the "
        "nodes start, a fresh process (`tune_malloc()`, one thread, idle apart from other "
        f"users of the machine) encodes {_size(args.codec_bytes)} with the same k, m and "
        "chunk size, keeping the parity like a holder; best of 3 passes after a warm-up.",
        "- CPU: 'node processes' cores busy' = the CPU seconds of all node processes (all "
        "threads) / protect time; 'machine cores busy' = busy time of every CPU of the "
        "machine from /proc/stat over the same window (other processes included); 'protector "
        "thread' = the CPU time of the thread calling `protect`/`rebuild`, 'other threads' = "
        "the rest of the process (ZeroMQ I/O threads with the CURVE encryption, the ZAP "
        "authenticator); 'encode share' = encoding-thread CPU in `encode_stripe` / process CPU.",
        "- parity held: `parity_bytes(step)` (fragments include pyeclib's 80-byte header per "
        "chunk); peer bytes sent / received: buffer bytes of protocol messages "
        "(`GroupProtector.sent_bytes`; received counted by wrapping `transport.recv`), JSON "
        "headers and ZeroMQ/CURVE framing left out; 'x own' divides by the node's snapshot "
        "bytes. Peak RSS: `ru_maxrss` of the node process (the snapshot itself is 1x).",
        "- rebuild: the lost nodes' processes are SIGKILLed; new processes (empty protector, "
        "new transport on a new port, same node names) start, the survivors `connect` to "
        "the new endpoints and `serve()`, then the new nodes call `rebuild(step, lost, "
        "source=first survivor)` from a common start instant; the time runs to the last "
        "node rebuilt. Process start-up and reconnect ('new process up + reconnected') are "
        "not in it. The rebuilt snapshot's xxh3-64 and the digest of its parity fragments "
        "are compared with those of the lost node (computed in the node processes). Every "
        "repeat kills the previous replacements and rebuilds again from the survivors.",
    ]
    out += ["", END_MARK]
    return "\n".join(out) + "\n"


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else "?"


def _default_size_note(results: list[CaseResult]) -> str:
    """Peak memory the measured RSS ratios imply at the default size, per case."""
    parts = []
    for r in results:
        if not r.protect or not r.rebuild:
            continue
        survivors = r.n - len(r.lost)
        prot = max(x["maxrss"] for rows in r.protect for x in rows) / r.size
        new = max(x["maxrss"] for rows in r.rebuild for x in rows) / r.size
        need = (survivors * prot + len(r.lost) * new) * DEFAULT_SIZE_MIB * MiB / GiB
        parts.append(f"n={r.n}, m={r.m}: {need:.0f} GiB during a rebuild")
    if not parts:
        return ""
    return (
        "; at the default size, the peak RSS ratios measured here would need about "
        + ", ".join(parts)
        + " (survivors' and new nodes' peaks added)"
    )


def reading(results: list[CaseResult], args: argparse.Namespace) -> str:
    """One paragraph on the figures against the goals, from the medians of this run."""
    cpus = os.cpu_count() or 0
    parts = []
    done = [(r, s) for r in results if (s := summarize(r)) is not None]
    in_range = 1 <= args.stripe / MiB <= 4
    if done:
        enc = "; ".join(
            f"n={r.n}, m={r.m}: {s.enc_gbps:.2f} GB/s of wall time, {s.enc_cpu_gbps:.2f} GB/s "
            "per CPU-second"
            + (f", against {r.codec_alone[0]:.2f} GB/s alone" if r.codec_alone else "")
            for r, s in done
        )
        best = max(s.enc_cpu_gbps for _, s in done)
        alone = [r.codec_alone[0] for r, _ in done if r.codec_alone]
        verdict = "met" if min(s.enc_gbps for _, s in done) >= GOAL_ENCODE_GBPS else "missed"
        parts.append(
            f"Encoding inside protect ran at {enc} ({_size(args.stripe)} stripes): the goal of "
            f">= {GOAL_ENCODE_GBPS:g} GB/s per SMP at 1-4 MiB stripes is **{verdict}** here"
            + ("" if in_range else " (and this run's stripe size is outside 1-4 MiB)")
            + "."
        )
        if alone and max(alone) < GOAL_ENCODE_GBPS:
            parts.append(
                f"This machine cannot show the goal either way: the codec alone, in a fresh "
                f"process with the same chunk size, reached at most {max(alone):.2f} GB/s, so "
                "the shortfall is this machine's (its CPU and memory speed) before it "
                "is the protector's."
            )
        elif alone and best < GOAL_ENCODE_GBPS:
            parts.append(
                f"The codec alone reached {max(alone):.2f} GB/s on this machine, so the loss "
                "is in the protect run itself (the other node processes on the same cores, the "
                "new parity memory)."
            )
        prot = "; ".join(
            f"n={r.n}, m={r.m}: {s.protect_s:.2f} s = {s.node_gbps:.3f} GB/s per node, the "
            f"node processes keeping {s.cores_busy:.2f} cores busy (machine: "
            f"{s.machine_busy:.2f}), {s.main_cpu_gib:.1f} CPU-s per GiB in the protector "
            f"thread and {s.other_cpu_gib:.1f} in the other threads, encoding "
            f"{100 * s.enc_share:.0f} % of it"
            for r, s in done
        )
        parts.append(
            f"Protecting {_size(args.size)} per node took {prot}. On loopback all n node "
            f"processes (each with its ZeroMQ I/O and ZAP threads) share this machine's {cpus} "
            "logical cores, so protect time is bounded by the machine, not by a network: "
            "it measures CPU per protected byte (CURVE encryption, checksums and copies in "
            "the transport, the protector's Python bookkeeping, encoding), and what one SMP "
            "reaches with its own cores and NIC needs a run across hosts."
        )
        busy = [
            (r, s.machine_busy - s.cores_busy)
            for r, s in done
            if s.machine_busy - s.cores_busy > 0.25 * cpus
        ]
        if busy:
            parts.append(
                "Other processes on the machine ran during "
                + " and ".join(
                    f"n={r.n}, m={r.m} (about {other:.2f} of the {cpus} cores, from /proc/stat "
                    "minus the node processes)"
                    for r, other in busy
                )
                + ": those protect times are inflated by outside load; the CPU seconds per "
                "GiB are the steadier figures."
            )
        rb = [(r, s) for r, s in done if s.rebuild_s is not None]
        if rb:
            txt = "; ".join(
                f"{len(r.lost)} lost of n={r.n}: {s.rebuild_s:.2f} s "
                f"({s.rebuild_gbps:.3f} GB/s), each new node fetching {s.fetched_x:.2f}x "
                f"its snapshot, peak RSS {s.rss_x:.2f}x"
                for r, s in rb
            )
            ok = sum(sum(r.rebuild_ok) for r, _ in rb)
            total = sum(len(r.rebuild_ok) for r, _ in rb)
            parts.append(
                f"Rebuild ({txt}) was bitwise exact in {ok}/{total} runs. A new node "
                "fetches k fragments of every stripe it took part in (n times its snapshot: "
                "its data and its parity) and its peak memory is a multiple of the snapshot "
                "it rebuilds."
            )
    failed = [r for r in results if r.error]
    if failed:
        parts.append(
            "Failed: "
            + "; ".join(f"n={r.n}, m={r.m} ({_last_line(r.error)})" for r in failed)
            + "."
        )
    return " ".join(parts) if parts else "No figures: every case failed."


def _machine() -> dict[str, str]:
    import zmq

    from ftmem.exchange.codec import EC_TYPE

    ver = _report.version_of
    return {
        "date": _report.utc_now(),
        "cpu": _report.cpu_model(),
        "mem": _report.machine_facts()[1].split("; memory ")[-1],
        "versions": (
            f"Python {platform.python_version()}, torch {ver('torch')} (not used by the "
            f"benchmark), pyzmq {zmq.pyzmq_version()} (libzmq {zmq.zmq_version()}, CURVE "
            f"{'available' if zmq.has('curve') else 'MISSING'}), pyeclib {ver('pyeclib')} "
            f"(`{EC_TYPE}`), numpy {ver('numpy')}, xxhash {ver('xxhash')}, "
            f"Linux {platform.release()}"
        ),
        "load": f"{os.getloadavg()[0]:.2f}",
    }


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="256 MiB per node, 2 repeats")
    p.add_argument("--size-mib", type=int, default=None, help="snapshot per node (default 2048)")
    p.add_argument("--stripe-mib", type=float, default=1.0, help="data per stripe (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 2)")
    p.add_argument("--timeout", type=float, default=None, help="protocol timeout per wait (s)")
    p.add_argument("--cases", default=",".join(CASES), help="n:m configurations to run")
    _report.add_output_args(p)
    return p


def run(argv: list[str], *, command: str | None = None) -> _report.Outcome:
    """Parse ``argv``, run every case, render the section (not written).

    ``command`` replaces the command line shown in the section (the suite passes its own).
    The outcome's data is the list of :class:`CaseResult`.
    """
    p = get_args_parser()
    args = p.parse_args(argv)
    size_mib = args.size_mib or (256 if args.quick else DEFAULT_SIZE_MIB)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if size_mib < 8 or args.repeats < 1 or args.stripe_mib <= 0:
        p.error("need --size-mib >= 8, --repeats >= 1, --stripe-mib > 0")
    args.size = size_mib * MiB
    args.stripe = int(args.stripe_mib * MiB)
    # Protocol waits scale with the size: at least 120 s, plus 60 s per GiB.
    # A bound on hangs, not an expectation: protect time grows faster than linearly with size.
    args.timeout = args.timeout or max(300.0, 600.0 * args.size / GiB)
    args.codec_bytes = (64 if args.quick or size_mib < 256 else 256) * MiB
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.cases or any(c not in CASES for c in args.cases):
        p.error(f"--cases: a comma-separated subset of {', '.join(CASES)}")
    args.command = command or _report.shown_command("ec_protect.py", argv)

    from ftmem.exchange import keys

    keys_json = keys.generate().to_json()
    load0 = f"{os.getloadavg()[0]:.2f}"
    t_run = time.monotonic()
    ctx = mp.get_context("spawn")
    results = []
    for name in args.cases:
        n, m, lost = CASES[name]
        logger.info("n=%d m=%d: %s per node, %d repeats", n, m, _size(args.size), args.repeats)
        results.append(run_case(ctx, n, m, lost, args, keys_json))
    machine = _machine()
    machine["load"] = f"{load0} / {machine['load']}"
    section = render(results, args, machine, time.monotonic() - t_run)
    bad = any(r.error or not all(r.rebuild_ok) for r in results)
    return _report.Outcome(name=SECTION, section=section, args=args, data=results, ok=not bad)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the cases, print (and write) the section."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks run
    return _report.finish(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
