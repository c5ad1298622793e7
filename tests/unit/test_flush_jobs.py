"""The flush worker protocol (protocol/flush_jobs.py): every message reads back as written;
anything else, hostile input included, is a ProtocolError and nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmem.errors import ProtocolError
from ftmem.protocol.flush_jobs import (
    AssembleJob,
    FlushJob,
    JobDone,
    Progress,
    SlotSource,
    TierWritten,
    WorkerReady,
    encode,
    parse_job,
    parse_reply,
)
from tests._support.strategies import json_values

JOB = FlushJob(
    id=3,
    step=40,
    sources=[SlotSource(0, 40, "/dev/shm/ftmem-x/s0", 4096, '{"v": 1}')],
    tiers=["/local/ckpt", "/shared/ckpt"],
    keep=2,
    world_size=8,
    shared=True,
    assemble_timeout=300.0,
)


@pytest.mark.parametrize("job", [JOB, AssembleJob(4, "/shared/ckpt", 8)])
def test_jobs_read_back_as_written(job: Any) -> None:
    assert parse_job(encode(job)) == job


@pytest.mark.parametrize(
    "reply",
    [
        WorkerReady(123),
        Progress(3, "writing", 0, 10, 20),
        Progress(3, "waiting for parts", 1, 2, 4, "ranks"),
        TierWritten(3, 0, "/local/ckpt/step_40", 4096),
        JobDone(3, True, ["/local/ckpt/step_40"], 4096, 0.5, [40]),
        JobDone(-1, False, error="bad request"),
    ],
)
def test_replies_read_back_as_written(reply: Any) -> None:
    assert parse_reply(encode(reply)) == reply


def _job(**change: Any) -> str:
    doc = json.loads(encode(JOB))
    doc.update(change)
    return json.dumps({k: v for k, v in doc.items() if v is not ...})


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"op": "format_disk", "id": 1}), "no 'op'"),
        (json.dumps({"op": ["flush"], "id": 1}), "no 'op'"),
        (_job(step="40"), "'step' must be an integer"),
        (_job(step=...), "missing field 'step'"),
        (_job(extra=1), "unknown fields"),
        (_job(sources={"rank": 0}), "'sources' must be a list"),
        (_job(sources=[{"rank": 0}]), "missing field"),
        (_job(sources=[{**json.loads(encode(JOB))["sources"][0], "path": 7}]), "'path'"),
        (_job(tiers=["/a", 3]), "'tiers'"),
        (_job(assemble_timeout=float("inf")), "finite"),
        (_job(direct=1), "'direct' must be bool"),
        (_job(event="done"), "unknown fields"),
        ("x" * (17 << 20), "a line of"),
    ],
)
def test_malformed_jobs_are_refused_with_a_clear_error(line: str, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        parse_job(line)


def test_a_job_is_not_a_reply_and_a_reply_not_a_job() -> None:
    with pytest.raises(ProtocolError, match="no 'event'"):
        parse_reply(encode(JOB))
    with pytest.raises(ProtocolError, match="no 'op'"):
        parse_job(encode(WorkerReady(1)))


tagged = st.dictionaries(st.text(max_size=10), json_values, max_size=8).flatmap(
    lambda d: st.sampled_from(
        [
            d,
            {**d, "op": "flush"},
            {**d, "op": "assemble"},
            {**d, "event": "done"},
            {**d, "event": "progress"},
            {**d, "op": "flush", "sources": [d]},
        ]
    )
)


@settings(max_examples=300, deadline=None)
@given(tagged)
def test_hostile_lines_raise_protocol_errors_only(doc: dict[str, Any]) -> None:
    line = json.dumps(doc)
    for parse in (parse_job, parse_reply):
        try:
            parse(line)
        except ProtocolError:
            pass
