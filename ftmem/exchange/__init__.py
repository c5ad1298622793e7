"""Erasure-coded peer exchange between the SMPs of a group.

placement.py (pure: groups, stripe layout, parity holders, rebuild plans), codec.py (pyeclib
ISA-L encode/rebuild of one stripe, xxh3 fragment checksums, malloc tuning), transport.py
(PeerTransport interface), zmq_transport.py (ZeroMQ + CURVE), data_channel.py (the plain data
channel: a length-prefixed TCP stream read into bounded buffers), data_mac.py (its keyed tags),
keys.py (CURVE key files). The protocol of one node: protector.py (GroupProtector, with its
messages queued per peer), steps.py (its per-step state and bounds), rebuilder.py (a lost
node's rebuild, both ends), seals.py (what a node commits about each step), segments.py
(buffers read as one), encode_pool.py and encode_worker.py (encoding in worker processes).

Importing the package loads nothing, so ``from ftmem.exchange import keys`` (the ``ftmem
keygen`` command) does not load numpy and pyeclib.
"""
