"""The rendezvous state elastic reads from the store, checked before elastic unpickles it.

elastic's dynamic rendezvous keeps its state in the store as a pickle and ``pickle.loads``
whatever it reads back, on every backend, about once a second: whoever could write the store
would run code in every agent. :class:`GuardedBackend` sits between elastic's state holder
and its backend (:func:`guard_rendezvous_state` puts it there); with
:mod:`ftmem.launch.elastic_compat` this is the one file that knows elastic's private state
classes:

1. every state read is unpickled admitting only the globals of elastic's state, bounded in
   size, and rebuilt field by field (:func:`load_rendezvous_state`); elastic's own
   ``pickle.loads`` only ever sees the bytes of that rebuilt object;
2. with ``--ftmem-key-file`` every state written is framed with an HMAC-SHA256 under a key
   derived from the job's (:func:`state_key`) and the run id, and a state read whose MAC does
   not verify is refused before it is unpickled;
3. a refused state never reaches elastic: the read answers the last state that passed (or a
   fresh one) with the refused value's token, so the handler's next compare-and-set
   overwrites the planted value. Each incident is logged once (then a count at most every
   :data:`LOG_EVERY_S`), and once more when a state passes again;
4. :class:`RoundRules`: rounds only move forward, and while the node leaves its round a
   refused read does not bring back a round that ended (:func:`leaving_round`).

A store writer can still delete or replace the state (repaired at the handlers' next write),
replay a state of the current round (with a key file) or write a well-formed state of its own
(without one): it can disturb the rendezvous, never run code.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import logging
import pickle
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import dynamic_rendezvous
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


class StaleState(StateRefused):
    """A state this job wrote that is older than one this node read (:class:`RoundRules`)."""


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
        rules: reads every answer (:class:`RoundRules`); None: answered as they are.
    """

    def __init__(
        self,
        inner: Any,
        clean: Callable[[bytes], bytes],
        empty: bytes,
        key: bytes | None = None,
        context: str = "",
        rules: RoundRules | None = None,
    ) -> None:
        self._inner = inner
        self._clean = clean
        self._empty = empty
        self._key = key
        self._context = context.encode()
        self._last: bytes | None = None
        self._refused = 0
        self._stale = False
        self._logged_at: float | None = None
        self.rules = rules

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # the backend's own methods (close, ...)

    @property
    def name(self) -> str:
        """The wrapped backend's name."""
        return str(self._inner.name)

    def get_state(self) -> tuple[bytes, Any] | None:
        """The checked state and its token (None: no state); a stale state is written over
        first, and that write answered. See the module docstring."""
        got = self._inner.get_state()
        if got is None:
            return None
        bits, token = got
        answer = self.checked(bits)
        repaired = self._write_back_if_stale(token)
        return (repaired[0], repaired[1]) if repaired is not None else (answer, token)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        """Write ``state`` (MACed with a key) by compare-and-set; the answer's state checked."""
        answer = self._write(state, token)
        if answer is None:
            return None
        repaired = self._write_back_if_stale(answer[1])
        return (repaired[0], repaired[1], False) if repaired is not None else answer

    def _write(self, state: bytes, token: Any) -> tuple[bytes, Any, bool] | None:
        if self._key is not None:
            state = seal(self._key, self._context, state)
        answer = self._inner.set_state(state, token)
        if answer is None:
            return None
        bits, new_token, done = answer
        return self.checked(bits), new_token, done

    def _write_back_if_stale(self, token: Any) -> tuple[bytes, Any, bool] | None:
        """If the state just read was refused as stale (:class:`StaleState`), write the newest
        state this node read back over it at once (compare-and-set on ``token``: the node
        whose stale view it is may be waiting on the store meanwhile) and answer that write;
        None otherwise. Not while this node leaves its round (its join writes)."""
        stale, self._stale = self._stale, False
        rules = self.rules
        if not stale or self._last is None or (rules and rules.leaves(rules.newest)):
            return None
        log.info("writing back the newest rendezvous state this node read over a stale one")
        written = self._write(self._last, token)
        self._stale = False
        return written

    def checked(self, bits: bytes) -> bytes:
        """The state in ``bits`` as bytes safe for ``pickle.loads``: rebuilt from a state that
        passed; else the last one that did (or a fresh one), and the incident logged."""
        try:
            body = bits if self._key is None else unseal(self._key, self._context, bits)
            clean = self._clean(body)
            if self.rules is not None:
                self.rules.admit(clean)
        except Exception as exc:  # whatever a malformed pickle raises: refused
            self._stale = isinstance(exc, StaleState)
            self._refuse(exc)
            last = self._last if self._last is not None else self._empty
            return last if self.rules is None else self.rules.review(last, True)
        if self._refused:
            log.info(
                "the rendezvous state in the store passes its checks again (%d refused reads)",
                self._refused,
            )
            self._refused, self._logged_at = 0, None
        self._last = clean
        return clean if self.rules is None else self.rules.review(clean, False)

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


EXPIRED = datetime(1970, 1, 1, tzinfo=timezone.utc)
"""The keep-alive time :func:`expire_keep_alive` writes: older than any bound."""


def expire_keep_alive(handler: Any, node: str, attempts: int = 5) -> bool:
    """Publish that ``node`` (a descriptor's ``repr``) is lost: mark its keep-alive in the
    rendezvous state as expired, by compare-and-set through the handler's guarded backend
    (elastic's own verdict on a node whose keep-alive stopped: every handler's next read
    drops it). Returns True once written, or if ``node`` is no participant any more; False
    where this handler has no such backend or every attempt lost the race.

    Raises:
        Exception: what the backend raises when the store cannot be reached.
    """
    if not guard_rendezvous_state(handler):  # guarded now, without a key, if it was not
        return False
    backend = handler._state_holder._backend
    for _ in range(attempts):
        got = backend.get_state()
        if got is None:
            return True
        bits, token = got
        state = load_rendezvous_state(bits)
        key = next((n for n in state.participants if repr(n) == node), None)
        if key is None:
            return True
        state.last_heartbeats[key] = EXPIRED
        answer = backend.set_state(pickle.dumps(state), token)
        if answer is not None and answer[2]:
            return True
    return False


_STATE_GLOBALS = frozenset(
    {
        (dynamic_rendezvous.__name__, "_RendezvousState"),
        (dynamic_rendezvous.__name__, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
    }
)
"""The only globals a pickled ``_RendezvousState`` names (pickle protocols 4 and 5: elastic
pickles with the default protocol, 4 up to Python 3.13 and 5 from 3.14)."""
_STATE_FIELDS = {"round", "complete", "deadline", "closed", "participants", "wait_list"}
_STATE_FIELDS |= {"redundancy_list", "last_heartbeats"}


def load_rendezvous_state(data: bytes) -> Any:
    """elastic's ``_RendezvousState`` in ``data``, unpickled with only :data:`_STATE_GLOBALS`
    (:func:`restricted_loads`) and rebuilt field by field: a fresh
    object whose fields have exactly the types elastic's have (nodes as ``_NodeDesc``,
    times as aware ``datetime`` in UTC). No code of the pickle's choosing runs.

    Raises:
        Exception: ``data`` is not such a state (``UnpicklingError``, ``ValueError``, ...).
    """
    got = restricted_loads(data, _STATE_GLOBALS)
    cls, node_cls = dynamic_rendezvous._RendezvousState, dynamic_rendezvous._NodeDesc
    fields = vars(got) if type(got) is cls else {}
    if set(fields) != _STATE_FIELDS:
        raise ValueError(f"not a rendezvous state: {type(got).__name__} {sorted(fields)}")

    def node(n: Any) -> Any:
        f = vars(n) if type(n) is node_cls else {}
        types = {k: type(v) for k, v in f.items()}
        if types != {"addr": str, "pid": int, "local_id": int}:
            raise ValueError("a node is not a _NodeDesc")
        return node_cls(f["addr"], f["pid"], f["local_id"])

    def when(t: Any) -> datetime:
        if type(t) is not datetime or t.tzinfo is None:
            raise ValueError("a time is not an aware datetime")
        return t.astimezone(timezone.utc)

    def nodes(s: Any) -> set[Any]:
        if type(s) is not set:
            raise ValueError("a node list is not a set")
        return {node(n) for n in s}

    if type(fields["round"]) is not int or fields["round"] < 0:
        raise ValueError("the round is not a number")
    if type(fields["complete"]) is not bool or type(fields["closed"]) is not bool:
        raise ValueError("complete/closed are not booleans")
    parts, beats = fields["participants"], fields["last_heartbeats"]
    if type(parts) is not dict or type(beats) is not dict:
        raise ValueError("participants/last_heartbeats are not dicts")
    if any(type(r) is not int for r in parts.values()):
        raise ValueError("a participant's rank is not a number")
    state = cls()
    state.round, state.complete = fields["round"], fields["complete"]
    state.closed = fields["closed"]
    state.deadline = None if fields["deadline"] is None else when(fields["deadline"])
    state.participants = {node(n): r for n, r in parts.items()}
    state.wait_list = nodes(fields["wait_list"])
    state.redundancy_list = nodes(fields["redundancy_list"])
    state.last_heartbeats = {node(n): when(t) for n, t in beats.items()}
    return state


def _clean_state(data: bytes) -> bytes:
    return pickle.dumps(load_rendezvous_state(data))


def guard_rendezvous_state(handler: Any, key: bytes | None = None) -> bool:
    """Wrap the handler's rendezvous backend in a :class:`GuardedBackend` (with ``key``,
    :func:`state_key`: MACed states). Call it right after the handler is made, before any
    read. False where the handler has no backend (another kind)."""
    holder: Any = getattr(handler, "_state_holder", None)
    backend = getattr(holder, "_backend", None)
    if backend is None:
        return False
    if not isinstance(backend, GuardedBackend):
        run_id = str(getattr(getattr(handler, "settings", None), "run_id", ""))
        empty = pickle.dumps(dynamic_rendezvous._RendezvousState())
        rules = RoundRules(getattr(handler, "_this_node", None))
        holder._backend = GuardedBackend(backend, _clean_state, empty, key, run_id, rules)
    return True


class RoundRules:
    """How this node reads the rendezvous state on top of elastic's rules (every answer of
    its :class:`GuardedBackend` passes through :meth:`review`), so that a round that ended
    does not come back through this node after a store writer erased the state.

    Rounds only move forward: elastic's own writes never lower a state's round nor reopen a
    complete round. A state that does (a node writing back its stale view after the state
    was erased, or a replay) is refused like a planted one (:meth:`admit`), and the node
    writes the newer state it read back over it.

    A refused read answers the last state that passed. While this node leaves its round
    (:func:`leaving_round`) that may be a complete round the others already left: its leave
    would rewrite that round without it, and a node still in it would finish it again, short
    of a node. So then, if this node took part in it, the refused read reads as the next
    round, open and empty: its join adds itself, the others re-add themselves. Leaving ends
    with the first state of a later round this node reads (at a first join: the first
    complete round it reads itself in), although the agent's join goes on (MASTER_ADDR, the
    slot agreement).
    """

    def __init__(self, me: Any) -> None:
        self.me = me
        self.leaving = False
        self.left: int | None = None
        """While leaving: the round this node leaves (None: it had read none)."""
        self.joined: int | None = None
        """While leaving a round it had read none of (a first join): the round it joined,
        once it read that round complete with itself in it."""
        self.newest: tuple[int, bool] | None = None
        """(round, complete) of the newest state that passed here."""

    def leaves(self, order: tuple[int, bool] | None) -> bool:
        """True while this node leaves the round of ``order`` (a state's round, complete):
        a later round is one it joined, whatever its join still does after."""
        if not self.leaving or order is None:
            return self.leaving
        if self.left is None:
            return self.joined is None or order[0] < self.joined
        return order[0] <= self.left

    def admit(self, bits: bytes) -> None:
        """Raise :class:`StaleState` if the state in ``bits`` (checked bytes) is older than
        one this node read before: a lower round, or a round it read complete, open again."""
        state = load_rendezvous_state(bits)
        order = (state.round, state.complete)
        if self.newest is not None and order < self.newest:
            raise StaleState(
                f"round {order[0]} ({'complete' if order[1] else 'open'}) is older than the "
                f"round {self.newest[0]} ({'complete' if self.newest[1] else 'open'}) this node "
                "read: a replayed state, or a node's stale view written back"
            )
        self.newest = order
        if self.leaving and self.left is None and state.complete and self.me in state.participants:
            self.joined = state.round

    def review(self, bits: bytes, refused: bool) -> bytes:
        """The state in ``bits`` (one that passed the guard, or the last that did in place of
        a refused one) as this node must read it (the class docstring)."""
        if not (refused and self.leaving):
            return bits
        state = load_rendezvous_state(bits)
        if not (
            state.complete and self.me in state.participants and self.leaves((state.round, True))
        ):
            return bits
        after = dynamic_rendezvous._RendezvousState()
        after.round, after.closed = state.round + 1, state.closed
        return pickle.dumps(after)


def reread_state(handler: Any) -> None:
    """Read the rendezvous state through the handler's guarded backend, past the state
    holder's cache: a state older than this node's newest is written over with it
    (:class:`GuardedBackend`). Nothing where the backend is not guarded."""
    backend = getattr(getattr(handler, "_state_holder", None), "_backend", None)
    if isinstance(backend, GuardedBackend):
        backend.get_state()


@contextlib.contextmanager
def leaving_round(handler: Any) -> Iterator[None]:
    """While this node leaves its round to join the next (elastic's ``next_rendezvous``), a
    store writer's value in place of the state reads as the next round, not the one it left
    (:class:`RoundRules`). Nothing where the handler's backend is not guarded."""
    backend = getattr(getattr(handler, "_state_holder", None), "_backend", None)
    rules = backend.rules if isinstance(backend, GuardedBackend) else None
    if rules is None:
        yield
        return
    rules.leaving, rules.left = True, rules.newest[0] if rules.newest else None
    try:
        yield
    finally:
        rules.leaving, rules.left, rules.joined = False, None, None
