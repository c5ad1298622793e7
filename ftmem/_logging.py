"""Logging helpers: module loggers and the ``[node/rank step]`` identity prefix.

No handler is attached on import; CLIs call :func:`configure` once.
"""

from __future__ import annotations

import logging
import os
import sys


def get_logger(name: str) -> logging.Logger:
    """Return the logger for module ``name`` (a child of the ``ftmem`` logger)."""
    return logging.getLogger(name)


def prefix(node: str | None = None, rank: int | None = None, step: int | None = None) -> str:
    """Return the ``[node/rank step]`` prefix used on every event line."""
    parts = node if node is not None else "-"
    parts += f"/{rank}" if rank is not None else "/-"
    if step is not None:
        parts += f" {step}"
    return f"[{parts}]"


def configure(level: str | int | None = None) -> None:
    """Attach one stderr handler to the ``ftmem`` logger (for CLIs and daemons only).

    The level comes from ``level``, else ``FTMEM_LOG_LEVEL``, else INFO.
    """
    # ftmem.config.ENV_LOG_LEVEL, spelled out: this module sits below config in the layers.
    lvl = level if level is not None else os.environ.get("FTMEM_LOG_LEVEL", "INFO")
    root = logging.getLogger("ftmem")
    if not any(getattr(h, "_ftmem", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._ftmem = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(lvl if isinstance(lvl, int) else lvl.upper())
