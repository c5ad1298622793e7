"""The exceptions ftmem raises. Everything ftmem raises on purpose derives from FtmemError, but
RoundAbandoned: a signal to the launcher's rejoin loop, which no handler of failures may take."""

from __future__ import annotations

import enum


class FtmemError(Exception):
    """Base class of every error ftmem raises on purpose."""


class ProtocolError(FtmemError):
    """A message was malformed, too large, of the wrong version or failed authentication."""


class RoundAbandoned(Exception):
    """A node left the rendezvous round (or one waits for the next) before this node's ranks
    started: the agent joins the next round instead. Not an FtmemError: the steps that go on
    degraded after a failure (``except FtmemError``) must let it through."""


class SmpUnavailableError(FtmemError):
    """The node's SMP did not answer in time, or is not running."""


class SmpStartError(FtmemError):
    """The SMP did not become ready before its deadline, or exited while starting."""


class ErrorKind(str, enum.Enum):
    """Why the SMP refused a request (a refusal's ``kind`` on the wire): callers tell one
    refusal from another by this, never by its text."""

    REFUSED = "refused"
    """Any other refusal; the text says why."""
    BAD_REQUEST = "bad-request"
    """Malformed, unauthenticated, out of bounds, or not allowed in the SMP's state."""
    UNKNOWN_LAYOUT = "unknown-layout"
    """A COMMIT named a layout the SMP does not hold (it restarted, or forgot the oldest):
    send the commit again with its layout."""
    UNRECOVERABLE = "unrecoverable"
    """More nodes of the group lost the generation's step than its parity covers."""


class SmpRequestError(FtmemError):
    """The SMP answered a request with an error; ``kind`` says which."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.REFUSED) -> None:
        super().__init__(message)
        self.kind = kind


class CorruptSnapshotError(FtmemError):
    """Snapshot data failed its checksum (or its layout is inconsistent) and was not restored."""


class InconsistentSnapshotError(FtmemError):
    """Ranks disagree: some hold a snapshot and others none, or no step is common to all ranks."""


class SnapshotMismatchError(FtmemError):
    """A snapshot does not fit the state it is loaded into (missing keys, shapes or dtypes)."""


class UnrecoverableError(FtmemError):
    """More fragments (or nodes) of an erasure-coding group are lost than its parity covers."""


class UnsafePathError(FtmemError):
    """A file or directory ftmem would trust is not this user's, is a symlink, or is writable
    (or, for secrets, readable) by others; it was not used."""


class IllegalTransition(FtmemError):
    """A state machine was asked for a change its table does not allow (a bug)."""
