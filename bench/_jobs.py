"""What the parts that run training jobs of the example share: flags, a run's result, cleanup."""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import _launch

MODEL_FLAGS = ("d_model", "n_layers", "vocab", "seq_len", "batch_size")


def flags(**values: Any) -> list[str]:
    """``--name value`` for each keyword, in order (``_`` in a name becomes ``-``)."""
    return [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def model_flags(args: argparse.Namespace) -> list[str]:
    """The example's model-size flags from ``args`` (``_launch.add_model_args``)."""
    return flags(**{k: getattr(args, k) for k in MODEL_FLAGS})


def example() -> str:
    """The example script, relative to the repository root."""
    return str(_launch.EXAMPLE.relative_to(_launch.REPO))


@dataclass
class JobRun:
    """One training job in one configuration: status and each rank's step times."""

    config: str
    repeat: int
    ok: bool = False
    error: str = ""
    wall_s: float = 0.0
    load_start: float = 0.0
    rank_median: dict[int, float] = field(default_factory=dict)
    rank_mean: dict[int, float] = field(default_factory=dict)

    def read_step_times(self, text: str) -> None:
        """Each rank's median and mean step time from the example's closing lines."""
        for r, v in _launch.MEDIAN_RE.findall(text):
            self.rank_median[int(r)] = float(v)
        for r, v in _launch.MEAN_RE.findall(text):
            self.rank_mean[int(r)] = float(v)


def clean_up(res: Any, run_id: str, tmp: Path, keep_logs: bool) -> None:
    """Remove the shared memory of ``run_id`` left behind (noted in ``res.notes``) and ``tmp``."""
    if leftovers := _launch.remove_shm(run_id):
        res.notes.append(f"shared memory left behind (removed): {leftovers}")
    if keep_logs:
        print(f"# {res.config} {res.repeat}: logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
