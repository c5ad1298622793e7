"""Memory per node: what ftmem holds for a training state of a given size.

Usage (from the repository root; ftmem importable, e.g. ``pip install -e .``):

    python bench/memory.py                      # 0.5 and 2 GiB states
    python bench/memory.py --sizes 0.25 --no-write

Per state size it builds the benchmark state (square ``nn.Linear`` layers + AdamW,
``bench/_baselines.build_state``), starts an SMP with the default 2 slots per rank in a
temporary run directory, takes snapshots with ``ftmem.save`` (one rank, this process: the
ftmem part of ``bench/snapshot.py``, whose first two saves fill both slots) and after each
committed snapshot reads:

* **shared memory**: the bytes allocated to the run's files in /dev/shm (``st_blocks``), i.e.
  every slot of every rank of the node;
* **SMP**: its resident memory (``VmRSS``) split into ``RssShmem`` (the slots it maps, the same
  pages as above) and ``RssAnon`` (its own heap: Python, ZeroMQ, bookkeeping);
* **rank**: the anonymous memory the training process gained from the first ``ftmem.save``
  on (``RssAnon`` now minus before it: the client's own buffers and layout).

Memory per node = shared memory + the SMP's ``RssAnon`` + each rank's added ``RssAnon`` (the
shared pages counted once). Each figure is a median (min-max) over the snapshots measured.
``bench/snapshot.py`` and ``bench/run.py`` measure it on the way (no extra run); this script
runs that ftmem part alone. The section goes between ``<!-- bench:memory:start -->`` and
``<!-- bench:memory:end -->``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from dataclasses import dataclass, field

try:
    from bench import _launch, _report
except ImportError:  # run as a script: bench/ is sys.path[0]
    import _launch  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]

SECTION = "memory"
START_MARK, END_MARK = _report.markers(SECTION)
MiB = 1 << 20
GiB = 1 << 30

logger = logging.getLogger("bench.memory")


def proc_memory(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``RssShmem`` of ``pid`` in bytes (0 if unknown)."""
    keys = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    out = dict.fromkeys(keys, 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in out:
                    out[name] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


@dataclass(kw_only=True, slots=True)
class NodeMemory:
    """Readings of one node's memory for one state size (one entry per snapshot read)."""

    state_bytes: int
    """Bytes of the state one rank snapshots."""
    slots: int
    """Snapshot slots per rank in the SMP."""
    ranks: int = 1
    shm: list[int] = field(default_factory=list)
    """Bytes allocated to the run's files in /dev/shm."""
    shm_files: int = 0
    smp_rss: list[int] = field(default_factory=list)
    smp_anon: list[int] = field(default_factory=list)
    smp_shmem: list[int] = field(default_factory=list)
    rank_anon_added: list[int] = field(default_factory=list)
    """Anonymous memory the rank gained since before its first ``ftmem.save``."""

    def read(self, *, smp_pid: int, run_id: str, rank_anon_before: int) -> None:
        """Take one reading (after a committed snapshot)."""
        shm, self.shm_files = _launch.shm_bytes(run_id)
        smp = proc_memory(smp_pid)
        self.shm.append(shm)
        self.smp_rss.append(smp["VmRSS"])
        self.smp_anon.append(smp["RssAnon"])
        self.smp_shmem.append(smp["RssShmem"])
        self.rank_anon_added.append(proc_memory(os.getpid())["RssAnon"] - rank_anon_before)

    def totals(self) -> list[float]:
        """Memory per node of each reading: shm + SMP RssAnon + the rank's added RssAnon."""
        return [
            float(s + a + r)
            for s, a, r in zip(self.shm, self.smp_anon, self.rank_anon_added, strict=True)
        ]


def _mib(values: list[int] | list[float]) -> str:
    return _report.stat([v / MiB for v in values], ".0f", " MiB")


def _x(values: list[int] | list[float], state: int) -> str:
    return _report.stat([v / state for v in values], ".2f", "x")


def render(results: list[NodeMemory], *, command: str) -> str:
    """The Markdown section (markers included)."""
    out = [START_MARK, "## Memory per node", ""]
    out += ["Every figure below was measured in the run of this command:", ""]
    out += ["```", command, "```", ""]
    out += [f"- {f}" for f in _report.machine_facts()]
    out += [
        "- one rank (this process) snapshots the benchmark state (params + AdamW exp_avg + "
        "exp_avg_sq, fp32) into an SMP with the default slots per rank; read after every "
        "committed snapshot once both slots hold one; median (min-max) over those readings",
        "- shared memory = bytes allocated to the run's /dev/shm files; SMP RssShmem is the "
        "part of those the SMP has mapped (not counted twice); memory per node = shared memory "
        "+ SMP RssAnon + the rank's added RssAnon. 'x state' divides by the state's bytes",
        "",
        "| state | slots per rank | shared memory (x state) | SMP RSS | SMP RssShmem "
        "| SMP RssAnon | rank RssAnon added | memory per node (x state) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.shm:
            out.append(f"| {r.state_bytes / GiB:.2f} GiB | {r.slots} | not measured | | | | | |")
            continue
        out.append(
            f"| {r.state_bytes / GiB:.2f} GiB | {r.slots} | {_mib(r.shm)} "
            f"({_x(r.shm, r.state_bytes)}) | {_mib(r.smp_rss)} | {_mib(r.smp_shmem)} | "
            f"{_mib(r.smp_anon)} | {_mib(r.rank_anon_added)} | {_mib(r.totals())} "
            f"({_x(r.totals(), r.state_bytes)}) |"
        )
    out += [
        "",
        "Reading: the shared memory is the slots (each rounded up to whole pages), so it "
        "grows with `--ftmem-slots` x the state of every rank of the node; the SMP's and the "
        "rank's own memory do not grow with the state. A flush worker (`--ftmem-flush-dir`) "
        "and erasure-coded protection (parity held for peers, m/(n-m) of the snapshot) add to "
        "this; see their sections.",
        "",
        END_MARK,
    ]
    return "\n".join(out) + "\n"


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--sizes", default="0.5,2", help="state sizes in GiB, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="snapshots read after the warm-up")
    _report.add_output_args(p)
    return p


def run(argv: list[str], *, command: str | None = None) -> _report.Outcome:
    """Measure memory per node for every size of ``argv`` and render the section."""
    try:
        from bench import _baselines as baselines
        from bench import snapshot
    except ImportError:  # run as a script
        import _baselines as baselines  # type: ignore[no-redef]
        import snapshot  # type: ignore[no-redef]

    args = get_args_parser().parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",") if s]
    results = []
    for size in sizes:
        state = baselines.build_state(size)
        res = snapshot.bench_ftmem(
            state, repeats=args.repeats, simulate=snapshot.make_simulator("sleep", 0.2)
        )
        if res.memory is not None:
            results.append(res.memory)
        del state
        gc.collect()
    section = render(results, command=command or _report.shown_command("memory.py", argv))
    return _report.Outcome(
        name=SECTION,
        section=section,
        args=args,
        data=results,
        ok=len(results) == len(sizes),
        after="snapshot",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the section and write it into ``--out``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return _report.finish(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
