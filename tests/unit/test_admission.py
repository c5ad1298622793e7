"""The data channel's admission of connections that have not said hello (admission.py): a pure
policy, and the drop log's counts."""

from __future__ import annotations

import logging

import pytest

from ftmem.exchange import admission
from ftmem.exchange.admission import MAX_PENDING, PER_SOURCE, DropLog, refusal

PEERS = frozenset({"10.0.0.1", "10.0.0.2"})


def test_a_peer_host_has_room_of_its_own_whatever_others_hold() -> None:
    full = {"10.0.0.1": PER_SOURCE}  # one peer host's quota used up (by a flood from it)
    assert refusal("10.0.0.2", full, PEERS) == ""
    assert "wait for their hello" in refusal("10.0.0.1", full, PEERS)


def test_no_peer_host_is_refused_once_the_generation_is_known() -> None:
    assert refusal("10.9.9.9", {}, PEERS) == "no peer host of this generation"


def test_before_the_generation_any_address_within_its_quota_and_the_total() -> None:
    assert refusal("10.9.9.9", {"10.9.9.9": PER_SOURCE - 1}, None) == ""
    assert refusal("10.9.9.9", {"10.9.9.9": PER_SOURCE}, None)
    many = {f"10.1.0.{i}": PER_SOURCE for i in range(MAX_PENDING // PER_SOURCE)}
    assert "wait for their hello" in refusal("10.2.0.1", many, None)


def test_the_drop_log_writes_counts_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test.admission")
    d = DropLog(log, "dc", interval_s=10.0)
    with caplog.at_level(logging.WARNING, "test.admission"):
        for _ in range(1000):
            d.count("10.9.9.9", "no hello")
        d.flush(now=100.0)
        for i in range(admission.MAX_LINES + 5):
            d.count(f"10.1.0.{i}", "no hello")
        d.flush(now=105.0)  # within the interval: nothing
        assert len(caplog.records) == 1
        assert "refused or closed 1000 connections from 10.9.9.9: no hello" in caplog.text
        assert d.due() == 110.0
        d.flush(now=110.0)
    assert len(caplog.records) == 1 + admission.MAX_LINES + 1  # the rest summed in one line
    assert "and 5 more connections from 5 other addresses" in caplog.records[-1].getMessage()
    assert d.due() == float("inf")
