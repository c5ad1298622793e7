"""The rendezvous state elastic reads from the store, checked before elastic unpickles it.

elastic's dynamic rendezvous keeps its state in the store as a pickle and ``pickle.loads``
whatever it reads back, on every backend (c10d, etcd-v2, etcd-v3), about once a second: whoever
could write the store ran code in every agent. :class:`GuardedBackend` sits between elastic's
state holder and its backend (:func:`ftmem.launch.elastic_compat.guard_rendezvous_state` puts
it there):

1. every state read is unpickled by a restricted unpickler that admits only the globals of
   elastic's state (``_RendezvousState``, ``_NodeDesc``, ``datetime``), bounded in size, and
   rebuilt field by field (``load``); elastic's own ``pickle.loads`` only ever sees the bytes
   of that rebuilt object, pickled here;
2. with the job's key file (``--ftmem-key-file``) every state written is framed with an
   HMAC-SHA256 under a key derived from the job's (:func:`state_key`) and the run id, and a
   state read whose MAC does not verify is refused before it is unpickled at all;
3. a refused state (planted by a store writer, or malformed) runs nothing and never reaches
   elastic: the read answers the last state that passed, with the refused value's token, so
   the handler's next compare-and-set (a keep-alive, a join) overwrites the planted value
   (no last state: a fresh, empty one). Each incident is logged once (then a count at most
   every :data:`LOG_EVERY_S`), and once more when a state passes again.
4. every answer, read or refused, passes through ``review`` (elastic_compat: the rules that
   keep a round that ended from coming back, once a store writer erased the real state).

What a store writer can still do: delete or replace the state (a denial of service, which
the handlers repair at their next write), replay a state this job wrote earlier (with a key
file) or write a well-formed state of its own (without one): it can disturb the rendezvous,
never run code.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

log = logging.getLogger(__name__)

MAX_STATE_BYTES = 4 << 20
"""The largest state accepted (a node costs ~100 bytes of it)."""
MAGIC = b"ftmem-rdzv-state/1\n"
"""The prefix of a state framed with its MAC (the MAC is its last 32 bytes)."""
LOG_EVERY_S = 60.0
"""Least time between two log lines about one incident of refused states."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in ``allowed`` (``(module, name)``
    pairs); any other global, and any persistent id, raises ``UnpicklingError``."""

    def __init__(self, file: io.BytesIO, allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if it is allowed."""
        if (module, name) not in self._allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed here")
        return super().find_class(module, name)


def restricted_loads(
    data: bytes, allowed: frozenset[tuple[str, str]], max_bytes: int = MAX_STATE_BYTES
) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`: no code but the constructors of
    ``allowed`` runs.

    Raises:
        pickle.UnpicklingError: ``data`` is over ``max_bytes`` or names another global;
            any other error of a malformed pickle (ValueError, TypeError, EOFError, ...).
    """
    if len(data) > max_bytes:
        raise pickle.UnpicklingError(f"{len(data)} bytes, over the bound of {max_bytes}")
    return RestrictedUnpickler(io.BytesIO(data), allowed).load()


def state_key(key_file: Path | None) -> bytes | None:
    """The key that MACs the rendezvous state, derived from the job's key file (None: none).

    Raises:
        KeyFileError: the key file is unreadable or malformed.
    """
    if key_file is None:
        return None
    from ftmem.exchange.keys import read_key_file

    return read_key_file(key_file).derived_key("rendezvous-state")


class StateRefused(Exception):
    """A state read from the store that is not one this job wrote."""


def _mac(key: bytes, context: bytes, body: bytes) -> bytes:
    return hmac.new(key, MAGIC + context + b"\0" + body, hashlib.sha256).digest()


def seal(key: bytes, context: bytes, body: bytes) -> bytes:
    """``body`` framed with its MAC: ``MAGIC + body + HMAC-SHA256(key, MAGIC, context, body)``."""
    return MAGIC + body + _mac(key, context, body)


def unseal(key: bytes, context: bytes, data: bytes) -> bytes:
    """The body of what :func:`seal` framed with the same key and context.

    Raises:
        StateRefused: ``data`` is not framed, or its MAC does not verify.
    """
    if len(data) < len(MAGIC) + 32 or not data.startswith(MAGIC):
        raise StateRefused("no MAC of this job")
    body, mac = data[len(MAGIC) : -32], data[-32:]
    if not hmac.compare_digest(mac, _mac(key, context, body)):
        raise StateRefused("its MAC does not verify with this job's key")
    return body


class GuardedBackend(RendezvousBackend):
    """A rendezvous backend (``inner``) whose states are checked as the module docstring says.

    Args:
        inner: elastic's backend (c10d, etcd-v2, etcd-v3).
        clean: a state's bytes -> the bytes of the state rebuilt from them (restricted
            unpickling); raises on anything that is not elastic's state.
        empty: the bytes of a fresh state (answered when no state ever passed).
        key: the MAC key (:func:`state_key`); None: states are not MACed.
        context: bound into the MAC (the run id).
        review: ``review(bits, refused)`` -> the bytes answered for a state that passed
            (``refused`` False) or for the last one that did, answered in place of a refused
            one (True); None: answered as they are.
    """

    def __init__(
        self,
        inner: Any,
        clean: Callable[[bytes], bytes],
        empty: bytes,
        key: bytes | None = None,
        context: str = "",
        review: Callable[[bytes, bool], bytes] | None = None,
    ) -> None:
        self._inner = inner
        self._clean = clean
        self._empty = empty
        self._key = key
        self._context = context.encode()
        self._last: bytes | None = None
        self._refused = 0
        self._logged_at: float | None = None
        self._review = review
        self.rules: Any = None
        """Whatever ``review`` belongs to, for its owner to find again (elastic_compat's
        :class:`~ftmem.launch.elastic_compat.RoundRules`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # the backend's own methods (close, ...)

    @property
    def inner(self) -> Any:
        """The wrapped backend."""
        return self._inner

    @property
    def name(self) -> str:
        """The wrapped backend's name."""
        return str(self._inner.name)

    def get_state(self) -> tuple[bytes, Any] | None:
        """The checked state and its token (None: no state). See the module docstring."""
        got = self._inner.get_state()
        if got is None:
            return None
        bits, token = got
        return self.checked(bits), token

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        """Write ``state`` (MACed with a key) by compare-and-set; the answer's state checked."""
        if self._key is not None:
            state = seal(self._key, self._context, state)
        answer = self._inner.set_state(state, token)
        if answer is None:
            return None
        bits, new_token, done = answer
        return self.checked(bits), new_token, done

    def checked(self, bits: bytes) -> bytes:
        """The state in ``bits`` as bytes safe for ``pickle.loads``: rebuilt from a state that
        passed; else the last one that did (or a fresh one), and the incident logged."""
        try:
            body = bits if self._key is None else unseal(self._key, self._context, bits)
            clean = self._clean(body)
        except Exception as exc:  # whatever a malformed pickle raises: refused
            self._refuse(exc)
            last = self._last if self._last is not None else self._empty
            return last if self._review is None else self._review(last, True)
        if self._refused:
            log.info(
                "the rendezvous state in the store passes its checks again (%d refused reads)",
                self._refused,
            )
            self._refused, self._logged_at = 0, None
        self._last = clean
        return clean if self._review is None else self._review(clean, False)

    def _refuse(self, exc: Exception) -> None:
        self._refused += 1
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        log.warning(
            "the rendezvous state in the store was not written by this job (%s: %.200s; "
            "%d refused read(s)): ignored, nothing of it was run; this node goes on with the "
            "last state that passed and overwrites the planted one at its next write%s",
            type(exc).__name__,
            exc,
            self._refused,
            " (an agent without this job's --ftmem-key-file writes no MAC)" if self._key else "",
        )
