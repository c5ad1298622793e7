"""Erasure-coded peer exchange between the SMPs of a group.

placement.py (pure: groups, stripe layout, parity holders, rebuild plans), codec.py (pyeclib
ISA-L encode/rebuild of one stripe, xxh3 fragment checksums, malloc tuning), transport.py
(PeerTransport interface), zmq_transport.py (ZeroMQ + CURVE), data_channel.py (the plain
data channel: a length-prefixed TCP stream read into bounded buffers), data_mac.py (its keyed
tags), keys.py (CURVE key files). The protocol of one node: protector.py (GroupProtector),
steps.py (its per-step state and bounds), outbox.py (messages queued per peer), rebuilder.py
(a lost node's rebuild, both ends), seals.py (what a node commits about each step),
segments.py (buffers read as one), stripe_encoder.py (where stripes are encoded),
encode_pool.py and encode_worker.py (encoding in worker processes).

The codec names are imported on first use, so ``from ftmem.exchange import keys`` (the
``ftmem keygen`` command) does not load numpy and pyeclib.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ftmem.errors import UnrecoverableError
from ftmem.exchange.placement import (
    GroupPlan,
    RebuildPlan,
    StripePlan,
    parity_bytes_per_node,
    plan_group,
    plan_groups,
    rebuild_plan,
    stripe_map,
)

if TYPE_CHECKING:
    from ftmem.exchange.codec import EncodedStripe, Rebuilt, StripeCodec, checksum, tune_malloc

_CODEC_NAMES = frozenset({"EncodedStripe", "Rebuilt", "StripeCodec", "checksum", "tune_malloc"})

__all__ = [
    "EncodedStripe",
    "GroupPlan",
    "RebuildPlan",
    "Rebuilt",
    "StripeCodec",
    "StripePlan",
    "UnrecoverableError",
    "checksum",
    "parity_bytes_per_node",
    "plan_group",
    "plan_groups",
    "rebuild_plan",
    "stripe_map",
    "tune_malloc",
]


def __getattr__(name: str) -> Any:
    if name in _CODEC_NAMES:
        return getattr(importlib.import_module("ftmem.exchange.codec"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
