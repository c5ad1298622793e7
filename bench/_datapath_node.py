"""The data path benchmark's node side: its SMP, the rank process, and the helpers of its
``--gpu`` variant.

``bench/datapath.py`` starts an SMP (:func:`node_smp`) and runs this file as the rank, one
child process per state size (``python bench/_datapath_node.py --size-gib S --result FILE
...``): it builds the state, times a memcpy, the saves, the restore, the skips and
``dcp.async_save``, and writes its raw figures to ``--result`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/_datapath_node.py

from bench import _baselines as baselines
from bench import _launch, _proc

logger = logging.getLogger("bench.datapath")

VERIFY_POLL_MIN_S = 0.005
VERIFY_POLL_MAX_S = 0.05
"""STATUS poll intervals while waiting for the SMP to verify (each poll costs both sides CPU)."""


def smp_help() -> str:
    """The SMP's ``--help`` text ("" if it could not be read)."""
    try:
        cmd, env = [sys.executable, "-m", "ftmem.smp", "--help"], _launch.job_env()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)
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
        left = _launch.remove_shm(run_id)
        if left:
            logger.warning("removed shared memory the SMP left behind: %s", left)


def rank_status(client: Any, rank: int) -> dict[str, Any]:
    """The SMP's STATUS entry of ``rank`` ({} if it has none)."""
    return dict((client.status().get("ranks") or {}).get(str(rank)) or {})


def wait_verified(
    client: Any, rank: int, step: int, timeout: float
) -> tuple[bool | None, float, dict[str, Any], int]:
    """Wait until the SMP reports ``step`` (or newer) of ``rank`` verified, polling STATUS
    every 5 ms backing off to 50 ms; (verified: None if the SMP verifies nothing, False on
    timeout; seconds waited, the rank's last STATUS entry, STATUS requests made)."""
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
    """``ckpt.save(state, step)``, then ``handle.wait()`` (skipped: ``ckpt.wait()``, which saves
    the newest step again); save_s (in ``save()``), safe_s (to committed), skipped, reason,
    committed, error."""
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


def _delta(after: Any, before: Any) -> Any:
    """``after - before`` for counts and dicts of counts (None if either is missing)."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        d = {k: int(v) - int(before.get(k) or 0) for k, v in after.items()}
        return {k: v for k, v in d.items() if v}
    if isinstance(after, int | float) and isinstance(before, int | float):
        return after - before
    return None


def memcpy_into(dst: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the bytes of ``tensors`` one after the other into the flat uint8 ``dst``."""
    off = 0
    for t in tensors:
        n = t.nbytes
        dst[off : off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        off += n


# --------------------------------------------------------------------------- hash table


def _rank_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="_datapath_node.py", description="the benchmark's rank")
    required: dict[str, type] = {"size-gib": float, "run-dir": Path, "smp-pid": int, "result": Path}
    required.update({"saves": int, "repeats": int, "compute-ms": float, "dcp-saves": int})
    for name, kind in required.items():
        p.add_argument(f"--{name}", type=kind, required=True)
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
        return _proc.cpu_seconds(self.args.smp_pid)

    def state_dict(self) -> dict[str, Any]:
        """The model's and optimizer's state dicts, and the loose buffers if any."""
        sd = {"model": self.state.model.state_dict(), "optim": self.state.optimizer.state_dict()}
        if "buffers" in self.st:
            sd["buffers"] = self.st["buffers"]
        return sd

    # -- phases ----------------------------------------------------------------------------
    def build(self) -> None:
        a = self.args
        t0 = time.perf_counter()
        self.state = baselines.build_state(a.size_gib, narrow=True)
        self.st = {"model": self.state.model, "optim": self.state.optimizer}
        if a.loose_frac > 0:
            total = self.state.nbytes / (1 - a.loose_frac)
            each = max(1, int(total * a.loose_frac / 4 / 4))
            self.st["buffers"] = {f"b{i}": torch.randn(each) for i in range(4)}
        tensors = baselines.state_tensors(self.state_dict())
        self.nbytes = sum(t.nbytes for t in tensors)
        self.res.update(
            nbytes=self.nbytes,
            tensors=len(tensors),
            loose_bytes=sum(t.nbytes for t in baselines.state_tensors(self.st.get("buffers", {}))),
            layers=len(self.state.model),
            width=self.state.model[0].in_features,
            build_s=time.perf_counter() - t0,
            torch_threads=torch.get_num_threads(),
            pid=os.getpid(),
        )

    def memcpy(self) -> None:
        tensors = baselines.state_tensors(self.state_dict())
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
                verified=verified, verify_wait_s=vwait, polls=polls, smp_cpu=self.smp_cpu() - s0
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
            s0, r0, w0 = self.smp_cpu(), time.process_time(), time.perf_counter()
            saves, committed = timed_saves(ckpt, self.st, self.step, a.saves, timeout)
            self.step += a.saves
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
            ok = baselines.check_restore(lambda: ckpt.load(self.st), self.state)
            out["check"] = "ok" if ok else "MISMATCH"
            self.step = max(self.step, *out["steps"])
        finally:
            ckpt.close()

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
                work = baselines.make_simulator("compute", ms / 1e3) if ms > 0 else (lambda: None)
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
        from torch.distributed.checkpoint.state_dict_saver import async_save

        a = self.args
        sd = self.state_dict()
        stager = baselines.cpu_stager(True)
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


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(rank_main(sys.argv[1:]))
