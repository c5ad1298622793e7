"""Step time of the HF Trainer and Lightning examples: a snapshot every step against torchrun.

    python bench/integrations.py                   # 3 rounds, 300 steps each (~6 minutes)
    python bench/integrations.py --rounds 1 --steps 100 --no-write

Each round runs, for each script (``examples/train_hf.py``: a tiny Llama under
``FtmemTrainer``; ``examples/train_lightning.py``: a small regressor under ``FtmemCallback``),
2 ranks on this machine (DDP over gloo) in three ways, in an order that rotates from round to
round: plain torchrun with ``--no-ftmem`` (the script without ftmem), ``ftmem-launch`` as
shipped, and ``ftmem-launch --ftmem-standby 0``. The figure is the script's own
``train_runtime`` (the Trainer's, or first batch to the end of training for Lightning), the
slowest rank's, divided by the steps: milliseconds per step, the job's start-up left out.
Written to docs/benchmarks.md (section ``bench:integrations``) with the machine's load. Not part
of ``bench/run.py`` (it needs the ``hf`` and ``lightning`` extras).
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/integrations.py

from bench import _render
from bench._stats import median, stat
from bench.machine_loss import _load

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "integrations"
SCRIPTS = {"HF Trainer": "examples/train_hf.py", "Lightning": "examples/train_lightning.py"}
TORCHRUN = "torchrun, without ftmem"
CONFIGS = {
    TORCHRUN: ["-m", "torch.distributed.run"],
    "ftmem-launch (defaults)": ["-m", "ftmem.launch"],
    "ftmem-launch --ftmem-standby 0": ["-m", "ftmem.launch", "--ftmem-standby", "0"],
}
RUNTIME = re.compile(r"\[rank \d+\] train_runtime ([0-9.]+) s")


def one_run(config: str, script: str, steps: int, timeout: float) -> float | None:
    """Milliseconds per step of one job (the slowest rank's), None if it failed."""
    cmd = [sys.executable, *CONFIGS[config], "--standalone", "--nproc-per-node", "2"]
    cmd += [str(REPO / script), "--steps", str(steps)]
    if config == TORCHRUN:
        cmd.append("--no-ftmem")
    with tempfile.TemporaryDirectory(prefix="bint-") as cwd:
        try:
            done = subprocess.run(
                cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            print(f"{config} {script}: timed out after {timeout:g} s", file=sys.stderr)
            return None
    found = [float(x) for x in RUNTIME.findall(done.stdout + done.stderr)]
    if done.returncode != 0 or len(found) != 2:
        print(f"{config} {script}: exit {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return max(found) / steps * 1e3


def run(args: argparse.Namespace) -> dict[str, dict[str, list[float | None]]]:
    """Every round: script -> configuration -> ms per step, one value per round."""
    got: dict[str, dict[str, list[float | None]]] = {
        name: {c: [] for c in CONFIGS} for name in SCRIPTS if name in args.only
    }
    order = list(CONFIGS)
    for r in range(args.rounds):
        turn = order[r % len(order) :] + order[: r % len(order)]
        for name in got:
            for config in turn:
                ms = one_run(config, SCRIPTS[name], args.steps, args.timeout)
                got[name][config].append(ms)
                print(f"round {r + 1} {name}: {config}: {ms} ms/step", flush=True)
    return got


def render(
    got: dict[str, dict[str, list[float | None]]], args: argparse.Namespace, load: str
) -> str:
    """The section of docs/benchmarks.md."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    start, end = _render.markers(SECTION)
    lines = [
        start,
        "## Step time of the HF Trainer and Lightning examples: ftmem-launch vs torchrun",
        "",
        f"`python bench/integrations.py --rounds {args.rounds} --steps {args.steps}` ({when}; "
        f"{load}; 2 ranks, DDP over gloo; a snapshot every optimizer step under ftmem). "
        "Milliseconds per step: median (min-max) over the rounds; the difference is the "
        "median of each round's difference to torchrun in the same round.",
        "",
        "| script | configuration | ms per step | vs torchrun |",
        "|---|---|---|---|",
    ]
    for name, by in got.items():
        base = by[TORCHRUN]
        for config, values in by.items():
            diffs = [v - b for v, b in zip(values, base, strict=True) if None not in (v, b)]
            d = median(diffs) if config != TORCHRUN else None
            rel = f"{d:+.1f} ms ({d / median(base) * 100:+.0f}%)" if d is not None else "-"
            failed = sum(v is None for v in values)
            note = f" ({failed} failed)" if failed else ""
            lines.append(f"| {name} | {config} | {stat(values, '.1f')}{note} | {rel} |")
    lines.append(end)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run it; print the section; write it to docs/benchmarks.md unless told not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--only", default=",".join(SCRIPTS), help="scripts: 'HF Trainer,Lightning'")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",")]
    load = _load()
    got = run(args)
    text = render(got, args, f"{load} at the start, {_load()} at the end")
    print(text)
    if not args.no_write:
        _render.write_section(DOC, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
