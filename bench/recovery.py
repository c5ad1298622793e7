"""Recovery benchmark: failure -> all ranks stepping again, ftmem-launch vs torchrun + DCP.

Usage (from the repository root; ftmem installed, e.g. ``pip install -e .``):

    python bench/recovery.py                       # 3 repeats per system (~6-9 min)
    python bench/recovery.py --quick               # 1 repeat per system (~2-3 min)
    python bench/recovery.py --repeats 5 --out docs/benchmarks.md

All systems train the same model on the same data: ``examples/train_gpt.py`` (default size,
2 ranks, gloo, one node), and rank 1 SIGKILLs itself right after step ``--fail-at-step``:

* **ftmem + standbys** (the default): ``ftmem-launch --standalone --nproc-per-node 2
  --ftmem-standby 1 --ftmem-run-dir DIR examples/train_gpt.py ... --fail-at-step N
  --fail-rank 1``, a snapshot after every step; the launcher hands both ranks to its warm
  standby processes, which ``ftmem.load`` from the node's SMP (a run where the standbys were
  not ready at the failure is reported as an error).
* **ftmem cold**: the same with ``--ftmem-standby 0``: new processes, as torchrun starts them.
* **torchrun + DCP**: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` (with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) runs this very script as a worker
  (``--_dcp-worker``), which imports the example's model, data, schedule and digest code with
  ``importlib``, runs the same training loop, and every ``--dcp-every`` steps writes a
  ``torch.distributed.checkpoint.save`` to a disk directory (files fsync'd); on restart it
  ``dcp.load``s the newest complete checkpoint (model, AdamW, LR schedule, data position and
  the per-rank RNG state, so the run stays bitwise deterministic).

A failure-free ``--no-ftmem`` run gives the reference digest; every recovered run must end
with it. The time line of each recovery comes from timestamps in the logs (the example's and
the worker's ``logging`` lines, elastic's log lines with ``LOGGER=INFO``): rank death (the
failing rank's log line of step N) -> detected (elastic's first reaction) -> ranks stopped
-> ranks spawned ("Starting worker group") -> process start + ``import torch`` + process group
+ model built (the ``model:`` line) -> restored (``restored step``) -> first step done. It
writes its tables into ``--out`` between ``<!-- bench:recovery:start -->`` and
``<!-- bench:recovery:end -->`` (the rest of the file is kept). Every number is measured.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    from bench import _launch, _report, _train
except ImportError:  # run as a script (also as torchrun's worker): bench/ is sys.path[0]
    import _launch  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]
    import _train  # type: ignore[no-redef]

REPO = _launch.REPO
EXAMPLE = _launch.EXAMPLE
SECTION = "recovery"
START_MARK, END_MARK = _report.markers(SECTION)
GOAL_RATIO = 1.0 / 3.0
GOAL_RESTART_S = 1.5
"""Issue 14: rank death -> all ranks stepping with standbys (half of DLRover's 2.98 s here)."""
DLROVER_DETECT_S, DLROVER_START_S = 0.10, 0.02
"""DLRover Flash Checkpoint on this kind of machine (issue 14): detection, detection -> new
ranks started."""
FAIL_RANK = 1
FT_STANDBY = "ftmem-launch + standbys"
FT_COLD = "ftmem-launch (cold)"
DCP = "torchrun + DCP"
SYSTEMS = (FT_STANDBY, FT_COLD, DCP)
LAUNCHER_PHASES = ("stop", "rendezvous", "start", "script", "load", "first_step")
WORKER_FLAG = "--_dcp-worker"

logger = logging.getLogger("bench.recovery")


# --------------------------------------------------------------------------- the DCP worker


def _newest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    """Return (step, path) of the newest complete DCP checkpoint (``.metadata`` written)."""
    best: tuple[int, Path] | None = None
    if not ckpt_dir.is_dir():
        return None
    for entry in ckpt_dir.iterdir():
        m = re.fullmatch(r"step_(\d+)", entry.name)
        if m and (entry / ".metadata").is_file():
            step = int(m.group(1))
            if best is None or step > best[0]:
                best = (step, entry)
    return best


def dcp_worker(argv: Sequence[str]) -> int:
    """The torchrun entry point of the torchrun + DCP system (``--_dcp-worker``).

    ``argv``: ``--ckpt-dir DIR --ckpt-every K -- <examples/train_gpt.py arguments>``. Runs the
    example's training loop (same model, data, optimizer, schedule, seeds, failure injection,
    ``--step-delay`` and digest) with a ``dcp.save`` every K steps instead of ``ftmem.save``
    after every step; a restart ``dcp.load``s the newest complete checkpoint.
    """
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    wp = argparse.ArgumentParser(prog="recovery.py --_dcp-worker")
    wp.add_argument("--ckpt-dir", type=Path, required=True)
    wp.add_argument("--ckpt-every", type=int, required=True)
    wp.add_argument("example_args", nargs=argparse.REMAINDER)
    wargs = wp.parse_args(list(argv))
    example_argv = list(wargs.example_args)
    if example_argv[:1] == ["--"]:
        example_argv = example_argv[1:]
    t = _train.setup(example_argv, "dcp_worker")
    args, rank, log = t.args, t.rank, t.log

    start = 0
    newest = _newest_checkpoint(wargs.ckpt_dir)
    if newest is not None:
        step, path = newest
        t0 = time.perf_counter()
        state = t.dcp_state()  # the structure to load into (initialises AdamW state)
        dcp_load(state, checkpoint_id=str(path))
        t.dcp_restore(state)
        start = step
        log.info("restored step %d (dcp.load %.3f s)", step, time.perf_counter() - t0)
    print(f"[rank {rank}] resumed from step {start}", flush=True)

    # Fail once: the example's rule (not when resumed at >= N) would fail again after a
    # restore from an older checkpoint, so only the first incarnation fails (one node here).
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    step_times: list[float] = []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        loss = t.step()
        step_times.append(time.perf_counter() - t0)
        t.log_step(step + 1, loss)
        if (step + 1) % wargs.ckpt_every == 0:
            t1 = time.perf_counter()
            dcp_save(t.dcp_state(), checkpoint_id=str(wargs.ckpt_dir / f"step_{step + 1:06d}"))
            log.info("checkpoint of step %d: dcp.save %.3f s", step + 1, time.perf_counter() - t1)
        if step + 1 == args.fail_at_step and rank == args.fail_rank and first_start:
            print(f"[rank {rank}] injecting failure (kill) after step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.step_delay:
            time.sleep(args.step_delay)  # as the example: host idle (e.g. an accelerator's time)
    t.finish(max(start, args.steps), step_times)
    return 0


# --------------------------------------------------------------------------- running jobs


_tool = _launch.tool
run_job = _launch.run_job


# --------------------------------------------------------------------------- log parsing

_PY_LINE = re.compile(
    r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}) \[rank (\d+)\] (\S+) [A-Z]+: (.*)$"
)
_GLOG_LINE = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6}) +\d+ \S+\] (.*)$")
_DIGEST = re.compile(r"\[rank (\d+)\] digest ([0-9a-f]{64})")
_MEDIAN = re.compile(r"\[rank (\d+)\] median step time ([0-9.]+) s")


@dataclass(slots=True)
class LogLine:
    """One timestamped line: a rank's ``logging`` line (rank set) or elastic's (rank None)."""

    t: float
    rank: int | None
    msg: str


def parse_log(text: str, year: int) -> tuple[list[LogLine], dict[int, str], list[float]]:
    """Return the timestamped lines (by time), the digest per rank, and the median step times.

    Digests and median step times are those printed last per rank (the final incarnation).
    """
    lines: list[LogLine] = []
    digests: dict[int, str] = {}
    medians: dict[int, float] = {}
    for raw in text.splitlines():
        m = _PY_LINE.search(raw)
        if m:
            ts = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            lines.append(LogLine(ts, int(m.group(2)), m.group(4)))
            continue
        g = _GLOG_LINE.match(raw)
        if g:
            mo, d, hh, mm, ss, us = (int(x) for x in g.groups()[:6])
            ts = datetime.datetime(year, mo, d, hh, mm, ss, us).timestamp()
            lines.append(LogLine(ts, None, g.group(7)))
            continue
        m = _DIGEST.search(raw)
        if m:
            digests[int(m.group(1))] = m.group(2)
            continue
        m = _MEDIAN.search(raw)
        if m:
            medians[int(m.group(1))] = float(m.group(2))
    lines.sort(key=lambda line: line.t)
    return lines, digests, list(medians.values())


PHASES: tuple[tuple[str, str], ...] = (
    ("detect", "rank death -> elastic's first reaction (SIGTERM to the survivor)"),
    ("stop", "-> survivor stopped, failure handled ('Rendezvous'ing worker group')"),
    ("rendezvous", "-> new ranks being spawned ('Starting worker group')"),
    ("spawn+import", "-> 'script started' on all ranks: process start, the imports (torch)"),
    ("script", "-> 'model:' line on all ranks: PG init, model (and imports on first use)"),
    ("restore", "-> 'restored step' on all ranks: DDP wrap, optimizer, ftmem.load / dcp.load"),
    ("first step", "-> first step after the restore logged on all ranks"),
)


@dataclass(slots=True)
class Result:
    """One failure run of one system, as measured from its logs."""

    system: str
    repeat: int
    rc: int | None
    wall_s: float
    digest_ok: bool
    digest: str = ""
    """The final digest both ranks printed ("" if they did not agree or did not print)."""
    restored: int | None = None
    steps_lost: int | None = None
    step_time_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    death_to_resumed_s: float | None = None
    detect_to_resumed_s: float | None = None
    launcher_detect_to_resumed_s: float | None = None
    launcher_phases: dict[str, float | None] = field(default_factory=dict)
    """ftmem-launch's own split of detect -> stepping (its ``resumed`` event)."""
    warmup_extra_s: float | None = None
    """Training time the standbys' warm-ups cost: steps during warm-ups minus as many steps
    of the run's median outside them (rank 0's step lines)."""
    warmups: int = 0
    load1: float | None = None
    """The 1-minute load average when the run started (a shared machine)."""
    checkpoint_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def time_lost_s(self) -> float | None:
        """Rank death -> all ranks stepping again, plus the re-done steps."""
        if None in (self.death_to_resumed_s, self.steps_lost, self.step_time_s):
            return None
        assert self.death_to_resumed_s is not None and self.step_time_s is not None
        assert self.steps_lost is not None
        return self.death_to_resumed_s + self.steps_lost * self.step_time_s


def _first(lines: list[LogLine], pred: Callable[[LogLine], bool], after: float) -> LogLine | None:
    return next((ln for ln in lines if ln.t >= after and pred(ln)), None)


def analyse(
    res: Result, text: str, fail_step: int, year: int, events: list[dict[str, Any]] | None
) -> None:
    """Fill ``res`` from the run's combined log (and ftmem's events.jsonl)."""
    lines, _, medians = parse_log(text, year)
    step_re = re.compile(r"step (\d+) loss ")
    death = next(
        (
            ln
            for ln in lines
            if ln.rank == FAIL_RANK
            and (m := step_re.match(ln.msg))
            and int(m.group(1)) == fail_step
        ),
        None,
    )
    if death is None:
        res.error = f"no log line of step {fail_step} on rank {FAIL_RANK}"
        return
    t_death = death.t

    def elastic(pattern: str, after: float) -> LogLine | None:
        return _first(lines, lambda ln: ln.rank is None and pattern in ln.msg, after)

    failed = elastic("failed (exitcode", t_death)
    sigterm = elastic("closing signal SIGTERM", t_death)
    if failed is None:
        res.error = "elastic never reported the failure"
        return
    t_detect = min(failed.t, sigterm.t) if sigterm is not None else failed.t
    rdzv = elastic("Rendezvous'ing worker group", failed.t)
    t_stopped = rdzv.t if rdzv is not None else failed.t
    spawn = elastic("Starting worker group", t_stopped)
    t_spawn: float | None = spawn.t if spawn is not None else None
    if t_spawn is None and events:  # ftmem-launch: its own event, just after the spawn
        starts = [e for e in events if e.get("event") == "ranks_started" and e["time"] >= t_stopped]
        t_spawn = starts[0]["time"] if starts else None
    after = t_spawn if t_spawn is not None else t_stopped

    def all_ranks(pred: Callable[[LogLine], bool], since: float) -> float | None:
        ts = []
        for rank in (0, 1):
            ln = _first(lines, lambda x, r=rank: x.rank == r and pred(x), since)  # type: ignore[misc]
            if ln is None:
                return None
            ts.append(ln.t)
        return max(ts)

    t_ready = all_ranks(lambda ln: ln.msg.startswith("model: "), after)
    t_script = all_ranks(lambda ln: ln.msg == "script started", after)
    restored_lines = [ln for ln in lines if ln.t >= after and ln.msg.startswith("restored step ")]
    if t_ready is None or not restored_lines:
        res.error = "the restarted ranks did not log 'model:' and 'restored step'"
        return
    res.restored = int(restored_lines[0].msg.split()[2])
    t_restored = all_ranks(lambda ln: ln.msg.startswith("restored step "), after)
    first = res.restored + 1
    t_resumed = all_ranks(
        lambda ln: (m := step_re.match(ln.msg)) is not None and int(m.group(1)) == first,
        t_restored or after,
    )
    if t_restored is None or t_resumed is None:
        res.error = "no first step after the restore on every rank"
        return
    res.steps_lost = fail_step - res.restored
    res.step_time_s = statistics.median(medians) if medians else None
    res.phases = {
        "detect": t_detect - t_death,
        "stop": t_stopped - t_detect,
        "rendezvous": (t_spawn - t_stopped) if t_spawn is not None else float("nan"),
        "spawn+import": (
            (t_script - t_spawn) if t_spawn is not None and t_script is not None else float("nan")
        ),
        "script": (t_ready - t_script) if t_script is not None else float("nan"),
        "restore": t_restored - t_ready,
        "first step": t_resumed - t_restored,
    }
    res.death_to_resumed_s = t_resumed - t_death
    res.detect_to_resumed_s = t_resumed - t_detect
    res.checkpoint_s = [
        float(m.group(1))
        for ln in lines
        if (m := re.search(r"dcp\.save ([0-9.]+) s", ln.msg)) is not None
    ]
    res.load_s = [
        float(m.group(1))
        for ln in lines
        if (m := re.search(r"dcp\.load ([0-9.]+) s", ln.msg)) is not None
    ]
    if events:
        res.warmup_extra_s, res.warmups = warmup_cost(lines, events)
        resumed = [e for e in events if e.get("event") == "resumed"]
        if resumed:
            res.launcher_detect_to_resumed_s = float(resumed[0]["detect_to_resumed_s"])
            res.launcher_phases = dict(resumed[0].get("phases") or {})


def warmup_cost(lines: list[LogLine], events: list[dict[str, Any]]) -> tuple[float | None, int]:
    """What the standbys' warm-ups cost the training: (extra seconds, warm-ups seen).

    A step's duration is the time between rank 0's consecutive step lines (``--log-every
    1``) within one incarnation; a step counts as "during a warm-up" if it ended between a
    ``standbys_started`` event and the matching ``standbys_ready`` events.
    """
    step_re = re.compile(r"step (\d+) loss ")
    steps = [
        (ln.t, int(m.group(1))) for ln in lines if ln.rank == 0 and (m := step_re.match(ln.msg))
    ]
    durations = [(t1, t1 - t0) for (t0, s0), (t1, s1) in itertools.pairwise(steps) if s1 == s0 + 1]
    windows: list[tuple[float, float]] = []
    for e in events:
        if e.get("event") != "standbys_started":
            continue
        ready = [
            r["time"]
            for r in events
            if r.get("event") == "standbys_ready" and r["time"] > e["time"]
        ]
        windows.append((e["time"], max(ready[: len(e.get("pids", []))] or [e["time"]])))
    if not windows or not durations:
        return None, len(windows)
    inside = [d for t, d in durations if any(a <= t <= b for a, b in windows)]
    outside = [d for t, d in durations if not any(a <= t <= b for a, b in windows)]
    if not outside:
        return None, len(windows)
    base = statistics.median(outside)
    return sum(inside) - len(inside) * base, len(windows)


# --------------------------------------------------------------------------- the benchmark


@dataclass(slots=True)
class Setup:
    """What every run shares."""

    steps: int
    fail_step: int
    dcp_every: int
    timeout: float
    workdir: Path
    year: int
    ref_digest: str = ""
    ref_step_time: float | None = None
    commands: dict[str, str] = field(default_factory=dict)


def _env(setup: Setup) -> dict[str, str]:
    env = dict(os.environ)
    # torchrun leaves a log directory in $TMPDIR per run: keep it inside our temp dir.
    tmp = setup.workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env["LOGLEVEL"] = "INFO"  # elastic's "Starting worker group" etc.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("FTMEM_RUN_DIR", None)
    return env


def _example_args(setup: Setup) -> list[str]:
    return ["--steps", str(setup.steps), "--log-every", "1"]


def _show(cmd: list[str], setup: Setup) -> str:
    """A command for the docs: repository-relative, temp dirs as placeholders."""
    out = []
    for part in cmd:
        part = part.replace(str(setup.workdir), "$TMP").replace(str(REPO) + "/", "")
        if part == sys.executable:
            part = "python"
        elif os.path.isabs(part) and shutil.which(os.path.basename(part)) == part:
            part = os.path.basename(part)
        out.append(part)
    return " ".join(out)


def run_reference(setup: Setup) -> None:
    """The failure-free ``--no-ftmem`` run under torchrun: reference digest and step time."""
    cmd = [
        *_tool("torchrun", "torch.distributed.run"),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        *_example_args(setup),
        "--no-ftmem",
    ]
    setup.commands["reference"] = _show(cmd, setup)
    log_path = setup.workdir / "reference.log"
    rc, wall = run_job(cmd, _env(setup), log_path, setup.timeout)
    _, digests, medians = parse_log(log_path.read_text(errors="replace"), setup.year)
    if rc != 0 or len(digests) != 2 or len(set(digests.values())) != 1:
        raise RuntimeError(f"reference run failed (rc {rc}); log {log_path} (kept with --keep)")
    setup.ref_digest = next(iter(digests.values()))
    setup.ref_step_time = statistics.median(medians) if medians else None
    logger.info("reference: digest %s..., %.1f s", setup.ref_digest[:12], wall)


def run_ftmem(setup: Setup, repeat: int, *, standby: bool) -> Result:
    """One ftmem-launch run with rank 1 SIGKILLed after ``fail_step``, with standby ranks
    (the default) or cold restarts (``--ftmem-standby 0``)."""
    tag = "sb" if standby else "ft"
    run_dir = setup.workdir / f"{tag}{repeat}"
    cmd = [
        *_tool("ftmem-launch", "ftmem.launch"),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--ftmem-standby",
        "1" if standby else "0",
        "--ftmem-run-dir",
        str(run_dir),
        str(EXAMPLE),
        *_example_args(setup),
        "--fail-at-step",
        str(setup.fail_step),
        "--fail-rank",
        str(FAIL_RANK),
    ]
    setup.commands[tag] = _show(cmd, setup).replace(f"$TMP/{tag}{repeat}", "$RUN_DIR")
    log_path = setup.workdir / f"ftmem-{tag}{repeat}.log"
    load1 = os.getloadavg()[0]
    rc, wall = run_job(cmd, _env(setup), log_path, setup.timeout)
    events: list[dict[str, Any]] = []
    events_path = run_dir / "events.jsonl"
    if events_path.is_file():
        events = [json.loads(x) for x in events_path.read_text().splitlines() if x.strip()]
    res = _finish(
        FT_STANDBY if standby else FT_COLD, repeat, rc, wall, log_path, setup, events, load1
    )
    started = [e for e in events if e.get("event") == "ranks_started"]
    if standby and (len(started) < 2 or sorted(started[1].get("from_standby", [])) != [0, 1]):
        res.error = (res.error + "; the standbys were not ready at the failure").lstrip("; ")
    return res


def run_dcp(setup: Setup, repeat: int) -> Result:
    """One torchrun + DCP run with rank 1 SIGKILLed after ``fail_step``."""
    ckpt_dir = setup.workdir / f"dcp{repeat}"
    ckpt_dir.mkdir()
    cmd = [
        *_tool("torchrun", "torch.distributed.run"),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(Path(__file__).resolve()),
        WORKER_FLAG,
        "--ckpt-dir",
        str(ckpt_dir),
        "--ckpt-every",
        str(setup.dcp_every),
        "--",
        *_example_args(setup),
        "--fail-at-step",
        str(setup.fail_step),
        "--fail-rank",
        str(FAIL_RANK),
    ]
    shown = _show(cmd, setup).replace(f"$TMP/dcp{repeat}", "$CKPT_DIR")
    setup.commands["dcp"] = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 " + shown
    log_path = setup.workdir / f"dcp{repeat}.log"
    load1 = os.getloadavg()[0]
    rc, wall = run_job(cmd, _env(setup), log_path, setup.timeout)
    return _finish(DCP, repeat, rc, wall, log_path, setup, None, load1)


def _finish(
    system: str,
    repeat: int,
    rc: int | None,
    wall: float,
    log_path: Path,
    setup: Setup,
    events: list[dict[str, Any]] | None,
    load1: float,
) -> Result:
    text = log_path.read_text(errors="replace")
    _, digests, _ = parse_log(text, setup.year)
    agreed = next(iter(digests.values())) if len(set(digests.values())) == 1 else ""
    agreed = agreed if len(digests) == 2 else ""
    # Without a reference run, run() compares the digests of all runs once they are done.
    ok = bool(agreed) and (agreed == setup.ref_digest or not setup.ref_digest)
    res = Result(
        system=system, repeat=repeat, rc=rc, wall_s=wall, digest_ok=ok, load1=load1, digest=agreed
    )
    analyse(res, text, setup.fail_step, setup.year, events)
    if rc != 0:
        res.error = (res.error + f"; exit code {rc}").lstrip("; ")
    logger.info(
        "%s #%d: rc %s, %.1f s, digest %s, restored %s, death->resumed %s s, time lost %s s%s",
        system,
        repeat,
        rc,
        wall,
        "ok" if ok else "MISMATCH",
        res.restored,
        _fmt(res.death_to_resumed_s),
        _fmt(res.time_lost_s),
        f" ({res.error}; log {log_path})" if res.error else "",
    )
    return res


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def _stat(values: Sequence[float | None], digits: int = 2, unit: str = "") -> str:
    """``median (min-max)`` over the measured values."""
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return "n/a"
    med = statistics.median(vals)
    if len(vals) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v == v]
    return statistics.median(vals) if vals else None


@dataclass(slots=True)
class StandbyCost:
    """What one standby rank costs while it waits (measured on a standby started here)."""

    warm_up_s: float
    """Spawn -> ready (wall)."""
    cpu_s: float
    """CPU (user + system) the standby spent to get ready."""
    rss_mib: float
    uss_mib: float
    """Memory only this process holds (the shared libraries' pages are shared with ranks)."""
    idle_cpu_s: float
    """CPU it spent in the 2 s after it was ready (waiting on its socket)."""


def measure_standby_cost(workdir: Path) -> StandbyCost | None:
    """Start one standby as the agent would (default imports), time it and weigh it."""
    import psutil

    from ftmem.launch.standby import StandbyPool

    pool = StandbyPool(count=1, imports=(), cuda=False, run_dir=workdir, node="bench")
    pool.configure(sys.executable, ["-u", str(EXAMPLE)], 1)
    try:
        (standby,) = pool.spawn_missing()
        deadline = time.monotonic() + 120
        while not standby.poll_ready():
            if time.monotonic() > deadline or standby.popen.poll() is not None:
                return None
            time.sleep(0.02)
        proc = psutil.Process(standby.pid)
        warm = (standby.ready_at or time.time()) - standby.spawned
        t0 = proc.cpu_times()
        time.sleep(2.0)
        t1 = proc.cpu_times()
        mem = proc.memory_full_info()
        return StandbyCost(
            warm_up_s=warm,
            cpu_s=t0.user + t0.system,
            rss_mib=mem.rss / 2**20,
            uss_mib=mem.uss / 2**20,
            idle_cpu_s=(t1.user + t1.system) - (t0.user + t0.system),
        )
    finally:
        pool.stop()


def render(
    setup: Setup,
    results: dict[str, list[Result]],
    command: str,
    machine: dict[str, str],
    cost: StandbyCost | None = None,
) -> str:
    """The markdown section, between the markers."""
    systems = [name for name in SYSTEMS if results.get(name)]
    repeats = max((len(results[n]) for n in systems), default=0)
    sb, cold, dc = (results.get(n, []) for n in SYSTEMS)
    out = [
        START_MARK,
        "## Recovery: failure to resumed, ftmem-launch (standby ranks, cold) vs torchrun + DCP",
        "",
        *_report.generated_by("recovery.py", command),
        f"- date: {machine['date']}",
        f"- CPU: {machine['cpu']}; {machine['versions']}",
        f"- 1-minute load average at start / end: {machine['load']} (the machine may be shared: "
        "compare the systems within this run only)",
        f"- model: `examples/train_gpt.py` default size ({machine['params']} parameters: "
        "d_model 256, 4 layers, vocab 512, seq 64, batch 8 per rank; AdamW, dropout 0.1), "
        f"2 ranks (gloo) on one node, {setup.steps} steps; failure-free step time "
        f"{_fmt(setup.ref_step_time, 3)} s ("
        + (
            "median of the reference run)"
            if setup.ref_digest
            else "no reference run (`--no-reference`): median of the runs below)"
        ),
        f"- failure: rank {FAIL_RANK} SIGKILLs itself right after step {setup.fail_step} "
        "(`--fail-at-step`), once; "
        f"{repeats} run(s) per system, alternating; figures are median (min-max) over the runs",
        "- ftmem-launch + standbys is the default (`--ftmem-standby 1`): the failure comes late "
        "enough that the standbys started after the first steps are ready (a run where they "
        "were not is marked as an error); ftmem-launch (cold) is `--ftmem-standby 0`",
        f"- torchrun + DCP: `dcp.save` every K = {setup.dcp_every} steps (a fixed interval, "
        f"not Young/Daly) to a directory on the local disk (/tmp, files fsync'd); the failure "
        f"at step {setup.fail_step} lies in the middle of an interval, so the steps lost are "
        "K/2, the expected loss of a failure at a uniformly random time. ftmem snapshots "
        "every step.",
        "",
        "Commands (`$RUN_DIR`, `$CKPT_DIR`: fresh temporary directories per run; "
        "`LOGLEVEL=INFO` is set for all, so that elastic logs its phases):",
        "",
        "```",
        f"# reference (failure-free): {setup.commands.get('reference', 'not run')}",
        f"# ftmem + standbys: {setup.commands.get('sb', '')}",
        f"# ftmem cold:       {setup.commands.get('ft', '')}",
        f"# DCP:              {setup.commands.get('dcp', '')}",
        "```",
        "",
        "The DCP worker is `bench/recovery.py --_dcp-worker`: it imports the example with "
        "`importlib`, builds the same model, data, AdamW and LR schedule in the same order, "
        "runs the same loop and prints the same digest; its checkpoint holds the model and "
        "optimizer (`get_state_dict`), the schedule, the data position and each rank's RNG "
        "state, and a restart `dcp.load`s the newest complete one (`.metadata` present).",
        "",
        "| system | rank death -> all ranks stepping | detect -> stepping | steps lost "
        "| step time | time lost | "
        + (
            "final digest = failure-free |"
            if setup.ref_digest
            else "final digest = every other run's (no reference run) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for name in systems:
        rs = results[name]
        digest = f"{sum(r.digest_ok for r in rs)}/{len(rs)}"
        out.append(
            f"| {name} | {_stat([r.death_to_resumed_s for r in rs], unit=' s')} "
            f"| {_stat([r.detect_to_resumed_s for r in rs], unit=' s')} "
            f"| {_stat([None if r.steps_lost is None else float(r.steps_lost) for r in rs], 0)} "
            f"| {_stat([r.step_time_s for r in rs], 3, ' s')} "
            f"| {_stat([r.time_lost_s for r in rs], unit=' s')} | {digest} |"
        )
    out += [
        "",
        "time lost = (rank death -> all ranks stepping again) + steps lost x step time (the "
        "run's own median step time after the restart); steps lost = failure step - restored "
        "step. 'detect -> stepping' leaves out the detection latency (the first row of the "
        "split).",
        "",
        "Split of rank death -> all ranks stepping again, from the logs (seconds, median "
        "(min-max)):",
        "",
        "| phase | what ends it | " + " | ".join(systems) + " |",
        "|---|---|" + "---|" * len(systems),
    ]
    for key, what in PHASES:
        cells = " | ".join(_stat([r.phases.get(key) for r in results[n]]) for n in systems)
        out.append(f"| {key} | {what} | {cells} |")
    totals = " | ".join(_stat([r.death_to_resumed_s for r in results[n]]) for n in systems)
    out.append(f"| total | | {totals} |")
    ft_systems = [n for n in (FT_STANDBY, FT_COLD) if results.get(n)]
    out += [
        "",
        "ftmem-launch's own split (its `resumed` event in `events.jsonl`, also in `ftmem "
        "timeline`; seconds, median (min-max)): detection is when the agent's monitor saw the "
        "rank dead, then stop = survivors stopped, rendezvous = the new round, start = ranks "
        "spawned or handed to standbys, script = until every rank's first contact with the SMP "
        "(`ftmem.load` called: imports, process group, model, DDP wrap), load = `ftmem.load`, "
        "first step = first progress report after the restore:",
        "",
        "| phase | " + " | ".join(ft_systems) + " |",
        "|---|" + "---|" * len(ft_systems),
    ]
    for key in LAUNCHER_PHASES:
        cells = " | ".join(
            _stat([r.launcher_phases.get(key) for r in results[n]]) for n in ft_systems
        )
        out.append(f"| {key} | {cells} |")
    out += [
        "",
        "Every run (in the order run):",
        "",
        "| run | load avg at start | death -> stepping | spawn+import | step time | restored "
        "| time lost | digest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i in range(repeats):
        for name in systems:
            if i >= len(results[name]):
                continue
            r = results[name][i]
            out.append(
                f"| {r.system} #{r.repeat} | {_fmt(r.load1)} | {_fmt(r.death_to_resumed_s)} s "
                f"| {_fmt(r.phases.get('spawn+import'))} s | {_fmt(r.step_time_s, 3)} s "
                f"| {r.restored} | {_fmt(r.time_lost_s)} s | {'ok' if r.digest_ok else 'DIFFERS'} |"
            )
    ckpt = [c for r in dc for c in r.checkpoint_s]
    out += [
        "",
        "Notes:",
        "",
        "- Timestamps: the ranks' `logging` lines (ms resolution) and elastic's log lines; rank "
        f"death is rank {FAIL_RANK}'s log line of step {setup.fail_step} (the kill follows "
        "it after the wait for that step's commit in the ftmem runs, not timed). 'restore' "
        "starts at the `model:` line, so it also holds the DDP wrap (a broadcast), the "
        "optimizer and schedule construction; 'spawn+import' is process start (or the "
        "standby's handoff) and the script's module imports (a standby has done `import "
        "torch`), up to the scripts' `script started` line; 'script' is `init_process_group` "
        "(the example logs it: `process group: S`), the model build and what is imported on "
        "first use (`torch.use_deterministic_algorithms` imports `torch._dynamo`: 1.7 s, "
        "which a standby has done too). The DCP worker's imports include DCP and the "
        "benchmark's helpers, so its 'spawn+import' is not the example's.",
        f"- torchrun + DCP checkpoint cost while training: `dcp.save` blocking "
        f"{_stat(ckpt, 3, ' s')} per checkpoint and rank ({len(ckpt)} saves), i.e. "
        + (
            f"{100 * statistics.median(ckpt) / setup.dcp_every / setup.ref_step_time:.0f}% "
            f"of the training time at K = {setup.dcp_every}"
            if ckpt and setup.ref_step_time
            else "n/a"
        )
        + "; paid on every interval, failure or not, and not in 'time lost'.",
        f"- Inside 'restore', `dcp.load` + `set_state_dict` themselves took "
        f"{_stat([x for r in dc for x in r.load_s], 3, ' s')} per rank (page-cached files "
        "written seconds before).",
    ]
    if cost is not None:
        out.append(
            f"- What a standby costs (one started by this benchmark with the default imports, "
            f"torch + torch.distributed + torch._inductor.config + ftmem.client): warm-up "
            f"{cost.warm_up_s:.1f} s and {cost.cpu_s:.1f} CPU-s (once per restart, at nice 10, "
            f"after the ranks step again), then RSS {cost.rss_mib:.0f} MiB of which "
            f"{cost.uss_mib:.0f} MiB its own (USS; the rest are the shared libraries' pages), "
            f"and {cost.idle_cpu_s:.3f} CPU-s in 2 s of waiting."
        )
    extra = [r.warmup_extra_s for r in sb]
    if any(x is not None for x in extra):
        out.append(
            f"- What the standbys' warm-ups cost the training in these runs (two per run: after "
            f"the first steps and after the restart; steps that ended during a warm-up minus as "
            f"many steps of the run's median outside): {_stat(extra, unit=' s')} per run. On "
            "these 2 vCPUs (hyperthreads of one core) a warm-up thread slows the ranks' steps "
            "whatever its priority (nice 10 and SCHED_IDLE measured alike); on a node whose "
            "cores the ranks leave idle it costs nothing. Not in 'time lost' above."
        )
    failed = [r for n in systems for r in results[n] if r.error or not r.digest_ok]
    for r in failed:
        out.append(
            f"- run {r.system} #{r.repeat}: {r.error or 'ok'}; digest "
            f"{'ok' if r.digest_ok else 'DIFFERS from the reference (or the other runs)'}"
        )
    out += ["", "### Goals (issue 14)", ""]
    out += _goals(setup, sb, cold, dc)
    out += ["", END_MARK]
    return "\n".join(out) + "\n"


def _goals(setup: Setup, sb: list[Result], cold: list[Result], dc: list[Result]) -> list[str]:
    sb_lost = _median([r.time_lost_s for r in sb])
    dc_lost = _median([r.time_lost_s for r in dc])
    cold_lost = _median([r.time_lost_s for r in cold])
    sb_restart = _median([r.death_to_resumed_s for r in sb])
    detect = _median([r.phases.get("detect") for r in sb])
    to_start = _median(
        [
            None
            if r.launcher_phases.get("start") is None
            else sum(
                float(r.launcher_phases.get(k) or 0.0) for k in ("stop", "rendezvous", "start")
            )
            for r in sb
        ]
    )
    if sb_lost is None or not dc_lost or sb_restart is None:
        return ["Not evaluated: a system has no measured time lost (see the notes)."]

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    ratio = sb_lost / dc_lost
    lines = [
        "| goal | measured | verdict |",
        "|---|---|---|",
        f"| time lost per failure, ftmem with standbys / torchrun + DCP <= {GOAL_RATIO:.2f} "
        f"| {sb_lost:.2f} s / {dc_lost:.2f} s = {ratio:.2f} | {verdict(ratio <= GOAL_RATIO)} |",
        f"| rank death -> all ranks stepping, with standbys, <= {GOAL_RESTART_S} s "
        f"| {sb_restart:.2f} s | {verdict(sb_restart <= GOAL_RESTART_S)} |",
    ]
    if detect is not None:
        lines.append(
            f"| detection (rank death -> elastic's reaction) <= DLRover's {DLROVER_DETECT_S} s "
            f"| {detect:.2f} s | {verdict(detect <= DLROVER_DETECT_S)} |"
        )
    if to_start is not None:
        lines.append(
            f"| detection -> new ranks started <= DLRover's {DLROVER_START_S} s "
            f"| {to_start:.2f} s (stop + rendezvous + start) "
            f"| {verdict(to_start <= DLROVER_START_S)} |"
        )
    if cold_lost is not None:
        lines += [
            "",
            f"Cold restarts (`--ftmem-standby 0`) lose {cold_lost:.2f} s per failure: the "
            f"standbys save {cold_lost - sb_lost:.2f} s of it.",
        ]
    return lines


def _machine(params: str) -> dict[str, str]:
    facts = _report.machine_facts()
    return {
        "date": _report.utc_now(),
        "cpu": _report.cpu_model(),
        "versions": facts[2],
        "params": params,
        "load": f"{os.getloadavg()[0]:.2f}",
    }


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (not of the DCP worker)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="1 repeat per system")
    p.add_argument("--repeats", type=int, default=None, help="runs per system (default 3)")
    _report.add_output_args(p)
    p.add_argument("--steps", type=int, default=70, help="training steps per run")
    p.add_argument(
        "--fail-at-step",
        type=int,
        default=55,
        help="rank 1 dies after this step (late enough for the standbys to be ready)",
    )
    p.add_argument("--dcp-every", type=int, default=10, help="DCP checkpoint interval K (steps)")
    p.add_argument("--timeout", type=float, default=180.0, help="per run (s)")
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the failure-free run; the runs' final digests are compared with each other",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    return p


@dataclass(kw_only=True, slots=True)
class RecoveryData:
    """What the suite reads from a recovery run."""

    setup: Setup
    results: dict[str, list[Result]]


def run(argv: list[str], *, command: str | None = None) -> _report.Outcome:
    """Parse ``argv``, run the failure runs of both systems and render the section.

    ``command`` replaces the command line shown in the section (the suite passes its own).
    """
    p = get_args_parser()
    args = p.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if not 0 < args.fail_at_step < args.steps or repeats < 1 or args.dcp_every < 1:
        p.error("need 0 < --fail-at-step < --steps, --repeats >= 1, --dcp-every >= 1")
    if args.fail_at_step % args.dcp_every == 0:
        logger.warning("the failure step is a DCP checkpoint step: DCP loses no steps")
    load_start = f"{os.getloadavg()[0]:.2f}"
    workdir = Path(tempfile.mkdtemp(prefix="ftrcv-", dir="/tmp"))
    setup = Setup(
        steps=args.steps,
        fail_step=args.fail_at_step,
        dcp_every=args.dcp_every,
        timeout=args.timeout,
        workdir=workdir,
        year=datetime.datetime.now().year,
    )
    results: dict[str, list[Result]] = {name: [] for name in SYSTEMS}
    params = "?"
    cost: StandbyCost | None = None
    try:
        cost = measure_standby_cost(workdir)
        if not args.no_reference:
            run_reference(setup)
        for i in range(repeats):
            results[FT_STANDBY].append(run_ftmem(setup, i, standby=True))
            results[FT_COLD].append(run_ftmem(setup, i, standby=False))
            results[DCP].append(run_dcp(setup, i))
        for log in sorted(workdir.glob("*.log")):
            m = re.search(r"model: ([0-9.]+ M) parameters", log.read_text(errors="replace"))
            if m:
                params = m.group(1)
                break
    finally:
        if args.keep:
            logger.info("logs kept in %s", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    every = [r for rs in results.values() for r in rs]
    if args.no_reference:
        digests = {r.digest for r in every}
        for r in every:
            r.digest_ok = bool(r.digest) and len(digests) == 1
        steps = [r.step_time_s for r in every if r.step_time_s is not None]
        setup.ref_step_time = statistics.median(steps) if steps else None
    machine = _machine(params)
    machine["load"] = f"{load_start} / {machine['load']}"
    cmd = command or _report.shown_command("recovery.py", argv)
    section = render(setup, results, cmd, machine, cost)
    return _report.Outcome(
        name=SECTION,
        section=section,
        args=args,
        data=RecoveryData(setup=setup, results=results),
        ok=not [r for r in every if r.error or not r.digest_ok],
    )


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the benchmark (or the DCP worker)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER_FLAG]:
        return dcp_worker(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return _report.finish(run(argv))


if __name__ == "__main__":
    sys.exit(main())
