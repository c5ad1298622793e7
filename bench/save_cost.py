"""Save cost: the CPU of every ftmem thread and process per steady-state save, against a memcpy.

    python -m bench.save_cost --quick                   # this checkout (a few minutes)
    python -m bench.save_cost                           # + 2 GiB "first snapshot safe", 50 saves
    python -m bench.save_cost --quick --tree /tmp/ftmem-base   # before (the tree), after (here)
    python -m bench.save_cost --quick --no-self --tree /tmp/ftmem-base --no-write
    python -m bench.save_cost --smoke --no-write        # tiny states, 3 saves: does it run

Each checkout (``--tree PATH``, repeatable, then this one unless ``--no-self``) is measured in
worker processes (this file with ``--_worker``, one per state, the checkouts taking turns state
by state) whose ``ftmem`` and SMP come from that checkout (PYTHONPATH), each state beside an SMP
of its own; the bench code is this checkout's in every worker, so the figures of one run
compare. States: ``small`` (~30 MiB in 120 tensors: 15
``Linear(418, 418)`` + AdamW, the size of the example's model), ``many`` (the same bytes in 5000
tensors), ``large`` (~1 GiB in 40 tensors) and, in the full profile, ``first`` (~2 GiB: the
time from a new ``Checkpointer`` to its first snapshot verified by the SMP).

Per steady-state save (after warm-up saves; each save waited for until committed, then until
the SMP verified it, polling STATUS, so that the next save finds a free slot as it does when a
training step outlasts the checksum): CPU of the training thread inside ``save()``
(``time.thread_time``), of the rank's ftmem threads (``ftmem-copy``; Linux per-thread CPU
clocks), of the rank's other threads (ZeroMQ I/O: process CPU less its main thread and ftmem
threads), of the SMP process (all its threads and live children); the polls' CPU on both
sides (measured per STATUS beforehand) taken off;
a memcpy of the same tensors (``copy_`` into touched preallocated tensors, one torch thread)
for the ratio; ``save()``'s wall time and the slope per tensor (``many`` against ``small``);
the messages the rank sent to the SMP (counted by wrapping the client's encoder in the worker:
the bench's own STATUS requests left out); ``Checkpointer.load`` into a fresh state. Section
``bench:save-cost`` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/save_cost.py

from bench import _results  # no ftmem at import: a worker picks its checkout's first
from bench import _stats as st
from bench._figures import Goal, le, table
from bench._stats import GiB, MiB, fmt

logger = logging.getLogger("bench.save_cost")

PART = "save-cost"
TITLE = "Save cost: CPU of every ftmem thread and process per save, against a memcpy"
REPO = Path(__file__).resolve().parents[1]
WORKER_FLAG = "--_worker"
RUN_PREFIX = "bssc"  # run ids: "bs" so the smoke test's leak check covers them
SELF = "this checkout"


@dataclass(frozen=True)
class StateSpec:
    """One benchmark state: ``layers`` square ``nn.Linear(width, width)`` + AdamW."""

    name: str
    width: int
    layers: int
    saves: int

    def as_dict(self) -> dict[str, Any]:
        """The spec as plain data (the worker's plan)."""
        return {"name": self.name, "width": self.width, "layers": self.layers, "saves": self.saves}


def width_for(gib: float, layers: int) -> int:
    """The width of ``layers`` square layers (with bias) + AdamW moments of ~``gib`` GiB."""
    return max(8, round((gib * GiB / 12 / layers) ** 0.5))


def plan_of(args: argparse.Namespace) -> dict[str, Any]:
    """What a worker measures: the states, the repeats, the waits (``args``: the command line)."""
    smoke, quick = args.profile == "smoke", args.profile == "quick"
    saves = args.saves or (3 if smoke else 20 if quick else 50)
    large_saves = args.saves or (3 if smoke else 10 if quick else 50)
    if smoke:
        states = [StateSpec("small", 32, 4, saves), StateSpec("many", 8, 50, saves)]
    else:
        states = [StateSpec("small", 418, 15, saves), StateSpec("many", 64, 625, saves)]
        if args.large_gib > 0:
            states.append(StateSpec("large", width_for(args.large_gib, 5), 5, large_saves))
    first_gib = 0.0 if smoke or quick else args.first_gib
    first = StateSpec("first", width_for(first_gib, 10), 10, 1) if first_gib > 0 else None
    return {
        "states": [s.as_dict() for s in states],
        "first": first.as_dict() if first else None,
        "warmup": args.warmup if args.warmup is not None else (1 if smoke else 3 if quick else 5),
        "repeats": args.repeats or (2 if smoke else 5 if quick else 10),
        "gap_s": args.gap_ms / 1e3,
        "slots": args.slots,
        "hash_threads": args.hash_threads,
        "wait_timeout": args.wait_timeout,
        "idle_s": 0.2 if smoke else 1.0,
    }


# ----------------------------------------------------------------------------- the results


@dataclass(kw_only=True)
class StateResult:
    """What a worker measured on one state (seconds; CPU totals over the saves' window)."""

    name: str
    shape: str = ""
    nbytes: int = 0
    tensors: int = 0
    saves: int = 0
    committed: int = 0
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    save_wall: list[float] = field(default_factory=list)  # each save() call
    train_cpu: list[float] = field(default_factory=list)  # the training thread in each save()
    ftmem_threads_cpu: dict[str, float] = field(default_factory=dict)  # by thread name
    rank_other_cpu: float = 0.0  # the rank process less its main thread, ftmem threads, polls
    main_outside_cpu: float = 0.0  # the main thread outside save() (waits, loop): not counted
    smp_cpu_raw: float = 0.0  # the SMP, saves' start to the last one verified
    smp_status_cpu: float = 0.0  # the SMP's CPU for the verification waits' STATUS polls
    rank_status_cpu: float = 0.0  # the rank's (ZeroMQ I/O) for them: off rank_other_cpu
    unverified: int = 0  # committed saves the SMP did not verify within the wait
    smp_idle_cpu_per_s: float = 0.0  # the SMP's CPU per second with nothing to do
    window_s: float = 0.0
    verified: bool | None = None
    polls: int = 0
    threads: dict[str, float] = field(default_factory=dict)  # CPU by process:thread (/proc ticks)
    messages: dict[str, int] = field(default_factory=dict)  # frames sent by type, over the saves
    message_bytes: int = 0
    message_hook: str = ""
    memcpy_cpu: list[float] = field(default_factory=list)
    memcpy_wall: list[float] = field(default_factory=list)
    warmup: list[dict[str, Any]] = field(default_factory=list)  # save_and_wait of each warm-up
    restore_wall: list[float] = field(default_factory=list)
    restore_cpu: list[float] = field(default_factory=list)
    restore_step: list[int] = field(default_factory=list)
    restore_check: str = ""
    first: dict[str, Any] = field(default_factory=dict)  # the "first snapshot safe" figures
    notes: list[str] = field(default_factory=list)
    error: str = ""


@dataclass(kw_only=True)
class TreeResult:
    """One checkout's figures."""

    label: str
    path: str
    commit: str = ""
    modified: list[str] = field(default_factory=list)  # files under ftmem/ changed since HEAD
    ftmem_file: str = ""  # where the worker's ftmem came from (checked against ``path``)
    states: list[StateResult] = field(default_factory=list)
    first: StateResult | None = None
    wall_s: float = 0.0  # its workers' wall time
    load: list[float] = field(default_factory=list)  # 1-minute load at each worker's start, end
    error: str = ""
    log_tail: str = ""


@dataclass(kw_only=True)
class SaveCostResult(_results.PartResult):
    """The save-cost part's results."""

    profile: str
    plan: dict[str, Any]
    loadavg_start: list[float] = field(default_factory=list)  # os.getloadavg(): 1, 5, 15 min
    loadavg_end: list[float] = field(default_factory=list)
    trees: list[TreeResult] = field(default_factory=list)


# ------------------------------------------------------------------------ the worker's tools


def thread_cpu(tid: int) -> float | None:
    """CPU seconds of thread ``tid`` of this process (Linux per-thread CPU clock, ns
    resolution); None if the thread is gone."""
    try:
        return time.clock_gettime((~tid << 3) | 6)  # MAKE_THREAD_CPUCLOCK(tid, SCHED)
    except OSError:
        return None


def process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads; its live descendants added), from its
    CPU clock (ns resolution), else ``bench._proc.cpu_seconds`` (clock ticks)."""
    import psutil

    from bench import _proc

    try:
        total = time.clock_gettime((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except OSError:
        return _proc.cpu_seconds(pid)
    with contextlib.suppress(psutil.Error):
        for kid in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += sum(kid.cpu_times()[:2])
    return total


def thread_ticks(pid: int, names: dict[int, str] | None = None) -> dict[str, float]:
    """CPU seconds by thread name of process ``pid`` from /proc/<pid>/task/*/stat (clock
    ticks); ``names``: tid -> name where known (Python thread names are not the kernel's)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                comm, rest = text[text.index("(") + 1 : text.rindex(")")], text.rindex(")")
                fields = text[rest + 2 :].split()
                name = (names or {}).get(int(tid), comm)
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def ftmem_threads() -> dict[int, str]:
    """This process's threads whose Python name starts with ``ftmem`` (tid -> name)."""
    return {
        t.native_id: t.name
        for t in threading.enumerate()
        if t.native_id is not None and t.name.startswith("ftmem")
    }


class MessageCounter:
    """Counts the frames this process's SMP clients send, by message type, and their bytes:
    wraps ``ftmem.protocol.smp_client``'s encoder (else ``SmpClient.request``). The bench's own
    STATUS requests are counted apart (``Status``) and left out of the figures."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.nbytes = 0
        self.how = ""
        self._lock = threading.Lock()

    def install(self) -> None:
        """Wrap the client's encoder (or its ``request``)."""
        from ftmem.protocol import smp_client

        counter = self
        enc = getattr(smp_client, "encode", None)
        if callable(enc):

            def encode(payload: Any, *a: Any, **kw: Any) -> Any:
                frame = enc(payload, *a, **kw)
                counter.add(type(payload).__name__, len(frame) if hasattr(frame, "__len__") else 0)
                return frame

            smp_client.encode = encode  # type: ignore[attr-defined]
            self.how = "frames encoded by ftmem.protocol.smp_client (every request sent)"
            return
        req = smp_client.SmpClient.request

        def request(client: Any, payload: Any, *a: Any, **kw: Any) -> Any:
            counter.add(type(payload).__name__, 0)
            return req(client, payload, *a, **kw)

        smp_client.SmpClient.request = request  # type: ignore[method-assign]
        self.how = "SmpClient.request calls (bytes not counted)"

    def add(self, kind: str, nbytes: int) -> None:
        """Count one frame."""
        with self._lock:
            self.counts[kind] += 1
            if kind != "Status":
                self.nbytes += nbytes

    def take(self) -> tuple[dict[str, int], int]:
        """The counts and bytes since the last call (STATUS left out), and reset."""
        with self._lock:
            counts = {k: v for k, v in self.counts.items() if k != "Status"}
            nbytes = self.nbytes
            self.counts.clear()
            self.nbytes = 0
        return counts, nbytes


@contextlib.contextmanager
def tree_smp(run_dir: Path, run_id: str, *, slots: int, extra: list[str], log: Path) -> Iterator:
    """An SMP of this worker's checkout for ``run_dir`` (``bench/_datapath_rank.node_smp``, but
    with this process's PYTHONPATH: that helper puts this bench's checkout first). On exit it is
    stopped (SIGTERM, then SIGKILL, bounded), its descendants SIGKILLed by pid, and the shared
    memory of ``run_id`` removed."""
    import psutil

    from bench import _launch
    from ftmem.smp.spawn import start_smp

    smp = None
    try:
        smp = start_smp(
            run_dir=run_dir,
            run_id=run_id,
            slots=slots,
            log_path=log,
            extra_args=extra,
            parent_pid=os.getpid(),
            start_timeout=timedelta(seconds=120),
        )
        yield smp
    finally:
        if smp is not None:
            kids: list[int] = []
            with contextlib.suppress(psutil.Error):
                kids = [c.pid for c in psutil.Process(smp.pid).children(recursive=True)]
            smp.stop(timeout=timedelta(seconds=15))
            for pid in kids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if left := _launch.remove_shm(run_id):
            logger.warning("removed shared memory the SMP left behind: %s", left)


def build(spec: dict[str, Any], seed: int = 0) -> tuple[dict[str, Any], list[Any]]:
    """The state of ``spec`` (``bench/_baselines.linear_state``): ({"model", "optim"}, its
    tensors: the model's and the optimizer's state dicts')."""
    from bench import _baselines as baselines

    model, optimizer = baselines.linear_state(spec["width"], spec["layers"], seed=seed)
    sd = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    return {"model": model, "optim": optimizer}, baselines.state_tensors(sd)


def memcpy(tensors: list[Any], repeats: int) -> tuple[list[float], list[float]]:
    """``copy_`` of every tensor into a touched preallocated one, after one warm-up: (CPU of
    this thread, wall) seconds per repeat."""
    import torch

    dst = [torch.empty_like(t) for t in tensors]
    for d in dst:
        d.zero_()

    def copy() -> None:
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s)

    copy()
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.thread_time(), time.perf_counter()
        copy()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.thread_time() - c0)
    return cpu, wall


# --------------------------------------------------------------------------- the worker


class Worker:
    """Measures every state of the plan with this process's ftmem; dumps ``out`` after each."""

    def __init__(self, plan: dict[str, Any], result: Path, tmp: Path) -> None:
        self.plan, self.result, self.tmp = plan, result, tmp
        self.out: dict[str, Any] = {"states": [], "first": None, "errors": []}
        self.counter = MessageCounter()
        self.extra = ["--hash-threads", str(plan["hash_threads"])] if plan["hash_threads"] else []

    def dump(self) -> None:
        """Write what was measured so far (tmp + rename)."""
        _results.write_json(self.result, _results.as_dict(self.out))

    def smp(self, name: str) -> Any:
        """A fresh run directory and an SMP for it (:func:`tree_smp`)."""
        run_dir = Path(tempfile.mkdtemp(prefix=f"run-{name}-", dir=self.tmp))
        run_dir.chmod(0o700)
        run_id = f"{RUN_PREFIX}{os.getppid()}x{uuid.uuid4().hex[:8]}"
        log = self.tmp / f"smp-{name}.log"
        return run_dir, tree_smp(
            run_dir, run_id, slots=self.plan["slots"], extra=self.extra, log=log
        )

    def state(self, spec: dict[str, Any]) -> StateResult:
        """Memcpy, warm-up saves, the steady-state saves, the restore, on one state."""
        from bench import _datapath_rank as dr

        p, timeout = self.plan, self.plan["wait_timeout"]
        r = StateResult(name=spec["name"], saves=spec["saves"])
        sd, tensors = build(spec)
        r.shape = f"{spec['layers']} x Linear({spec['width']}, {spec['width']}) + AdamW"
        r.nbytes, r.tensors = sum(t.nbytes for t in tensors), len(tensors)
        logger.info("[%s] %s: %.1f MiB, %d tensors", r.name, r.shape, r.nbytes / MiB, r.tensors)
        r.memcpy_cpu, r.memcpy_wall = memcpy(tensors, p["repeats"])
        run_dir, smp_cm = self.smp(r.name)
        with smp_cm as smp:
            with dr.connect(run_dir) as (ckpt, client):
                step = 0
                for _ in range(max(1, p["warmup"])):
                    step += 1
                    r.warmup.append(dr.save_and_wait(ckpt, sd, step, timeout))
                r.verified = dr.wait_verified(client, ckpt.rank, step, timeout)[0]
                cost = self.status_cost(client, ckpt.rank, smp.pid)
                i0, w0 = process_cpu(smp.pid), time.perf_counter()
                time.sleep(p["idle_s"])
                r.smp_idle_cpu_per_s = (process_cpu(smp.pid) - i0) / (time.perf_counter() - w0)
                step = self.saves(r, ckpt, client, smp.pid, sd, step, cost)
            self.restore(r, run_dir, spec, tensors, step)
        return r

    @staticmethod
    def status_cost(client: Any, rank: int, smp_pid: int, n: int = 40) -> tuple[float, float]:
        """CPU seconds one STATUS request costs the SMP and the rank's threads other than the
        main one (its client's ZeroMQ I/O thread): subtracted for the verification polls."""
        from bench import _datapath_rank as dr

        main = threading.get_native_id()
        s0, r0, m0 = process_cpu(smp_pid), time.process_time(), thread_cpu(main) or 0.0
        for _ in range(n):
            dr.rank_status(client, rank)
        rank_io = (time.process_time() - r0) - ((thread_cpu(main) or 0.0) - m0)
        return (process_cpu(smp_pid) - s0) / n, max(0.0, rank_io) / n

    def saves(
        self,
        r: StateResult,
        ckpt: Any,
        client: Any,
        smp_pid: int,
        sd: Any,
        step: int,
        cost: tuple[float, float],
    ) -> int:
        """The timed saves into ``r``: each waited for until committed and then verified by
        the SMP (polling STATUS: the polls' CPU, ``cost`` each on the SMP and the rank, is
        taken off), then ``gap_s`` of sleep, so that every save finds a free slot as in a
        training loop whose step outlasts the checksum; the newest step committed."""
        from bench import _datapath_rank as dr

        p, timeout = self.plan, self.plan["wait_timeout"]
        threads = ftmem_threads()
        if not threads:
            r.notes.append("no thread named ftmem* found in the rank")
        names = {threading.get_native_id(): "main", **threads}
        pid, main = os.getpid(), threading.get_native_id()
        tick0 = {f"rank:{k}": v for k, v in thread_ticks(pid, names).items()}
        tick0 |= {f"smp:{k}": v for k, v in thread_ticks(smp_pid).items()}
        fth0 = {tid: thread_cpu(tid) or 0.0 for tid in threads}
        rank0, main0 = time.process_time(), thread_cpu(main) or time.thread_time()
        smp0, w0 = process_cpu(smp_pid), time.perf_counter()
        self.counter.take()
        newest = step
        for _ in range(r.saves):
            step += 1
            c0, t0 = time.thread_time(), time.perf_counter()
            h = ckpt.save(sd, step=step)
            r.save_wall.append(time.perf_counter() - t0)
            r.train_cpu.append(time.thread_time() - c0)
            if h.skipped:
                r.skipped += 1
                r.skip_reasons[h.reason] = r.skip_reasons.get(h.reason, 0) + 1
            elif h.wait(timeout=timeout):
                r.committed += 1
                newest = step
                ok, _, _, polls = dr.wait_verified(client, ckpt.rank, step, timeout)
                r.polls += polls
                r.unverified += int(not ok)
            if p["gap_s"]:
                time.sleep(p["gap_s"])
        r.messages, r.message_bytes = self.counter.take()
        r.message_hook = self.counter.how
        rank1, main1 = time.process_time(), thread_cpu(main) or time.thread_time()
        fth1 = {tid: thread_cpu(tid) for tid in threads}
        for tid, name in threads.items():
            if (after := fth1[tid]) is not None:
                r.ftmem_threads_cpu[name] = r.ftmem_threads_cpu.get(name, 0.0) + after - fth0[tid]
        r.main_outside_cpu = (main1 - main0) - sum(r.train_cpu)
        rank_other = (rank1 - rank0) - (main1 - main0) - sum(r.ftmem_threads_cpu.values())
        r.rank_status_cpu = cost[1] * r.polls
        r.rank_other_cpu = rank_other - r.rank_status_cpu
        tick1 = {f"rank:{k}": v for k, v in thread_ticks(pid, names).items()}
        r.smp_cpu_raw, r.window_s = process_cpu(smp_pid) - smp0, time.perf_counter() - w0
        r.smp_status_cpu = cost[0] * r.polls
        r.verified = r.committed > 0 and not r.unverified
        tick1 |= {f"smp:{k}": v for k, v in thread_ticks(smp_pid).items()}
        r.threads = {k: v - tick0.get(k, 0.0) for k, v in tick1.items() if v - tick0.get(k, 0.0)}
        return newest

    @staticmethod
    def restore(
        r: StateResult, run_dir: Path, spec: dict[str, Any], saved: list, step: int
    ) -> None:
        """``Checkpointer.load`` into a fresh state (other values), timed; then compared."""
        import torch

        from bench import _baselines as baselines
        from bench import _datapath_rank as dr

        fresh, _ = build(spec, seed=1)
        with dr.connect(run_dir, client=False) as (ckpt, _):
            for _ in range(max(1, len(r.memcpy_cpu) // 2)):
                c0, w0 = time.thread_time(), time.perf_counter()
                got = ckpt.load(fresh)
                r.restore_wall.append(time.perf_counter() - w0)
                r.restore_cpu.append(time.thread_time() - c0)
                r.restore_step.append(int(got))
        sd = {"model": fresh["model"].state_dict(), "optim": fresh["optim"].state_dict()}
        tensors = baselines.state_tensors(sd)  # after the load: it may replace tensors
        same = len(tensors) == len(saved) and all(
            torch.equal(a, b) for a, b in zip(tensors, saved, strict=True)
        )
        r.restore_check = "ok" if same else "MISMATCH"
        if r.restore_step[-1] < step:
            r.restore_check += f" (step {r.restore_step[-1]}, older than {step})"

    def first(self, spec: dict[str, Any]) -> StateResult:
        """From a new ``Checkpointer`` to its first snapshot verified, on a fresh SMP."""
        import psutil

        from bench import _datapath_rank as dr
        from ftmem.client import Checkpointer
        from ftmem.config import ClientConfig
        from ftmem.protocol.smp_client import SmpClient

        timeout = self.plan["wait_timeout"] * 4
        r = StateResult(name=spec["name"], saves=1)
        r.shape = f"{spec['layers']} x Linear({spec['width']}, {spec['width']}) + AdamW"
        need = (1 + 1.15 * self.plan["slots"]) * spec["layers"] * spec["width"] ** 2 * 12 / GiB
        if (avail := psutil.virtual_memory().available / GiB) < need + 0.5:
            r.error = f"needs ~{need + 0.5:.1f} GiB of free memory, {avail:.1f} GiB available"
            return r
        sd, tensors = build(spec)
        r.nbytes, r.tensors = sum(t.nbytes for t in tensors), len(tensors)
        run_dir, smp_cm = self.smp(r.name)
        t0 = time.perf_counter()
        with smp_cm:
            r.first["smp_start_s"] = time.perf_counter() - t0
            with contextlib.closing(SmpClient(run_dir)) as client:
                t0 = time.perf_counter()
                with contextlib.closing(Checkpointer(ClientConfig(run_dir=run_dir))) as ckpt:
                    r.first["create_s"] = time.perf_counter() - t0
                    one = dr.save_and_wait(ckpt, sd, 1, timeout)
                    t_commit = time.perf_counter() - t0
                    r.first |= {"save_s": one["save_s"], "skipped": one["skipped"]}
                    r.first |= {"reason": one["reason"], "committed": one["committed"]}
                    r.first |= {"committed_s": t_commit, "error": one["error"]}
                    if one["committed"]:
                        v, _, _, polls = dr.wait_verified(client, ckpt.rank, 1, timeout)
                        r.first |= {"verified": v, "verified_s": time.perf_counter() - t0}
                        r.first["polls"] = polls
        return r

    def run(self) -> int:
        """Every state, then the first snapshot; a failed one is recorded, the rest go on."""
        import ftmem

        self.out["ftmem_file"] = ftmem.__file__
        self.counter.install()
        todo: list[tuple[str, Callable[[], StateResult]]] = [
            (s["name"], lambda s=s: self.state(s)) for s in self.plan["states"]
        ]
        if self.plan["first"]:
            todo.append(("first", lambda: self.first(self.plan["first"])))
        for name, measure in todo:
            try:
                res = measure()
            except Exception as exc:  # record it, measure the others
                logger.exception("[%s] failed", name)
                res = StateResult(name=name, error=f"{type(exc).__name__}: {exc}")
            if res.error:
                self.out["errors"].append(f"{name}: {res.error}")
            if name == "first":
                self.out["first"] = _results.as_dict(res)
            else:
                self.out["states"].append(_results.as_dict(res))
            self.dump()
        return 0


def worker_main(argv: list[str]) -> int:
    """The worker (``--_worker --tree PATH --plan FILE --result FILE``): ``ftmem`` from the
    checkout PATH (checked), the bench's code from this one; writes its figures to FILE."""
    p = argparse.ArgumentParser()
    for flag in ("--tree", "--plan", "--result"):
        p.add_argument(flag, type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(name)s: %(message)s")
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))  # before `bench`'s checkout: ftmem from the tree
    import torch

    import ftmem

    if Path(ftmem.__file__).resolve().parents[1] != tree:
        print(f"ftmem imported from {ftmem.__file__}, not from {tree}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    plan = json.loads(args.plan.read_text())
    return Worker(plan, args.result, args.result.parent).run()


# ---------------------------------------------------------------------------- the parent


def git(tree: Path, *args: str) -> str:
    """``git -C tree ARGS`` (read-only, no optional locks), its output; "" on failure."""
    cmd = ["git", "--no-optional-locks", "-C", str(tree), *args]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        return run.stdout.strip() if run.returncode == 0 else ""
    return ""


def remove_leftovers(run_prefix: str) -> list[str]:
    """Shared memory of the run ids starting with ``run_prefix`` that a killed worker left."""
    try:
        from ftmem.config import default_shm_dir
        from ftmem.shm import parse_slot_name
    except Exception:  # this checkout's ftmem does not import (being edited): leave it
        return []
    d, gone = default_shm_dir(), []
    with contextlib.suppress(OSError):
        for name in os.listdir(d):
            parsed = parse_slot_name(name)
            if parsed is not None and parsed.run_id.startswith(run_prefix):
                with contextlib.suppress(OSError):
                    os.unlink(d / name)
                    gone.append(name)
    return gone


def tree_result(tree: Path, label: str) -> TreeResult:
    """An empty result for checkout ``tree``: its commit and its files under ftmem/ that differ
    from that commit."""
    res = TreeResult(label=label, path=str(tree))
    res.commit = git(tree, "rev-parse", "--short", "HEAD")
    status = git(tree, "status", "--porcelain", "--untracked-files=no", "--", "ftmem")
    res.modified = [line[3:] for line in status.splitlines()]
    return res


def run_worker(res: TreeResult, plan: dict[str, Any], timeout: float) -> None:
    """Run the worker on ``res``'s checkout with ``plan`` in a session of its own (SIGKILLed as
    a group, the worker and its SMPs, after ``timeout``); add its figures and errors to ``res``."""
    tree = Path(res.path)
    tmp = Path(tempfile.mkdtemp(prefix="ftmem-bench-sc-"))
    result, log = tmp / "result.json", tmp / "worker.log"
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTMEM_")}
    env |= {"PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), WORKER_FLAG]
    cmd += ["--tree", str(tree), "--plan", str(tmp / "plan.json"), "--result", str(result)]
    t0, error = time.perf_counter(), ""
    res.load.append(os.getloadavg()[0])
    try:
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                cmd, cwd=tmp, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            rc = proc.wait(timeout=timeout)
            error = f"the worker exited with {rc}" if rc else ""
        except subprocess.TimeoutExpired:
            error = f"the worker did not finish within {timeout:.0f} s (killed)"
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its session: the worker and its SMPs
            proc.wait(timeout=30)
        res.wall_s += time.perf_counter() - t0
        res.load.append(os.getloadavg()[0])
        if error:
            res.log_tail = log.read_text(errors="replace")[-2000:]
        if result.exists():
            doc = json.loads(result.read_text())
            res.ftmem_file = doc.get("ftmem_file", "")
            res.states += [StateResult(**s) for s in doc["states"]]
            if doc.get("first"):
                res.first = StateResult(**doc["first"])
            error = "; ".join([*([error] if error else []), *doc.get("errors", [])])
        if error:
            res.error = "; ".join(x for x in (res.error, error) if x)
    finally:
        if left := remove_leftovers(RUN_PREFIX + str(os.getpid()) + "x"):
            logger.warning("removed shared memory a worker left: %s", left)
        shutil.rmtree(tmp, ignore_errors=True)


def get_args_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = _results.parser(__doc__)
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="20 saves (large: 10), no 2 GiB")
    prof.add_argument("--smoke", action="store_true", help="tiny states, 3 saves")
    tree = "another checkout to measure (repeatable), in the order given, before this one"
    p.add_argument("--tree", type=Path, action="append", default=[], help=tree)
    p.add_argument("--no-self", action="store_true", help="measure the --tree checkouts only")
    p.add_argument("--saves", type=int, default=None, help="timed saves per state")
    p.add_argument("--warmup", type=int, default=None, help="warm-up saves (default 5, quick 3)")
    p.add_argument("--repeats", type=int, default=None, help="memcpy repeats (restore: half)")
    p.add_argument("--gap-ms", type=float, default=0.0, help="sleep after each committed save")
    p.add_argument("--large-gib", type=float, default=1.0, help="the large state (0: none)")
    p.add_argument("--first-gib", type=float, default=2.0, help="first snapshot safe (0: none)")
    p.add_argument("--slots", type=int, default=2, help="SMP slots per rank")
    hash_threads = "the SMP's --hash-threads (0: its default)"
    p.add_argument("--hash-threads", type=int, default=0, help=hash_threads)
    wait = "bound on each wait for a commit or a verification (s)"
    p.add_argument("--wait-timeout", type=float, default=120.0, help=wait)
    p.add_argument("--timeout", type=float, default=None, help="one worker: a state (s)")
    return p


def run(argv: list[str]) -> SaveCostResult:
    """Parse ``argv``; measure every checkout."""
    p = get_args_parser()
    args = p.parse_args(argv)
    args.profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    trees = [t.resolve() for t in args.tree] + ([] if args.no_self else [REPO])
    if not trees:
        p.error("nothing to measure: --no-self without --tree")
    for t in trees:
        if not (t / "ftmem" / "__init__.py").is_file():
            p.error(f"{t} holds no ftmem package")
    plan = plan_of(args)
    timeout = args.timeout or {"smoke": 120.0, "quick": 600.0, "full": 1200.0}[args.profile]
    res = SaveCostResult(argv=argv, machine=_results.machine(), profile=args.profile, plan=plan)
    res.loadavg_start = list(os.getloadavg())
    res.trees = [tree_result(t, SELF if t == REPO else str(t)) for t in trees]
    # One worker per state and checkout, the checkouts taking turns state by state: a load
    # that comes and goes on this shared machine then weighs on each checkout alike.
    jobs = [{**plan, "states": [spec], "first": None} for spec in plan["states"]]
    jobs += [{**plan, "states": [], "first": plan["first"]}] if plan["first"] else []
    for job in jobs:
        for tree in res.trees:
            what = job["first"]["name"] if job["first"] else job["states"][0]["name"]
            logger.info("[%s] %s", tree.label, what)
            run_worker(tree, job, timeout)
    res.errors += [f"{t.label}: {t.error}" for t in res.trees if t.error]
    res.loadavg_end = list(os.getloadavg())
    _results.finish(res.machine)
    return res


# --------------------------------------------------------------------------- the figures


def per_save(s: dict[str, Any]) -> dict[str, float | None]:
    """Milliseconds per committed save of each part of the cost, their total, the memcpy and
    the ratio (None where nothing was committed)."""
    n = s["committed"]
    if not n:
        return {}
    smp = s["smp_cpu_raw"] - s["smp_status_cpu"]
    parts = {
        "train": sum(s["train_cpu"]) / n * 1e3,
        "ftmem_threads": sum(s["ftmem_threads_cpu"].values()) / n * 1e3,
        "rank_other": s["rank_other_cpu"] / n * 1e3,
        "smp": smp / n * 1e3,
    }
    total = sum(v for v in parts.values() if v is not None)
    mem = st.median(s["memcpy_cpu"])
    mem_ms = None if mem is None else mem * 1e3
    out: dict[str, float | None] = {**parts, "total": total, "memcpy": mem_ms}
    out["ratio"] = st.ratio(total, mem_ms)
    out["idle_smp"] = s["smp_idle_cpu_per_s"] * s["window_s"] / n * 1e3
    return out


def _budget(name: str, memcpy_ms: float | None) -> tuple[str, float | None]:
    """The goal of a state: its threshold's text and value in ms (None: no goal)."""
    if memcpy_ms is None:
        return "", None
    if name == "small":
        return "<= 1 ms + 2x memcpy", 1.0 + 2 * memcpy_ms
    if name == "large":
        return "<= 1.5x memcpy", 1.5 * memcpy_ms
    return "", None


def slope(tree: dict[str, Any]) -> dict[str, float | None]:
    """Microseconds per tensor beyond ``small``'s (``many`` against ``small``: same bytes):
    of save()'s median wall, the training thread's CPU and the total CPU per save."""
    by = {s["name"]: s for s in tree["states"]}
    a, b = by.get("small"), by.get("many")
    if not a or not b or not a["committed"] or not b["committed"]:
        return {}
    dn = b["tensors"] - a["tensors"]

    def d(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None or not dn else (x - y) / dn * 1e6

    pa, pb = per_save(a), per_save(b)
    return {
        "save_wall": d(st.median(b["save_wall"]), st.median(a["save_wall"])),
        "train_cpu": d(st.median(b["train_cpu"]), st.median(a["train_cpu"])),
        "total_cpu": d((pb["total"] or 0) / 1e3, (pa["total"] or 0) / 1e3),
    }


def _label(t: dict[str, Any]) -> str:
    mod = f", {len(t['modified'])} files of ftmem/ modified" if t["modified"] else ""
    return f"{t['label']} (`{t['commit'] or '?'}`{mod})"


def _ms(x: float | None, spec: str = ".2f") -> str:
    return fmt(x, spec, " ms")


def _ms_of(values: list[float], q: float = 50.0, spec: str = ".3f") -> str:
    """The ``q``-th percentile of seconds, in ms."""
    v = st.percentile(values, q)
    return _ms(None if v is None else v * 1e3, spec)


def _messages(s: dict[str, Any]) -> str:
    n = s["committed"]
    if not n or not s["messages"]:
        return "-"
    kinds = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(s["messages"].items()))
    return f"{sum(s['messages'].values()) / n:.2f} ({kinds}); {s['message_bytes'] / n:,.0f} B"


def _cost_row(name: str, s: dict[str, Any]) -> list[str]:
    c = per_save(s)
    goal, limit = _budget(s["name"], c.get("memcpy"))
    met = le(c.get("total"), limit) if limit is not None else None
    what = f"{s['name']}: {s['nbytes'] / MiB:.1f} MiB, {s['tensors']} tensors"
    parts = [_ms(c.get(k)) for k in ("train", "ftmem_threads", "rank_other", "smp", "total")]
    ratio = fmt(c.get("ratio"), ".2f", "x")
    verdict = {None: "-", True: "**met**", False: "**missed**"}[met]
    counts = f"{s['committed']} ({s['skipped']})"
    return [name, what, counts, *parts, _ms(c.get("memcpy")), ratio, goal or "-", verdict]


def _restore_row(name: str, s: dict[str, Any]) -> list[str]:
    wall, mem = st.median(s["restore_wall"]), st.median(s["memcpy_wall"])
    load = st.stat(st.scale(s["restore_wall"], 1e3), ".2f", " ms")
    ratio = fmt(st.ratio(wall, mem), ".2f", "x")
    cpu, mem_ms = _ms_of(s["restore_cpu"], spec=".2f"), _ms_of(s["memcpy_wall"], spec=".2f")
    return [name, s["name"], load, cpu, mem_ms, ratio, s["restore_check"]]


def _first_row(name: str, f: dict[str, Any]) -> list[str]:
    x = f["first"]
    what = f"{f['nbytes'] / GiB:.2f} GiB, {f['tensors']} tensors"
    keys = ("smp_start_s", "save_s", "committed_s", "verified_s")
    times = [fmt(x.get(k), ".2f", " s") for k in keys]
    return [name, what, *times, str(x.get("skipped", "-")), f["error"] or x.get("error") or "ok"]


COST_HEAD = ["checkout", "state", "saves (skipped)", "train", "ftmem threads", "rank other"]
COST_HEAD += ["SMP", "total", "memcpy", "total / memcpy", "goal", "met"]
WALL_HEAD = ["checkout", "state", "tensors", "median", "p90", "max", "train CPU median"]
RESTORE_HEAD = ["checkout", "state", "load (wall)", "load CPU", "memcpy (wall)", "load / memcpy"]
RESTORE_HEAD += ["check"]
FIRST_HEAD = ["checkout", "state", "SMP start", "in save()", "committed", "verified"]
FIRST_HEAD += ["first save skipped", "status"]


def sections(r: dict[str, Any]) -> dict[str, list[str]]:
    """Section ``save-cost``: per checkout and state the CPU per save, save()'s wall time, the
    messages, the restore, the slope per tensor, the first snapshot; before/after ratios."""
    p, m = r["plan"], r["machine"]
    hashing = (
        f"`--hash-threads {p['hash_threads']}`" if p["hash_threads"] else "its default hashing"
    )

    def avg(key: str) -> str:
        return " / ".join(f"{x:.2f}" for x in r[key]) or "-"

    loads = "; ".join(f"{t['label']}: {st.stat(t['load'])}" for t in r["trees"])
    out = [
        f"- profile `{r['profile']}`: per state {p['warmup']} warm-up saves, then the timed "
        f"saves, each waited for until committed (then {p['gap_s'] * 1e3:g} ms of sleep); one "
        f"torch thread; memcpy: median of {p['repeats']} copies; an SMP of its own per state, "
        f"{p['slots']} slots per rank, {hashing}",
        f"- load average (`os.getloadavg()`, 1 / 5 / 15 min) at start {avg('loadavg_start')}, "
        f"at end {avg('loadavg_end')}; 1-minute at each worker's start and end, per checkout: {loads}. The machine "
        f"has {m['cores']} cores and is shared (other jobs ran meanwhile): the figures are noisy, "
        "compare them within this run only",
        "- each timed save is waited for until committed, then until the SMP verified it "
        "(STATUS polls, whose CPU, measured per request beforehand, is taken off both sides)",
        "- CPU per committed save: the training thread inside `save()`; the rank's ftmem threads "
        "(`ftmem-copy`); the rank's other threads (ZeroMQ I/O); the SMP (every thread and "
        "child); their total; a `copy_` of the same tensors (one thread); total / memcpy",
        "",
    ]
    cost, walls, msgs, restores, slopes, firsts, threads = [], [], [], [], [], [], []
    for t in r["trees"]:
        name = _label(t)
        for s in t["states"]:
            cost.append(_cost_row(name, s))
            w = s["save_wall"]
            walls.append([name, s["name"], s["tensors"], _ms_of(w), _ms_of(w, 90)])
            walls[-1] += [_ms_of(w, 100), _ms_of(s["train_cpu"])]
            msgs.append([name, s["name"], _messages(s), s["message_hook"] or "-"])
            if s["restore_wall"]:
                restores.append(_restore_row(name, s))
            n = max(1, s["committed"])
            split = ", ".join(f"{k} {v / n * 1e3:.1f}" for k, v in sorted(s["threads"].items()))
            threads.append([name, s["name"], split or "-", _ms(per_save(s).get("idle_smp"))])
        sl = slope(t)
        slopes.append([name, *(fmt(sl.get(k), ".2f", " us") for k in SLOPES)])
        if t["first"]:
            firsts.append(_first_row(name, t["first"]))
    out += table(COST_HEAD, cost)
    out += ["`save()` on the training thread, per save (wall; and its CPU):", ""]
    out += table(WALL_HEAD, walls)
    out += ["Slope per tensor (`many` against `small`: the same bytes in more tensors):", ""]
    out += table(["checkout", "save() wall", "train thread CPU", "total CPU"], slopes)
    out += ["Messages the rank sent to the SMP per committed save (by type), and their bytes:", ""]
    out += table(["checkout", "state", "messages per save", "counted as"], msgs)
    if restores:
        out += [
            "Restore: `Checkpointer.load` into a fresh state (one process, no process "
            "group), against the memcpy's wall time:",
            "",
        ]
        out += table(RESTORE_HEAD, restores)
    if firsts:
        out += [
            "First snapshot safe: seconds from a new `Checkpointer` (the SMP started "
            "before, its start apart) through `save()` (skipped while the SMP allocates "
            "the slots; `wait()` then saves it again) to committed and to verified:",
            "",
        ]
        out += table(FIRST_HEAD, firsts)
    if len(r["trees"]) > 1:
        out += compare(r)
    out += [
        "<details><summary>CPU by process and thread in ms per save (/proc clock ticks, "
        "10 ms over the whole window), and the SMP's idle CPU over the window</summary>",
        "",
    ]
    out += table(["checkout", "state", "process:thread", "SMP idle"], threads)
    out += ["</details>", ""]
    return {PART: out}


SLOPES = ("save_wall", "train_cpu", "total_cpu")


def compare(r: dict[str, Any]) -> list[str]:
    """Each checkout's figures as ratios to the first one's (before/after in one run)."""
    first, rows = r["trees"][0], []
    base = {s["name"]: s for s in first["states"]}

    def msgs(s: dict[str, Any]) -> float:
        return sum(s["messages"].values()) / max(1, s["committed"])

    for t in r["trees"][1:]:
        for s in t["states"]:
            if (b := base.get(s["name"])) is None:
                continue
            pa, pb = per_save(s), per_save(b)
            ratios = [st.ratio(pa.get(k), pb.get(k)) for k in ("total", "train", "smp")]
            ratios.append(st.ratio(st.median(s["save_wall"]), st.median(b["save_wall"])))
            ratios.append(st.ratio(msgs(s), msgs(b)))
            rows.append([_label(t), s["name"], *(fmt(x, ".2f", "x") for x in ratios)])
    head = ["checkout", "state", "total CPU", "train CPU", "SMP CPU", "save() median", "messages"]
    return [f"Against {_label(first)} (ratios; below 1: less):", "", *table(head, rows)]


def goals(r: dict[str, Any] | None) -> list[Goal]:
    """Per checkout: CPU per save of ``small`` <= 1 ms + 2x memcpy, of ``large`` <= 1.5x."""
    out = []
    for t in (r or {}).get("trees", []):
        for s in t["states"]:
            c = per_save(s)
            goal, limit = _budget(s["name"], c.get("memcpy"))
            if limit is None:
                continue
            measured = (
                f"{_ms(c['total'])} vs memcpy {_ms(c['memcpy'])} ({fmt(c['ratio'], '.2f', 'x')})"
            )
            what = f"CPU per save, every ftmem thread and process ({s['name']})"
            out.append(Goal(PART, what, goal, measured, le(c["total"], limit), _label(t)))
    return out


def render(doc: dict[str, Any]) -> str:
    """The section with its markers, head (command, machine), goals and errors."""
    from bench import _render

    body = sections(doc["result"])[PART]
    rows = goals(doc["result"])
    tail = _render.goal_table(rows, "### Goals") if rows else []
    tail += [f"- FAILED: {e}" for e in doc["result"].get("errors", [])]
    lines = [*_render.head(PART, TITLE, doc), *body, *tail, "", _render.markers(PART)[1]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure, write the JSON (``--json``), print the section and write it into ``--out``
    (``bench/_render.write_section``) unless ``--no-write``; 1 if anything failed."""
    from bench import _render

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _render._on_sigterm)
    argv = sys.argv[1:] if argv is None else argv
    result = run(argv)
    ns = get_args_parser().parse_args(argv)
    doc = _results.document(PART, result)
    if ns.json is not None:
        _results.write_json(ns.json, doc)
        print(f"# wrote {ns.json}", file=sys.stderr)
    text = render(doc)
    print(text)
    if not ns.no_write:
        _render.write_section(ns.out, PART, text)
        print(f"# wrote {ns.out} ({PART})", file=sys.stderr)
    return 1 if doc["result"].get("errors") else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER_FLAG]:
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit(main())
