"""The command lines users script against are frozen: every ``--ftmem-*`` flag of
``ftmem-launch`` and every subcommand flag of ``ftmem``, with its default and help, must equal
``tests/unit/cli_surface.txt``. A change to them is then a deliberate one: rerun with
``FTMEM_UPDATE_CLI_SURFACE=1`` and commit the file with the change (and its docs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ftmem.cli import get_args_parser as ftmem_parser
from ftmem.launch.cli import get_args_parser as launch_parser

SURFACE = Path(__file__).with_name("cli_surface.txt")


def _lines(prefix: str, parser: argparse.ArgumentParser, only: str = "") -> list[str]:
    out = []
    for action in parser._actions:  # argparse has no public listing of its options
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in sorted(action.choices.items()):
                out += _lines(f"{prefix} {name}", sub)
            continue
        flags = ", ".join(action.option_strings) or action.dest
        if only and not any(f.startswith(only) for f in action.option_strings):
            continue
        if action.default == argparse.SUPPRESS:
            continue
        default = action.default if not isinstance(action.default, Path) else str(action.default)
        out.append(f"{prefix} {flags} default={default!r}: {' '.join((action.help or '').split())}")
    return out


def surface() -> str:
    """The frozen text: one line per flag."""
    lines = _lines("ftmem-launch", launch_parser(), only="--ftmem")
    lines += _lines("ftmem", ftmem_parser())
    return "\n".join(lines) + "\n"


def test_the_command_lines_are_what_was_decided() -> None:
    now = surface()
    if os.environ.get("FTMEM_UPDATE_CLI_SURFACE") == "1":
        SURFACE.write_text(now)
    assert SURFACE.read_text() == now, (
        "a flag, default or help text changed: if on purpose, rerun with "
        "FTMEM_UPDATE_CLI_SURFACE=1 and commit tests/unit/cli_surface.txt"
    )
