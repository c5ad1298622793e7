"""Recovery benchmark: failure -> all ranks stepping again, ftmem-launch vs torchrun + DCP.

    python bench/recovery.py                       # 3 repeats per system (~6-9 min)
    python bench/recovery.py --quick               # 1 repeat per system
    python bench/recovery.py --repeats 5 --dcp-every 20 --steps 40 --fail-at-step 30 --no-write

How it measures: docs/benchmarks.md, "How the parts measure". Section ``bench:recovery``,
rendered by ``bench/recovery_tables.py``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import logging
import math
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/recovery.py

from bench import _launch, _render, _results, _train
from bench._figures import fig
from bench._stats import median
from ftmem.observe.timeline import Event, read_events

PART = "recovery"
EXAMPLE = _launch.EXAMPLE
FAIL_RANK = 1
FT_INPROC = "ftmem-launch in process"  # the example under ftmem.run (--in-process)
FT_FORK = "ftmem-launch + fork server"  # the shipped default
FT_STANDBY = "ftmem-launch + standbys"  # --ftmem-tune standby-fork=off
FT_COLD = "ftmem-launch (cold)"
DCP = "torchrun + DCP"
SYSTEMS = (FT_INPROC, FT_FORK, FT_STANDBY, FT_COLD, DCP)
TAGS = {
    FT_INPROC: "ip",
    FT_FORK: "fs",
    FT_STANDBY: "sb",
    FT_COLD: "ft",
    DCP: "dcp",
}  # of logs and commands
PHASES = ("detect", "stop", "rendezvous", "start", "script", "load", "first_step")
"""The split of rank death -> all ranks stepping (docs/benchmarks.md)."""
WORKER_FLAG = "--_dcp-worker"
_STANDALONE = ["--standalone", "--nproc-per-node", "2"]
# The example's lines: its logging's 'script started', its closing prints.
_STARTED = re.compile(r"(\d{4}-\d\d-\d\d \S+) \[rank (\d+)\] \S+ [A-Z]+: script started$", re.M)
_DIGEST = re.compile(r"\[rank (\d+)\] digest ([0-9a-f]{64})")
# torch elastic's glog lines: torchrun writes no event log, so its phases come from these.
_GLOG = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6}) +\d+ \S+\] (.*)$", re.M)
_ELASTIC = {
    "failed": ("failed (exitcode", "closing signal SIGTERM"),
    "stopped": ("Rendezvous'ing worker group",),
    "spawned": ("Starting worker group",),
}

logger = logging.getLogger("bench.recovery")


# --------------------------------------------------------------------------- the DCP worker


def dcp_worker(argv: Sequence[str]) -> int:
    """The torchrun + DCP system's rank (``--_dcp-worker --ckpt-dir DIR --ckpt-every K --
    EXAMPLE_ARGS``): the example's loop with a ``dcp.save`` every K steps; a restart
    ``dcp.load``s the newest complete checkpoint (``.metadata`` written)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    w, t = _train.worker("recovery.py --_dcp-worker", argv, ["ckpt_every"])
    args, rank = t.args, t.rank
    found = [
        (int(m.group(1)), e)
        for e in (w.ckpt_dir.iterdir() if w.ckpt_dir.is_dir() else ())
        if (m := re.fullmatch(r"step_(\d+)", e.name)) and (e / ".metadata").is_file()
    ]
    start = 0
    if found:
        start, path = max(found)
        t0 = time.perf_counter()
        state = t.dcp_state()  # the structure to load into (initialises AdamW state)
        dcp_load(state, checkpoint_id=str(path))
        t.dcp_restore(state)
        _train.mark("restored", rank, step=start, load_s=time.perf_counter() - t0)
    print(f"[rank {rank}] resumed from step {start}", flush=True)

    # Fail once: the example's rule (not when resumed at >= N) would fail again after a
    # restore from an older checkpoint, so only the first incarnation fails (one node here).
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    step_times: list[float] = []
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        loss = t.step()
        step_times.append(time.perf_counter() - t0)
        t.log_step(step, loss)
        _train.mark("step", rank, step=step)
        if step % w.ckpt_every == 0:
            t1 = time.perf_counter()
            dcp_save(t.dcp_state(), checkpoint_id=str(w.ckpt_dir / f"step_{step:06d}"))
            _train.mark("checkpoint", rank, step=step, save_s=time.perf_counter() - t1)
        if step == args.fail_at_step and rank == args.fail_rank and first_start:
            print(f"[rank {rank}] injecting failure (kill) after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.step_delay:
            time.sleep(args.step_delay)  # as the example: host idle (e.g. an accelerator's time)
    t.finish(max(start, args.steps), step_times)
    return 0


@dataclass
class StandbyCost:
    """What one standby rank costs while it waits (measured on a standby started here)."""

    warm_up_s: float  # Spawn -> ready (wall).
    cpu_s: float  # CPU (user + system) the standby spent to get ready.
    rss_mib: float
    uss_mib: float  # Memory only this process holds (shared libraries' pages are shared).
    idle_cpu_s: float  # CPU it spent in the 2 s after it was ready (waiting on its socket).


def measure_standby_cost(workdir: Path, fork: bool) -> StandbyCost | None:
    """Start one standby (or the fork server) as the agent would (default imports), time it
    and weigh it."""
    import psutil

    from ftmem.launch.warm_start import StandbyPool

    pool = StandbyPool(count=1, imports=(), cuda=False, run_dir=workdir, node="bench", fork=fork)
    pool.configure(sys.executable, ["-u", str(EXAMPLE)], 1)
    try:
        pool.spawn_missing()
        (standby,) = pool.standbys()
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
        cpu, idle = t0.user + t0.system, (t1.user + t1.system) - (t0.user + t0.system)
        return StandbyCost(warm, cpu, mem.rss / 2**20, mem.uss / 2**20, idle)
    finally:
        pool.stop()


# --------------------------------------------------------------------------- results


@dataclass(kw_only=True)
class Run:
    """One failure run of one system."""

    system: str
    repeat: int
    rc: int | None = None
    wall_s: float = 0.0
    load1: float = field(default=0.0, metadata=fig("load avg at start", ".2f"))
    digest: str = ""  # The final digest both ranks printed ("" if they did not agree).
    digest_ok: bool = field(
        default=False, metadata=fig("digest", get=lambda x: "ok" if x["digest_ok"] else "DIFFERS")
    )
    restored: int | None = field(default=None, metadata=fig("restored"))
    steps_lost: int | None = None
    step_time_s: float | None = field(default=None, metadata=fig("step time", ".3f", " s"))
    phases: dict[str, float | None] = field(default_factory=dict)  # Split as PHASES.
    death_to_resumed_s: float | None = field(
        default=None, metadata=fig("death -> stepping", ".2f", " s")
    )
    spawn_import_s: float | None = field(default=None, metadata=fig("spawn+import", ".2f", " s"))
    """Ranks started -> 'script started' on all ranks."""
    time_lost_s: float | None = field(default=None, metadata=fig("time lost", ".2f", " s"))
    """Death -> stepping + steps lost x step time."""
    warmup_extra_s: float | None = None  # Training time the standbys' warm-ups cost.
    from_standby: list[int] = field(default_factory=list)  # Ranks the restart took warm.
    warmups: int = 0
    checkpoint_s: list[float] = field(default_factory=list)  # DCP: dcp.save per save and rank.
    load_s: list[float] = field(default_factory=list)  # DCP: the restore per rank.
    error: str = field(default="", metadata=fig("error", get=lambda x: x["error"] or "-"))


@dataclass(kw_only=True)
class RecoveryResult(_results.PartResult):
    """The recovery part's results."""

    steps: int
    fail_step: int
    dcp_every: int
    params_m: float | None = None
    ref_digest: str = ""
    ref_step_time: float | None = None
    commands: dict[str, str] = field(default_factory=dict)
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    phase_names: list[str] = field(default_factory=lambda: list(PHASES))
    runs: list[Run] = field(default_factory=list)
    standby: StandbyCost | None = None
    fork_server: StandbyCost | None = None


EARLY_PART = "recovery-early"
"""The section (and goal) of a run whose rank dies early: see :func:`early_failure`."""


def early_failure(fail_step: int, dcp_every: int) -> bool:
    """The rank dies before torchrun + DCP's first checkpoint (its restart begins at step
    0), while standby ranks may still be warming up (section ``EARLY_PART``)."""
    return fail_step < dcp_every


# --------------------------------------------------------------------------- analysis


def _all_ranks(items: list[dict[str, Any]], after: float, pred: Callable) -> float | None:
    """When every rank has done what ``pred`` matches (the slowest), None if one has not."""
    times = [
        next((m["time"] for m in items if m["time"] >= after and m["rank"] == r and pred(m)), None)
        for r in (0, 1)
    ]
    return None if None in times else max(times)  # type: ignore[type-var]


def _finish_run(run: Run, death: float, resumed: float, fail_step: int) -> None:
    run.death_to_resumed_s = resumed - death
    if run.restored is not None:
        run.steps_lost = fail_step - run.restored
    if run.steps_lost is not None and run.step_time_s is not None:
        run.time_lost_s = run.death_to_resumed_s + run.steps_lost * run.step_time_s


def analyse_ftmem(run: Run, events: list[Event], text: str, fail_step: int) -> None:
    """Fill ``run`` from ftmem-launch's event logs (and the example's 'script started' lines)."""

    def first(kind: str, after: float = 0.0, **match: Any) -> Event | None:
        hits = (e for e in events if e.event == kind and e.time > after)
        return next((e for e in hits if match.items() <= e.fields.items()), None)

    failed, resumed = first("failed"), first("resumed")
    missing = "no commit of the failure step, 'failed' or 'resumed' event"
    if failed is None or resumed is None:
        run.error = missing
        return
    # Every rank commits the failure step and they meet at a barrier; then the rank dies.
    commits = [
        e
        for e in events
        if e.event == "committed" and e.fields.get("step") == fail_step and e.time <= failed.time
    ]
    if FAIL_RANK not in {e.fields.get("rank") for e in commits}:
        run.error = missing
        return
    death = max(commits, key=lambda e: e.time)
    detected = float(failed.fields.get("detected", failed.time))
    run.phases = {"detect": detected - death.time, **(resumed.fields.get("phases") or {})}
    restore = first("discard_newer", detected)
    run.restored = int(restore.fields["step"]) if restore else int(resumed.fields["step"]) - 1
    _finish_run(run, death.time, detected + float(resumed.fields["detect_to_resumed_s"]), fail_step)
    if started := first("ranks_started", detected):
        stamp = "%Y-%m-%d %H:%M:%S,%f"
        lines = [
            {"time": datetime.datetime.strptime(t, stamp).timestamp(), "rank": int(r)}
            for t, r in _STARTED.findall(text)
        ]
        t = _all_ranks(lines, started.time - 1.0, lambda m: True)
        # A standby runs the script a few ms before the agent writes ranks_started (the event
        # follows the last handoff): nothing was spawned or imported after the failure, so 0.
        run.spawn_import_s = None if t is None else max(0.0, t - started.time)
    run.warmup_extra_s, run.warmups = warmup_cost(events)


def warmup_cost(events: list[Event]) -> tuple[float | None, int]:
    """What the standbys' warm-ups cost the training: (extra seconds, warm-ups seen); steps
    are rank 0's consecutive commits, "during a warm-up" if ending between ``standbys_started``
    and the matching ``standbys_ready`` events."""
    commits = [
        (e.time, int(e.fields["step"]))
        for e in events
        if e.event == "committed" and e.fields.get("rank") == 0
    ]
    durations = [
        (t1, t1 - t0) for (t0, s0), (t1, s1) in itertools.pairwise(commits) if s1 == s0 + 1
    ]
    windows = []
    for e in (e for e in events if e.event == "standbys_started"):
        ready = [r.time for r in events if r.event == "standbys_ready" and r.time > e.time]
        windows.append((e.time, max(ready[: len(e.fields.get("pids", []))] or [e.time])))
    inside = [d for t, d in durations if any(a <= t <= b for a, b in windows)]
    outside = [d for t, d in durations if not any(a <= t <= b for a, b in windows)]
    if not windows or not outside:
        return None, len(windows)
    return sum(inside) - len(inside) * statistics.median(outside), len(windows)


def analyse_dcp(run: Run, text: str, fail_step: int, year: int) -> None:
    """Fill ``run`` from the DCP worker's JSON lines and elastic's log lines."""
    marks = _train.marks(text)
    elastic = [
        (datetime.datetime(year, *map(int, g.groups()[:6])).timestamp(), g.group(7))
        for g in _GLOG.finditer(text)
    ]
    run.checkpoint_s = [m["save_s"] for m in marks if m["event"] == "checkpoint"]
    run.load_s = [m["load_s"] for m in marks if m["event"] == "restored"]
    last = {"event": "step", "rank": FAIL_RANK, "step": fail_step}
    death = next((m for m in marks if last.items() <= m.items()), None)
    if death is None:
        seen = [m["step"] for m in marks if m["event"] == "step" and m["rank"] == FAIL_RANK]
        starts = sum(m["event"] == "script_started" for m in marks)
        run.error = (
            f"no step {fail_step} of rank {FAIL_RANK} (its steps seen: {len(seen)}, up to "
            f"{max(seen, default=0)}; {starts} rank starts; failure "
            f"{'injected' if 'injecting failure' in text else 'never injected'})"
        )
        return
    t = {"death": death["time"]}
    for key, patterns in _ELASTIC.items():
        hit = [s for s, msg in elastic if s >= t["death"] and any(p in msg for p in patterns)]
        if not hit:
            run.error = f"no elastic line for {key}"
            return
        t[key] = hit[0]
    after = [m for m in marks if m["time"] >= t["spawned"]]
    restored = next((m for m in after if m["event"] == "restored"), None)
    run.restored = int(restored["step"]) if restored is not None else 0  # none: from scratch

    def when(start: float, event: str, step: int | None = None) -> float:
        """When every rank has marked ``event`` (of ``step``) after ``start``; NaN if one has not."""
        x = _all_ranks(
            marks, start, lambda m: m["event"] == event and (step is None or m["step"] == step)
        )
        return x or float("nan")

    t["script"] = when(t["spawned"], "script_started")
    t["model"] = when(t["spawned"], "model")
    t["restored"] = t["model"] if restored is None else when(t["spawned"], "restored")
    t["resumed"] = when(t["restored"], "step", run.restored + 1)
    keys = ["death", "failed", "stopped", "spawned", "script", "model", "restored", "resumed"]
    if unmarked := [k for k in keys if math.isnan(t[k])]:
        run.error = f"not every rank's JSON line after the restart for: {', '.join(unmarked)}"
        return
    run.phases = {p: t[b] - t[a] for p, a, b in zip(PHASES, keys[:-1], keys[1:], strict=True)}
    run.spawn_import_s = run.phases["start"]
    _finish_run(run, t["death"], t["resumed"], fail_step)


# --------------------------------------------------------------------------- the runs


def _job(cmd: list[str], workdir: Path, name: str, timeout: float) -> tuple[int | None, float, str]:
    """Run ``cmd`` to its end: exit code (None: timed out), seconds, its log (``NAME.log``)."""
    tmp = workdir / "tmp"  # torchrun leaves a log directory in $TMPDIR per run
    tmp.mkdir(exist_ok=True)
    env = _launch.job_env(TMPDIR=str(tmp), LOGLEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop("PET_FTMEM_STANDBY", None)  # the runs pass --ftmem-standby themselves
    log = workdir / f"{name}.log"
    t0 = time.monotonic()
    with _launch.Job(cmd, log, env) as job:
        rc = job.wait(timeout)
        wall = time.monotonic() - t0
    return rc, wall, log.read_text(errors="replace")


def _launcher(name: str, module: str) -> list[str]:
    """The console script ``name`` if it is on PATH, else ``python -m module``; one node."""
    path = shutil.which(name)
    return [*([path] if path else [sys.executable, "-m", module]), *_STANDALONE]


def _read(text: str) -> tuple[str, float | None]:
    """(the digest both ranks printed or "", the ranks' median step time) of a run's log."""
    digests = {int(r): d for r, d in _DIGEST.findall(text)}
    same = len(digests) == 2 and len(set(digests.values())) == 1
    times = [float(v) for _, v in _launch.MEDIAN_RE.findall(text)]
    return (next(iter(digests.values())) if same else ""), median(times)


def run_reference(res: RecoveryResult, workdir: Path, timeout: float) -> None:
    """The failure-free ``--no-ftmem`` run under torchrun: reference digest and step time."""
    cmd = [*_launcher("torchrun", "torch.distributed.run"), str(EXAMPLE)]
    cmd += ["--steps", str(res.steps), "--log-every", "1", "--no-ftmem"]
    res.commands["reference"] = _launch.shown(cmd, workdir)
    rc, _, text = _job(cmd, workdir, "reference", timeout)
    res.ref_digest, res.ref_step_time = _read(text)
    if rc != 0 or not res.ref_digest:
        raise RuntimeError(f"reference run failed (rc {rc}); log in {workdir} (kept with --keep)")
    if (m := re.search(r"model: ([0-9.]+) M parameters", text)) is not None:
        res.params_m = float(m.group(1))


def run_one(res: RecoveryResult, system: str, repeat: int, workdir: Path, timeout: float) -> Run:
    """One run of ``system`` with rank 1 SIGKILLed after the failure step."""
    tag = TAGS[system]
    rdir = workdir / f"{tag}{repeat}"
    fail = ["--fail-at-step", str(res.fail_step), "--fail-rank", str(FAIL_RANK)]
    example = ["--steps", str(res.steps), "--log-every", "1", *fail]
    if system == DCP:
        rdir.mkdir()
        cmd = _launcher("torchrun", "torch.distributed.run")
        cmd += ["--max-restarts", "1", str(Path(__file__).resolve()), WORKER_FLAG]
        cmd += ["--ckpt-dir", str(rdir), "--ckpt-every", str(res.dcp_every), "--", *example]
        prefix, placeholder = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ", "$CKPT_DIR"
    else:
        example += ["--in-process"] if system == FT_INPROC else []
        cmd = _launcher("ftmem-launch", "ftmem.launch")
        cmd += ["--ftmem-standby", "0" if system == FT_COLD else "1"]
        cmd += ["--ftmem-tune", "standby-fork=off"] if system == FT_STANDBY else []
        cmd += ["--ftmem-run-dir", str(rdir), str(EXAMPLE), *example]
        prefix, placeholder = "", "$RUN_DIR"
    shown = _launch.shown(cmd, workdir).replace(f"$TMP/{tag}{repeat}", placeholder)
    res.commands[tag] = prefix + shown
    run = Run(system=system, repeat=repeat, load1=os.getloadavg()[0])
    run.rc, run.wall_s, text = _job(cmd, workdir, f"{tag}{repeat}", timeout)
    run.digest, run.step_time_s = _read(text)
    run.digest_ok = bool(run.digest) and run.digest == (res.ref_digest or run.digest)
    if system == DCP:
        analyse_dcp(run, text, res.fail_step, datetime.datetime.now().year)
    else:
        events = read_events([rdir]).events
        analyse_ftmem(run, events, text, res.fail_step)
        started = [e.fields for e in events if e.event == "ranks_started"]
        second = started[1] if len(started) > 1 else {}
        warm: tuple[list[int], list[int]] = ([0, 1], [])
        want = {FT_FORK: warm, FT_STANDBY: warm, FT_INPROC: ([FAIL_RANK], [0])}.get(system)
        if system == FT_STANDBY and early_failure(res.fail_step, res.dcp_every):
            want = None  # standby ranks start once the ranks step: early, either is right
        got = tuple(sorted(second.get(k, [])) for k in ("from_standby", "in_process"))
        run.from_standby = got[0]
        if want is not None and got != want:
            why = f"restart from standbys / in process: ranks {got[0]} / {got[1]}, not {want}"
            run.error = (run.error + "; " + why).lstrip("; ")
    if run.rc != 0:
        run.error = (run.error + f"; exit code {run.rc}").lstrip("; ")
    msg = f"rc {run.rc}, {run.wall_s:.1f} s, death->resumed {run.death_to_resumed_s} s"
    logger.info("%s #%d: %s, %s", system, repeat, msg, run.error or "ok")
    return run


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (not of the DCP worker)."""
    p = _results.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="1 repeat per system")
    p.add_argument("--repeats", type=int, default=None, help="runs per system (default 3)")
    p.add_argument("--steps", type=int, default=70, help="training steps per run")
    p.add_argument("--fail-at-step", type=int, default=55, help="rank 1 dies after this step")
    p.add_argument("--dcp-every", type=int, default=10, help="DCP checkpoint interval K (steps)")
    p.add_argument("--timeout", type=float, default=180.0, help="per run (s)")
    no_ref = "compare the runs' digests with each other"
    p.add_argument("--no-reference", action="store_true", help=no_ref)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    return p


def run(argv: list[str]) -> RecoveryResult:
    """Parse ``argv``; the reference run, then the failure runs of every system, alternating."""
    p = get_args_parser()
    args = p.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if not 0 < args.fail_at_step < args.steps or repeats < 1 or args.dcp_every < 1:
        p.error("need 0 < --fail-at-step < --steps, --repeats >= 1, --dcp-every >= 1")
    cfg = {"steps": args.steps, "fail_step": args.fail_at_step, "dcp_every": args.dcp_every}
    res = RecoveryResult(argv=argv, machine=_results.machine(), **cfg)
    workdir = Path(tempfile.mkdtemp(prefix="ftrcv-", dir="/tmp"))
    try:
        res.standby = measure_standby_cost(workdir, fork=False)
        res.fork_server = measure_standby_cost(workdir, fork=True)
        if not args.no_reference:
            run_reference(res, workdir, args.timeout)
        for i in range(repeats):
            res.runs += [run_one(res, system, i, workdir, args.timeout) for system in SYSTEMS]
    finally:
        if args.keep or any(r.error for r in res.runs):
            logger.info("logs kept in %s%s", workdir, "" if args.keep else " (a run failed)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.no_reference:  # the runs' digests against each other
        same = len({r.digest for r in res.runs}) == 1
        for r in res.runs:
            r.digest_ok = bool(r.digest) and same
        res.ref_step_time = median(r.step_time_s or None for r in res.runs)
    res.errors = [
        f"{r.system} #{r.repeat}: {r.error or 'digest differs'}"
        for r in res.runs
        if r.error or not r.digest_ok
    ]
    _results.finish(res.machine)
    return res


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER_FLAG]:
        sys.exit(dcp_worker(sys.argv[2:]))
    sys.exit(_render.script_main(PART, run))
