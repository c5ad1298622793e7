"""ftmem's control plane modelled to 1,000 nodes / 8,000 ranks from figures measured here.

    python bench/scale_model.py --scale-json scale.json        # after bench/scale.py --json
    python bench/scale_model.py --scale-json scale.json --rendezvous 16,64,128 --no-write

Measured first, on this machine, with the real parts:

- **c10d rendezvous**: N of torch elastic's own ``DynamicRendezvousHandler`` (threads of this
  process, each with its own ``TCPStore`` client and keep-alive, the c10d backend) join one
  round on one ``TCPStore``: the time until all N have it, and the size of the round's state
  (the value every node reads each time it polls).
- **the store's throughput**: 4 client processes ``get`` a value of that size in a loop.

Then, for N = 16 ... 1,000 nodes (8 ranks each), it extrapolates each figure the way the
design says it grows (per node: flat; store bytes: per node times the state's size) and says
which part of a machine-loss recovery first exceeds 10 s. The inputs and the formulas are in
the rendered section (docs/scale.md explains them); nothing is fitted beyond a least-squares
line or parabola through the measured points.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/scale_model.py

from bench import _render

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "scale-model"
NODES = (16, 64, 256, 1000)
RANKS_PER_NODE = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous(n: int, quick: bool) -> tuple[float, int, int]:
    """Seconds until ``n`` elastic c10d handlers all have round 0, its state's bytes, and the
    state reads and writes (compare-and-set) all of them made of the store for it.
    ``quick``: as ftmem-launch joins at a restart (its own code: every state read a real one,
    polls every :func:`~ftmem.launch.elastic_compat.rendezvous_poll_s`, no start delay);
    else elastic's first join as torchrun makes it."""
    import contextlib

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from ftmem.launch.elastic_compat import (
        rendezvous_poll_s,
        restart_rendezvous_quickly,
        trust_rendezvous_state_for,
    )

    poll_s = rendezvous_poll_s(n)
    calls = 0
    lock = threading.Lock()

    class Counted(C10dRendezvousBackend):
        def get_state(self) -> Any:
            nonlocal calls
            with lock:
                calls += 1
            return super().get_state()

        def set_state(self, state: bytes, token: Any = None) -> Any:
            nonlocal calls
            with lock:
                calls += 1
            return super().set_state(state, token)

    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    run_id = f"model{n}"
    done: list[float] = []
    errors: list[BaseException] = []
    handlers = []

    def join() -> None:
        try:
            store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
            params = RendezvousParameters(
                "c10d", f"127.0.0.1:{port}", run_id, n, n, join_timeout=600, local_addr="127.0.0.1"
            )
            h = create_handler(store, Counted(store, run_id), params)
            if quick:
                trust_rendezvous_state_for(h, poll_s)
            handlers.append(h)
            h.next_rendezvous()
            done.append(time.monotonic())
        except BaseException as exc:  # reported below
            errors.append(exc)

    t0 = time.monotonic()
    threads = [threading.Thread(target=join, daemon=True) for _ in range(n)]
    quickly = restart_rendezvous_quickly(True, poll_s) if quick else contextlib.nullcontext()
    with quickly:  # (it swaps a module function: every thread's join)
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
    if errors or len(done) != n:
        raise RuntimeError(f"rendezvous of {n}: {len(done)} joined; {errors[:1]}")
    state = server.get(f"torch.rendezvous.{run_id}")
    ops = calls
    for h in handlers:
        h.shutdown()
    return max(done) - t0, len(state), ops


def _getter(port: int, nbytes: int, seconds: float, out: Any) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        store.get("state")
        n += 1
    out.put(n)


def store_throughput(nbytes: int, clients: int = 4, seconds: float = 3.0) -> float:
    """``get`` requests per second that ``clients`` processes get from one TCPStore."""
    from torch.distributed import TCPStore

    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    server.set("state", b"x" * nbytes)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_getter, args=(port, nbytes, seconds, q)) for _ in range(clients)]
    for p in procs:
        p.start()
    total = sum(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return total / seconds


def _fit(xs: list[float], ys: list[float], degree: int) -> list[float]:
    """Least-squares polynomial coefficients (lowest power first)."""
    import numpy as np

    return [float(c) for c in np.polynomial.polynomial.polyfit(xs, ys, degree)]


def _at(coef: list[float], x: float) -> float:
    return sum(c * x**i for i, c in enumerate(coef))


def entry_bytes() -> int:
    """The size of one node's peer-mesh entry in the store, as an agent writes it."""
    from ftmem.exchange import keys
    from ftmem.launch.peers import peer_entry
    from ftmem.protocol.peer import PeerAddress

    job = keys.generate()
    address = PeerAddress("tcp://10.0.0.10:40000", keys.generate().public, "tcp://10.0.0.10:40001")
    return len(peer_entry(job, 123, 999, str(address)))


def model(scale: dict[str, Any], rdzv: dict[int, tuple[float, int, int]], ops: float) -> Any:
    """The modelled figures per N (module docstring; the formulas are in the section)."""
    ns = sorted(rdzv)
    state_fit = _fit([float(n) for n in ns], [float(rdzv[n][1]) for n in ns], 1)
    state_bw = ops * _at(state_fit, 1000)  # bytes/s the store serves at that value size
    hosts = scale.get("hosts", [])
    detect = max((h["detect_s"] for h in hosts if h.get("detect_s") is not None), default=None)
    per_node_req = max((h["store_packets_per_s"] / h["n"] for h in hosts), default=0.0)
    entry = entry_bytes()

    def round_s(n: int) -> float:  # a restart's round: N(N+1)/2 compare-and-sets of the state
        return n * (n + 1) / 2 * _at(state_fit, n) / state_bw

    rows = []
    for n in NODES:
        state = _at(state_fit, n)
        req = n * per_node_req
        rows.append(
            {
                "nodes": n,
                "ranks": n * RANKS_PER_NODE,
                "state_kib": state / 1024,
                "steady_req_per_s": req,
                "steady_mib_per_s": n * state / 2**20,
                "store_busy": req / ops if ops else None,
                "rdzv_cas": n * (n + 1) / 2,
                "rdzv_s": round_s(n),
                "mesh_all_mib": n * n * entry / 2**20,
                "mesh_group_mib": n * min(n, 8) * entry / 2**20,
                "detect_s": detect,
            }
        )
    first = next((n for n in range(2, 100_000) if round_s(n) > 10.0), None)
    return {
        "first_over_10s": first,
        "state_fit": state_fit,
        "state_bw": state_bw,
        "per_node_req": per_node_req,
        "entry_bytes": entry,
        "rows": rows,
    }


def render(
    rdzv: dict[int, tuple[float, int, int]],
    stock: dict[int, tuple[float, int, int]],
    store_ops: float,
    m: dict[str, Any],
    load: str,
    reused: str = "",
) -> str:
    """The section of docs/benchmarks.md (``reused``: when the handlers and the store were
    measured, if this run modelled from an earlier run's figures)."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    start, end = _render.markers(SECTION)
    c0, c1 = m["state_fit"]
    lines = [
        start,
        "## Scale model: 1,000 nodes from the figures measured here",
        "",
        f"`python bench/scale_model.py --scale-json <bench/scale.py's> --measured <an earlier "
        f"run's>` (modelled {when}; the handlers and the store measured {reused})."
        if reused
        else f"`python bench/scale_model.py` ({when}; {load}).",
        "",
        "Measured: N of torch elastic's c10d rendezvous handlers (threads of one process, "
        "each its own TCPStore client) joining one round on one TCPStore, as ftmem-launch "
        "joins at a restart and as elastic's first join; the state reads and compare-and-sets "
        "they made; the store's `get` throughput (4 client processes, a value of the "
        "1,000-node state's size). The handlers share one process and its lock: the wall "
        "times are this harness's, and they inflate the poll counts (a slow round is polled "
        "more).",
        "",
        "| handlers | ftmem's join: round formed (s) | its state reads + writes | elastic's "
        "first join (s) | its reads + writes | round state (KiB) |",
        "|---|---|---|---|---|---|",
    ]
    for n in sorted(rdzv):
        old = stock.get(n)
        lines.append(
            f"| {n} | {rdzv[n][0]:.2f} | {rdzv[n][2]:,} | "
            f"{'-' if old is None else f'{old[0]:.2f}'} | "
            f"{'-' if old is None else f'{old[2]:,}'} | {rdzv[n][1] / 1024:.1f} |"
        )
    lines += [
        "",
        f"Store throughput: {store_ops:,.0f} `get`s per second. One peer-mesh entry: "
        f"{m['entry_bytes']} bytes. Steady store requests per node: "
        f"{m['per_node_req']:.1f}/s (packets into the store's port per agent while "
        f"training, `bench/scale.py`, at most one request each). Round state: "
        f"{c0:.0f} + {c1:.0f} x N bytes (a line through the measured sizes).",
        "",
        "A restart's round, all N nodes joining at once: every join is a compare-and-set of "
        "the whole state; of the nodes that set at once one wins and the others retry at once "
        "with the state it wrote, so the round costs N(N+1)/2 compare-and-sets of the state, "
        "served one after the other by the store: N(N+1)/2 x state / (the store's `get`s per "
        f"second x the 1,000-node state: {m['state_bw'] / 2**30:.2f} GiB/s), a lower bound "
        "on the store's time (a compare-and-set carries the state twice).",
        "",
        "| nodes | ranks | state (KiB) | steady store requests/s | store busy | every agent "
        "re-reading the state once a second (MiB/s) | a restart's round: compare-and-sets | "
        "its store time (s) | peer-mesh entries read per generation, every node's "
        "(before) / the group's (MiB) | silent loss -> declared (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in m["rows"]:
        busy = "-" if r["store_busy"] is None else f"{r['store_busy']:.0%}"
        det = "-" if r["detect_s"] is None else f"{r['detect_s']:.2f}"
        lines.append(
            f"| {r['nodes']:,} | {r['ranks']:,} | {r['state_kib']:.1f} | "
            f"{r['steady_req_per_s']:,.0f} | {busy} | {r['steady_mib_per_s']:.1f} | "
            f"{r['rdzv_cas']:,.0f} | {r['rdzv_s']:.2f} | "
            f"{r['mesh_all_mib']:.1f} / {r['mesh_group_mib']:.2f} | {det} |"
        )
    lines += [
        "",
        f"The first part of a machine-loss recovery to pass 10 s: the restart's rendezvous round "
        f"on one store, at about {m['first_over_10s']:,} nodes (the formula above). Per node, "
        "what `bench/scale.py` measured stays flat (detection, the group's sync and rebuild, "
        "protection traffic): they do not grow with N.",
        end,
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure, model, print; write the section unless told not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale-json", type=Path, default=None, help="bench/scale.py --json output")
    p.add_argument("--rendezvous", default="16,32,64", help="handler counts (ftmem's join)")
    p.add_argument("--stock", default="16,32,64", help="handler counts (elastic's first join)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument(
        "--measured", type=Path, default=None, help="model from this --json of an earlier run"
    )
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    scale = json.loads(args.scale_json.read_text()) if args.scale_json else {}
    load0 = os.getloadavg()[0]
    rdzv, stock = {}, {}
    if args.measured is not None:
        doc = json.loads(args.measured.read_text())
        rdzv = {int(k): tuple(v) for k, v in doc["rendezvous"].items()}
        stock = {int(k): tuple(v) for k, v in doc["stock"].items()}
        args.rendezvous = args.stock = ""
    for n in (int(x) for x in args.rendezvous.split(",") if x):
        rdzv[n] = rendezvous(n, quick=True)
        print(f"rendezvous {n}: {rdzv[n]}", flush=True)
    for n in (int(x) for x in args.stock.split(",") if x):
        stock[n] = rendezvous(n, quick=False)
        print(f"elastic's rendezvous {n}: {stock[n]}", flush=True)
    coef = _fit([float(n) for n in rdzv], [float(v[1]) for v in rdzv.values()], 1)
    ops = doc["store_ops"] if args.measured else store_throughput(int(_at(coef, 1000)))
    print(f"store: {ops:,.0f} get/s", flush=True)
    m = model(scale, rdzv, ops)
    load = f"1-minute load {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    measured_at = f"{datetime.datetime.now():%Y-%m-%d %H:%M}; {load}"
    if args.measured is not None:
        measured_at = doc.get("measured_at", "in an earlier run")
    text = render(rdzv, stock, ops, m, load, measured_at if args.measured else "")
    print(text)
    if args.json:
        doc = {"rendezvous": rdzv, "stock": stock, "store_ops": ops, **m}
        doc["measured_at"] = measured_at
        args.json.write_text(json.dumps(doc, indent=1))
    if not args.no_write:
        _render.write_section(DOC, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
