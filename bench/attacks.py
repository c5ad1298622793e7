"""Keyless attackers against a real SMP mesh: time to a protected step and to a rebuild, with
and without each attack running: a keyless flood of connects and idle connections to the CURVE port.

    python bench/attacks.py                   # 5 steps per case, 1 MiB per node
    python bench/attacks.py --steps 3 --no-write

3 SMP processes on loopback (erasure coding m=1, one rank each; tests/_support/smp_mesh.py),
a fresh mesh per case. Cases: ``control`` (no attacker), ``flood`` (connects in bursts of 16
to every port the SMPs listen on, the newest 64 per port held), ``idle`` (1,500 idle TCP
connections held to node 0's CURVE port); the attackers are tests/_support/attackers.py, each
its own process, started before the first measured step and stopped after the rebuild. Per
case: each step's time from the ranks' commits to every node reporting it protected, the time
of the generation that rebuilds a SIGKILLed node 2 (a fresh SMP), the SMPs' log growth per
minute of attack, node 0's peak descriptors. The replay of a sniffed stream (D3) is tested in
tests/integration/test_data_channel_attacks.py, not timed here. Written to docs/benchmarks.md
(section ``bench:attacks``) with the machine's load. Not part of ``bench/run.py``.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/attacks.py

from bench import _render
from bench.machine_loss import _load
from tests._support.attackers import Attacker
from tests._support.launcher import shm_files
from tests._support.smp_mesh import Cluster

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SECTION = "attacks"
CASES = ("control", "flood", "idle")


def run_case(case: str, steps: int, size: int, base: Path) -> dict[str, float]:
    """One case on a fresh mesh; its figures (module docstring)."""
    run_id = f"atk{uuid.uuid4().hex[:8]}"
    (base / case).mkdir()
    c = Cluster(base / case, run_id, 3, 1)
    attack: Attacker | None = None
    try:
        c.generation()
        c.save_all(1, size)
        c.wait("step 1 protected", lambda: c.protected(1), timeout=120)
        pids = base / f"{case}.pids"
        pids.write_text(",".join(str(n.proc.pid) for n in c.nodes))  # type: ignore[union-attr]
        node0 = psutil.Process(c.nodes[0].proc.pid)  # type: ignore[union-attr]
        logs0 = [n.log().stat().st_size for n in c.nodes[:2]]
        t_attack = time.monotonic()
        if case == "flood":
            attack = Attacker("flood", "--pids", str(pids))
        elif case == "idle":
            host, port = c.endpoint(0).removeprefix("tcp://").rsplit(":", 1)
            attack = Attacker("idle", "--to", f"{host}:{port}", "--count", "1500")
        time.sleep(1.0)  # the attack is in force before the first measured step
        times, fds = [], node0.num_fds()
        for step in range(2, steps + 2):
            t0 = time.monotonic()
            c.save_all(step, size)
            c.wait(f"step {step} protected", lambda s=step: c.protected(s), timeout=120)  # type: ignore[misc]
            times.append(time.monotonic() - t0)
            fds = max(fds, node0.num_fds())
        lost = c.nodes[2]
        lost.lose()
        lost.start()
        pids.write_text(",".join(str(n.proc.pid) for n in c.nodes))  # type: ignore[union-attr]
        t0 = time.monotonic()
        res = c.generation()
        rebuild = time.monotonic() - t0
        assert res[2]["rebuilt"] is True, res  # type: ignore[index]
        minutes = (time.monotonic() - t_attack) / 60
        connects = attack.stop() if attack is not None else 0
        grown = max(n.log().stat().st_size - b for n, b in zip(c.nodes[:2], logs0, strict=True))
        return {
            "step_s": statistics.median(times),
            "step_max_s": max(times),
            "rebuild_s": rebuild,
            "log_mib_per_min": grown / 2**20 / minutes,
            "fds": fds,
            "connects": connects,
        }
    finally:
        if attack is not None:
            attack.stop()
        c.close()
        assert shm_files(run_id) == [], "an SMP left shared memory behind"


def render(res: dict[str, dict[str, float]], args: argparse.Namespace, load: str) -> str:
    """The section of docs/benchmarks.md."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    start, end = _render.markers(SECTION)
    ctl = res["control"]
    rows = [
        f"| {case} | {r['step_s']:.2f} (max {r['step_max_s']:.2f}) | "
        f"{r['step_max_s'] / ctl['step_max_s']:.2f}x | {r['rebuild_s']:.2f} | "
        f"{r['rebuild_s'] / ctl['rebuild_s']:.2f}x | {r['log_mib_per_min']:.3f} | "
        f"{int(r['fds'])} | {int(r['connects'])} |"
        for case, r in res.items()
    ]
    return (
        "\n".join(
            [
                start,
                "## Keyless attackers of the peer ports: protection and rebuilds go on",
                "",
                f"`python bench/attacks.py --steps {args.steps} --size-mib {args.size_mib:g}` "
                f"({when}; {load}; 3 SMPs on loopback, m=1, one rank each; a fresh mesh per "
                "case; flood: connects in bursts of 16 to every listening port of the SMPs; "
                "idle: 1,500 idle connections held to node 0's CURVE port).",
                "",
                "| case | step commit -> protected, s: median (max) | max vs control | "
                "rebuild generation, s | vs control | log MiB per minute of attack | "
                "node 0 peak fds | attacker connects |",
                "|---|---|---|---|---|---|---|---|",
                *rows,
                end,
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Run every case; print the section; write it to docs/benchmarks.md unless told not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--size-mib", type=float, default=1.0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="atk-", dir="/tmp"))
    load = _load()
    try:
        res = {case: run_case(case, args.steps, int(args.size_mib * 2**20), base) for case in CASES}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = render(res, args, f"{load} at the start, {_load()} at the end")
    print(text)
    if not args.no_write:
        _render.write_section(DOC, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
