"""The rank <-> SMP protocol: typed messages (messages.py) and their wire format (wire.py)."""

from ftmem.protocol.messages import PROTOCOL_VERSION, Kind, Reply
from ftmem.protocol.wire import decode, encode

__all__ = ["PROTOCOL_VERSION", "Kind", "Reply", "decode", "encode"]
