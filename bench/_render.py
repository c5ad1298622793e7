"""The one renderer: results JSON (``bench/_results.py``) -> the sections of docs/benchmarks.md.

    python -m bench._render docs/bench-results/*.json --out docs/benchmarks.md

Every table of docs/benchmarks.md between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->`` is made here from the figures of one run; the rest of the file
(the hand-written reading of the figures) is never touched. Each part's rendering module
(:data:`MODULES`: the part's own module, or its ``*_tables.py`` beside it) gives its sections'
tables (``sections(result)``, from the figures declared on its results dataclasses,
``bench/_figures.py``) and its goals (``goals(result)``: goal, threshold, measured, met).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/_render.py

from bench import _results
from bench._figures import Goal, table
from bench._stats import fmt

_TITLE = "# Benchmarks"
Doc = dict[str, Any]


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of section ``name``."""
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def machine_lines(m: Doc, what: str = "the part") -> list[str]:
    """Bullets of the machine, software and load of a part."""
    v = m["versions"]
    soft = ", ".join(f"{k} {v[k]}" for k in ("torch", "pyzmq", "pyeclib", "xxhash") if k in v)
    out = [
        f"- date: {m['date']}; {what} took {m['seconds'] / 60:.1f} min",
        f"- CPU: {m['cpu']}, {m['cores']} logical cores; memory {m['memory_gib']:.1f} GiB",
        f"- Python {v['python']}, {soft}, Linux {v['linux']}; torch threads {m['torch_threads']}",
        f"- 1-minute load average at start / end: {fmt(m['load_start'])} / "
        f"{fmt(m['load_end'])} (a shared machine: compare figures within this run only)",
    ]
    d = m.get("disk") or {}
    if d:
        out.append(f"- disk dir {d['dir']}: {d['fs']} at {d['mount']}; /dev/shm: {d['shm_fs']}")
    return out


def _command(doc: Doc) -> str:
    """The part's script with the arguments it ran with (output flags left out)."""
    args, skip = [], False
    for a in doc["result"].get("argv") or []:
        if skip:
            skip = False
        elif a in ("--json", "--out"):
            skip = True
        elif a != "--no-write" and not a.startswith(("--json=", "--out=")):
            args.append(shlex.quote(a))
    script = "datapath" if doc["part"] == "gpu" else doc["part"].replace("-", "_")  # --gpu
    return " ".join([f"python bench/{script}.py", *args])


def head(name: str, title: str, doc: Doc) -> list[str]:
    """A section's opening: markers, title, the command, the machine."""
    cmd = doc.get("command") or _command(doc)
    intro = "Every figure below was measured in the run of this command:"
    machine = machine_lines(doc["result"]["machine"])
    return [markers(name)[0], f"## {title}", "", intro, "", "```", cmd, "```", "", *machine, ""]


def tail(name: str, doc: Doc) -> list[str]:
    """A section's end: the part's goals, its errors, the end marker."""
    rows = goals({name: doc}, only=name)
    out = goal_table(rows, "### Goals") if rows else []
    out += [f"- FAILED: {e}" for e in doc["result"].get("errors", [])]
    return [*out, "", markers(name)[1]]


def goal_table(rows: Sequence[Goal], title: str) -> list[str]:
    """The goals as data: goal, threshold, measured, met, where from."""
    verdict = {None: "not measured", True: "**met**", False: "**missed**"}
    body = [[g.goal, g.threshold, g.measured, verdict[g.met], g.source] for g in rows]
    return [title, "", *table(["goal", "threshold", "measured", "met", "from"], body)]


MODULES = {  # part: the module in bench/ that renders it, in the order of the goals table
    "snapshot": "snapshot",
    "overhead": "overhead",
    "flush": "flush_tables",
    "recovery": "recovery_tables",
    "ec-overhead": "ec_overhead",
    "ec-protect": "ec_protect_tables",
    "datapath": "datapath_tables",
    "gpu": "datapath_tables",
    "sharding": "sharding",
    "ec": "ec",
    "reshard": "reshard",
    "recovery-early": "recovery_tables",
}
"""In the order of the goals table; ``python bench/run.py`` runs the first eight (their
measuring modules: ``bench/run.py``'s ``SCRIPTS``)."""
SECTION_GOALS = {"gpu", "recovery-early"}
"""Sections whose module gives their goals by section name (``goals(result, name)``): a
part's second kind of run (``--gpu``, an early failure)."""
TITLES = {
    "snapshot": "Snapshot: ftmem vs torch.save vs DCP",
    "memory": "Memory per node",
    "overhead": "End-to-end training overhead: snapshot every step, every K steps, none",
    "recovery": "Recovery: failure to resumed, ftmem-launch (in process, fork server, standby ranks, cold) vs torchrun + DCP",
    "recovery-early": "Recovery from a failure early in the run (before the first DCP checkpoint)",
    "ec-protect": "Erasure-coded peer exchange: protect and rebuild between node processes",
    "ec-overhead": "Erasure-coded protection: training-loop overhead, on vs off",
    "flush": "Flush to disk: ftmem vs dcp.save, and step time while flushing",
    "datapath": "Data path: every CPU cycle of a snapshot",
    "gpu": "GPU data path: snapshot of a CUDA state",
    "sharding": "Sharded snapshots of replicated state (DDP): 1/D per rank vs everything",
    "ec": "Erasure codec alone: encode and rebuild throughput",
    "reshard": "Resharding a step to another world size: DCP from memory vs from disk",
}


def module(part: str) -> Any:
    """The rendering module of ``part``: its ``sections(result)`` and ``goals(result)``."""
    return importlib.import_module(f"bench.{MODULES[part]}")


def goals(docs: dict[str, Doc], only: str | None = None) -> list[Goal]:
    """Every goal of every part (or of part ``only``), from the parts' results (missing parts:
    not measured)."""
    out = []
    for part in [only] if only else MODULES:
        if part not in MODULES or not hasattr(mod := module(part), "goals"):
            continue
        r = docs[part]["result"] if part in docs else None
        out += mod.goals(r, part) if part in SECTION_GOALS else mod.goals(r)
    return out


def sections(doc: Doc) -> dict[str, str]:
    """Every section one part's results make (the snapshot part also makes ``memory``)."""
    out: dict[str, str] = {}
    for name, body in module(doc["part"]).sections(doc["result"]).items():
        lines = [*head(name, TITLES[name], doc), *body, *tail(name, doc)]
        out[name] = "\n".join(lines) + "\n"
    return out


# ------------------------------------------------------------------------------ the summary


def summary(docs: dict[str, Doc], suite: Doc) -> str:
    """The suite's Summary section: the run, the goals table, the parts' status."""
    start, end = markers("summary")
    m = suite["machine"]
    out = [
        start,
        "## Summary",
        "",
        f"Generated by `{suite['command']}` (profile `{suite['profile']}`) in "
        f"{m['seconds'] / 60:.1f} min; every figure is a median (min-max) over the repeats of "
        "this run, and every comparison a ratio of figures of this run.",
        "",
        *machine_lines(m, "the suite"),
        f"- highest 1-minute load average between the parts: {fmt(suite['peak_load'])}",
        "",
        *goal_table(goals(docs), "### Goals, checked on this run"),
        *module("snapshot").headline(docs["snapshot"]["result"] if "snapshot" in docs else None),
    ]
    for file, caption in suite.get("plots", {}).items():
        out += [f"![{caption}]({file})", ""]
    if suite.get("plot_note"):
        out += [f"Plots: {suite['plot_note']}.", ""]
    rows = [
        [p["name"], f"`bench:{p['name']}`", f"{p['seconds']:.0f} s", p["status"]]
        for p in suite["parts"]
    ]
    out += ["### Parts of this run", "", *table(["part", "section", "wall time", "status"], rows)]
    return "\n".join([*out, end]) + "\n"


# ------------------------------------------------------------------------------ the file


def _insert_at(text: str, after: str | None) -> int:
    """Where a new section goes: after section ``after`` (``title``: below the title), else
    after the last marked section, else at the end."""
    if after == "title":
        i = text.find(_TITLE)
        eol = text.find("\n", i) if i != -1 else -1
        return 0 if i == -1 else (len(text) if eol == -1 else eol + 1)
    if after is not None and (i := text.find(markers(after)[1])) != -1:
        return i + len(markers(after)[1])
    last = text.rfind(":end -->")
    if last != -1 and text.rfind("<!-- bench:", 0, last) != -1:
        return last + len(":end -->")
    return len(text)


AFTER = {"memory": "snapshot", "recovery-early": "recovery"}
"""Sections placed after another; the rest (the summary too) go after the last results block,
below the hand-written first page."""


def write_section(path: Path, name: str, section: str) -> None:
    """Put ``section`` (markers included) into ``path`` in place of section ``name``.

    The file is read right before it is replaced (tmp + rename), so sections written meanwhile
    by other scripts and the hand-written text are kept.
    """
    start_mark, end_mark = markers(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else _TITLE + "\n"
    body = section.strip("\n")
    start, end = text.find(start_mark), text.find(end_mark)
    if start != -1 and end > start:
        new = text[:start] + body + text[end + len(end_mark) :]
    else:
        at = _insert_at(text, AFTER.get(name))
        head_, tail_ = text[:at].rstrip("\n"), text[at:].lstrip("\n")
        new = head_ + "\n\n" + body + "\n" + ("\n" + tail_ if tail_ else "")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(new)
    os.replace(tmp, path)


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so that the finally blocks stop every job


def script_main(part: str, run: Callable[[list[str]], Any], argv: list[str] | None = None) -> int:
    """A benchmark script's ``main``: measure, write the JSON, render and write the section.

    Returns 1 when the results carry errors.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
    argv = sys.argv[1:] if argv is None else argv
    ns, _ = _output_parser().parse_known_args(argv)
    result = run(argv)
    doc = _results.document(part, result)
    if ns.json is not None:
        _results.write_json(ns.json, doc)
        print(f"# wrote {ns.json}", file=sys.stderr)
    for name, text in sections(doc).items():
        print(text)
        if not ns.no_write:
            write_section(ns.out, name, text)
            print(f"# wrote {ns.out} ({name})", file=sys.stderr)
    return 1 if doc["result"].get("errors") else 0


def _output_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    _results.add_output_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Re-render sections of ``--out`` from results JSON files (the summary from suite.json)."""
    p = argparse.ArgumentParser(description="render bench results JSON into Markdown")
    p.add_argument("files", nargs="+", type=Path, help="results JSON files")
    p.add_argument("--out", type=Path, default=_results.DEFAULT_OUT)
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    docs = {d["part"]: d for d in map(_results.read_json, args.files)}
    texts = {n: t for d in docs.values() if d["part"] != "suite" for n, t in sections(d).items()}
    if suite := docs.pop("suite", None):
        texts["summary"] = summary(docs, suite["result"])
    for name, text in texts.items():
        print(text) if args.no_write else write_section(args.out, name, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
