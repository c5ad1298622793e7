"""CheckFree: rebuild a lost pipeline stage from its two neighbours when no snapshot is left.

A last resort, opt-in with ``ftmem-launch --ftmem-checkfree`` (``FTMEM_CHECKFREE=1``): only
when a stage's snapshot is gone from memory and from the disk tiers. The job runs one stage
per rank, with a :class:`CheckFreeStage` in its state. At ``ftmem.load``
(:func:`rebuild_lost_stages`) the holders restore the newest step they all hold; each lost
intermediate stage is then set to its neighbours' average weighted by their gradient norms,
``(g_prev * W_prev + g_next * W_next) / (g_prev + g_next)`` (float64, cast back; equal weights
when both norms are 0; non-floating tensors from the previous stage), its optimizer state is
reset and its scheduler stepped to the restored step. A lost first or last stage, or two
neighbouring lost stages, fail the load on every rank. See docs/api.md, "CheckFree".
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ftmem._logging import get_logger
from ftmem.config import ENV_CHECKFREE
from ftmem.errors import InconsistentSnapshotError

log = get_logger(__name__)


def enabled() -> bool:
    """``FTMEM_CHECKFREE=1`` (``ftmem-launch --ftmem-checkfree``)."""
    return os.environ.get(ENV_CHECKFREE, "") == "1"


class CheckFreeStage:
    """A pipeline stage's part in CheckFree (see the module docstring); Stateful.

    ``module``: this rank's stage; ``stage_index`` of ``num_stages``; ``optimizer`` and
    ``scheduler``: the stage's (reset and fast-forwarded if the stage is rebuilt).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage {stage_index} is not one of {num_stages} stages")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_norm = torch.zeros((), dtype=torch.float64)
        self.rebuilt_at: int | None = None
        """The step this stage was rebuilt from its neighbours at (None: never)."""

    def record_gradients(self) -> float:
        """The L2 norm of the stage's gradients now (call after backward, before the optimizer
        step); kept for the next snapshot."""
        sq = sum(
            float(p.grad.detach().double().pow(2).sum())
            for p in self.module.parameters()
            if p.grad is not None
        )
        self.grad_norm.fill_(math.sqrt(sq))
        return float(self.grad_norm)

    def state_dict(self) -> dict[str, Any]:
        """The recorded gradient norm and the stage's place."""
        return {
            "grad_norm": self.grad_norm,
            "stage_index": self.stage_index,
            "num_stages": self.num_stages,
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore the gradient norm; the stage's place must be the same."""
        if (sd["stage_index"], sd["num_stages"]) != (self.stage_index, self.num_stages):
            raise ValueError(
                f"a snapshot of stage {sd['stage_index']}/{sd['num_stages']} cannot restore "
                f"stage {self.stage_index}/{self.num_stages}"
            )
        self.grad_norm.copy_(torch.as_tensor(sd["grad_norm"], dtype=torch.float64))


def find_stage(state: Mapping[str, Any]) -> CheckFreeStage | None:
    """The :class:`CheckFreeStage` among the top-level values of ``state`` (None: none)."""
    found = [v for v in state.values() if isinstance(v, CheckFreeStage)]
    return found[0] if len(found) == 1 else None


def _stages_of_ranks(stage: CheckFreeStage | None) -> list[tuple[int, int]]:
    """Every rank's (stage index, stage count); (-1, -1) for a rank without a stage."""
    mine = torch.tensor(
        [stage.stage_index, stage.num_stages] if stage is not None else [-1, -1],
        dtype=torch.int64,
    )
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [(int(t[0]), int(t[1])) for t in out]


def plan_rebuild(stages: list[tuple[int, int]], lost: list[int]) -> dict[int, tuple[int, int]]:
    """For each lost rank, the ranks of its previous and next stage.

    Raises:
        InconsistentSnapshotError: a rank has no stage, the ranks disagree on the stage count
            or a stage is held twice, or a lost stage is the first or the last, or a
            neighbour of it is lost too.
    """
    counts = {n for _, n in stages}
    if len(counts) != 1 or -1 in counts:
        raise InconsistentSnapshotError(
            "CheckFree needs a CheckFreeStage in every rank's state, with the same stage count"
        )
    n = counts.pop()
    rank_of = {s: r for r, (s, _) in enumerate(stages)}
    if len(rank_of) != len(stages) or sorted(rank_of) != list(range(n)):
        raise InconsistentSnapshotError(
            f"CheckFree needs one stage per rank: the ranks hold stages {[s for s, _ in stages]}"
        )
    plan: dict[int, tuple[int, int]] = {}
    for r in lost:
        s = stages[r][0]
        if s in (0, n - 1):
            raise InconsistentSnapshotError(
                f"CheckFree cannot rebuild stage {s} (rank {r}): the first and the last stage "
                "need copies of their neighbours' layers (CheckFree+), which ftmem does not keep"
            )
        prev, nxt = rank_of[s - 1], rank_of[s + 1]
        if prev in lost or nxt in lost:
            raise InconsistentSnapshotError(
                f"CheckFree cannot rebuild stage {s} (rank {r}): a neighbouring stage is lost too"
            )
        plan[r] = (prev, nxt)
    return plan


def _send_bytes(data: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst)


def _recv_bytes(src: int, limit: int = 64 << 20) -> bytes:
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src=src)
    if not 0 <= int(n) <= limit:
        raise InconsistentSnapshotError(f"CheckFree: rank {src} announced {int(n)} bytes")
    buf = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(buf, src=src)
    return bytes(buf.numpy())


def rebuild_lost_stages(state: Mapping[str, Any], step: int, lost: list[int]) -> bool:
    """Every rank calls this after the holders restored ``step``: rebuild the stages of the
    ``lost`` ranks from their neighbours; True on a rebuilt rank.

    A lost rank first sends each neighbour the names and shapes of its stage's state-dict
    tensors (JSON); each neighbour must hold a tensor of that name and shape for every one
    (stages built alike: a middle stage's blocks are named as its neighbours' are; extra
    tensors of a neighbour, such as the first stage's embedding, are not sent).

    Raises:
        InconsistentSnapshotError: the loss cannot be rebuilt (:func:`plan_rebuild`), or a
            neighbour lacks one of the lost stage's tensors; raised on every rank, so none
            waits for the others.
    """
    me = dist.get_rank()
    stage = find_stage(state)
    plan = plan_rebuild(_stages_of_ranks(stage), sorted(lost))
    assert stage is not None
    own = stage.module.state_dict()
    wanted: dict[tuple[int, int], list[str]] = {}
    ok, why = True, ""
    for r, pair in sorted(plan.items()):  # names and shapes first: no sender left blocked
        for nb in pair:
            if me == r:
                shapes = [[k, list(t.shape), str(t.dtype)] for k, t in own.items()]
                _send_bytes(json.dumps(shapes).encode(), nb)
            elif me == nb:
                asked = json.loads(_recv_bytes(r))
                wanted[(r, nb)] = [str(k) for k, _, _ in asked]
                for k, shape, dtype in asked:
                    t = own.get(k)
                    if t is None or list(t.shape) != shape or str(t.dtype) != dtype:
                        ok, why = False, f"stage {stage.stage_index} has no {k} {shape} {dtype}"
    agreed = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if not int(agreed):
        raise InconsistentSnapshotError(
            f"CheckFree cannot rebuild ranks {sorted(plan)}: their neighbours' stages are not "
            f"built alike ({why or 'on another rank'})"
        )
    rebuilt = False
    for r, (prev, nxt) in sorted(plan.items()):
        for nb in (prev, nxt):
            if me == nb:  # the norm first, so the lost rank can weigh each tensor as it comes
                dist.send(stage.grad_norm.reshape(1).clone(), dst=r)
                for k in wanted[(r, nb)]:
                    dist.send(own[k].detach().contiguous(), dst=r)
        if me == r:
            _average_into(stage, list(own.values()), prev, nxt, step)
            rebuilt = True
    return rebuilt


def _average_into(
    stage: CheckFreeStage, own: list[torch.Tensor], prev: int, nxt: int, step: int
) -> None:
    """Receive both neighbours' norms, then their tensors one pair at a time, and set this
    stage to their weighted average (one pair of tensors in memory at a time, not two
    stages)."""
    norms = []
    for src in (prev, nxt):
        g = torch.empty(1, dtype=torch.float64)
        dist.recv(g, src=src)
        norms.append(float(g))
    total = norms[0] + norms[1]
    w = (
        (0.5, 0.5)
        if total <= 0 or not math.isfinite(total)
        else (norms[0] / total, norms[1] / total)
    )
    with torch.no_grad():
        for t in own:
            a = torch.empty(t.shape, dtype=t.dtype)
            b = torch.empty_like(a)
            dist.recv(a, src=prev)
            dist.recv(b, src=nxt)
            if t.is_floating_point():
                t.copy_((a.double() * w[0] + b.double() * w[1]).to(t.dtype))
            else:  # taken from the previous stage
                t.copy_(a)
    if stage.optimizer is not None:
        stage.optimizer.state.clear()  # reset: moments of another stage would not fit
    if stage.scheduler is not None:
        with warnings.catch_warnings():  # stepping a scheduler before its optimizer warns
            warnings.simplefilter("ignore")
            for _ in range(step):
                stage.scheduler.step()
    stage.grad_norm.fill_(norms[0] * w[0] + norms[1] * w[1])
    stage.rebuilt_at = step
    log.error(
        "CHECKFREE: no snapshot of stage %d was left: rebuilt it at step %d as %.3f x stage %d "
        "+ %.3f x stage %d (gradient norms %.4g, %.4g); its optimizer state was reset",
        stage.stage_index,
        step,
        w[0],
        stage.stage_index - 1,
        w[1],
        stage.stage_index + 1,
        norms[0],
        norms[1],
    )
