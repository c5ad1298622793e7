"""The ``ftmem`` command: ``ftmem status`` (what a node's SMP holds), ``ftmem export`` (a step
in memory to a stock DCP checkpoint), ``ftmem keygen``.

Modules: __main__.py (``python -m ftmem.cli``, the subcommands), cleanup.py (``ftmem cleanup``:
orphaned slot files), persist.py (``ftmem flush``, ``ftmem assemble``), combine.py
(``ftmem combine``)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from ftmem.config import default_run_dir
from ftmem.errors import ProtocolError
from ftmem.protocol.status import FlushStatus, ProtectionStatus, SmpStatus


def _fmt_age(t: float | None) -> str:
    return "-" if t is None else f"{time.time() - t:.1f}s ago"


def print_status(st: SmpStatus) -> None:
    """Print one SMP's STATUS as a table."""
    print(
        f"node {st.node}  run {st.run_id}  smp pid {st.pid}  up {st.uptime_s:.0f}s  "
        f"bad messages {st.bad_messages}"
    )
    print(
        f"{'rank':>5} {'pid':>8} {'committed':>10} {'verified':>9} {'steps':>12} {'held MiB':>9} "
        f"{'snap MiB':>9} {'unshard':>8} "
        f"{'stall ms':>9} {'copy ms':>8} {'skipped':>8} {'progress':>14}"
    )
    for rank, r in sorted(st.ranks.items()):
        steps = ",".join(str(s) for s in r.committed_steps) or "-"
        newest = "-" if r.newest_committed is None else str(r.newest_committed)
        verified = "-" if r.newest_verified is None else str(r.newest_verified)
        print(
            f"{rank:>5} {r.pid or '-':>8} {newest:>10} {verified:>9} {steps:>12} "
            f"{r.bytes_held / 2**20:>9.1f} {r.snapshot_bytes / 2**20:>9.1f} "
            f"{r.unsharded_bytes / 2**20:>8.1f} {r.last_stall_s * 1e3:>9.2f} "
            f"{r.last_copy_s * 1e3:>8.1f} {r.skipped:>8} {_fmt_age(r.last_progress_time):>14}"
        )
    for rank, r in sorted(st.ranks.items()):
        if r.skips:
            reasons = "; ".join(f"{n} x {reason}" for reason, n in sorted(r.skips.items()))
            print(f"  rank {rank} skipped: {reasons}")
    if st.protection is None:
        print("erasure coding: unreadable status")
    else:
        print_exchange(st.protection)
    if st.flush.enabled:
        print(flush_line(st.flush))


def flush_line(fl: FlushStatus) -> str:
    """The disk tiers' line of ``ftmem status`` (pure)."""
    when = f"every {fl.every} steps" if fl.every > 0 else "on `ftmem flush` and SIGTERM only"
    last = (
        f"last flushed step {fl.last_step} ({fl.last_seconds} s)"
        if fl.last_step is not None
        else "nothing flushed yet"
    )
    running = fl.running
    return (
        f"disk tiers: {', '.join(fl.tiers)}  {when}, keep {fl.keep}; {last}; "
        f"flushes {fl.flushes}, failures {fl.failures}"
        + (f"; now step {running.step}: {running.stage}" if running else "")
        + (f"; last error: {fl.last_error}" if fl.last_error else "")
    )


def print_exchange(ex: ProtectionStatus) -> None:
    """Print the erasure-coding part of a STATUS document (protection, bytes, peers)."""
    if not ex.enabled or ex.state is None:
        print("erasure coding: off (single node, or fewer than m + 2 nodes)")
        return
    own, parity = ex.own_bytes, ex.parity_bytes
    ratio = f"{parity / own:.3f}" if own else "-"
    group = list(ex.group)
    k = len(group) - (ex.m or 0)
    expect = f"{(ex.m or 0) / k:.3f}" if k > 0 else "-"
    c = ex.counters
    print(
        f"erasure coding: node {ex.me} of group {group} m={ex.m} "
        f"generation {'-' if ex.epoch is None else ex.epoch // 2} state {ex.state.value}"
        + (f" ({ex.error})" if ex.error else "")
    )
    print(
        f"  protected step {ex.protected_step}  own {own / 2**20:.1f} MiB  "
        f"parity {parity / 2**20:.1f} MiB (ratio {ratio}, m/(n-m) = {expect})  "
        f"last protect {ex.last_protect_s}s  rounds ok {c.protected} "
        f"aborted {c.aborted} failed {c.failed} rebuilt {c.rebuilt}"
    )
    for p in ex.peers:
        seen = p.last_seen_s
        health = "never heard from" if seen is None else f"heard {seen}s ago"
        if seen is not None and seen > 10:
            health += " (UNHEALTHY)"
        print(f"  peer {p.node:>3} {p.endpoint}  {health}")


def get_args_parser() -> argparse.ArgumentParser:
    """Return the parser of the ``ftmem`` command."""
    p = argparse.ArgumentParser(prog="ftmem", description="ftmem tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="show what the node's SMP holds")
    s.add_argument(
        "--run-dir",
        type=Path,
        nargs="+",
        default=None,
        help="the SMP's run directory, or several (one per node on this host); default "
        "$FTMEM_RUN_DIR, else every SMP of yours running on this host",
    )
    s.add_argument(
        "--run-id", default=None, help="the SMPs of this run on this host (ftmem-launch's)"
    )
    s.add_argument("--json", action="store_true", help="print the raw STATUS document")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the SMP")
    e = sub.add_parser(
        "export",
        help="write a step held in the SMPs' memory as a stock torch.distributed.checkpoint dir",
    )
    e.add_argument(
        "--run-dir",
        type=Path,
        nargs="+",
        default=None,
        help="the run directory of every SMP whose ranks make up the run (this host)",
    )
    e.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="instead of memory: a flushed checkpoint (verified first) to convert with "
        "--torch-save or --safetensors",
    )
    e.add_argument("--out", type=Path, default=None, help="new DCP directory to create")
    e.add_argument("--step", type=int, default=None, help="default: newest step of every rank")
    e.add_argument("--writers", type=int, default=2, help="data files written in parallel")
    e.add_argument(
        "--buffered",
        action="store_true",
        help="write through the page cache (default: O_DIRECT where the file system allows it)",
    )
    e.add_argument(
        "--torch-save",
        type=Path,
        default=None,
        help="also convert it to this single torch.save file (dcp_to_torch_save)",
    )
    e.add_argument(
        "--safetensors",
        type=Path,
        default=None,
        help="also convert it to this safetensors file (needs `pip install safetensors`)",
    )
    f = sub.add_parser("flush", help="flush the newest step to the disk tiers now and wait")
    f.add_argument("--run-dir", type=Path, nargs="+", default=None, help="the SMPs to ask")
    f.add_argument("--run-id", default=None, help="ask the SMPs of this run on this host")
    f.add_argument("--step", type=int, default=-1, help="default: the newest complete step")
    f.add_argument(
        "--tier",
        choices=("local", "persistent"),
        default="persistent",
        help="local: the first tier only; persistent (default): every tier",
    )
    f.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")
    a = sub.add_parser(
        "assemble", help="assemble the nodes' parts of a step in a tier into one DCP checkpoint"
    )
    a.add_argument("tier", type=Path, help="directory holding step_<N>.part-r<R> parts")
    a.add_argument("--step", type=int, default=-1, help="default: the newest step with parts")
    a.add_argument("--timeout", type=float, default=0.0, help="seconds to wait for parts")
    ls = sub.add_parser("ls", help="list the checkpoints of disk tiers")
    ls.add_argument("tiers", type=Path, nargs="+", help="tier directories")
    ls.add_argument("--verify", action="store_true", help="also check every file's hash")
    from ftmem.cli import combine
    from ftmem.observe import plan, timeline_plot

    timeline_plot.add_parser(sub)
    plan.add_parser(sub)
    combine.add_parser(sub)
    k = sub.add_parser("keygen", help="write a CURVE key file (mode 0600) for the SMP mesh")
    k.add_argument("path", type=Path, help="file to create (must not exist)")
    c = sub.add_parser(
        "cleanup",
        help="list this user's orphaned slot files (left by a SIGKILLed SMP) in the private "
        "shared-memory directory",
    )
    c.add_argument("--remove", action="store_true", help="delete them (default: a dry run)")
    c.add_argument(
        "--shm-dir",
        default=None,
        help="where slot files live (default: $FTMEM_SHM_DIR, else /dev/shm/ftmem-<uid>)",
    )
    c.add_argument("--run-id", default=None, help="only this run's files (e.g. after a requeue)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ftmem`` console script."""
    try:
        return _main(argv)
    finally:
        # ``ftmem export`` loads torch: skip the interpreter's last garbage collection of
        # its heap at exit.
        gc.freeze()


def _main(argv: list[str] | None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.cmd in ("timeline", "plan"):
        from ftmem.observe import plan, timeline_plot

        return timeline_plot.run(args) if args.cmd == "timeline" else plan.run(args)
    if args.cmd == "combine":
        from ftmem.cli import combine

        return combine.run(args)
    from ftmem.errors import FtmemError
    from ftmem.protocol.smp_client import SmpClient

    if args.cmd in ("status", "flush") and args.run_dir is None:
        try:
            args.run_dir = chosen_run_dirs(args.run_id)
        except FtmemError as exc:
            print(f"ftmem {args.cmd}: {exc}", file=sys.stderr)
            return 1
    if args.cmd == "status":
        code = 0
        docs: list[dict[str, Any]] = []
        for run_dir in args.run_dir:
            try:
                with SmpClient(run_dir, timeout=timedelta(seconds=args.timeout)) as c:
                    docs.append(c.status_document())
            except FtmemError as exc:
                print(f"ftmem status: {run_dir}: {exc}", file=sys.stderr)
                code = 1
        for i, doc in enumerate(docs):
            if args.json:
                print(json.dumps(doc, indent=2))
                continue
            if i:
                print()
            try:
                print_status(SmpStatus.from_json(doc))
            except ProtocolError as exc:
                print(f"ftmem status: unreadable status ({exc})", file=sys.stderr)
                code = 1
        return code
    if args.cmd == "export":
        from ftmem.tiers.export import export_dcp, find_sources, to_safetensors, to_torch_save

        if args.checkpoint is not None:
            return _export_checkpoint(args)
        if not args.run_dir or args.out is None:
            print("ftmem export: give --run-dir and --out (or --checkpoint)", file=sys.stderr)
            return 2
        try:
            sources = find_sources(args.run_dir, args.step)
            threads, direct = max(1, args.writers), not args.buffered
            res = export_dcp(sources, args.out, threads=threads, direct=direct)
            if args.torch_save is not None:
                to_torch_save(res.path, args.torch_save)
            if args.safetensors is not None:
                to_safetensors(res.path, args.safetensors)
        except (FtmemError, OSError) as exc:
            print(f"ftmem export: {exc}", file=sys.stderr)
            return 1
        print(
            f"exported step {res.step} of {res.world_size} ranks to {res.path} "
            f"({res.nbytes / 2**20:.1f} MiB; {res.shared_tensors} tensors shared by all ranks, "
            f"{res.per_rank_tensors} per rank)"
            + (f"; torch.save file {args.torch_save}" if args.torch_save else "")
            + (f"; safetensors file {args.safetensors}" if args.safetensors else "")
        )
        return 0
    if args.cmd in ("flush", "assemble"):
        from ftmem.cli.persist import run_assemble, run_flush

        return run_flush(args) if args.cmd == "flush" else run_assemble(args)
    if args.cmd == "ls":
        return _ls(args)
    if args.cmd == "cleanup":
        from ftmem.cli.cleanup import run_cleanup

        return run_cleanup(args)
    if args.cmd == "keygen":
        from ftmem.exchange import keys

        try:
            keys.write_key_file(args.path, keys.generate())
        except OSError as exc:
            print(f"ftmem keygen: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.path} (mode 0600)")
        return 0
    return 2


def running_smps() -> dict[Path, SmpStatus]:
    """The run directories of this user on this host whose SMP answers, with its status
    (looked for under :func:`~ftmem.config.user_base_dir`)."""
    import socket

    from ftmem.config import SOCKET_NAME, user_base_dir
    from ftmem.errors import FtmemError
    from ftmem.protocol.smp_client import SmpClient

    found: dict[Path, SmpStatus] = {}
    try:
        dirs = sorted(d for d in user_base_dir().iterdir() if (d / SOCKET_NAME).is_socket())
    except OSError:  # no such base
        dirs = []
    for d in dirs:
        with socket.socket(socket.AF_UNIX) as probe:  # a stale socket refuses at once
            try:
                probe.connect(str(d / SOCKET_NAME))
            except OSError:
                continue
        try:
            with SmpClient(d, timeout=timedelta(seconds=2)) as c:
                found[d] = c.status()
        except FtmemError:
            continue
    return found


def chosen_run_dirs(run_id: str | None) -> list[Path]:
    """The run directories ``ftmem status``/``flush`` ask when given no ``--run-dir``: those of
    ``run_id``'s SMPs on this host; else $FTMEM_RUN_DIR; else every SMP of the user's here.
    Raises FtmemError naming the runs that do exist when none matches."""
    from ftmem.config import ENV_RUN_DIR
    from ftmem.errors import SmpUnavailableError

    if run_id is None and os.environ.get(ENV_RUN_DIR):
        return [default_run_dir()]
    runs = running_smps()
    chosen = [d for d, st in runs.items() if run_id is None or st.run_id == run_id]
    if chosen:
        return chosen
    listed = "; ".join(f"run {st.run_id} node {st.node} ({d})" for d, st in runs.items())
    what = f"of run {run_id!r} " if run_id is not None else "of yours "
    raise SmpUnavailableError(
        f"no SMP {what}runs on this host"
        + (f"; running here: {listed} (give --run-id or --run-dir)" if listed else "")
    )


def _export_checkpoint(args: argparse.Namespace) -> int:
    """``ftmem export --checkpoint DIR --torch-save FILE / --safetensors FILE``: verify every
    file, then convert."""
    from ftmem.errors import FtmemError
    from ftmem.tiers.checkpoints import read_checkpoint, verify_checkpoint
    from ftmem.tiers.export import to_safetensors, to_torch_save

    if args.torch_save is None and args.safetensors is None:
        print(
            "ftmem export: --checkpoint needs --torch-save or --safetensors FILE", file=sys.stderr
        )
        return 2
    try:
        ck = read_checkpoint(args.checkpoint)
        if ck.is_part:
            print(
                f"ftmem export: {ck.path} is one node's part (ranks {ck.ranks[0]}-"
                f"{ck.ranks[-1]}); assemble the parts first (ftmem assemble)",
                file=sys.stderr,
            )
            return 1
        verify_checkpoint(ck)
        for out, convert in ((args.torch_save, to_torch_save), (args.safetensors, to_safetensors)):
            if out is not None:
                convert(ck.path, out)
                print(f"wrote {out} from step {ck.step} ({ck.path})")
    except (FtmemError, OSError) as exc:
        print(f"ftmem export: {exc}", file=sys.stderr)
        return 1
    return 0


def _ls(args: argparse.Namespace) -> int:
    """``ftmem ls``: complete checkpoints (newest first) and what else is in each tier."""
    from ftmem.errors import CorruptSnapshotError, UnsafePathError
    from ftmem.tiers.checkpoints import list_checkpoints, verify_checkpoint

    code = 0
    for tier in args.tiers:
        try:
            good, other = list_checkpoints(tier)
        except UnsafePathError as exc:
            print(f"ftmem ls: {exc}", file=sys.stderr)
            code = 1
            continue
        print(f"{tier}:")
        for ck in good:
            state = "complete"
            if args.verify:
                try:
                    verify_checkpoint(ck)
                    state = "complete, verified"
                except CorruptSnapshotError as exc:
                    state, code = f"CORRUPT ({exc})", 1
            print(
                f"  step {ck.step:>8}  {ck.nbytes / 2**20:>9.1f} MiB  world {ck.world_size:>4}  "
                f"{state}  {ck.path.name}"
            )
        for path, why in other:
            print(f"  {'-':>13}  {'':>9}      {'':>10}  {why}  {path.name}")
        if not good and not other:
            print("  (empty)")
    return code
