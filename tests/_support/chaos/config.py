"""The chaos runner's settings (:class:`ChaosConfig`, the CLI's flags) and its one error."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests._support.workload import SCRIPT, TINY_ARGS


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    """Shape of a chaos run (the CLI's flags)."""

    nodes: int = 3
    """``ftmem-launch`` agents (nodes) of the faulty run."""
    nproc: int = 1
    """Ranks per node."""
    parity: int = 1
    """Erasure coding's m (0: off); needs at least m + 2 nodes."""
    flush_every: int = 5
    """``--ftmem-flush-every`` (0: no disk tiers, no disk faults)."""
    hang_timeout_s: float = 5.0
    """``--ftmem-hang-timeout``: how long a SIGSTOPped rank goes unnoticed."""
    step_delay_s: float = 0.2
    """The script's ``--step-delay``: time for the runner to act within a step."""
    tail_steps: int = 15
    """Steps trained after the last fault's step (room for the last faults' recovery and
    for the flushes that show that the disk faults were recovered from)."""
    model_args: list[str] = field(default_factory=lambda: list(TINY_ARGS))
    """More arguments of the script: its model's size (default the workload's tiny model,
    :data:`tests._support.workload.TINY_ARGS`)."""
    script: Path = SCRIPT
    """The training script: by default the test workload
    (:data:`tests._support.workload.SCRIPT`). It must take ``--steps``, ``--pg-timeout`` and
    ``--step-delay``, print ``[rank R] resumed from step N``, log ``[rank R] <logger> INFO:
    step N loss`` every step and end with ``[rank R] digest``."""
    recovery_timeout_s: float = 300.0
    """Longest wait for one fault to fire and the run to recover (else the run fails)."""
    timeout_s: float = 3600.0
    """Longest whole run (reference run included)."""
    reference: dict[int, str] | None = None
    """Digests of a failure-free run of the same world size (None: run one first)."""
    workdir: Path | None = None
    """Where everything goes (default: a new /tmp/chaos-* directory)."""
    keep: bool | None = None
    """Keep the work directory (logs, events, disk tiers) after the run: always (True),
    never (False), or only when the run failed (None)."""
    agent_args: list[str] = field(default_factory=list)
    """More ``ftmem-launch`` arguments."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc < 1 or self.parity < 0 or self.flush_every < 0:
            raise ValueError("nodes and nproc must be >= 1, parity and flush_every >= 0")
        if self.parity > 0 and self.nodes < self.parity + 2:
            raise ValueError(f"m={self.parity} needs at least {self.parity + 2} nodes")
        if self.recovery_timeout_s <= 0 or self.timeout_s <= 0:
            raise ValueError("timeouts must be > 0")

    @property
    def world(self) -> int:
        """Ranks in the run."""
        return self.nodes * self.nproc


class RunFailed(Exception):
    """The faulty run cannot go on (an agent exited, a wait ran out): the report says why."""
