"""The benchmark suite: every part in one run on this machine, results JSON, docs/benchmarks.md.

    python bench/run.py --quick                    # small sizes, few repeats: minutes
    python bench/run.py                            # 0.5 and 2 GiB states, full repeats
    python -m bench --smoke --out /tmp/b.md        # tiny: does the suite run
    python bench/run.py --quick --parts snapshot,overhead --no-plots

Each part is a measuring module whose ``run(argv)`` returns a results dataclass; the suite runs
them one after the other with the profile's arguments, writes each one's JSON into
``--json-dir`` (default: ``bench-results/`` next to ``--out``) and its sections into ``--out``
as soon as it ends, then ``suite.json``, the Summary section and the plots. A part that fails
is reported in the summary and the others still run; the exit code is then 1.
``python -m bench._render DIR/*.json`` renders the same sections again from the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/run.py

from bench import _plots, _render, _results

logger = logging.getLogger("bench.run")

PARTS = tuple("snapshot overhead recovery ec-protect ec-overhead flush datapath gpu".split())
SCRIPTS = {  # part: its measuring module in bench/ (its ``run(argv)``; the script run alone)
    **{part: part.replace("-", "_") for part in PARTS},
    "gpu": "datapath",
}
_PROFILES = {  # part: (smoke, quick, full) arguments
    "snapshot": (
        "--sizes 0.02 --repeats 1 --fwd-bwd-s 0.05 --simulate sleep --skip-sync-staging",
        "--sizes 0.125,0.25 --repeats 3 --fwd-bwd-s 0.3 --skip-sync-staging",
        "--sizes 0.5,2 --repeats 5",
    ),
    "overhead": ("--cycles 1 --interval 2 --d-model 32 --vocab 64", "--quick", ""),
    "recovery": (
        "--repeats 1 --no-reference --steps 6 --fail-at-step 3",
        "--repeats 1 --no-reference",
        "--repeats 3",
    ),
    "ec-protect": (
        "--size-mib 8 --repeats 1 --cases 3:1",
        "--size-mib 64 --repeats 2 --cases 3:1",
        "--size-mib 1024 --repeats 3",
    ),
    "ec-overhead": (
        "--configs off,on --steps 6 --repeats 1",
        "--configs off,on --steps 16 --repeats 1",
        "--repeats 3",
    ),
    "flush": (
        "--sizes 0.02 --repeats 1 --train-repeats 0",
        "--sizes 0.25 --repeats 2 --train-repeats 0",
        "--sizes 0.5,2 --repeats 3 --train-repeats 3",
    ),
    "datapath": ("--smoke", "--quick", ""),
    "gpu": ("--gpu --smoke", "--gpu --quick", "--gpu"),
}
PROFILES = {
    prof: {part: shlex.split(args[i]) for part, args in _PROFILES.items()}
    for i, prof in enumerate(("smoke", "quick", "full"))
}
# --quick leaves out ec-overhead: its 3-node jobs take a minute and a half on their own here.
PROFILE_PARTS = {
    "smoke": ("snapshot",),
    "quick": tuple(p for p in PARTS if p != "ec-overhead"),
    "full": PARTS,
}
REPEAT_FLAG = {"overhead": "--cycles"}  # every other part: --repeats


def part_argv(name: str, args: argparse.Namespace) -> list[str]:
    """The arguments of part ``name`` under the chosen profile and the suite's flags."""
    argv = list(PROFILES[args.profile][name])
    if args.repeats is not None:
        argv += [REPEAT_FLAG.get(name, "--repeats"), str(args.repeats)]
    if args.sizes and name in ("snapshot", "flush"):
        argv += ["--sizes", args.sizes]
    if args.disk_dir and name in ("snapshot", "flush", "datapath"):
        argv += ["--disk-dir", str(args.disk_dir)]
    for extra in args.extra:
        part, _, text = extra.partition("=")
        argv += shlex.split(text) if part == name else []
    return argv


def run_part(name: str, argv: list[str], suite_command: str) -> tuple[dict[str, Any] | None, str]:
    """Run one part; (its JSON document or None, error text). A crash is caught, not raised."""
    module = importlib.import_module(f"bench.{SCRIPTS[name]}")
    shown = " ".join(["python", f"bench/{SCRIPTS[name]}.py", *map(shlex.quote, argv)])
    try:
        doc = _results.document(name, module.run(argv))
    except (Exception, SystemExit) as exc:  # argparse errors are SystemExit
        logger.error("part %s failed:\n%s", name, traceback.format_exc())
        return None, f"{type(exc).__name__}: {exc}"
    doc["command"] = f"{suite_command}\n# this part alone: {shown}"
    return doc, ""


def get_args_parser() -> argparse.ArgumentParser:
    """The suite's command line."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, few repeats (minutes)")
    size.add_argument(
        "--smoke", action="store_true", help="tiny: snapshot part only, unless --parts"
    )
    p.add_argument(
        "--parts", default=None, help=f"comma-separated subset of: {', '.join(PARTS)}; or 'all'"
    )
    p.add_argument("--skip", default="", help="comma-separated parts to leave out")
    p.add_argument("--sizes", default=None, help="state sizes in GiB for snapshot and flush")
    p.add_argument("--repeats", type=int, default=None, help="repeats (overhead: cycles) per part")
    p.add_argument("--disk-dir", type=Path, default=None, help="a disk directory (not tmpfs)")
    extra = "more arguments for one part (repeatable)"
    p.add_argument("--extra", action="append", default=[], metavar="PART=ARGS", help=extra)
    p.add_argument("--out", type=Path, default=_results.DEFAULT_OUT, help="the Markdown file")
    json_dir = "results JSON (default: bench-results/ by --out)"
    p.add_argument("--json-dir", type=Path, default=None, help=json_dir)
    p.add_argument("--img-dir", type=Path, default=None, help="PNGs (default: img/ by --out)")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNGs")
    p.add_argument("--no-write", action="store_true", help="print the sections only")
    return p


def _choose(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    chosen = args.parts or ",".join(PROFILE_PARTS[args.profile])
    parts = {
        x.strip() for x in (",".join(PARTS) if chosen == "all" else chosen).split(",") if x.strip()
    }
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    if unknown := (parts | skip) - set(PARTS):
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return [x for x in PARTS if x in parts and x not in skip]


def _emit(args: argparse.Namespace, name: str, text: str) -> None:
    if args.no_write:
        print(text)
    else:
        _render.write_section(args.out, name, text)


def main(argv: list[str] | None = None) -> int:
    """Run the suite; 0 if every part ran without failure."""
    argv = sys.argv[1:] if argv is None else argv
    p = get_args_parser()
    args = p.parse_args(argv)
    args.profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    parts = _choose(p, args)
    args.out = args.out.absolute()
    json_dir = (args.json_dir or args.out.parent / "bench-results").absolute()
    img_dir = (args.img_dir or args.out.parent / "img").absolute()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command = " ".join(["python bench/run.py", *map(shlex.quote, argv)])
    suite: dict[str, Any] = {
        "command": command,
        "profile": args.profile,
        "parts": [],
        "peak_load": 0.0,
    }
    machine = _results.machine()
    docs: dict[str, dict[str, Any]] = {}
    for name in parts:
        logger.info("part %s: starting", name)
        t0 = time.monotonic()
        doc, error = run_part(name, part_argv(name, args), command)
        seconds = time.monotonic() - t0
        suite["peak_load"] = max(suite["peak_load"], os.getloadavg()[0])
        if doc is not None:
            docs[name] = doc
            errors = doc["result"].get("errors")
            error = f"ran, with failures: {'; '.join(errors)[:300]}" if errors else ""
            if not args.no_write:
                _results.write_json(json_dir / f"{name}.json", doc)
            for section, text in _render.sections(doc).items():
                _emit(args, section, text)
        suite["parts"].append({"name": name, "seconds": seconds, "status": error or "ok"})
        logger.info("part %s: %s in %.0f s", name, error or "done", seconds)
    suite["machine"] = _results.as_dict(_results.finish(machine))
    if not args.no_plots:
        suite["plots"], suite["plot_note"] = _plots.draw_all(docs, img_dir, args.out.parent)
    if not args.no_write:
        _results.write_json(json_dir / "suite.json", {"part": "suite", "result": suite})
    _emit(args, "summary", _render.summary(docs, suite))
    if not args.no_write:
        print(f"# wrote {args.out} and {json_dir}", file=sys.stderr)
    return 1 if any(x["status"] != "ok" for x in suite["parts"]) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
