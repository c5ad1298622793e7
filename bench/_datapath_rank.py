"""The data path's processes: the SMP beside each size's rank and the SMP client helpers the
rank and ``--gpu`` share, and the rank process itself (``bench/datapath.py --_rank``), which
measures one size phase by phase and writes its raw figures to ``--result`` as JSON.
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
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch

from bench import _baselines as baselines
from bench import _launch, _proc

logger = logging.getLogger("bench.datapath")


def cpu_wall(fn: Callable[[], Any], repeats: int) -> dict[str, list[float]]:
    """``fn()`` ``repeats`` times: the ``wall`` and ``cpu`` (this process) seconds of each."""
    out: dict[str, list[float]] = {"wall": [], "cpu": []}
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        out["wall"].append(time.perf_counter() - w0)
        out["cpu"].append(time.process_time() - c0)
    return out


# ------------------------------------------------------------------- the SMP and its clients


def smp_args(hash_threads: int) -> tuple[list[str], str]:
    """The SMP's arguments for ``--hash-threads`` (if its ``--help`` lists the flag; 0: leave
    its default) and a note saying how its hashing is set up."""
    try:
        cmd, env = [sys.executable, "-m", "ftmem.smp", "--help"], _launch.job_env()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)
        help_text = proc.stdout
    except (OSError, subprocess.TimeoutExpired):
        help_text = ""
    if "--hash-threads" not in help_text:
        return [], "`--hash-threads` not offered by this SMP (it does not hash: the rank does)"
    if hash_threads <= 0:
        try:
            from ftmem.config import hash_threads_for

            here = f" ({hash_threads_for(0)} threads here)"
        except ImportError:  # a checkout from before the automatic default
            here = ""
        return [], f"`--hash-threads` offered by this SMP, left at its default{here}"
    return ["--hash-threads", str(hash_threads)], f"`--hash-threads {hash_threads}`"


@contextlib.contextmanager
def node_smp(
    run_dir: Path, *, slots: int, extra_args: list[str], log_path: Path
) -> Iterator[tuple[Any, str]]:
    """Start an SMP for ``run_dir`` (its own run id); yield (SmpProcess, run id). On exit it is
    stopped (SIGTERM, then SIGKILL, bounded), its descendants SIGKILLed by pid and its /dev/shm
    files removed."""
    from ftmem.smp.spawn import start_smp

    run_id = "bsdp" + uuid.uuid4().hex[:10]  # "bs": the smoke test's leak check covers it
    smp = None
    try:
        kw = {"log_path": log_path, "extra_args": extra_args, "env": _launch.job_env()}
        kw |= {"parent_pid": os.getpid(), "start_timeout": timedelta(seconds=120)}
        smp = start_smp(run_dir=run_dir, run_id=run_id, slots=slots, **kw)
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
        if left := _launch.remove_shm(run_id):
            logger.warning("removed shared memory the SMP left behind: %s", left)


@contextlib.contextmanager
def connect(run_dir: Path, client: bool = True) -> Iterator[tuple[Any, Any]]:
    """A ``Checkpointer`` of ``run_dir`` and an ``SmpClient`` (or None), closed on exit."""
    from ftmem.client import Checkpointer
    from ftmem.config import ClientConfig
    from ftmem.protocol.smp_client import SmpClient

    with contextlib.closing(Checkpointer(ClientConfig(run_dir=run_dir))) as ckpt:
        with contextlib.closing(SmpClient(run_dir)) if client else contextlib.nullcontext() as c:
            yield ckpt, c


def rank_status(client: Any, rank: int) -> dict[str, Any]:
    """The SMP's STATUS entry of ``rank`` as the SMP sent it ({} if it has none; the bench
    records these documents)."""
    return dict((client.status_document().get("ranks") or {}).get(str(rank)) or {})


def wait_verified(
    client: Any, rank: int, step: int, timeout: float
) -> tuple[bool | None, float, dict[str, Any], int]:
    """Wait until the SMP reports ``step`` (or newer) of ``rank`` verified, polling STATUS every
    5 ms backing off to 50 ms (each poll costs both sides CPU); (verified: None if the SMP
    verifies nothing, False on timeout; seconds waited, the last STATUS entry, polls made)."""
    t0, polls, pause = time.perf_counter(), 0, 0.005
    while True:
        status = rank_status(client, rank)
        polls += 1
        if "newest_verified" not in status:
            return None, time.perf_counter() - t0, status, polls
        newest = status["newest_verified"]
        done = newest is not None and int(newest) >= step
        if done or time.perf_counter() - t0 > timeout:
            return done, time.perf_counter() - t0, status, polls
        time.sleep(pause)
        pause = min(0.05, pause * 1.5)


def save_and_wait(ckpt: Any, state: Any, step: int, timeout: float) -> dict[str, Any]:
    """``ckpt.save(state, step)``, then ``handle.wait()`` (skipped: ``ckpt.wait()``, which saves
    the newest step again): save_s (in ``save()``), skipped, reason, committed, error and
    safe_s (to committed)."""
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


def timed_saves(
    ckpt: Any, state: Any, step: int, n: int, timeout: float, sync: Callable[[], Any] = lambda: None
) -> tuple[dict[str, Any], list[int]]:
    """Steps ``step + 1 .. step + n``, each :func:`save_and_wait` after ``sync()``: (save_s,
    safe_s of the committed ones, skipped, retried, reasons, errors), the committed steps."""
    out: dict[str, Any] = {"save_s": [], "safe_s": [], "skipped": 0, "retried": 0}
    out.update(reasons={}, errors=[])
    committed: list[int] = []
    for s in range(step + 1, step + n + 1):
        sync()
        one = save_and_wait(ckpt, state, s, timeout)
        out["save_s"].append(one["save_s"])
        if one["skipped"]:
            out["skipped"] += 1
            reason = one["reason"] or "?"
            out["reasons"][reason] = out["reasons"].get(reason, 0) + 1
            out["retried"] += int(one["committed"])
        if one["error"]:
            out["errors"].append(f"save of step {s}: {one['error']}")
        if one["committed"]:
            out["safe_s"].append(one["safe_s"])
            committed.append(s)
    return out, committed


def measure_saves(
    ckpt: Any, client: Any, state: Any, step: int, n: int, timeout: float, smp_pid: int, sync: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`timed_saves`, then :func:`wait_verified` of the last committed step: their figures,
    with the CPU of this process around the saves and of the SMP until verified; the last STATUS."""
    s0, r0, w0 = _proc.cpu_seconds(smp_pid), time.process_time(), time.perf_counter()
    saves, committed = timed_saves(ckpt, state, step, n, timeout, sync)
    r1, w1 = time.process_time(), time.perf_counter()
    verified, vwait, after, polls = None, 0.0, {}, 0
    if committed:
        verified, vwait, after, polls = wait_verified(client, ckpt.rank, committed[-1], timeout)
    s1, w2 = _proc.cpu_seconds(smp_pid), time.perf_counter()
    saves.update(committed=len(committed), rank_cpu=r1 - r0, smp_cpu=s1 - s0)
    saves.update(saves_wall_s=w1 - w0, window_s=w2 - w0, verified=verified)
    saves.update(verify_wait_s=vwait, polls=polls)
    return saves, after


def _delta(after: Any, before: Any) -> Any:
    """``after - before`` for counts and dicts of counts (None if either is missing)."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        d = {k: int(v) - int(before.get(k) or 0) for k, v in after.items()}
        return {k: v for k, v in d.items() if v}
    if isinstance(after, int | float) and isinstance(before, int | float):
        return after - before
    return None


# ------------------------------------------------------------------ the rank (a child process)


@dataclass
class _Rank:
    """The rank process of one size: measures phase by phase into ``res``, dumped after each."""

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
        return _proc.cpu_seconds(self.args.smp_pid)

    def state_dict(self) -> dict[str, Any]:
        sd = self.state.state_dicts()
        if "buffers" in self.st:
            sd["buffers"] = self.st["buffers"]
        return sd

    def build(self) -> None:
        a, t0 = self.args, time.perf_counter()
        self.state = baselines.build_state(a.size_gib, narrow=True)
        self.st = {"model": self.state.model, "optim": self.state.optimizer}
        if a.loose_frac > 0:  # tensors outside the optimizer: copied inside save()
            each = max(1, int(self.state.nbytes / (1 - a.loose_frac) * a.loose_frac / 4 / 4))
            self.st["buffers"] = {f"b{i}": torch.randn(each) for i in range(4)}
        tensors = baselines.state_tensors(self.state_dict())
        self.nbytes = sum(t.nbytes for t in tensors)
        loose = sum(t.nbytes for t in baselines.state_tensors(self.st.get("buffers", {})))
        model = self.state.model
        self.res.update(nbytes=self.nbytes, tensors=len(tensors), loose_bytes=loose)
        self.res.update(layers=len(model), width=model[0].in_features)
        self.res.update(build_s=time.perf_counter() - t0, torch_threads=torch.get_num_threads())
        self.res["pid"] = os.getpid()

    def memcpy(self) -> None:
        tensors = baselines.state_tensors(self.state_dict())
        dst = torch.empty(self.nbytes, dtype=torch.uint8)
        dst.zero_()  # touched: no page faults in the timed copies

        def copy() -> None:
            off = 0
            for t in tensors:
                dst[off : off + t.nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
                off += t.nbytes

        copy()
        self.res["memcpy"] = cpu_wall(copy, max(3, self.args.repeats))

    def ftmem_saves(self) -> None:
        a, timeout = self.args, self.args.wait_timeout
        with connect(a.run_dir) as (ckpt, client):
            rank = self.res["rank"] = ckpt.rank
            # The first save: the SMP creates and pre-faults the slots (inside save(), or off
            # the training thread while saves skip, then wait() saves the step again).
            self.step = 1
            s0, r0 = self.smp_cpu(), time.process_time()
            first = save_and_wait(ckpt, self.st, self.step, timeout)
            first["rank_cpu"] = time.process_time() - r0
            verified, vwait, _, polls = (None, 0.0, {}, 0)
            if first["committed"]:
                verified, vwait, _, polls = wait_verified(client, rank, self.step, timeout)
            first.update(verified=verified, verify_wait_s=vwait, polls=polls)
            first["smp_cpu"] = self.smp_cpu() - s0
            self.res["first"] = first
            self.dump()
            # What one STATUS request costs the SMP, and its CPU while idle (housekeeping).
            c0 = self.smp_cpu()
            for _ in range(40):
                rank_status(client, rank)
            self.res["smp_cpu_per_status"] = (self.smp_cpu() - c0) / 40
            i0, w0 = self.smp_cpu(), time.perf_counter()
            time.sleep(a.idle_s)
            self.res["smp_idle_cpu_per_s"] = (self.smp_cpu() - i0) / (time.perf_counter() - w0)
            before = rank_status(client, rank)
            # K saves, each waited for; CPU of the rank around them, of the SMP until verified.
            saves, after = measure_saves(
                ckpt, client, self.st, self.step, a.saves, timeout, a.smp_pid, lambda: None
            )
            self.step += a.saves
            saves["stats"] = ckpt.stats()
            after = after or rank_status(client, rank)
            keep = ("newest_committed", "newest_verified", "skipped", "skips", "commits")
            saves["status_after"] = {k: after[k] for k in keep if k in after}
            saves["smp_skips"] = _delta(after.get("skips"), before.get("skips"))
            self.res["saves"] = saves

    def restore(self) -> None:
        out: dict[str, Any] = {"wall": [], "rank_cpu": [], "smp_cpu": [], "steps": []}
        self.res["restore"] = out
        with connect(self.args.run_dir, client=False) as (ckpt, _):
            for _ in range(self.args.repeats):
                s0, r0, t0 = self.smp_cpu(), time.process_time(), time.perf_counter()
                got = ckpt.load(self.st)
                out["wall"].append(time.perf_counter() - t0)
                out["rank_cpu"].append(time.process_time() - r0)
                out["smp_cpu"].append(self.smp_cpu() - s0)
                out["steps"].append(got)
            ok = baselines.check_restore(lambda: ckpt.load(self.st), self.state)
            out["check"] = "ok" if ok else "MISMATCH"
            self.step = max(self.step, *out["steps"])

    def skips(self) -> None:
        a, out = self.args, {}
        self.res["skips"] = out
        with connect(a.run_dir) as (ckpt, client):
            cases = (("back to back", 0.0), (f"{a.compute_ms:g} ms compute", a.compute_ms))
            for label, ms in cases:
                work = baselines.make_simulator("compute", ms / 1e3) if ms > 0 else (lambda: None)
                before = rank_status(client, ckpt.rank)
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
                committed = bool(ckpt.wait(timeout=a.wait_timeout))
                row["last_committed"] = committed and ckpt.stats().get("last_step") == self.step
                after: dict[str, Any] = {}
                if (newest := ckpt.stats().get("last_step")) is not None:
                    after = wait_verified(client, ckpt.rank, int(newest), a.wait_timeout)[2]
                after = after or rank_status(client, ckpt.rank)
                row["smp_skipped"] = _delta(after.get("skipped"), before.get("skipped"))
                row["smp_skips"] = _delta(after.get("skips"), before.get("skips"))
                out[label] = row
                self.dump()

    def dcp(self) -> None:
        stager = baselines.cpu_stager(True)
        disk = tempfile.mkdtemp(prefix="ftmem-bench-dp-dcp-", dir=self.args.disk_dir)
        self.res["dcp"] = {"blocking": [], "staged": [], "done": [], "disk": disk}
        try:
            sd, n = self.state_dict(), self.args.dcp_saves
            self.res["dcp"].update(baselines.dcp_async_saves(sd, disk, n, stager))
        finally:
            stager.close()
            shutil.rmtree(disk, ignore_errors=True)

    def run(self) -> int:
        """Every phase; a failed one is recorded in ``errors`` (0, or 1 if the build failed)."""
        phases = {"build": self.build, "memcpy": self.memcpy, "ftmem": self.ftmem_saves}
        phases |= {"restore": self.restore, "skips": self.skips, "dcp": self.dcp}
        if self.args.skip_dcp:
            del phases["dcp"]
        for name, phase in phases.items():
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


def rank_main(args: argparse.Namespace) -> int:
    """The rank process: measure one size (``--sizes``), write its raw figures to ``--result``
    (``args``: datapath.py's command line with ``--_rank``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(name)s: %(message)s")
    args.size_gib = float(args.sizes)
    torch.set_num_threads(1)
    os.environ["FTMEM_RUN_DIR"] = str(args.run_dir)
    return _Rank(args).run()
