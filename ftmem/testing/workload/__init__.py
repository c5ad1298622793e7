"""The training job the chaos runner trains, shipped inside the package so that
``python -m ftmem.testing.chaos`` runs from an installed wheel (no repository checkout).

:data:`SCRIPT` is a file to hand to ``ftmem-launch`` as its training script
(``ftmem-launch ... SCRIPT --steps 40``); its flags and the lines it prints are described in
its docstring (``train.py`` in this directory). It lives in a directory of its own because
Python puts a script's directory first on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("train.py")
"""The workload's training script (a file inside the installed ``ftmem`` package)."""

__all__ = ["SCRIPT"]
