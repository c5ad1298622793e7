"""Sharded snapshots of replicated (data-parallel) state: each of D ranks saves 1/D, vs all.

Every rank of a D-process gloo group builds the same state (``_baselines.build_state``: square
``nn.Linear`` layers + AdamW, identical on every rank, as under DDP) and takes snapshots into
one SMP with sharding on (``replicated_over=WORLD``) and off (``shard_replicated=False``),
alternating, in the same run. Per mode: the stall (``save`` + the fence at the next
``optimizer.step``, after a compute stand-in), the background copy time, the bytes each rank
holds, and the restore time (``load``: verify, copy and, sharded, the all-gather of the rows
from every rank). Writes its table into docs/benchmarks.md (section ``sharding``)::

    python bench/sharding.py                      # 0.5 GiB of state, D = 2 and 4, 5 repeats
    python bench/sharding.py --size-gib 0.1 --repeats 2 --out /tmp/b.md   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _report

MARK = "RESULT "


def worker(args: argparse.Namespace) -> None:
    """One rank: snapshots with sharding on and off, then restores; prints JSON results."""
    import torch
    import torch.distributed as dist

    from bench._baselines import build_state
    from ftmem.client import Checkpointer
    from ftmem.config import ClientConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    st = build_state(args.size_gib, seed=0)  # the same on every rank: replicated
    state = {"model": st.model, "optim": st.optimizer}
    out: dict[str, Any] = {"rank": rank, "nbytes": st.nbytes}
    modes = {
        "sharded": (Checkpointer(ClientConfig(shard_replicated=True)), dist.group.WORLD),
        "full": (Checkpointer(ClientConfig(shard_replicated=False)), None),
    }
    step = 0
    for rep in range(args.repeats + 1):  # the first round allocates the slots: a warm-up
        for name, (ck, group) in modes.items():
            step += 1
            t0 = time.perf_counter()
            ck.save(state, step, replicated_over=group)
            save_s = time.perf_counter() - t0
            time.sleep(args.compute_s)  # forward/backward stand-in (the copy overlaps it)
            t1 = time.perf_counter()
            for p in st.model.parameters():
                p.grad = None
            st.optimizer.step()  # the fence: waits for the copy if it is not done
            fence_s = time.perf_counter() - t1
            ck.wait(600)
            if rep:
                r = out.setdefault(name, {"stall": [], "copy": [], "restore": [], "held": 0})
                r["stall"].append(save_s + fence_s)
                r["copy"].append(ck.stats()["last_copy_s"])
                r["held"] = _held_bytes(rank, step)
            dist.barrier()
    for name, (ck, group) in modes.items():
        step += 1
        ck.save(state, step, replicated_over=group)  # the newest step: the one load restores
        ck.wait(600)
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            got = ck.load(state, replicated_over=group)
            out[name]["restore"].append(time.perf_counter() - t0)
            assert got > 0
    for ck, _ in modes.values():
        ck.close()
    print(MARK + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _held_bytes(rank: int, step: int) -> int:
    """Bytes of ``rank``'s snapshot of ``step`` (tensors + objects), from the SMP."""
    from datetime import timedelta

    from ftmem.protocol import messages as m
    from ftmem.protocol.smp_client import SmpClient

    with SmpClient(Path(os.environ["FTMEM_RUN_DIR"]), timeout=timedelta(seconds=10)) as c:
        snaps = c.request(m.Query(rank=rank))["snapshots"]
    doc = json.loads(next(s for s in snaps if int(s["step"]) == step)["layout"])
    return sum(int(t["nbytes"]) for t in doc["tensors"]) + int(doc["objects"]["nbytes"])


def run_world(world: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Start an SMP and ``world`` ranks; return the ranks' results and the bytes they hold."""
    from ftmem.smp.spawn import start_smp

    run_dir = tmp / f"run{world}"
    store = tmp / f"store{world}"
    with start_smp(run_dir=run_dir, run_id=f"bshard{os.getpid()}w{world}", slots=2):
        procs = []
        for r in range(world):
            env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(r),
                FTMEM_RUN_DIR=str(run_dir),
                OMP_NUM_THREADS="1",
            )
            cmd = [sys.executable, __file__, "--_worker", "--store", str(store)]
            cmd += ["--size-gib", str(args.size_gib), "--repeats", str(args.repeats)]
            cmd += ["--compute-s", str(args.compute_s)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        results = []
        for p in procs:
            stdout, _ = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"a rank failed (exit {p.returncode})")
            line = next(x for x in stdout.splitlines() if x.startswith(MARK))
            results.append(json.loads(line[len(MARK) :]))
    held = {
        "sharded": [int(r["sharded"]["held"]) for r in results],
        "unsharded": [int(r["full"]["held"]) for r in results],
    }
    return {"ranks": results, "held": held}


def render(worlds: dict[int, dict[str, Any]], args: argparse.Namespace, took: float) -> str:
    """The markdown section."""
    start, end = _report.markers("sharding")
    lines = [
        start,
        "## Sharded snapshots of replicated state (DDP): 1/D per rank vs everything",
        "",
        "Generated by `bench/sharding.py`; every figure below was measured in this run.",
        "",
        "```",
        _report.shown_command("sharding.py", sys.argv[1:]),
        "```",
        "",
        *[f"- {f}" for f in _report.machine_facts()],
        f"- the whole run took {took / 60:.1f} min; state {args.size_gib} GiB per rank "
        f"(square nn.Linear + AdamW, identical on every rank), {args.repeats} repeats after "
        f"one warm-up, modes alternating; compute stand-in {args.compute_s} s (sleep); all D "
        "ranks and the SMP share this machine's 2 cores",
        "- stall = `save` + the fence at the next `optimizer.step`; copy = the background "
        "copy (`stats()['last_copy_s']`); held = bytes of each rank's snapshot; restore = "
        "`load` of a snapshot of that mode (agreement, verify, copy, and sharded: the "
        "all-gather of every rank's rows). Medians over ranks and repeats (min-max)",
        "",
        "| D | mode | held per rank | stall | copy | restore | copy vs full | held vs full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, res in sorted(worlds.items()):
        full_copy = statistics.median(c for r in res["ranks"] for c in r["full"]["copy"])
        for mode in ("full", "sharded"):
            vals = {k: [v for r in res["ranks"] for v in r[mode][k]] for k in ("stall", "copy")}
            restore = [v for r in res["ranks"] for v in r[mode]["restore"]]
            held = res["held"]["unsharded" if mode == "full" else "sharded"]
            held_med = statistics.median(held) / 2**20
            copy_ratio = statistics.median(vals["copy"]) / full_copy if full_copy else 0.0
            held_ratio = statistics.median(res["held"]["sharded"]) / statistics.median(
                res["held"]["unsharded"]
            )
            lines.append(
                f"| {world} | {mode} | {held_med:.0f} MiB | {_report.stat(vals['stall'], '.4f')} s"
                f" | {_report.stat(vals['copy'], '.3f')} s | {_report.stat(restore, '.3f')} s | "
                + ("1 | 1 |" if mode == "full" else f"{copy_ratio:.2f} | {held_ratio:.3f} |")
            )
    lines += [
        "",
        "Goal (issue 8): copy time and bytes ~1/D with sharding on. "
        + "; ".join(
            f"D={w}: bytes {statistics.median(r['held']['sharded']) / statistics.median(r['held']['unsharded']):.3f}"
            f" (1/D = {1 / w:.3f})"
            for w, r in sorted(worlds.items())
        )
        + ". Held per rank: tensors + objects of the rank's snapshot in each mode, from the "
        "SMP's committed layouts.",
        end,
    ]
    return "\n".join(lines)


def get_args_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5, help="state per rank (GiB)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="values of D")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per mode")
    p.add_argument("--compute-s", type=float, default=0.3, help="forward/backward stand-in (s)")
    p.add_argument("--out", type=Path, default=_report.DEFAULT_OUT, help="markdown to update")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or one rank of it) and write the section."""
    args = get_args_parser().parse_args(argv)
    if args._worker:
        worker(args)
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ftmem-bench-shard-") as tmp:
        worlds = {w: run_world(w, args, Path(tmp)) for w in args.worlds}
    section = render(worlds, args, time.monotonic() - t0)
    _report.write_section(args.out, "sharding", section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
