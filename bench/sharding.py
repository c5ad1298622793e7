"""Sharded snapshots of replicated (data-parallel) state: each of D ranks saves 1/D, vs all.

    python bench/sharding.py                      # 0.5 GiB of state, D = 2 and 4, 5 repeats
    python bench/sharding.py --size-gib 0.1 --repeats 2 --no-write   # a quick look

How it measures: docs/benchmarks.md, "How the parts measure".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/sharding.py

from bench import _render, _results
from bench import _stats as st
from bench._figures import Goal, goal_rows, le, mib, table
from bench._stats import fmt, stat

PART = "sharding"
MARK = "RESULT "  # The line of a rank's JSON results on its stdout.


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
            if not rep:  # skipped while the SMP allocates: wait() saves it again, state unchanged
                ck.wait(600)
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

    from ftmem.protocol.smp_client import SmpClient

    deadline = time.monotonic() + 20.0  # the SMP lists a step once it has verified it
    with SmpClient(Path(os.environ["FTMEM_RUN_DIR"]), timeout=timedelta(seconds=10)) as c:
        while True:
            snaps = c.query(rank)
            if mine := [s for s in snaps if s.step == step]:
                break
            if time.monotonic() > deadline:
                held = [s.step for s in snaps]
                raise RuntimeError(
                    f"step {step} of rank {rank} is not in the SMP (it holds {held})"
                )
            time.sleep(0.05)
    doc = json.loads(mine[0].layout)
    return sum(int(t["nbytes"]) for t in doc["tensors"]) + int(doc["objects"]["nbytes"])


def run_world(world: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Start an SMP and ``world`` ranks; return the ranks' results and the bytes they hold."""
    from ftmem.smp.spawn import start_smp

    run_dir = tmp / f"run{world}"
    store = tmp / f"store{world}"
    with start_smp(run_dir=run_dir, run_id=f"bshard{os.getpid()}w{world}", slots=2):
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
            env.update(FTMEM_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
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
    modes: dict[str, dict[str, Any]] = {}
    for name in ("full", "sharded"):
        modes[name] = {
            "held": int(sorted(int(r[name]["held"]) for r in results)[len(results) // 2]),
            **{k: [x for r in results for x in r[name][k]] for k in ("stall", "copy", "restore")},
        }
    return {"world": world, "modes": modes, "ranks": results}


@dataclass(kw_only=True)
class ShardingResult(_results.PartResult):
    """The sharding part's results: per D, per mode, every rank's figures."""

    size_gib: float
    repeats: int
    compute_s: float
    worlds: list[dict[str, Any]] = field(default_factory=list)


def get_args_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = _results.parser(__doc__)
    p.add_argument("--size-gib", type=float, default=0.5, help="state per rank (GiB)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="values of D")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per mode")
    p.add_argument("--compute-s", type=float, default=0.3, help="forward/backward stand-in (s)")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    return p


def run(argv: list[str]) -> ShardingResult:
    """Parse ``argv`` and measure every D."""
    args = get_args_parser().parse_args(argv)
    same = {k: getattr(args, k) for k in ("size_gib", "repeats", "compute_s")}
    res = ShardingResult(argv=argv, machine=_results.machine(), **same)
    with tempfile.TemporaryDirectory(prefix="ftmem-bench-shard-") as tmp:
        res.worlds = [run_world(w, args, Path(tmp)) for w in args.worlds]
    _results.finish(res.machine)
    return res


# ------------------------------------------------------------------------------ the section

Doc = dict[str, Any]


def sections(r: Doc) -> dict[str, list[str]]:
    """Section ``sharding``: per D and mode, held bytes, stall, copy, restore."""
    out = [
        f"- state {r['size_gib']:g} GiB per rank, {r['repeats']} repeats after one warm-up, modes "
        f"alternating; compute stand-in {r['compute_s']:g} s (sleep); medians over ranks and repeats",
        "",
    ]
    body = []
    for w in r["worlds"]:
        full = w["modes"].get("full")
        for mode, m in w["modes"].items():
            copy_vs = fmt(st.ratio(st.median(m["copy"]), full and st.median(full["copy"])))
            held_vs = fmt(st.ratio(m["held"], full and full["held"]), ".3f")
            spec = {"stall": ".4f", "copy": ".3f", "restore": ".3f"}
            times = [stat(m[k], f, " s") for k, f in spec.items()]
            body.append([w["world"], mode, mib([m["held"]]), *times, copy_vs, held_vs])
    head = ["D", "mode", "held per rank", "stall", "copy", "restore", "copy vs full"]
    return {"sharding": out + table([*head, "held vs full"], body)}


def goals(r: Doc | None) -> list[Goal]:
    """Bytes held per rank with sharding on: 1/D of the full snapshot."""
    out = []
    for w in (r or {}).get("worlds", []):
        full, sh, d = w["modes"].get("full"), w["modes"].get("sharded"), w["world"]
        if full and sh:
            rat = st.ratio(sh["held"], full["held"])
            g = (f"bytes held per rank, sharded / full, D={d}", f"~1/D = {1 / d:.3f}")
            out += goal_rows(PART, [g], [(st.fmt(rat, ".3f"), le(rat, 1.05 / d))], "sharding")
    return out


if __name__ == "__main__":
    if "--_worker" in sys.argv:
        worker(get_args_parser().parse_args())
        sys.exit(0)
    sys.exit(_render.script_main(PART, run))
