"""The node processes of the erasure-coding benchmark (bench/ec_protect.py): each node is a
"spawn" child running :func:`node_main` (a GroupProtector over a real ZmqPeerTransport), plus
the children that time the codec alone and the channel alone. Every child reports through its
pipe; :func:`run_child` sends the traceback of an error instead of dying silently.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import resource
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil
import xxhash
import zmq

from bench._stats import MiB
from bench.ec import encode_alone
from ftmem.exchange import keys
from ftmem.exchange.codec import tune_malloc
from ftmem.exchange.placement import plan_group
from ftmem.exchange.protector import GroupProtector
from ftmem.exchange.zmq_transport import ZmqPeerTransport

MODES = ("tagged", "curve")
"""tagged: snapshot bytes on the plain data channel with keyed tags; curve: all over CURVE."""
CHANNELS = ("zmq", *MODES)
"""'Channel alone': zmq is a bare DEALER -> ROUTER (the floor: no tag, no checksum)."""
WARMUP_BYTES = 4 * MiB
COUNTERS = dict.fromkeys(("enc_s", "enc_cpu_s", "gather_s"), 0.0)  # a node's, per command
COUNTERS |= dict.fromkeys(("enc_bytes", "enc_calls", "recv_bytes"), 0)

logger = logging.getLogger("bench.ec_protect")


def run_child(conn: Connection, target: Callable[..., None], *args: Any) -> None:
    """A child's entry point: ``target(conn, *args)``; an error is sent as ``("error", text)``."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s node %(name)s: %(message)s")
    try:
        target(conn, *args)
    except BaseException:
        where = f"{mp.current_process().name} (pid {os.getpid()})"
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", f"{where}:\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def sleep_until(t: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``t`` (at most 10 s)."""
    time.sleep(min(max(t - time.monotonic(), 0.0), 10.0))


def _parity_digest(prot: GroupProtector, step: int) -> int:
    """xxh3-64 of the parity fragments (and their keys) ``prot`` holds for ``step``."""
    h = xxhash.xxh3_64()
    st = prot.steps.get(step)
    for key in sorted(st.parity) if st is not None else []:
        h.update(key[0].to_bytes(8, "little") + key[1].to_bytes(4, "little"))
        h.update(st.parity[key])
    return h.intdigest()


def _timed(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``fn()`` and its span (``t_start``, ``t_end``: monotonic), CPU of the process (``cpu_s``)
    and of this thread (``main_cpu_s``), then the process's peak RSS (``maxrss``, bytes)."""
    t, cpu, main_cpu = time.monotonic(), time.process_time(), time.thread_time()
    out = fn()
    res = {"t_start": t, "t_end": time.monotonic(), "cpu_s": time.process_time() - cpu}
    res["main_cpu_s"] = time.thread_time() - main_cpu
    res["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out, res


def node_main(conn: Connection, cfg: dict[str, Any]) -> None:
    """A node: its transport and GroupProtector, with the codec, the protector's encode and the
    transport's receive wrapped to count; a random snapshot unless it is a replacement. It
    reports its endpoint, then answers the parent's commands (:func:`_serve`)."""
    if not tune_malloc():
        logger.warning("tune_malloc() is not in effect in node %s", cfg["node"])
    data = digest = None
    t0 = time.monotonic()
    if not cfg["replacement"]:
        # PCG64 raw output: random (incompressible) bytes at a few GB/s, every page written.
        data = np.random.PCG64(cfg["seed"]).random_raw(cfg["size"] // 8).view(np.uint8)
        digest = xxhash.xxh3_64_intdigest(data)
    gen_s = time.monotonic() - t0
    key_pair = keys.CurveKeyPair.from_json(cfg["keys"])
    transport = ZmqPeerTransport(str(cfg["node"]), key_pair, encrypt_data=cfg["encrypt"])
    group = plan_group(list(range(cfg["n"])), cfg["m"])
    workers = int(cfg.get("workers", 0))
    prot = GroupProtector(
        cfg["node"],
        group,
        transport,
        cfg["stripe"],
        timeout_s=cfg["timeout"],
        encode_workers=workers,
    )
    c = dict(COUNTERS)
    encode_stripe, encode, recv = prot.codec.encode_stripe, prot._encode, transport.recv
    if prot.encode_pool is not None:
        _count_pool(prot.encode_pool, c)

    def timed_encode_stripe(stripe: Any, lengths: Sequence[int]) -> Any:
        t, cpu = time.perf_counter(), time.thread_time()
        out = encode_stripe(stripe, lengths)
        c["enc_s"] += time.perf_counter() - t
        c["enc_cpu_s"] += time.thread_time() - cpu
        c["enc_bytes"] += sum(lengths)
        c["enc_calls"] += 1
        return out

    def timed_encode(step: int, s: Any) -> None:
        t = time.perf_counter()
        encode(step, s)
        c["gather_s"] += time.perf_counter() - t

    def counted_recv(timeout_s: float) -> Any:
        msg = recv(timeout_s)
        c["recv_bytes"] += 0 if msg is None else sum(b.nbytes for b in msg.buffers)
        return msg

    prot.codec.encode_stripe = timed_encode_stripe  # type: ignore[method-assign]
    if prot.encode_pool is None:  # with workers, _encode only queues: not a figure
        prot._encode = timed_encode  # type: ignore[method-assign]
    transport.recv = counted_recv  # type: ignore[method-assign]
    try:
        conn.send(("ok", {"endpoint": transport.start(), "digest": digest, "gen_s": gen_s}))
        _serve(conn, float(cfg["idle"]), prot, transport, data, c)
    finally:
        transport.close()


def _count_pool(pool: Any, c: dict[str, Any]) -> None:
    """Count a pool's work in ``c`` like the inline encode's: ``enc_s`` = wall seconds while a
    stripe was out (submitted, not polled back), ``enc_bytes``/``enc_calls`` = the stripes the
    workers encoded (a fallback to the thread is timed by ``encode_stripe`` as inline)."""
    submit, poll = pool.submit, pool.poll
    since: list[float] = []

    def counted_submit(tag: Any, chunk: int, lengths: Any, fill: Any) -> bool:
        busy = pool.busy
        ok = bool(submit(tag, chunk, lengths, fill))
        if ok and not busy:
            since[:] = [time.perf_counter()]
        if ok:
            c["enc_bytes"] += sum(lengths)
            c["enc_calls"] += 1
        return ok

    def counted_poll() -> Any:
        out = poll()
        if out and since and not pool.busy:
            c["enc_s"] += time.perf_counter() - since.pop()
        return out

    pool.submit, pool.poll = counted_submit, counted_poll


def _workers_cpu(prot: GroupProtector) -> float:
    """CPU seconds the protector's live encode workers have used (0 without a pool)."""
    total = 0.0
    for pid in prot.encode_pool.pids if prot.encode_pool is not None else []:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def _serve(
    conn: Connection, idle_s: float, prot: GroupProtector, transport: Any, data: Any, c: dict
) -> None:
    """Answer the parent's ``(command, arg)`` with ``("ok", answer)`` until ``stop``; between
    ``serve`` and the next command, answer the peers (a survivor serving a rebuild)."""
    mark: dict[str, Any] = {}

    def protect(step: int, t_go: float) -> dict[str, Any]:
        c.update(COUNTERS)
        sent0 = prot.sent_bytes
        sleep_until(t_go)
        workers0 = _workers_cpu(prot)
        _, res = _timed(lambda: prot.protect(step, memoryview(data)))
        if prot.encode_pool is not None:  # the workers' CPU is the node's, and the encode's
            spent = _workers_cpu(prot) - workers0
            c["enc_cpu_s"] += spent
            res["cpu_s"] += spent
        res |= {k: c[k] for k in ("enc_cpu_s", "enc_s", "enc_bytes", "enc_calls", "gather_s")}
        res |= {"sent": prot.sent_bytes - sent0, "recv": c["recv_bytes"]}
        return res | {"parity": prot.parity_bytes(step)}

    def rebuild(step: int, lost: list[int], source: int, t_go: float) -> dict[str, Any]:
        c.update(COUNTERS)
        sleep_until(t_go)
        out, res = _timed(lambda: prot.rebuilder.rebuild(step, set(lost), source))
        res |= {"nbytes": out.nbytes, "digest": xxhash.xxh3_64_intdigest(out)}
        res |= {"parity_digest": _parity_digest(prot, step), "parity": prot.parity_bytes(step)}
        return res | {"recv": c["recv_bytes"]}

    def serve(eps: dict[str, str]) -> None:
        transport.connect(eps)  # the new endpoints of the replaced nodes
        mark.update(sent=prot.sent_bytes, cpu=time.process_time())

    def served(_: None) -> dict[str, Any]:
        return {"sent": prot.sent_bytes - mark["sent"], "cpu_s": time.process_time() - mark["cpu"]}

    commands: dict[str, Callable[..., Any]] = {
        "connect": transport.connect,
        "warmup": lambda step: prot.protect(step, memoryview(data)[:WARMUP_BYTES]),
        "forget": prot.forget,
        "parity_digest": lambda step: _parity_digest(prot, step),
        "protect": lambda arg: protect(*arg),
        "rebuild": lambda arg: rebuild(*arg),
        "serve": serve,
        "served": served,
    }
    cmd = ""
    while True:
        until = time.monotonic() + idle_s
        if cmd == "serve":
            prot.serve(lambda u=until: conn.poll() or time.monotonic() > u, poll_s=0.05)
        if not conn.poll(max(0.0, until - time.monotonic())):
            raise TimeoutError(f"no command from the parent in {idle_s} s")
        cmd, arg = conn.recv()
        conn.send(("ok", None if cmd == "stop" else commands[cmd](arg)))
        if cmd == "stop":
            return


def codec(conn: Connection, *args: Any) -> None:
    """'encode_stripe alone' (:func:`bench.ec.encode_alone`) in this fresh process."""
    conn.send(("ok", encode_alone(*args)))


def channel_end(conn: Connection, keys_json: str, mode: str, nbytes: int, send: bool) -> None:
    """One end of 'channel alone' over ``mode`` (:data:`CHANNELS`): ``nbytes`` in 1 MiB
    messages from the sending end to the receiving one; sends back this end's (CPU s, wall s)
    from the first message to the last, every thread counted (ZeroMQ's, where CURVE works)."""
    me, peer = ("a", "b") if send else ("b", "a")
    end: Any
    if mode == "zmq":
        end = zmq.Context().socket(zmq.DEALER if send else zmq.ROUTER)
        end.setsockopt(zmq.LINGER, 0)
        local = "tcp://127.0.0.1"
        conn.send(("ok", "" if send else f"{local}:{end.bind_to_random_port(local)}"))
        eps = conn.recv()
        if send:
            end.connect(eps[peer])
    else:
        key_pair = keys.CurveKeyPair.from_json(keys_json)
        end = ZmqPeerTransport(me, key_pair, encrypt_data=mode == "curve")
        conn.send(("ok", end.start()))
        end.connect(conn.recv())
    msg = memoryview(os.urandom(MiB))
    cpu0 = t0 = 0.0
    for i in range(nbytes // MiB + 1):  # the first message is a warm-up (connections, handshake)
        if i == 1:
            cpu0, t0 = time.process_time(), time.perf_counter()
        if mode == "zmq" and send:
            end.send_multipart([b"h", msg], copy=False)
        elif mode == "zmq":
            end.recv_multipart(copy=False)
        elif send:
            end.send(peer, {"i": i}, [msg])
        else:
            while end.recv(30.0) is None:
                pass
    if send:  # ZeroMQ's I/O thread still sends: its CPU counts once the receiver has all
        conn.recv()
    conn.send(("ok", (time.process_time() - cpu0, time.perf_counter() - t0)))
    end.close()
