"""The agent's recovery lifecycle (ftmem.launch.recovery): the transitions its table allows,
the recovery record it opens and closes, and the state events a timeline is drawn from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftmem.errors import IllegalTransition
from ftmem.events import EventLog
from ftmem.launch.monitor import NoProgressGuard
from ftmem.launch.recovery import AgentState, FailureKind, RecoveryLifecycle

S = AgentState


def _life(tmp_path: Path) -> RecoveryLifecycle:
    return RecoveryLifecycle("n0", EventLog(tmp_path / "events.jsonl", "n0"), NoProgressGuard(3))


def _walk(life: RecoveryLifecycle, *states: AgentState) -> None:
    for state in states:
        life.to(state)


def test_a_spare_takes_over_after_a_rank_failure_and_resumes(tmp_path: Path) -> None:
    life = _life(tmp_path)
    _walk(life, S.JOINING, S.SYNCING, S.STARTED)
    assert life.resumed() is None  # a first start opens no recovery
    rec = life.detected(FailureKind.RANK, "exit code 1", committed=7, stopped=1.0)
    assert life.state is S.DETECTED and life.kind is FailureKind.RANK
    _walk(life, S.RESTARTING, S.STOPPED, S.JOINING, S.SYNCING, S.STARTED)
    done = life.resumed()
    assert done is rec and done.committed == 7 and done.started == life.started_at
    assert life.state is S.RUNNING and life.kind is None and life.recovery is None
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    states = [e["state"] for e in events if e["event"] == "state"]
    assert states[-6:] == ["restarting", "stopped", "joining", "syncing", "started", "running"]


def test_a_round_a_node_left_before_the_ranks_started_is_joined_again(tmp_path: Path) -> None:
    life = _life(tmp_path)
    _walk(life, S.JOINING, S.SYNCING, S.JOINING, S.SYNCING, S.STARTED)


def test_a_hot_spare_waits_then_joins(tmp_path: Path) -> None:
    life = _life(tmp_path)
    _walk(life, S.JOINING, S.SPARE, S.JOINING, S.SYNCING, S.STARTED, S.RUNNING)
    life.detected(FailureKind.MACHINE_LOST, "MACHINE LOST (h2)", committed=None)
    _walk(life, S.RESTARTING, S.STOPPED, S.DONE)


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ((), S.RUNNING),  # INIT -> RUNNING
        ((S.JOINING,), S.STARTED),  # no sync
        ((S.JOINING, S.SYNCING, S.STARTED, S.RUNNING), S.STOPPED),  # stopped undetected
        ((S.JOINING, S.SPARE), S.SYNCING),  # a spare joins first
        ((S.JOINING, S.SYNCING, S.STARTED, S.RUNNING, S.DETECTED, S.RESTARTING), S.JOINING),
        ((S.DONE,), S.JOINING),  # DONE is final
    ],
)
def test_transitions_outside_the_table_are_refused(
    tmp_path: Path, path: tuple[AgentState, ...], bad: AgentState
) -> None:
    life = _life(tmp_path)
    _walk(life, *path)
    with pytest.raises(IllegalTransition, match=f"-> {bad.value} is not allowed"):
        life.to(bad)


def test_node_side_failures_restart_every_rank_cold() -> None:
    assert FailureKind.SMP.node_side and FailureKind.PROTECTION.node_side
    assert not any(k.node_side for k in (FailureKind.RANK, FailureKind.HANG))


def test_the_guard_stops_restarts_without_progress(tmp_path: Path) -> None:
    life = _life(tmp_path)
    assert not life.check_guard(5, restarts_left=3)
    assert not life.check_guard(5, restarts_left=3)
    assert not life.check_guard(5, restarts_left=3)
    assert life.check_guard(5, restarts_left=3) and "without a newer committed step" in str(
        life.stop_reason
    )
