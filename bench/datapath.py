"""Data path benchmark: every CPU cycle a snapshot costs, its stall, time to safe and restore.

Usage (from the repository root; ftmem importable, e.g. ``pip install -e .``):

    python bench/datapath.py --smoke --out /tmp/dp.md  # 8 MiB state, K=3: does it run (< 1 min)
    python bench/datapath.py --quick                   # 0.25 and 1 GiB, K=8 (a few minutes)
    python bench/datapath.py                           # 0.5, 2 and 4 GiB (4 if memory allows)
    python bench/datapath.py --sizes 1 --saves 12 --compute-ms 100 --no-write

Per state size, in ONE run, on ONE state (square ``nn.Linear`` layers + AdamW's moments, fp32,
built as ``bench/_baselines.build_state`` does) and in one process tree:

* this process starts an SMP (``python -m ftmem.smp``, READY handshake; ``--hash-threads N``
  when that SMP lists the flag) and a rank in a child process (one process, no process group);
* the rank times one memcpy of the state's bytes (``dst.copy_(src)`` into memory touched
  before, one thread: wall and CPU seconds), then ``Checkpointer().save(state, step)`` +
  ``handle.wait()`` once (the first save: it sizes the slots) and K more times; after the
  last one it waits until the SMP reports the step verified (STATUS ``newest_verified``; an
  SMP without that key verifies nothing, the rank hashed what it copied);
* CPU-seconds of those K saves: the rank process (``time.process_time``: every thread, the
  copy thread and ZeroMQ's included; read around the K save/wait calls, the loop does nothing
  else) and the SMP process with its children (psutil ``cpu_times``, until verified), per
  snapshotted GiB, beside the memcpy's;
* restore: ``Checkpointer().load(state)`` in place, from a fresh Checkpointer;
* skips: K every-step saves without waiting on the handle, back to back and with a compute
  stand-in of T ms between them;
* ``dcp.async_save`` with one reused ``DefaultStager`` (async staging) on the same state:
  blocking time per save, and the process's CPU-seconds per GiB over K saves (each waited for).

Before the sizes it measures the hash functions a checksum could use (python-xxhash xxh3_64,
xxh3_128, xxh64, zlib.crc32, hashlib.blake2b) on a 256 MiB buffer, one thread, beside a memcpy.
The section goes between ``<!-- bench:datapath:start -->`` and ``<!-- bench:datapath:end -->``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch

try:
    from bench import _baselines as baselines
    from bench import _launch, _report
except ImportError:  # run as a script: bench/ is sys.path[0]
    import _baselines as baselines  # type: ignore[no-redef]
    import _launch  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]

logger = logging.getLogger("bench.datapath")

SECTION = "datapath"
START_MARK, END_MARK = _report.markers(SECTION)
GiB = 1 << 30
MiB = 1 << 20

# The goals (issue 13, part 5).
CPU_RATIO_GOAL = 2.0
"""Rank + SMP CPU-seconds per snapshotted GiB, at most this many memcpys of the same bytes."""
STALL_GOAL_BASE_S = 0.001
STALL_GOAL_S_PER_GIB = 0.005
"""The time in ``save()`` (the first save included) at most 1 ms + 0.005 s per GiB."""
RESTORE_GOAL_S_PER_GIB = 0.1

HASH_CHUNK = 2 * MiB
"""Piece size of the hash table's updates (the client's copy moves 2 MiB pieces)."""
VERIFY_POLL_MIN_S = 0.005
VERIFY_POLL_MAX_S = 0.05
"""STATUS poll intervals while waiting for the SMP to verify (each poll costs both sides CPU)."""

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {
        "sizes": "0.0078125",
        "saves": 3,
        "repeats": 1,
        "compute_ms": 20.0,
        "hash_mib": 16,
        "idle_s": 0.2,
    },
    "quick": {
        "sizes": "0.25,1",
        "saves": 8,
        "repeats": 3,
        "compute_ms": 100.0,
        "hash_mib": 256,
        "idle_s": 1.0,
    },
    "full": {
        "sizes": "0.5,2,4",
        "saves": 8,
        "repeats": 3,
        "compute_ms": 100.0,
        "hash_mib": 256,
        "idle_s": 2.0,
    },
}


# --------------------------------------------------------------------------- shared helpers


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its descendants.

    All threads of each process, the children it has reaped (``children_user/system``) and
    the live descendants. 0.0 if the process is gone. Resolution: the kernel's clock tick.
    """
    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        kids = proc.children(recursive=True)
    except psutil.Error:
        return 0.0
    for kid in kids:
        with contextlib.suppress(psutil.Error):
            k = kid.cpu_times()
            total += k.user + k.system
    return float(total)


def smp_help() -> str:
    """The SMP's ``--help`` text ("" if it could not be read)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ftmem.smp", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            env=_launch.job_env(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout


def smp_extra_args(hash_threads: int | None, help_text: str) -> tuple[list[str], str]:
    """SMP arguments for ``hash_threads`` (if the SMP lists the flag) and a note saying so."""
    if "--hash-threads" not in help_text:
        return [], "`--hash-threads` not offered by this SMP (it does not hash: the rank does)"
    if hash_threads is None:
        return [], "`--hash-threads` offered by this SMP, left at its default"
    return ["--hash-threads", str(hash_threads)], f"`--hash-threads {hash_threads}`"


@contextlib.contextmanager
def node_smp(
    run_dir: Path, *, slots: int, extra_args: list[str], log_path: Path
) -> Iterator[tuple[Any, str]]:
    """Start an SMP for ``run_dir`` (its own run id); yield (SmpProcess, run id).

    Resource handling: on exit the SMP gets SIGTERM, then SIGKILL (by pid, bounded waits,
    ``SmpProcess.stop``); its descendants still alive are SIGKILLed by pid and its /dev/shm
    files removed by run id (``bench/_launch.remove_shm``).
    """
    from ftmem.smp.spawn import start_smp

    run_id = "bsdp" + uuid.uuid4().hex[:10]  # "bs": the smoke test's leak check covers it
    smp = None
    try:
        smp = start_smp(
            run_dir=run_dir,
            run_id=run_id,
            slots=slots,
            parent_pid=os.getpid(),
            env=_launch.job_env(),
            log_path=log_path,
            extra_args=extra_args,
            start_timeout=timedelta(seconds=120),
        )
        yield smp, run_id
    finally:
        if smp is not None:
            kids: list[int] = []
            with contextlib.suppress(psutil.Error):
                kids = [c.pid for c in psutil.Process(smp.pid).children(recursive=True)]
            smp.stop(timeout=timedelta(seconds=15))
            for pid in kids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        left = _launch.remove_shm(run_id)
        if left:
            logger.warning("removed shared memory the SMP left behind: %s", left)


def rank_status(client: Any, rank: int) -> dict[str, Any]:
    """The SMP's STATUS entry of ``rank`` ({} if it has none)."""
    return dict((client.status().get("ranks") or {}).get(str(rank)) or {})


def wait_verified(
    client: Any, rank: int, step: int, timeout: float
) -> tuple[bool | None, float, dict[str, Any], int]:
    """Wait until the SMP reports ``step`` (or a newer one) of ``rank`` verified.

    Returns (verified, seconds waited, the rank's last STATUS entry, STATUS requests made);
    verified is None when the SMP reports no ``newest_verified`` (it verifies nothing: the
    rank hashed, the commit is the end), False when ``timeout`` passed first. Polls every
    5 ms at first, backing off to 50 ms (each STATUS costs the SMP some CPU).
    """
    t0 = time.perf_counter()
    polls = 0
    pause = VERIFY_POLL_MIN_S
    while True:
        st = rank_status(client, rank)
        polls += 1
        if "newest_verified" not in st:
            return None, time.perf_counter() - t0, st, polls
        newest = st.get("newest_verified")
        if newest is not None and int(newest) >= step:
            return True, time.perf_counter() - t0, st, polls
        if time.perf_counter() - t0 > timeout:
            return False, time.perf_counter() - t0, st, polls
        time.sleep(pause)
        pause = min(VERIFY_POLL_MAX_S, pause * 1.5)


def save_and_wait(ckpt: Any, state: Any, step: int, timeout: float) -> dict[str, Any]:
    """``ckpt.save(state, step)``, then wait until that step is committed.

    A save that was not skipped: ``handle.wait()``. A skipped one: ``ckpt.wait()``, which
    (in a client that keeps the skipped newest step) saves it again, waiting for a slot; in
    one that does not, the step stays uncommitted. Returns save_s (time in ``save()``),
    safe_s (``save()`` call to committed), skipped, reason, committed, error.
    """
    from ftmem.errors import FtmemError

    out: dict[str, Any] = {"committed": False, "error": ""}
    t0 = time.perf_counter()
    h = ckpt.save(state, step=step)
    out["save_s"] = time.perf_counter() - t0
    out["skipped"], out["reason"] = bool(h.skipped), h.reason
    try:
        if not h.skipped:
            out["committed"] = bool(h.wait(timeout=timeout))
        else:
            ok = ckpt.wait(timeout=timeout)
            out["committed"] = bool(ok) and ckpt.stats().get("last_step") == step
    except (TimeoutError, FtmemError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["safe_s"] = time.perf_counter() - t0
    return out


def _delta(after: Any, before: Any) -> Any:
    """``after - before`` for counts and dicts of counts (None if either is missing)."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        d = {k: int(v) - int(before.get(k) or 0) for k, v in after.items()}
        return {k: v for k, v in d.items() if v}
    if isinstance(after, int | float) and isinstance(before, int | float):
        return after - before
    return None


def compute_stand_in(ms: float) -> Callable[[], None]:
    """A forward/backward stand-in: ``ms`` milliseconds of 256x256 matmuls on this thread."""
    a = torch.randn(256, 256) / 16

    def compute() -> None:
        x = a
        deadline = time.perf_counter() + ms / 1e3
        while time.perf_counter() < deadline:
            x = torch.tanh(x @ a)

    return compute


def build_state(size_gib: float, *, seed: int = 0) -> baselines.BenchState:
    """The benchmark state of ``bench/_baselines.build_state``, with narrower layers for tiny
    sizes (there, a state is at least one 2048-wide layer, 48 MiB)."""
    param_bytes = size_gib * GiB / 3
    if param_bytes >= 16 * MiB:
        return baselines.build_state(size_gib, seed=seed)
    width = next((w for w in (1024, 512, 256, 128) if 2 * w * w * 4 <= param_bytes), 64)
    n_layers = max(1, round(param_bytes / (width * width * 4)))
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        layer = torch.nn.Linear(width, width)
        with torch.no_grad():
            layer.weight.normal_(0.0, 0.02, generator=gen)
            layer.bias.zero_()
        layers.append(layer)
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = baselines.BenchState(model=model, optimizer=optimizer, nbytes=0)
    state.nbytes = baselines.tensor_bytes(state.state_dicts())
    return state


def state_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor nested in dicts/lists/tuples of ``obj``, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in state_tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in state_tensors(v)]
    return []


def memcpy_into(dst: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the bytes of ``tensors`` one after the other into the flat uint8 ``dst``."""
    off = 0
    for t in tensors:
        n = t.nbytes
        dst[off : off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        off += n


# --------------------------------------------------------------------------- hash table


def bench_hashes(mib: int, repeats: int) -> list[dict[str, Any]]:
    """CPU and wall seconds of each hash function over ``mib`` MiB, beside a memcpy of it.

    One thread (this one), ``HASH_CHUNK`` updates; median over ``repeats``. Rows:
    {name, wall, cpu, bytes} (lists of seconds).
    """
    import xxhash

    n = mib * MiB
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.empty(n, dtype=torch.uint8).random_(0, 256)
        dst = torch.zeros(n, dtype=torch.uint8)  # touched
        view = memoryview(src.numpy()).cast("B")  # type: ignore[arg-type]

        def streaming(new: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                h = new()
                for i in range(0, n, HASH_CHUNK):
                    h.update(view[i : i + HASH_CHUNK])
                return h.digest()

            return run

        def crc32() -> int:
            c = 0
            for i in range(0, n, HASH_CHUNK):
                c = zlib.crc32(view[i : i + HASH_CHUNK], c)
            return c

        cases: list[tuple[str, Callable[[], Any]]] = [
            ("memcpy (`dst.copy_(src)`, touched dst)", lambda: dst.copy_(src)),
            ("xxhash.xxh3_64", streaming(xxhash.xxh3_64)),
            ("xxhash.xxh3_128", streaming(xxhash.xxh3_128)),
            ("xxhash.xxh64", streaming(xxhash.xxh64)),
            ("zlib.crc32", crc32),
            ("hashlib.blake2b", streaming(hashlib.blake2b)),
        ]
        rows: list[dict[str, Any]] = []
        for name, fn in cases:
            row: dict[str, Any] = {"name": name, "wall": [], "cpu": [], "bytes": n}
            fn()  # warm-up (caches, lazy initialisation)
            for _ in range(repeats):
                c0, w0 = time.process_time(), time.perf_counter()
                fn()
                row["cpu"].append(time.process_time() - c0)
                row["wall"].append(time.perf_counter() - w0)
            rows.append(row)
        return rows
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the rank (child)


def _rank_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datapath.py --_rank", description="the benchmark's rank")
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--smp-pid", type=int, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--saves", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--compute-ms", type=float, required=True)
    p.add_argument("--dcp-saves", type=int, required=True)
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--idle-s", type=float, default=1.0)
    p.add_argument("--loose-frac", type=float, default=0.0)
    p.add_argument("--wait-timeout", type=float, default=300.0)
    p.add_argument("--skip-dcp", action="store_true")
    return p


@dataclass
class _Rank:
    """What the rank process measures, phase by phase, into ``res`` (dumped after each)."""

    args: argparse.Namespace
    res: dict[str, Any] = field(default_factory=lambda: {"errors": []})
    st: dict[str, Any] = field(default_factory=dict)
    state: Any = None
    nbytes: int = 0
    step: int = 0

    def dump(self) -> None:
        tmp = self.args.result.with_name(self.args.result.name + ".tmp")
        tmp.write_text(json.dumps(self.res, default=str))
        os.replace(tmp, self.args.result)

    def smp_cpu(self) -> float:
        return cpu_seconds(self.args.smp_pid)

    # -- phases ----------------------------------------------------------------------------
    def build(self) -> None:
        a = self.args
        t0 = time.perf_counter()
        self.state = build_state(a.size_gib)
        self.st = {"model": self.state.model, "optim": self.state.optimizer}
        if a.loose_frac > 0:
            total = self.state.nbytes / (1 - a.loose_frac)
            each = max(1, int(total * a.loose_frac / 4 / 4))
            self.st["buffers"] = {f"b{i}": torch.randn(each) for i in range(4)}
        sd = {"model": self.state.model.state_dict(), "optim": self.state.optimizer.state_dict()}
        if "buffers" in self.st:
            sd["buffers"] = self.st["buffers"]
        tensors = state_tensors(sd)
        self.nbytes = sum(t.nbytes for t in tensors)
        self.res.update(
            nbytes=self.nbytes,
            tensors=len(tensors),
            loose_bytes=sum(t.nbytes for t in state_tensors(self.st.get("buffers", {}))),
            layers=len(self.state.model),
            width=self.state.model[0].in_features,
            build_s=time.perf_counter() - t0,
            torch_threads=torch.get_num_threads(),
            pid=os.getpid(),
        )

    def memcpy(self) -> None:
        sd = {"model": self.state.model.state_dict(), "optim": self.state.optimizer.state_dict()}
        tensors = state_tensors(sd) + state_tensors(self.st.get("buffers", {}))
        dst = torch.empty(self.nbytes, dtype=torch.uint8)
        dst.zero_()  # touched: no page faults in the timed copies
        memcpy_into(dst, tensors)
        out: dict[str, list[float]] = {"wall": [], "cpu": []}
        for _ in range(max(3, self.args.repeats)):
            c0, w0 = time.process_time(), time.perf_counter()
            memcpy_into(dst, tensors)
            out["wall"].append(time.perf_counter() - w0)
            out["cpu"].append(time.process_time() - c0)
        del dst
        gc.collect()
        self.res["memcpy"] = out

    def ftmem_saves(self) -> None:
        from ftmem.client import Checkpointer
        from ftmem.config import ClientConfig
        from ftmem.protocol.smp_client import SmpClient

        a = self.args
        ckpt = Checkpointer(ClientConfig(run_dir=a.run_dir))
        client = SmpClient(a.run_dir)
        timeout = a.wait_timeout
        try:
            rank = ckpt.rank
            self.res["rank"] = rank
            # The first save: the SMP creates and pre-faults the slots (inside save(), or off
            # the training thread while saves skip, then wait() saves the step again).
            self.step = 1
            s0, r0 = self.smp_cpu(), time.process_time()
            first = save_and_wait(ckpt, self.st, self.step, timeout)
            first["rank_cpu"] = time.process_time() - r0
            verified, vwait, _, polls = (None, 0.0, {}, 0)
            if first["committed"]:
                verified, vwait, _, polls = wait_verified(client, rank, self.step, timeout)
            first.update(
                verified=verified,
                verify_wait_s=vwait,
                polls=polls,
                smp_cpu=self.smp_cpu() - s0,
            )
            self.res["first"] = first
            self.dump()
            # What one STATUS request costs the SMP, and its CPU while idle (housekeeping).
            n_cal = 40
            c0 = self.smp_cpu()
            for _ in range(n_cal):
                rank_status(client, rank)
            self.res["smp_cpu_per_status"] = (self.smp_cpu() - c0) / n_cal
            i0, w0 = self.smp_cpu(), time.perf_counter()
            time.sleep(a.idle_s)
            self.res["smp_idle_cpu_per_s"] = (self.smp_cpu() - i0) / (time.perf_counter() - w0)
            before = rank_status(client, rank)
            # K saves, each waited for; CPU of the rank around them, of the SMP until verified.
            saves: dict[str, Any] = {
                "save_s": [],
                "safe_s": [],
                "skipped": 0,
                "retried": 0,
                "reasons": {},
                "errors": [],
            }
            committed: list[int] = []
            s0, r0, w0 = self.smp_cpu(), time.process_time(), time.perf_counter()
            for _ in range(a.saves):
                self.step += 1
                one = save_and_wait(ckpt, self.st, self.step, timeout)
                saves["save_s"].append(one["save_s"])
                if one["skipped"]:
                    saves["skipped"] += 1
                    reason = one["reason"] or "?"
                    saves["reasons"][reason] = saves["reasons"].get(reason, 0) + 1
                    saves["retried"] += int(one["committed"])
                if one["error"]:
                    saves["errors"].append(one["error"])
                if one["committed"]:
                    saves["safe_s"].append(one["safe_s"])
                    committed.append(self.step)
            r1, w1 = time.process_time(), time.perf_counter()
            after: dict[str, Any] = {}
            verified, vwait, polls = None, 0.0, 0
            if committed:
                verified, vwait, after, polls = wait_verified(client, rank, committed[-1], timeout)
            s1, w2 = self.smp_cpu(), time.perf_counter()
            saves.update(
                committed=len(committed),
                rank_cpu=r1 - r0,
                smp_cpu=s1 - s0,
                saves_wall_s=w1 - w0,
                window_s=w2 - w0,
                verified=verified,
                verify_wait_s=vwait,
                polls=polls,
                stats=ckpt.stats(),
            )
            after = after or rank_status(client, rank)
            keep = ("newest_committed", "newest_verified", "skipped", "skips", "commits")
            saves["status_after"] = {k: after[k] for k in keep if k in after}
            saves["smp_skips"] = _delta(after.get("skips"), before.get("skips"))
            self.res["saves"] = saves
        finally:
            client.close()
            ckpt.close()

    def restore(self) -> None:
        from ftmem.client import Checkpointer
        from ftmem.config import ClientConfig

        a = self.args
        ckpt = Checkpointer(ClientConfig(run_dir=a.run_dir))
        out: dict[str, Any] = {"wall": [], "rank_cpu": [], "smp_cpu": [], "steps": []}
        self.res["restore"] = out
        try:
            for _ in range(a.repeats):
                s0, r0, t0 = self.smp_cpu(), time.process_time(), time.perf_counter()
                got = ckpt.load(self.st)
                out["wall"].append(time.perf_counter() - t0)
                out["rank_cpu"].append(time.process_time() - r0)
                out["smp_cpu"].append(self.smp_cpu() - s0)
                out["steps"].append(got)
            out["check"] = self._check_restore(ckpt)
            self.step = max(self.step, *out["steps"])
        finally:
            ckpt.close()

    def _check_restore(self, ckpt: Any) -> str:
        weight = next(iter(self.state.model.parameters()))
        moment = self.state.optimizer.state[weight]["exp_avg_sq"]
        want_w, want_m = weight.detach().clone(), moment.clone()
        with torch.no_grad():
            weight.fill_(123.0)
            moment.fill_(-1.0)
        ckpt.load(self.st)
        ok = torch.equal(weight, want_w) and torch.equal(moment, want_m)
        return "ok" if ok else "MISMATCH"

    def skips(self) -> None:
        from ftmem.client import Checkpointer
        from ftmem.config import ClientConfig
        from ftmem.protocol.smp_client import SmpClient

        a = self.args
        out: dict[str, Any] = {}
        self.res["skips"] = out
        ckpt = Checkpointer(ClientConfig(run_dir=a.run_dir))
        client = SmpClient(a.run_dir)
        try:
            rank = ckpt.rank
            cases = (("back to back", 0.0), (f"{a.compute_ms:g} ms compute", a.compute_ms))
            for label, ms in cases:
                work = compute_stand_in(ms) if ms > 0 else (lambda: None)
                before = rank_status(client, rank)
                row: dict[str, Any] = {"saves": a.saves, "skipped": 0, "reasons": {}, "ms": ms}
                t0 = time.perf_counter()
                for _ in range(a.saves):
                    self.step += 1
                    h = ckpt.save(self.st, step=self.step)
                    if h.skipped:
                        row["skipped"] += 1
                        row["reasons"][h.reason] = row["reasons"].get(h.reason, 0) + 1
                    work()
                row["loop_s"] = time.perf_counter() - t0
                row["last_committed"] = bool(ckpt.wait(timeout=a.wait_timeout)) and (
                    ckpt.stats().get("last_step") == self.step
                )
                newest = ckpt.stats().get("last_step")
                after: dict[str, Any] = {}
                if newest is not None:
                    _, _, after, _ = wait_verified(client, rank, int(newest), a.wait_timeout)
                after = after or rank_status(client, rank)
                row["smp_skipped"] = _delta(after.get("skipped"), before.get("skipped"))
                row["smp_skips"] = _delta(after.get("skips"), before.get("skips"))
                out[label] = row
                self.dump()
        finally:
            client.close()
            ckpt.close()

    def dcp(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import async_save

        a = self.args
        sd: dict[str, Any] = {
            "model": self.state.model.state_dict(),
            "optim": self.state.optimizer.state_dict(),
        }
        if "buffers" in self.st:
            sd["buffers"] = self.st["buffers"]
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
        disk = tempfile.mkdtemp(prefix="ftmem-bench-dp-dcp-", dir=a.disk_dir)
        out: dict[str, Any] = {"blocking": [], "staged": [], "done": [], "disk": disk}
        self.res["dcp"] = out

        def one(i: int) -> tuple[float, float, float]:
            path = os.path.join(disk, f"ckpt_{i}")
            t0 = time.perf_counter()
            resp = async_save(sd, checkpoint_id=path, async_stager=stager, no_dist=True)
            t_block = time.perf_counter() - t0
            staging = getattr(resp, "staging_completion", None)
            if staging is not None:
                staging.result()
            t_staged = time.perf_counter() - t0
            upload: Any = getattr(resp, "upload_completion", resp)
            upload.result()
            return t_block, t_staged, time.perf_counter() - t0

        try:
            out["first"] = one(0)  # allocates the staging buffers
            shutil.rmtree(os.path.join(disk, "ckpt_0"), ignore_errors=True)
            rm_cpu = 0.0
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(1, a.dcp_saves + 1):
                b, s, d = one(i)
                out["blocking"].append(b)
                out["staged"].append(s)
                out["done"].append(d)
                c1 = time.process_time()
                shutil.rmtree(os.path.join(disk, f"ckpt_{i}"), ignore_errors=True)
                rm_cpu += time.process_time() - c1
            out["cpu"] = time.process_time() - c0 - rm_cpu
            out["wall"] = time.perf_counter() - w0
        finally:
            stager.close()
            shutil.rmtree(disk, ignore_errors=True)

    def run(self) -> int:
        phases: list[tuple[str, Callable[[], None]]] = [
            ("build", self.build),
            ("memcpy", self.memcpy),
            ("ftmem", self.ftmem_saves),
            ("restore", self.restore),
            ("skips", self.skips),
        ]
        if not self.args.skip_dcp:
            phases.append(("dcp", self.dcp))
        for name, phase in phases:
            logger.info("[%g GiB] %s", self.args.size_gib, name)
            t0 = time.perf_counter()
            try:
                phase()
            except Exception as exc:  # record it, keep what the other phases measure
                logger.exception("phase %s failed", name)
                self.res["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                if name == "build":
                    self.dump()
                    return 1
            self.res.setdefault("phase_s", {})[name] = time.perf_counter() - t0
            self.dump()
        return 0


def rank_main(argv: list[str]) -> int:
    """The rank process: measure one size, write the results' JSON to ``--result``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(name)s: %(message)s")
    args = _rank_parser().parse_args(argv)
    torch.set_num_threads(1)
    os.environ["FTMEM_RUN_DIR"] = str(args.run_dir)
    return _Rank(args).run()


# --------------------------------------------------------------------------- one size


@dataclass(kw_only=True)
class SizeResult:
    """What the rank and this process measured for one state size."""

    size_gib: float
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    skipped: str = ""
    """Why the size was not run (not enough memory), else ""."""

    @property
    def nbytes(self) -> int:
        return int(self.data.get("nbytes") or 0)

    @property
    def gib(self) -> float:
        return self.nbytes / GiB

    def figures(self) -> dict[str, Any]:
        """The derived figures (None where not measured); see :func:`derive`."""
        return derive(self)


def _med(values: Any) -> float | None:
    vals = _report.finite(values or [])
    return statistics.median(vals) if vals else None


def derive(r: SizeResult) -> dict[str, Any]:
    """Per-GiB figures of one size from its raw measurements."""
    d, gib = r.data, r.gib
    f: dict[str, Any] = {"gib": gib}
    if not gib:
        return f
    mc = d.get("memcpy") or {}
    f["memcpy_wall"] = _med(mc.get("wall"))
    f["memcpy_cpu"] = _med(mc.get("cpu"))
    if f["memcpy_cpu"] is not None:
        f["memcpy_cpu_per_gib"] = f["memcpy_cpu"] / gib
        f["memcpy_gbps"] = r.nbytes / f["memcpy_wall"] / 1e9 if f["memcpy_wall"] else None
    sv = d.get("saves") or {}
    n = int(sv.get("committed") or 0)
    f["committed"] = n
    if n:
        snap_gib = n * gib
        f["rank_cpu_per_gib"] = sv["rank_cpu"] / snap_gib
        f["smp_cpu_per_gib"] = sv["smp_cpu"] / snap_gib
        f["total_cpu_per_gib"] = (sv["rank_cpu"] + sv["smp_cpu"]) / snap_gib
        idle = d.get("smp_idle_cpu_per_s")
        if idle is not None:
            f["smp_idle_share"] = idle * sv.get("window_s", 0.0) / snap_gib
        if f.get("memcpy_cpu_per_gib"):
            f["cpu_ratio"] = f["total_cpu_per_gib"] / f["memcpy_cpu_per_gib"]
        f["safe_med"] = _med(sv.get("safe_s"))
        f["safe_min"] = min(sv["safe_s"]) if sv.get("safe_s") else None
        f["safe_max"] = max(sv["safe_s"]) if sv.get("safe_s") else None
        if f["safe_med"] is not None and f.get("memcpy_wall"):
            f["safe_ratio"] = f["safe_med"] / f["memcpy_wall"]
    f["stall_limit"] = STALL_GOAL_BASE_S + STALL_GOAL_S_PER_GIB * gib
    first = d.get("first") or {}
    f["first_save"] = first.get("save_s")
    f["save_med"] = _med(sv.get("save_s"))
    f["save_max"] = max(sv["save_s"]) if sv.get("save_s") else None
    stalls = [x for x in (f["first_save"], f["save_max"]) if x is not None]
    f["stall_worst"] = max(stalls) if stalls else None
    rs = d.get("restore") or {}
    f["restore_med"] = _med(rs.get("wall"))
    if f["restore_med"] is not None:
        f["restore_per_gib"] = f["restore_med"] / gib
        rc = _med([a + b for a, b in zip(rs["rank_cpu"], rs["smp_cpu"], strict=False)])
        f["restore_cpu_per_gib"] = rc / gib if rc is not None else None
    dc = d.get("dcp") or {}
    if dc.get("blocking"):
        f["dcp_blocking"] = _med(dc["blocking"])
        f["dcp_staged"] = _med(dc["staged"])
        f["dcp_done"] = _med(dc["done"])
        if "cpu" in dc:
            f["dcp_cpu_per_gib"] = dc["cpu"] / (len(dc["blocking"]) * gib)
    return f


def measure_size(size_gib: float, args: argparse.Namespace, smp_args: list[str]) -> SizeResult:
    """Start an SMP and a rank process for one size; collect what the rank measured."""
    result = SizeResult(size_gib=size_gib)
    # The state, its slots, and one more copy: the memcpy's buffer, later DCP's staging.
    need = (2.0 + 1.15 * args.slots) * size_gib + 0.5
    avail = psutil.virtual_memory().available / GiB
    if avail < need:
        result.skipped = (
            f"needs ~{need:.1f} GiB of free memory (state, {args.slots} slots, staging), "
            f"{avail:.1f} GiB available"
        )
        logger.warning("[%g GiB] skipped: %s", size_gib, result.skipped)
        return result
    tmp = Path(tempfile.mkdtemp(prefix="ftmem-bench-dp-"))
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    res_path = tmp / "result.json"
    timeout = args.timeout + 120.0 * size_gib
    wait_timeout = 60.0 + 60.0 * size_gib
    try:
        t0 = time.perf_counter()
        with node_smp(run_dir, slots=args.slots, extra_args=smp_args, log_path=tmp / "smp.log") as (
            smp,
            run_id,
        ):
            result.notes.append(f"SMP pid {smp.pid} ready in {time.perf_counter() - t0:.2f} s")
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--_rank",
                *("--size-gib", repr(size_gib), "--run-dir", str(run_dir)),
                *("--smp-pid", str(smp.pid), "--result", str(res_path)),
                *("--saves", str(args.saves), "--repeats", str(args.repeats)),
                *("--compute-ms", str(args.compute_ms), "--dcp-saves", str(args.dcp_saves)),
                *("--idle-s", str(args.idle_s), "--loose-frac", str(args.loose_frac)),
                *("--wait-timeout", str(wait_timeout)),
                *(("--disk-dir", str(args.disk_dir)) if args.disk_dir else ()),
                *(("--skip-dcp",) if args.skip_dcp else ()),
            ]
            env = _launch.job_env(FTMEM_RUN_DIR=str(run_dir), FTMEM_RUN_ID=run_id)
            with _launch.Job(cmd, tmp / "rank.log", env) as job:
                rc = job.wait(timeout)
                if rc is None:
                    result.error = f"the rank did not finish within {timeout:.0f} s"
                elif rc != 0:
                    result.error = f"the rank exited with {rc}"
                if result.error:
                    result.notes.append(f"rank log tail: `{job.text()[-1500:]!r}`")
            if smp.poll() is not None:
                result.notes.append(f"the SMP exited early ({smp.poll()})")
        if res_path.exists():
            result.data = json.loads(res_path.read_text())
        for err in result.data.get("errors", []):
            result.notes.append(f"FAILED phase {err}")
    except Exception as exc:  # the SMP did not start, or the result is unreadable
        logger.exception("[%g GiB] failed", size_gib)
        result.error = result.error or f"{type(exc).__name__}: {exc}"
        log = tmp / "smp.log"
        if log.exists():
            result.notes.append(f"SMP log tail: `{log.read_text(errors='replace')[-1000:]!r}`")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- report


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "missed")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _s(x: float | None, fmt: str = ".3f", unit: str = " s") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{fmt}}{unit}"


def goals(results: list[SizeResult] | None) -> list[tuple[str, str, bool | None, str]]:
    """(goal, measured, met: True/False/None if not measured, what it is made of), checked on
    the largest state measured."""
    names = (
        f"datapath: CPU per snapshotted GiB (rank + SMP) <= {CPU_RATIO_GOAL:g}x a memcpy's",
        f"datapath: stall <= {STALL_GOAL_BASE_S * 1e3:g} ms + {STALL_GOAL_S_PER_GIB:g} s/GiB "
        "per save(), the first included",
        "datapath: time to safe (save() to commit) <= a memcpy of the same bytes",
        f"datapath: restore <= {RESTORE_GOAL_S_PER_GIB:g} s/GiB",
    )
    done = [r for r in results or [] if r.nbytes and (r.data.get("saves") or r.data.get("first"))]
    if not done:
        return [(n, "-", None, "") for n in names]
    big = max(done, key=lambda r: r.nbytes)
    f = big.figures()
    sv = big.data.get("saves") or {}
    gib = f"{big.gib:.2f} GiB"
    rows: list[tuple[str, str, bool | None, str]] = []
    hashing = (
        "hashing in the rank (this SMP reports no `newest_verified`)"
        if sv.get("verified") is None
        else f"the SMP verified the last step {sv.get('verify_wait_s', 0) * 1e3:.0f} ms after "
        "its commit"
    )
    if f.get("cpu_ratio") is not None:
        rows.append(
            (
                f"{names[0]} ({gib})",
                f"{f['total_cpu_per_gib']:.3f} CPU-s/GiB = {f['cpu_ratio']:.1f}x memcpy's "
                f"{f['memcpy_cpu_per_gib']:.3f}",
                f["cpu_ratio"] <= CPU_RATIO_GOAL,
                f"rank {f['rank_cpu_per_gib']:.3f} + SMP {f['smp_cpu_per_gib']:.3f} CPU-s/GiB "
                f"over {f['committed']} committed save + wait; memcpy of the same bytes "
                f"{f['memcpy_gbps']:.1f} GB/s, 1 thread; {hashing}",
            )
        )
    else:
        rows.append((names[0], "-", None, ""))
    if f.get("stall_worst") is not None:
        rows.append(
            (
                f"{names[1]} ({gib})",
                f"first {_ms(f['first_save'])}, then {_ms(f['save_med'])} "
                f"(max {_ms(f['save_max'])}); limit {_ms(f['stall_limit'])}",
                f["stall_worst"] <= f["stall_limit"],
                _first_save_text(big),
            )
        )
    else:
        rows.append((names[1], "-", None, ""))
    if f.get("safe_ratio") is not None:
        rows.append(
            (
                f"{names[2]} ({gib})",
                f"{f['safe_med']:.3f} s vs memcpy {f['memcpy_wall']:.3f} s "
                f"({f['safe_ratio']:.2f}x)",
                f["safe_ratio"] <= 1.0,
                f"median over {f['committed']} saves of `save()` to `handle.wait()`; the "
                "memcpy: one synchronous `copy_` of the state's bytes into touched memory",
            )
        )
    else:
        rows.append((names[2], "-", None, ""))
    if f.get("restore_per_gib") is not None:
        rows.append(
            (
                f"{names[3]} ({gib})",
                f"{f['restore_per_gib']:.3f} s/GiB",
                f["restore_per_gib"] <= RESTORE_GOAL_S_PER_GIB,
                f"`Checkpointer().load(state)` in place, fresh Checkpointer, "
                f"{big.gib / f['restore_med']:.2f} GiB/s; rank + SMP CPU "
                f"{_s(f.get('restore_cpu_per_gib'), '.3f', ' CPU-s/GiB')}",
            )
        )
    else:
        rows.append((names[3], "-", None, ""))
    return rows


def _first_save_text(r: SizeResult) -> str:
    first = r.data.get("first") or {}
    if not first:
        return "time in `save()`"
    if first.get("skipped"):
        how = (
            f"the first `save()` skipped ({first.get('reason')}: the slots are made off the "
            f"training thread) and `wait()` committed the step {first['safe_s']:.2f} s after it"
        )
    else:
        how = (
            "the first `save()` had the SMP create and pre-fault the slots and mapped them "
            f"({first['safe_s']:.2f} s to commit)"
        )
    return f"time in `save()`; {how}"


def _size_table(results: list[SizeResult], args: argparse.Namespace) -> list[str]:
    ok = [r for r in results if r.nbytes]
    if not ok:
        return []
    figs = [r.figures() for r in ok]
    head = "| figure | " + " | ".join(f"{r.gib:.2f} GiB" for r in ok) + " |"
    lines = [head, "|---|" + "---|" * len(ok)]

    def row(label: str, cell: Callable[[SizeResult, dict[str, Any]], str]) -> None:
        cells = []
        for r, f in zip(ok, figs, strict=True):
            try:
                cells.append(cell(r, f))
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                cells.append("-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def per(key: str, unit: str = " CPU-s/GiB", fmt: str = ".3f") -> Callable[..., str]:
        return lambda r, f: _s(f.get(key), fmt, unit)

    def saves(r: SizeResult) -> dict[str, Any]:
        return r.data.get("saves") or {}

    k = args.saves

    def counts(r: SizeResult, f: dict[str, Any]) -> str:
        sv = saves(r)
        text = f"{sv['committed']} / {sv['skipped']}"
        if sv.get("retried"):
            text += f" ({sv['retried']} skipped, then saved again by `wait()`)"
        return text

    row(f"**CPU**: {k} x save + wait: committed / skipped in save()", counts)
    row("rank process (all threads) per snapshotted GiB", per("rank_cpu_per_gib"))
    row("SMP process + children per snapshotted GiB", per("smp_cpu_per_gib"))
    row("**total** per snapshotted GiB", per("total_cpu_per_gib"))
    row("of which SMP idle housekeeping (its idle rate x window)", per("smp_idle_share"))
    row(
        "one memcpy of the same bytes: CPU per GiB (GB/s)",
        lambda r, f: f"{f['memcpy_cpu_per_gib']:.3f} CPU-s/GiB ({f['memcpy_gbps']:.1f} GB/s)",
    )
    row(
        f"**total / memcpy** (goal <= {CPU_RATIO_GOAL:g}x)",
        lambda r, f: f"{f['cpu_ratio']:.2f}x",
    )
    row(
        "**stall**: first save()",
        lambda r, f: _ms(f["first_save"]),
    )
    row(
        f"save() over the {k} saves: median (max)",
        lambda r, f: f"{_ms(f['save_med'])} ({_ms(f['save_max'])})",
    )
    row(
        "stall goal: 1 ms + 0.005 s/GiB (verdict, first included)",
        lambda r, f: f"{_ms(f['stall_limit'])} ({_verdict(f['stall_worst'] <= f['stall_limit'])})",
    )
    row(
        "**time to safe**: save() to commit, median (min-max)",
        lambda r, f: f"{f['safe_med']:.3f} s ({f['safe_min']:.3f}-{f['safe_max']:.3f})",
    )
    row(
        "first save to commit (slots created)",
        lambda r, f: _s((r.data.get("first") or {}).get("safe_s")),
    )
    row("synchronous memcpy of the same bytes (wall)", lambda r, f: f"{f['memcpy_wall']:.3f} s")
    row("time to safe / memcpy (goal <= 1)", lambda r, f: f"{f['safe_ratio']:.2f}x")
    row(
        "SMP verified the last step, after its commit",
        lambda r, f: (
            "n/a (no `newest_verified`)"
            if saves(r).get("verified") is None
            else f"{saves(r)['verify_wait_s']:.3f} s ({'yes' if saves(r)['verified'] else 'NO'})"
        ),
    )
    row(
        "**restore**: load in place, median",
        lambda r, f: f"{f['restore_med']:.3f} s = {f['restore_per_gib']:.3f} s/GiB",
    )
    row("restore CPU (rank + SMP) per GiB", per("restore_cpu_per_gib"))
    for label in ("back to back", f"{args.compute_ms:g} ms compute"):

        def cell(r: SizeResult, f: dict[str, Any], label: str = label) -> str:
            s = (r.data.get("skips") or {})[label]
            reasons = "; ".join(f"{v}x {k}" for k, v in s["reasons"].items())
            text = f"{s['skipped']} of {s['saves']}" + (f" ({reasons})" if reasons else "")
            if s.get("last_committed") is not None:
                text += f"; last step committed by wait(): {'yes' if s['last_committed'] else 'no'}"
            return text

        row(f"**skips**: {k} every-step saves, {label}", cell)
    row(
        "**dcp.async_save** (reused stager): blocking per save",
        lambda r, f: f"{_ms(f['dcp_blocking'])} ({f['dcp_blocking'] / f['gib']:.4f} s/GiB)",
    )
    row(
        "dcp.async_save: until staged / until written (fsync'd)",
        lambda r, f: f"{f['dcp_staged']:.3f} s / {f['dcp_done']:.3f} s",
    )
    row("dcp.async_save: process CPU per GiB saved", per("dcp_cpu_per_gib"))
    row(
        "ftmem total CPU / dcp.async_save's",
        lambda r, f: f"{f['total_cpu_per_gib'] / f['dcp_cpu_per_gib']:.2f}x",
    )
    return [*lines, ""]


def a_k(sv: dict[str, Any]) -> int:
    """K: the saves of the CPU loop."""
    return len(sv.get("save_s") or [])


def _size_notes(r: SizeResult) -> list[str]:
    d = r.data
    out = []
    if r.nbytes:
        loose = d.get("loose_bytes") or 0
        out.append(
            f"state: {d.get('layers')} x Linear({d.get('width')}, {d.get('width')}) + AdamW, "
            f"{d.get('tensors')} tensors, {r.nbytes / MiB:.1f} MiB"
            + (
                f", of which {loose / MiB:.1f} MiB loose tensors (copied in save())"
                if loose
                else ""
            )
            + f"; built in {d.get('build_s', 0):.1f} s"
        )
    first = d.get("first")
    if first:
        skipped = f"skipped in save() ({first['reason']})" if first["skipped"] else "not skipped"
        verified = ""
        if first.get("verified") is not None:
            verified = f", verified {first['verify_wait_s']:.3f} s after ({first['verified']})"
        out.append(
            f"first save: {first['save_s'] * 1e3:.1f} ms in save(), {skipped}; committed="
            f"{first['committed']} {first['safe_s']:.3f} s after the call{verified}; rank CPU "
            f"{first['rank_cpu']:.3f} s, SMP CPU {first['smp_cpu']:.3f} s"
            + (f"; error: {first['error']}" if first.get("error") else "")
        )
    if d.get("smp_idle_cpu_per_s") is not None:
        out.append(
            f"SMP idle: {d['smp_idle_cpu_per_s'] * 1e3:.1f} ms of CPU per second; one STATUS "
            f"request costs it {d.get('smp_cpu_per_status', 0) * 1e3:.2f} ms"
        )
    sv = d.get("saves") or {}
    if sv:
        polls = sv.get("polls", 0)
        out.append(
            f"the {a_k(sv)} saves took {sv.get('saves_wall_s', 0):.2f} s; the CPU window (until "
            f"verified) {sv.get('window_s', 0):.2f} s; rank CPU {sv.get('rank_cpu', 0):.3f} s, "
            f"SMP CPU {sv.get('smp_cpu', 0):.3f} s, of which ~"
            f"{polls * d.get('smp_cpu_per_status', 0) * 1e3:.1f} ms answering the {polls} "
            "STATUS polls of the wait for verification"
        )
        if sv.get("status_after"):
            out.append(f"SMP STATUS of the rank after them: {sv['status_after']}")
        if sv.get("reasons"):
            out.append(f"skipped in save(): {sv['reasons']}; SMP's count: {sv.get('smp_skips')}")
        if sv.get("errors"):
            out.append(f"errors: {sv['errors'][:3]}")
    rs = d.get("restore") or {}
    if rs.get("check"):
        out.append(
            f"restore check (clobber a weight and an exp_avg_sq, load, compare): {rs['check']}; "
            f"steps restored {sorted(set(rs.get('steps', [])))}"
        )
    dc = d.get("dcp") or {}
    if dc.get("first"):
        b, s, w = dc["first"]
        out.append(
            f"dcp.async_save warm-up call (allocates the staging buffers): {b * 1e3:.1f} ms "
            f"blocking, {s:.3f} s until staged, {w:.3f} s until written"
        )
    if d.get("phase_s"):
        out.append("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in d["phase_s"].items()))
    out += r.notes
    if r.error:
        out.append(f"FAILED: {r.error}")
    return out


def _hash_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    mib = rows[0]["bytes"] / MiB
    gib = rows[0]["bytes"] / GiB
    base = _med(rows[0]["cpu"]) or float("nan")
    out = [
        f"### Hash functions: CPU per GiB on {mib:.0f} MiB, one thread",
        "",
        f"Each over the same {mib:.0f} MiB of random bytes, in {HASH_CHUNK // MiB} MiB "
        "`update` calls on one thread (the ftmem copy hashes 2 MiB pieces); median (min-max) "
        "of the repeats; x memcpy = CPU over the memcpy's CPU.",
        "",
        "| function | GB/s | CPU-s per GiB | x memcpy |",
        "|---|---|---|---|",
    ]
    for r in rows:
        gbps = [r["bytes"] / w / 1e9 for w in r["wall"] if w > 0]
        cpu = [c / gib for c in r["cpu"]]
        ratio = (_med(r["cpu"]) or float("nan")) / base
        out.append(
            f"| {r['name']} | {_report.stat(gbps, '.2f')} | {_report.stat(cpu, '.3f')} | "
            f"{ratio:.2f}x |"
        )
    by = {r["name"].split(" ")[0]: _med(r["cpu"]) for r in rows}
    x3 = by.get("xxhash.xxh3_64")
    hashes = sorted((v, k) for k, v in by.items() if v and k != "memcpy")
    if x3 and hashes:
        rel = ", ".join(
            f"{k.removeprefix('xxhash.')} {v / x3:.1f}x" for v, k in hashes if k != "xxhash.xxh3_64"
        )
        cheapest = hashes[0][1]
        x128 = by.get("xxhash.xxh3_128")
        lead = (
            "the xxh3 family is the cheapest of the functions tried"
            if cheapest.startswith("xxhash.xxh3")
            else f"{cheapest} was the cheapest in this run"
        )
        wide = (
            f"xxh3_128 (the same algorithm, a wider digest) costs {x128 / x3:.2f}x xxh3_64's CPU"
            if x128
            else ""
        )
        out += [
            "",
            f"Reading: xxh3_64 costs {x3 / base:.2f}x a memcpy's CPU here ({'less' if x3 < base else 'more'} "
            f"than copying the bytes); relative to it: {rel}. In this run {lead}; {wide}. ftmem "
            "uses xxh3_64: 64 bits are plenty to detect a corrupted or torn slot (an accident, "
            "not an adversary: slot files are 0600 and every message is authenticated); a "
            "cryptographic hash (blake2b) buys nothing against accidents and costs "
            f"{(by.get('hashlib.blake2b') or float('nan')) / x3:.0f}x the CPU.",
        ]
    return [*out, ""]


def render(
    results: list[SizeResult],
    hashes: list[dict[str, Any]],
    *,
    args: argparse.Namespace,
    command: str,
    load_start: tuple[float, float, float],
    load_end: tuple[float, float, float],
    seconds: float,
    smp_note: str,
) -> str:
    """The section (markers included)."""
    facts = _report.machine_facts(args.disk_dir or tempfile.gettempdir())
    out = [START_MARK, "## Data path: every CPU cycle of a snapshot (issue 13)", ""]
    out += _report.generated_by("datapath.py", command)
    out += [f"- {x}" for x in facts[:2]]
    out += [f"- {facts[2]}; torch intra-op threads in the rank: 1", *[f"- {x}" for x in facts[3:]]]
    out += [
        f"- load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in load_start)}; "
        f"at end: {', '.join(f'{x:.2f}' for x in load_end)} (the machine may be shared: compare "
        f"within this run only); the part took {seconds / 60:.1f} min",
        f"- profile `{args.profile}`: K = {args.saves} saves, {args.repeats} repeats of the "
        f"memcpy (at least 3) and the restore, compute stand-in {args.compute_ms:g} ms of "
        f"256x256 matmuls, dcp.async_save {args.dcp_saves} saves",
        f"- SMP: `python -m ftmem.smp`, {args.slots} slots per rank, {smp_note}; the rank: one "
        "child process of this one (no process group, torch 1 thread), state = params of "
        "square `nn.Linear` layers + AdamW `exp_avg`/`exp_avg_sq` (fp32)",
        "- CPU: the rank's `time.process_time()` (every thread of the process) around the K "
        "save + `handle.wait()` calls (the loop does nothing else; the first save, which sizes "
        "the slots, is outside it); the SMP's psutil `cpu_times` (user + system, every thread, "
        "its children too) from just before the first of the K saves until STATUS says the "
        "last is verified (at once if the SMP verifies nothing); per GiB = over K committed x "
        "the state's bytes. memcpy: `dst.copy_(src)` of every state tensor into one flat "
        "buffer touched before, one thread, median of the repeats",
        "- skips: K saves at consecutive steps without waiting on the handles, back to back "
        f"and with {args.compute_ms:g} ms of compute after each (no optimizer step: a save "
        "while the previous copy runs is skipped, as without a fence)",
        "- dcp.async_save: one reused `DefaultStager` (async staging, thread executor, no "
        "pinned memory on CPU) to the disk dir, files fsync'd; each save waited for; its CPU "
        "is the whole process's (`time.process_time`) over the K saves, without the removal "
        "of each checkpoint",
        "",
    ]
    rows = goals(results)
    out += [
        "### Goals",
        "",
        "Checked on the largest state measured:",
        "",
        "| goal | measured | verdict | what the figure is made of |",
        "|---|---|---|---|",
        *[f"| {g} | {m} | {_verdict(ok)} | {why} |" for g, m, ok, why in rows],
        "",
    ]
    out += ["### Per state size", ""]
    out += _size_table(results, args)
    for r in results:
        label = f"{r.gib:.2f} GiB" if r.nbytes else f"{r.size_gib:g} GiB (requested)"
        notes = _size_notes(r)
        if r.skipped:
            notes = [f"not run: {r.skipped}"]
        if notes:
            out += [f"Notes, {label}:", "", *[f"- {n}" for n in notes], ""]
    out += _hash_table(hashes)
    out.append(END_MARK)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- CLI


def get_args_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="0.25 and 1 GiB, K=8")
    prof.add_argument("--smoke", action="store_true", help="8 MiB, K=3: does it run")
    p.add_argument("--sizes", default=None, help="state sizes in GiB (default: the profile's)")
    p.add_argument("--saves", type=int, default=None, help="K: saves per measurement")
    p.add_argument("--repeats", type=int, default=None, help="memcpy/restore/hash repeats")
    p.add_argument("--compute-ms", type=float, default=None, help="compute between saves (ms)")
    p.add_argument("--dcp-saves", type=int, default=None, help="dcp.async_save saves (K)")
    p.add_argument("--slots", type=int, default=2, help="SMP slots per rank")
    p.add_argument(
        "--hash-threads",
        type=int,
        default=1,
        help="the SMP's --hash-threads, if it has that flag (default 1; 0: leave its default)",
    )
    p.add_argument("--hash-mib", type=int, default=None, help="buffer of the hash table (MiB)")
    p.add_argument("--idle-s", type=float, default=None, help="SMP idle CPU measured this long")
    p.add_argument(
        "--loose-frac",
        type=float,
        default=0.0,
        help="fraction of the state in loose tensors (no optimizer: copied inside save())",
    )
    p.add_argument("--disk-dir", default=None, help="dcp.async_save's directory ($TMPDIR)")
    p.add_argument("--timeout", type=float, default=600.0, help="one size's rank (+120 s/GiB)")
    p.add_argument("--skip-dcp", action="store_true", help="leave out dcp.async_save")
    p.add_argument("--skip-hashes", action="store_true", help="leave out the hash table")
    _report.add_output_args(p)
    return p


def run(argv: list[str], *, command: str | None = None) -> _report.Outcome:
    """Parse ``argv``, measure every size and the hash table, render the section.

    The outcome's data is the list of :class:`SizeResult`.
    """
    args = get_args_parser().parse_args(argv)
    args.profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    prof = PROFILES[args.profile]
    for key in ("sizes", "saves", "repeats", "compute_ms", "hash_mib", "idle_s"):
        if getattr(args, key) is None:
            setattr(args, key, prof[key])
    if args.dcp_saves is None:
        args.dcp_saves = args.saves
    sizes = [float(s) for s in str(args.sizes).split(",") if s.strip()]
    if not sizes or args.saves < 1 or args.repeats < 1 or not 0 <= args.loose_frac < 0.9:
        raise ValueError("need a size, --saves >= 1, --repeats >= 1, 0 <= --loose-frac < 0.9")
    load_start = os.getloadavg()
    t0 = time.monotonic()
    hashes: list[dict[str, Any]] = []
    if not args.skip_hashes:
        logger.info("hash table on %d MiB", args.hash_mib)
        hashes = bench_hashes(args.hash_mib, args.repeats)
        gc.collect()
    threads = args.hash_threads if args.hash_threads > 0 else None
    smp_args, smp_note = smp_extra_args(threads, smp_help())
    results = []
    for size in sizes:
        logger.info("[%g GiB] starting", size)
        results.append(measure_size(size, args, smp_args))
        gc.collect()
    section = render(
        results,
        hashes,
        args=args,
        command=command or _report.shown_command("datapath.py", argv),
        load_start=load_start,
        load_end=os.getloadavg(),
        seconds=time.monotonic() - t0,
        smp_note=smp_note,
    )
    failed = any(r.error or r.data.get("errors") for r in results)
    return _report.Outcome(name=SECTION, section=section, args=args, data=results, ok=not failed)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the section and write it into ``--out``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_rank"]:
        return rank_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return _report.finish(run(argv))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
