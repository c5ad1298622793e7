"""``--rdzv-backend etcd-v3``: elastic's dynamic rendezvous on etcd's v3 API.

torch's ``etcd-v2`` backend speaks the v2 API, which etcd deprecated in 3.5 and removed in
3.6. This backend speaks v3 through etcd's gRPC-JSON gateway (``POST /v3/kv/...`` on the
client port, keys and values base64), served by etcd 3.4 and later.

The client is written on the standard library's :mod:`http.client` rather than on etcd3gw or
python-etcd: neither bounds a request per member nor fails over to the next member, so one
*silent* member (SIGSTOPped, or its host's link down: no RST ever comes) stalls every call
for its whole socket timeout. Here every request opens its own connection, which a member
must accept within :data:`CONNECT_TIMEOUT_S` (a live host's kernel accepts at once, however
busy etcd is: only a silent host takes the whole of it) and then answer within
:data:`MEMBER_TIMEOUT_S`, else the request goes to the next member; the member that answered
last is tried first, so a silent member costs a fraction of a second, once (a stopped etcd
process on a live host: one read timeout). The
members are learned from ``/v3/cluster/member/list``, so ``--rdzv-endpoint`` may name one;
a client's clones (the store's, the backend's) share what any of them learned.

What a caller should know: reads are linearizable (a member cut off from the quorum does not
answer them); nothing is ever unpickled (the rendezvous state is opaque bytes here); keys are
not deleted when the job ends (``etcdctl del --prefix /torch/elastic/`` clears them); a
write whose reply was lost may still have been applied (the compare-and-set writes, ``add``
and ``compare_set`` included, re-read and try again; a retried ``add`` may count twice, as
with any etcd client); ``https`` is not supported.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
DEFAULT_PORT = 2379
MEMBER_TIMEOUT_S = 1.0
"""How long one member may take to answer each read of a request (``member_timeout`` in
``--rdzv-conf``)."""
CONNECT_TIMEOUT_S = 0.25
"""How long one member may take to accept a connection (at most ``member_timeout``)."""
REQUEST_BUDGET_S = 5.0
"""How long one request goes on trying the members (several passes: an election lasts about
a second) before :class:`EtcdUnavailableError`."""
MAX_RESPONSE_BYTES = 64 << 20
"""The most a response body may hold (the rendezvous state is a few KiB)."""
DEFAULT_READ_TIMEOUT_S = 60
"""The store's timeout for a blocking ``get``/``wait`` (``read_timeout`` in ``--rdzv-conf``)."""
STATE_PREFIX = "/torch/elastic/rendezvous/"
STORE_PREFIX = "/torch/elastic/store/"
MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: longer key lists go in several transactions."""
_POLL_S = (0.01, 0.2)
_PASS_PAUSE_S = 0.2

Member = tuple[str, int]


class EtcdV3Error(RendezvousConnectionError, dist.DistNetworkError):
    """etcd could not serve a request: it refused it, or answered garbage. A
    ``RendezvousConnectionError`` for elastic's handler and a ``RuntimeError`` (torch's
    ``DistNetworkError``) for the store's callers."""


class EtcdUnavailableError(EtcdV3Error):
    """No member answered within :data:`REQUEST_BUDGET_S`."""


class _MemberFailed(Exception):
    """One member did not answer (or answered a server error): try the next one."""


def parse_endpoints(endpoint: str) -> list[Member]:
    """The members named by ``--rdzv-endpoint``: ``host[:port][,host[:port]...]``.

    ``http://`` prefixes and bracketed IPv6 addresses are accepted; the port defaults to
    2379. Returns them in order, without repeats.

    Raises:
        ValueError: none is named, a port is not a number in 1..65535, or one asks https.
    """
    out: list[Member] = []
    for raw in endpoint.split(","):
        item = raw.strip().rstrip("/")
        if item.startswith("https://"):
            raise ValueError(f"etcd-v3: https is not supported ({item!r})")
        item = item.removeprefix("http://")
        if not item:
            continue
        host, port = item, str(DEFAULT_PORT)
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            if rest:
                port = rest.removeprefix(":")
        elif ":" in item:
            host, _, port = item.rpartition(":")
        bare_v6 = ":" in host and not item.startswith("[")  # [v6]:port, please
        if not host or bare_v6 or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd-v3: bad endpoint {raw.strip()!r} (want host:port)")
        if (host, int(port)) not in out:
            out.append((host, int(port)))
    if not out:
        raise ValueError("etcd-v3: --rdzv-endpoint must name at least one etcd member")
    return out


def read_bounded(resp: Any, cap: int = MAX_RESPONSE_BYTES) -> bytes:
    """Read a response body of at most ``cap`` bytes (``resp`` has ``read(n)``).

    Raises:
        EtcdV3Error: the body is longer than ``cap``.
    """
    body: bytes = resp.read(cap + 1)
    if len(body) > cap:
        raise EtcdV3Error(f"etcd's response is larger than {cap} bytes: refused")
    return body


def parse_response(status: int, body: bytes) -> dict[str, Any]:
    """The JSON object of a gateway response with HTTP ``status``.

    Raises:
        _MemberFailed: a server error (5xx): another member may answer.
        EtcdV3Error: the body is not a JSON object, or etcd refused the request (4xx).
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        if status >= 500:
            raise _MemberFailed(f"HTTP {status}") from exc
        raise EtcdV3Error(f"malformed JSON from etcd (HTTP {status}): {body[:200]!r}") from exc
    if not isinstance(doc, dict):
        raise EtcdV3Error(f"etcd answered {type(doc).__name__}, not a JSON object (HTTP {status})")
    if status >= 500:
        raise _MemberFailed(f"HTTP {status}: {doc.get('error') or doc.get('message')}")
    if status != 200:
        raise EtcdV3Error(f"etcd refused the request (HTTP {status}): {doc.get('message')}")
    return doc


def member_endpoints(doc: dict[str, Any]) -> list[Member]:
    """The client endpoints of a ``/v3/cluster/member/list`` answer (http ones only)."""
    out: list[Member] = []
    members = doc.get("members", [])
    for member in members if isinstance(members, list) else []:
        urls = member.get("clientURLs", []) if isinstance(member, dict) else []
        for url in urls if isinstance(urls, list) else []:
            if isinstance(url, str) and url.startswith("http://"):
                try:
                    out += [m for m in parse_endpoints(url) if m not in out]
                except ValueError:
                    log.warning("etcd-v3: ignoring member URL %r", url)
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(field: Any) -> bytes:
    if not isinstance(field, str):
        raise EtcdV3Error(f"etcd sent {type(field).__name__} where base64 was expected")
    try:
        return base64.b64decode(field, validate=True)
    except binascii.Error as exc:
        raise EtcdV3Error(f"etcd sent bad base64: {field[:80]!r}") from exc


def _int(doc: dict[str, Any], key: str) -> int:
    """An int64 field (the gateway writes them as strings and leaves out zeros)."""
    try:
        return int(doc.get(key, 0))
    except (TypeError, ValueError) as exc:
        raise EtcdV3Error(f"etcd sent a bad {key}: {doc.get(key)!r}") from exc


def decode_kvs(doc: dict[str, Any]) -> dict[bytes, tuple[bytes, int]]:
    """``{key: (value, mod_revision)}`` of a range answer."""
    kvs = doc.get("kvs", [])
    if not isinstance(kvs, list) or not all(isinstance(kv, dict) for kv in kvs):
        raise EtcdV3Error("etcd sent a malformed kvs list")
    return {
        _unb64(kv.get("key")): (_unb64(kv.get("value", "")), _int(kv, "mod_revision")) for kv in kvs
    }


def _put(key: bytes, value: bytes) -> dict[str, Any]:
    return {"request_put": {"key": _b64(key), "value": _b64(value)}}


def _range(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


def _unchanged(key: bytes, mod_revision: int) -> dict[str, Any]:
    """The compare "``key`` was last written at ``mod_revision``" (0: it does not exist)."""
    if mod_revision == 0:
        return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(mod_revision)}


class _MemberView:
    """What a client and its clones know of the cluster (thread-safe): the members, in the
    order they were named or learned, and the one that answered last (tried first).

    Shared by the clones so that a client that has not sent anything yet (the store's, on a
    spare, until a round completes) knows the members another one learned: it must not
    depend on the members it was given being alive."""

    def __init__(self, members: Sequence[Member]) -> None:
        self._lock = threading.Lock()
        self._members = list(members)
        self._first = self._members[0]
        self.discovered = False

    def ordered(self) -> list[Member]:
        """The members, the one that answered last first."""
        with self._lock:
            i = self._members.index(self._first)
            return self._members[i:] + self._members[:i]

    def answered(self, member: Member) -> bool:
        """``member`` answered: try it first from now on. Whether it was not first yet."""
        with self._lock:
            switched = member != self._first
            self._first = member
        return switched

    def learn(self, members: Sequence[Member]) -> list[Member]:
        """Add the ``members`` of the cluster's member list; the new ones."""
        with self._lock:
            new = [m for m in dict.fromkeys(members) if m not in self._members]
            self._members += new
            self.discovered = True
        return new


class EtcdV3Client:
    """A client of an etcd cluster's v3 gateway (see the module docstring).

    Args:
        members: the members to try first (more are learned from the cluster).
        member_timeout: seconds one member may take to connect, then to answer each read.
        budget: seconds one request goes on trying the members.

    Resource handling: keep-alive connections, one per member and concurrent request, kept
    for the next request; :meth:`close` closes them. Thread-safe.
    """

    def __init__(
        self,
        members: Sequence[Member],
        member_timeout: float = MEMBER_TIMEOUT_S,
        budget: float = REQUEST_BUDGET_S,
    ) -> None:
        if not members or member_timeout <= 0:
            raise ValueError("etcd-v3: need a member and a positive member_timeout")
        self._view = _MemberView(members)
        self.member_timeout = member_timeout
        self.budget = max(budget, member_timeout)

    @property
    def members(self) -> list[Member]:
        """The members known, the one that answered last first."""
        return self._view.ordered()

    def clone(self) -> EtcdV3Client:
        """A new client of the same members (no connection shared). The clones share what
        they know of the cluster: the members one learns, and the one that answered last."""
        twin = EtcdV3Client(self.members, self.member_timeout, self.budget)
        twin._view = self._view
        return twin

    def close(self) -> None:
        """Nothing to release: no connection outlives its request (kept for the callers that
        close what they made)."""

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` (``/v3/kv/range``...) on the first member that answers.

        Raises:
            EtcdUnavailableError: no member answered within the budget.
            EtcdV3Error: etcd refused the request, or answered garbage.
        """
        out = self._call(path, body)
        if not self._view.discovered:
            self._discover()
        return out

    def _discover(self) -> None:
        try:
            learned = member_endpoints(self._call("/v3/cluster/member/list", {}))
        except EtcdV3Error as exc:
            log.debug("etcd-v3: no member list yet: %s", exc)
            return
        new = self._view.learn(learned)
        if new:
            log.info("etcd-v3: learned members %s", ", ".join(f"{h}:{p}" for h, p in new))

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        deadline = time.monotonic() + self.budget
        why: dict[Member, str] = {}
        while True:
            for member in self.members:
                try:
                    out = self._post(member, path, payload)
                except _MemberFailed as exc:
                    why[member] = str(exc)
                    continue
                if self._view.answered(member):
                    log.info("etcd-v3: %s:%d answers; trying it first from now on", *member)
                return out
            if time.monotonic() + _PASS_PAUSE_S >= deadline:
                raise EtcdUnavailableError(
                    f"no etcd member answered {path} within {self.budget:g} s "
                    f"({self.member_timeout:g} s each): "
                    + "; ".join(f"{h}:{p}: {e}" for (h, p), e in why.items())
                )
            time.sleep(_PASS_PAUSE_S)

    def _post(self, member: Member, path: str, payload: bytes) -> dict[str, Any]:
        # A connection per request: a kept-alive one to a member gone silent would cost a
        # whole read timeout before failing over; a fresh connect fails within
        # CONNECT_TIMEOUT_S. Requests are few (rendezvous polls, keep-alives, store calls).
        conn = http.client.HTTPConnection(
            *member, timeout=min(CONNECT_TIMEOUT_S, self.member_timeout)
        )
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self.member_timeout)
            conn.request("POST", path, payload, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return parse_response(resp.status, read_bounded(resp))
        except (OSError, http.client.HTTPException) as exc:
            raise _MemberFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()

    # -- the key-value calls ------------------------------------------------------------------

    def get(self, key: bytes) -> tuple[bytes, int] | None:
        """``(value, mod_revision)`` of ``key``, None if it does not exist."""
        return decode_kvs(self.call("/v3/kv/range", {"key": _b64(key)})).get(key)

    def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """The values of those of ``keys`` that exist, read at one revision per
        :data:`MAX_TXN_OPS` keys."""
        found: dict[bytes, bytes] = {}
        for i in range(0, len(keys), MAX_TXN_OPS):
            doc = self.txn([], [_range(k) for k in keys[i : i + MAX_TXN_OPS]], [])
            for answer in doc.get("responses", []):
                kvs = decode_kvs(
                    answer.get("response_range", {}) if isinstance(answer, dict) else {}
                )
                found.update((k, v) for k, (v, _) in kvs.items())
        return found

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Write ``items`` (atomically per :data:`MAX_TXN_OPS`)."""
        for i in range(0, len(items), MAX_TXN_OPS):
            self.txn([], [_put(k, v) for k, v in items[i : i + MAX_TXN_OPS]], [])

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """One transaction (the gateway's JSON form of each op)."""
        return self.call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure})

    def cas(
        self, key: bytes, mod_revision: int, value: bytes
    ) -> tuple[bool, tuple[bytes, int] | None]:
        """Write ``value`` if ``key`` was last written at ``mod_revision`` (0: does not exist).

        Returns ``(True, (value, new mod_revision))``, or ``(False, what key holds now)``.
        """
        doc = self.txn([_unchanged(key, mod_revision)], [_put(key, value)], [_range(key)])
        if doc.get("succeeded") is True:
            return True, (value, _int(doc.get("header", {}), "revision"))
        answers = doc.get("responses") or [{}]
        return False, decode_kvs(answers[0].get("response_range", {})).get(key)


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Elastic's rendezvous state on one etcd key, set by compare-and-set on its
    ``mod_revision`` (the fencing token). The state bytes are stored as they are given."""

    def __init__(self, client: EtcdV3Client, run_id: str, key_prefix: str = STATE_PREFIX) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._key = (key_prefix + run_id).encode()

    def close(self) -> None:
        """Close the client's connections."""
        self._client.close()

    @property
    def name(self) -> str:
        """``etcd-v3``."""
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state and its token (its mod revision); None if no state was set.

        Raises:
            RendezvousConnectionError: etcd did not answer (an :class:`EtcdV3Error`).
        """
        return self._client.get(self._key)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the stored one still has ``token`` (None: if there is none).

        Returns ``(state, new token, True)``, or ``(stored state, its token, False)``, or
        None if the state was removed meanwhile.

        Raises:
            RendezvousConnectionError: etcd did not answer (an :class:`EtcdV3Error`).
        """
        try:
            revision = int(token) if token else 0
        except (TypeError, ValueError):
            revision = -1
        if revision < 0:  # not a token of this backend: never matches
            now = self.get_state()
            return None if now is None else (*now, False)
        done, now = self._client.cas(self._key, revision, state)
        return None if now is None else (*now, done)


class EtcdV3Store(Store):
    """A ``torch.distributed.Store`` on etcd keys under ``STORE_PREFIX<run_id>/``.

    ``get``/``wait`` poll until the keys exist, for the store's timeout, then raise torch's
    ``DistStoreError``; ``add`` and ``compare_set`` are atomic (compare-and-set loops);
    ``multi_get``/``multi_set``/``check`` take several keys in one transaction. A request no
    member answers raises :class:`EtcdUnavailableError`, except in ``get``/``wait``, which go
    on polling until their deadline.

    Resource handling: :meth:`clone` keeps its clones alive (torch's C++ side holds them
    without their Python object), so clone a bounded number of times.
    """

    def __init__(
        self,
        client: EtcdV3Client,
        run_id: str,
        timeout: timedelta = timedelta(seconds=DEFAULT_READ_TIMEOUT_S),
        prefix: str = STORE_PREFIX,
    ) -> None:
        super().__init__()
        self.client = client
        self.run_id = run_id
        self.prefix = prefix
        self._root = f"{prefix}{run_id}/".encode()
        self._clones: list[EtcdV3Store] = []
        self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self._root + (key if isinstance(key, bytes) else key.encode())

    def _timeout(self) -> timedelta:
        value: timedelta = self.timeout  # type: ignore[attr-defined]  # not in torch's stub
        return value

    def clone(self) -> EtcdV3Store:
        """An independent store of the same keys with a client of its own (for another
        thread)."""
        twin = EtcdV3Store(self.client.clone(), self.run_id, self._timeout(), self.prefix)
        self._clones.append(twin)
        return twin

    def close(self) -> None:
        """Close the connections of this store and of its clones."""
        for twin in self._clones:
            twin.close()
        self.client.close()

    def set(self, key: str, value: str | bytes) -> None:
        """Write ``key``."""
        self.client.put_many([(self._key(key), _bytes(value))])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Write every key (atomically per :data:`MAX_TXN_OPS`)."""
        if len(keys) != len(values):
            raise ValueError("multi_set: as many values as keys, please")
        self.client.put_many([(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)])

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set.

        Raises:
            DistStoreError: ``key`` was not set within the timeout.
        """
        return self._wait([key], self._timeout())[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, waiting like :meth:`get` until all are set."""
        return self._wait(keys, self._timeout())

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key is set (up to ``timeout``, default the store's).

        Raises:
            DistStoreError: a key was not set within the timeout.
        """
        self._wait(keys, self._timeout() if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set now (no wait)."""
        return len(self.client.get_many([self._key(k) for k in keys])) == len(set(keys))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal integer at ``key`` (0 if unset), atomically; the sum.

        Raises:
            ValueError: ``key`` holds something else than a decimal integer.
        """
        k = self._key(key)
        now = self.client.get(k)
        while True:
            total = int(now[0] if now else b"0") + amount
            done, now = self.client.cas(k, now[1] if now else 0, str(total).encode())
            if done:
                return total

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is unset and ``expected``
        is empty), atomically, like torch's stores: returns ``desired`` if it was set, else
        the value held (``expected`` if unset)."""
        k, want, new = self._key(key), _bytes(expected), _bytes(desired)
        now = self.client.get(k)
        while True:
            if now is None and want:
                return want
            if now is not None and now[0] != want:
                return now[0]
            done, now = self.client.cas(k, now[1] if now else 0, new)
            if done:
                return new

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        doc = self.client.call("/v3/kv/deleterange", {"key": _b64(self._key(key))})
        return _int(doc, "deleted") > 0

    def num_keys(self) -> int:
        """How many keys this run's store holds."""
        root = self._root
        end = root[:-1] + bytes([root[-1] + 1])  # the prefix's range end ("/" + 1 = "0")
        doc = self.client.call(
            "/v3/kv/range", {"key": _b64(root), "range_end": _b64(end), "count_only": True}
        )
        return _int(doc, "count")

    # torch's C++ trampoline calls these two by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def _wait(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        wanted = [self._key(k) for k in keys]
        deadline = time.monotonic() + timeout.total_seconds()
        delay = _POLL_S[0]
        found: dict[bytes, bytes] = {}
        while True:
            try:
                found = self.client.get_many(wanted)
                if all(k in found for k in wanted):
                    return [found[k] for k in wanted]
            except EtcdUnavailableError:
                if time.monotonic() >= deadline:
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k in keys if self._key(k) not in found]
                raise dist.DistStoreError(
                    f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, "
                    f"keys not set in etcd: {missing}"
                )
            time.sleep(min(delay, left))
            delay = min(2 * delay, _POLL_S[1])


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    """The backend and store of ``params`` (``--rdzv-endpoint``, ``--rdzv-conf``).

    Settings: ``read_timeout`` (s, default 60: the store's wait for a key),
    ``member_timeout`` (s, default :data:`MEMBER_TIMEOUT_S`). Nothing is sent to etcd here.

    Raises:
        ValueError: a bad endpoint or setting.
    """
    members = parse_endpoints(params.endpoint)
    read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    try:
        member_timeout = float(params.get("member_timeout", MEMBER_TIMEOUT_S))
    except (TypeError, ValueError) as exc:
        raise ValueError("etcd-v3: member_timeout must be a number of seconds") from exc
    if params.get("protocol", "http").strip().lower() != "http":
        raise ValueError("etcd-v3: only protocol=http is supported")
    client = EtcdV3Client(members, member_timeout)
    backend = EtcdV3RendezvousBackend(client, params.run_id)
    store = EtcdV3Store(client.clone(), params.run_id, timedelta(seconds=read_timeout))
    return backend, store


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Elastic's dynamic rendezvous handler on etcd v3 (what ``--rdzv-backend etcd-v3``
    makes); its settings are those of torch's ``create_handler`` and :func:`create_backend`."""
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def register() -> None:
    """Make ``--rdzv-backend etcd-v3`` known to elastic's registry (idempotent)."""
    rendezvous_handler_registry.register(BACKEND_NAME, create_rdzv_handler)


register()
