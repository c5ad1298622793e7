"""False alarms of the failure detector: a long run with one slow, lossy link, nobody lost.

    sudo python bench/false_alarms.py                    # 10 minutes
    python bench/false_alarms.py --minutes 2 --no-write

3 network-namespace machines x 1 rank of the test workload (the test-sized model, a 0.1 s step
delay), erasure coding m=1 with a key file, ftmem's defaults (failure detector 1 s). Machine 1's
link gets ``--delay-ms`` each way and ``--loss`` of its packets dropped (an NFQUEUE delayer:
this kernel has no netem) for the whole run, so its heartbeats, collectives and erasure-coding
traffic all cross it. Nothing is lost, so every suspicion is a false one, and every declaration
and restart a false alarm.

Counted over the run, from every agent's log and event log: ``SUSPECT`` lines (a neighbour
silent for the bound), ``declared_lost`` events, restarts, the steps trained and the newest
protected step. Written to docs/benchmarks.md (section ``bench:false-alarms``) with the machine's
load. Not part of ``bench/run.py`` (it needs root for the namespaces).
"""

from __future__ import annotations

import argparse
import datetime
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/false_alarms.py

from bench import _render
from bench.machine_loss import EXAMPLE, REPO, TINY, _load
from ftmem.observe.timeline import read_events
from tests._support.hosts import Hosts, impair_unavailable, unavailable
from tests._support.launcher import agent_env
from tests._support.machines import Machines

DOC = REPO / "docs" / "benchmarks.md"
SECTION = "false-alarms"


def run(args: argparse.Namespace, workdir: Path) -> dict[str, int]:
    """One run; the counts of the module docstring."""
    steps = int(args.minutes * 60 / 0.1) + 1000  # more than the run lasts
    script = [str(EXAMPLE), "--steps", str(steps), "--step-delay", "0.1", *TINY]
    env = agent_env({}, pythonpath=[REPO])
    with Hosts(3, shm_size="512m") as hosts:
        m = Machines(hosts, workdir, "fa" + uuid.uuid4().hex[:8], 3, script, env, cwd=REPO)
        m.start_all()
        hosts.impair(1, delay_ms=args.delay_ms, loss=args.loss, seed=1)
        start = time.time()
        time.sleep(args.minutes * 60)
        texts = [m.agents[i].text() for i in range(3)]
        alive = sum(m.agents[i].poll() is None for i in range(3))
        events = [e for e in read_events([m.run_dir(i) for i in range(3)]).events]
    after = [e for e in events if e.time >= start]
    protected = [int(e.fields.get("step", 0)) for e in after if e.event == "protected"]
    trained = [
        int(s) for t in texts for s in re.findall(r"\[rank \d\] \S+ INFO: step (\d+) loss", t)
    ]
    return {
        "suspicions": sum(t.count("SUSPECT:") for t in texts),
        "declared": sum(1 for e in after if e.event == "declared_lost"),
        "restarts": sum(1 for e in after if e.event == "restart"),
        "steps": max(trained, default=0),
        "protected": max(protected, default=0),
        "agents_alive": alive,
    }


def render(counts: dict[str, int], args: argparse.Namespace, load: str) -> str:
    """The section of docs/benchmarks.md."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    start, end = _render.markers(SECTION)
    return (
        "\n".join(
            [
                start,
                "## False alarms: a slow, lossy link for a long run",
                "",
                f"`python bench/false_alarms.py --minutes {args.minutes:g}` ({when}; {load}; "
                f"3 namespace machines x 1 rank, machine 1's link +{args.delay_ms:g} ms each "
                f"way and {args.loss:.0%} loss for the whole run; failure detector 1 s).",
                "",
                "| minutes | suspicions | declared lost | restarts | steps trained | newest "
                "protected step | agents running at the end |",
                "|---|---|---|---|---|---|---|",
                f"| {args.minutes:g} | {counts['suspicions']} | {counts['declared']} | "
                f"{counts['restarts']} | {counts['steps']} | {counts['protected']} | "
                f"{counts['agents_alive']} of 3 |",
                end,
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Run it; print the counts; write them to docs/benchmarks.md unless told not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the run's logs")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = unavailable() or impair_unavailable()
    if why:
        print(f"false_alarms: {why}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="fa-", dir="/tmp"))
    load = _load()
    try:
        counts = run(args, workdir)
    finally:
        if args.keep:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    text = render(counts, args, f"{load} at the start, {_load()} at the end")
    print(text)
    if not args.no_write:
        _render.write_section(DOC, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
