"""The node processes of ``bench/ec_protect.py``: one per node of the erasure-coding group.

Each runs :func:`node_main` in a "spawn" child: its own ``ZmqPeerTransport`` and
``GroupProtector``, a random snapshot, and a loop that answers the parent's commands
(protect, rebuild, serve, digests) over a pipe, timing what ``bench/ec_protect.py`` reports;
:func:`codec_alone` times the codec in a fresh process; :class:`CpuSampler` reads the
machine's busy cores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

MiB = 1 << 20
WARMUP_BYTES = 4 * MiB

logger = logging.getLogger("bench.ec_protect")


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


def sleep_until(t: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``t`` (at most 10 s)."""
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
        with contextlib.suppress(OSError, ValueError):
            conn.send(
                ("error", f"node {cfg['node']} (pid {os.getpid()}):\n{traceback.format_exc()}")
            )
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
    transport = ZmqPeerTransport(
        str(me), CurveKeyPair.from_json(cfg["keys"]), encrypt_data=bool(cfg.get("encrypt"))
    )
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


def _maxrss() -> int:
    """Peak resident memory of this process so far (bytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _timed(fn: Any) -> tuple[Any, dict[str, float]]:
    """``fn()`` and its wall span (``t_start``, ``t_end``: monotonic), CPU of the process
    (``cpu_s``) and of this thread (``main_cpu_s``)."""
    t = time.monotonic()
    cpu, main_cpu = time.process_time(), time.thread_time()
    out = fn()
    t_end = time.monotonic()
    cpu_s, main_cpu_s = time.process_time() - cpu, time.thread_time() - main_cpu
    return out, {"t_start": t, "t_end": t_end, "cpu_s": cpu_s, "main_cpu_s": main_cpu_s}


def _serve_parent(
    conn: Connection, cfg: dict[str, Any], prot: Any, transport: Any, data: Any, c: _Counters
) -> None:
    import xxhash

    idle_s = float(cfg["idle"])
    simple = {  # commands answered with ("ok", None)
        "connect": transport.connect,
        "warmup": lambda step: prot.protect(step, memoryview(data)[:WARMUP_BYTES]),
        "forget": prot.forget,
    }
    while True:
        if not conn.poll(idle_s):
            raise TimeoutError(f"no command from the parent in {idle_s} s")
        cmd, arg = conn.recv()
        if cmd == "stop":
            conn.send(("ok", None))
            return
        if cmd in simple:
            simple[cmd](arg)
            conn.send(("ok", None))
        elif cmd == "protect":
            step, t_go = arg
            c.reset()
            sent0 = prot.sent_bytes
            sleep_until(t_go)
            _, res = _timed(lambda s=step: prot.protect(s, memoryview(data)))
            res |= {k: getattr(c, k) for k in ("enc_cpu_s", "enc_s", "enc_bytes", "enc_calls")}
            res |= {"sent": prot.sent_bytes - sent0, "recv": c.recv_bytes, "gather_s": c.gather_s}
            res |= {"parity": prot.parity_bytes(step), "maxrss": _maxrss()}
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
            sleep_until(t_go)
            out, res = _timed(lambda a=(step, set(lost), source): prot.rebuild(*a))
            res |= {
                "nbytes": out.nbytes,
                "digest": xxhash.xxh3_64_intdigest(out),
                "parity_digest": _parity_digest(prot, step),
                "parity": prot.parity_bytes(step),
                "recv": c.recv_bytes,
                "maxrss": _maxrss(),
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


CHANNELS = ("zmq", "tagged", "curve")
"""zmq: a bare DEALER -> ROUTER (the floor: no tag, no checksum); tagged: ZmqPeerTransport's
data channel; curve: ZmqPeerTransport with every message over CURVE."""


def channel_end(conn: Connection, keys_json: str, mode: str, nbytes: int, send: bool) -> None:
    """One end of 'channel alone': ``nbytes`` in 1 MiB messages from the sending end to the
    receiving one, each in its own process; sends back this end's (CPU-s, wall s) from the
    first message to the last (all threads: ZeroMQ's I/O threads, where CURVE works, too)."""
    try:
        import zmq

        from ftmem.exchange.keys import CurveKeyPair
        from ftmem.exchange.zmq_transport import ZmqPeerTransport

        me, peer = ("a", "b") if send else ("b", "a")
        raw: Any = None
        t: Any = None
        if mode == "zmq":
            ctx = zmq.Context()
            raw = ctx.socket(zmq.DEALER if send else zmq.ROUTER)
            raw.setsockopt(zmq.LINGER, 0)
            endpoint = (
                "" if send else f"tcp://127.0.0.1:{raw.bind_to_random_port('tcp://127.0.0.1')}"
            )
        else:
            keys = CurveKeyPair.from_json(keys_json)
            t = ZmqPeerTransport(me, keys, encrypt_data=mode == "curve")
            endpoint = t.start()
        conn.send(("ok", endpoint))
        eps = conn.recv()
        if raw is not None and send:
            raw.connect(eps[peer])
        elif t is not None:
            t.connect(eps)
        msg = memoryview(os.urandom(MiB))
        count = nbytes // MiB
        cpu0 = t0 = 0.0
        for i in range(count + 1):  # the first message is a warm-up (connections, handshake)
            if i == 1:
                cpu0, t0 = time.process_time(), time.perf_counter()
            if send and raw is not None:
                raw.send_multipart([b"h", msg], copy=False)
            elif send:
                t.send(peer, {"i": i}, [msg])
            elif raw is not None:
                raw.recv_multipart(copy=False)
            else:
                while t.recv(30.0) is None:
                    pass
        if send:  # ZeroMQ's I/O thread still sends: its CPU counts once the receiver has all
            conn.recv()
        conn.send(("ok", (time.process_time() - cpu0, time.perf_counter() - t0)))
        if t is not None:
            t.close()
        if raw is not None:
            raw.close(linger=0)
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
