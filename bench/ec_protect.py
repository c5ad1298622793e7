"""Erasure-coded peer exchange benchmark: GroupProtector protect and rebuild between node processes.

Usage (from the repository root; ftmem importable, e.g. ``pip install -e .``):

    python bench/ec_protect.py                 # 2 GiB per node, 1 MiB stripes, 3 repeats
    python bench/ec_protect.py --quick         # 256 MiB per node, 2 repeats (about a minute)
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
import datetime
import logging
import multiprocessing as mp
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
START_MARK = "<!-- bench:ec-protect:start -->"
END_MARK = "<!-- bench:ec-protect:end -->"
MiB = 1 << 20
GiB = 1 << 30
CASES: list[tuple[int, int, frozenset[int]]] = [(3, 1, frozenset({2})), (4, 2, frozenset({1, 3}))]
WARMUP_BYTES = 4 * MiB
GOAL_ENCODE_GBPS = 5.0
GO_DELAY_S = 0.5  # start-time barrier: now + this, handed to every node

logger = logging.getLogger("bench.ec_protect")


# ------------------------------------------------------------------------------ node process


@dataclass
class _Counters:
    enc_s: float = 0.0
    enc_bytes: int = 0
    enc_calls: int = 0
    gather_s: float = 0.0
    recv_bytes: int = 0

    def reset(self) -> None:
        self.enc_s = self.gather_s = 0.0
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
            conn.send(("error", f"node {cfg['node']} (pid {os.getpid()}):\n{traceback.format_exc()}"))
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
        t = time.perf_counter()
        out = codec_encode(stripe, lengths)
        c.enc_s += time.perf_counter() - t
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
            cpu = time.process_time()
            prot.protect(step, memoryview(data))
            t_end = time.monotonic()
            res = {
                "t_start": t,
                "t_end": t_end,
                "cpu_s": time.process_time() - cpu,
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
            deadline = time.monotonic() + float(cfg["idle"])
            prot.serve(lambda: conn.poll() or time.monotonic() > deadline, poll_s=0.05)
            if time.monotonic() > deadline:
                raise TimeoutError("served peers until the deadline without a parent command")
            cmd2, _ = conn.recv()
            if cmd2 != "served":
                raise RuntimeError(f"expected 'served' after 'serve', got {cmd2!r}")
            conn.send(("ok", {"sent": prot.sent_bytes - sent0, "cpu_s": time.process_time() - cpu}))
        elif cmd == "rebuild":
            step, lost, source, t_go = arg
            c.reset()
            _sleep_until(t_go)
            t = time.monotonic()
            cpu = time.process_time()
            out = prot.rebuild(step, set(lost), source)
            t_end = time.monotonic()
            res = {
                "t_start": t,
                "t_end": t_end,
                "cpu_s": time.process_time() - cpu,
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


def _recv(node: Node, timeout_s: float, what: str) -> Any:
    """The node's next answer within ``timeout_s``; NodeFailed on error, death or timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NodeFailed(f"node {node.name}: no answer to {what} within {timeout_s:.0f} s")
        try:
            ready = node.conn.poll(min(left, 0.5))
            if ready:
                kind, val = node.conn.recv()
        except (EOFError, OSError) as exc:
            node.proc.join(2.0)
            raise NodeFailed(
                f"node {node.name} died during {what} (exit code {node.proc.exitcode})"
            ) from exc
        if ready:
            if kind == "error":
                raise NodeFailed(str(val))
            return val
        if not node.proc.is_alive():
            raise NodeFailed(f"node {node.name} died during {what} (exit {node.proc.exitcode})")


def _ask(nodes: Sequence[Node], cmd: str, args: Callable[[Node], Any], timeout_s: float) -> list[Any]:
    """Send ``cmd`` to every node, then collect every answer (bounded)."""
    for nd in nodes:
        nd.conn.send((cmd, args(nd)))
    deadline = time.monotonic() + timeout_s
    return [_recv(nd, max(deadline - time.monotonic(), 0.1), cmd) for nd in nodes]


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
        t0 = time.monotonic()
        nodes = [_spawn(ctx, i, cfg, replacement=False) for i in range(n)]
        for nd in nodes:
            info = _recv(nd, tmo + size / 1e8, "start")
            nd.endpoint, res.digests[nd.name] = info["endpoint"], info["digest"]
            res.gen_s = max(res.gen_s, info["gen_s"])
        logger.info("n=%d m=%d: %d node processes up in %.1f s", n, m, n, time.monotonic() - t0)
        eps = {str(nd.name): nd.endpoint for nd in nodes}
        _ask(nodes, "connect", lambda nd: eps, tmo)
        _ask(nodes, "warmup", lambda nd: 0, tmo)
        _ask(nodes, "forget", lambda nd: 0, tmo)
        step = 0
        for r in range(args.repeats):
            if step:
                _ask(nodes, "forget", lambda nd, s=step: s, tmo)
            step = r + 1
            go = time.monotonic() + GO_DELAY_S
            rows = _ask(nodes, "protect", lambda nd, s=step, g=go: (s, g), tmo)
            res.protect.append(rows)
            wall = max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows)
            logger.info("n=%d m=%d protect #%d: %.2f s", n, m, r, wall)
        parity_digests = dict(
            zip(
                [nd.name for nd in nodes],
                _ask(nodes, "parity_digest", lambda nd: step, tmo),
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
            for nd in fresh:
                nd.endpoint = _recv(nd, tmo, "start")["endpoint"]
            eps = {str(nd.name): nd.endpoint for nd in nodes}
            _ask(survivors, "serve", lambda nd: eps, tmo)
            _ask(fresh, "connect", lambda nd: eps, tmo)
            res.rebuild_spawn_s.append(time.monotonic() - t0)
            go = time.monotonic() + GO_DELAY_S
            lost_list = sorted(lost)
            rows = _ask(fresh, "rebuild", lambda nd, g=go: (step, lost_list, source, g), tmo)
            res.served.append(_ask(survivors, "served", lambda nd: None, tmo))
            ok = True
            for nd, row in zip(fresh, rows, strict=True):
                ok &= row["digest"] == res.digests[nd.name]
                ok &= row["parity_digest"] == parity_digests[nd.name]
                ok &= row["nbytes"] == size
            res.rebuild.append(rows)
            res.rebuild_ok.append(ok)
            wall = max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows)
            logger.info(
                "n=%d m=%d rebuild #%d of %s: %.2f s, %s", n, m, r, lost_list, wall,
                "bitwise equal" if ok else "MISMATCH",
            )
    except NodeFailed as exc:
        res.error = str(exc)
        logger.error("n=%d m=%d failed: %s", n, m, exc)
    finally:
        _stop(nodes)
    return res
