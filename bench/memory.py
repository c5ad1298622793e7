"""Memory per node: what ftmem holds for a training state of a given size.

    python bench/memory.py                      # 0.5 and 2 GiB states
    python bench/memory.py --sizes 0.25 --repeats 2 --no-write

How it measures: docs/benchmarks.md, "How the parts measure".
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/memory.py

from bench import _launch, _results
from bench._proc import proc_memory

PART = "memory"


@dataclass(kw_only=True)
class NodeMemory:
    """Readings of one node's memory for one state size (one entry per snapshot read)."""

    state_bytes: int
    slots: int  # Snapshot slots per rank in the SMP.
    shm: list[int] = field(default_factory=list)  # Bytes allocated to the run's files in /dev/shm.
    smp_rss: list[int] = field(default_factory=list)
    smp_anon: list[int] = field(default_factory=list)
    smp_shmem: list[int] = field(default_factory=list)
    rank_anon_added: list[int] = field(default_factory=list)
    """Anonymous memory the rank gained since before its first ``ftmem.save``."""

    def read(self, *, smp_pid: int, run_id: str, rank_anon_before: int) -> None:
        """Take one reading (after a committed snapshot)."""
        smp = proc_memory(smp_pid)
        self.shm.append(_launch.shm_bytes(run_id)[0])
        self.smp_rss.append(smp["VmRSS"])
        self.smp_anon.append(smp["RssAnon"])
        self.smp_shmem.append(smp["RssShmem"])
        self.rank_anon_added.append(proc_memory(os.getpid())["RssAnon"] - rank_anon_before)


@dataclass(kw_only=True)
class MemoryResult(_results.PartResult):
    """The memory part's results: one :class:`NodeMemory` per state size."""

    sizes: list[NodeMemory] = field(default_factory=list)


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = _results.parser(__doc__)
    p.add_argument("--sizes", default="0.5,2", help="state sizes in GiB, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="snapshots read after the warm-up")
    return p


def run(argv: list[str]) -> MemoryResult:
    """Measure memory per node for every size of ``argv``."""
    from bench import _baselines, snapshot

    args = get_args_parser().parse_args(argv)
    result = MemoryResult(argv=argv, machine=_results.machine())
    for size in [float(s) for s in args.sizes.split(",") if s]:
        state = _baselines.build_state(size)
        res = snapshot.SizeResult(size_gib=size, nbytes=state.nbytes)
        snapshot.bench_ftmem(
            state, res, repeats=args.repeats, simulate=_baselines.make_simulator("sleep", 0.2)
        )
        if res.memory is None:
            result.errors.append(f"{size:g} GiB: not measured ({'; '.join(res.errors)})")
        else:
            result.sizes.append(res.memory)
        del state
        gc.collect()
    _results.finish(result.machine)
    return result


if __name__ == "__main__":
    sys.exit(_results.script_main(PART, run))
