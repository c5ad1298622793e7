"""A client of etcd's v3 API through its gRPC-JSON gateway, for ``--rdzv-backend etcd-v3``.

Written on :mod:`http.client` rather than on etcd3gw or python-etcd: neither bounds a request
per member nor fails over, so one *silent* member (SIGSTOPped, or its link down: no RST ever
comes) stalls every call for its whole socket timeout. Here every request opens its own
connection, which a member must accept within :data:`CONNECT_TIMEOUT_S` (a live host's kernel
accepts at once, however busy etcd is) and then answer within :data:`MEMBER_TIMEOUT_S`, else
the request goes to the next member; the member that answered last is tried first. The
members are learned from ``/v3/cluster/member/list``; a client's clones share what any of
them learned.

With TLS (:func:`tls_context`) every connection verifies the member's certificate and host
name and presents the client's certificate. A TLS refusal by every member is not retried: it
raises :class:`EtcdV3Error` saying which side refused.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from ftmem.errors import ProtocolError, UnsafePathError
from ftmem.typed_json import MAX_INT, Digits, Range, build

log = logging.getLogger(__name__)

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
MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: longer key lists go in several transactions."""
_PASS_PAUSE_S = 0.2

Member = tuple[str, int]


class EtcdV3Error(RendezvousConnectionError, dist.DistNetworkError):
    """etcd could not serve a request: it refused it, or answered garbage. A
    ``RendezvousConnectionError`` for elastic's handler and a ``RuntimeError`` (torch's
    ``DistNetworkError``) for the store's callers."""


class EtcdUnavailableError(EtcdV3Error):
    """No member answered within :data:`REQUEST_BUDGET_S`."""


class _MemberFailed(Exception):
    """One member did not answer (or answered a server error): try the next one. ``tls``:
    the TLS handshake or session failed (a refused certificate, most likely)."""

    def __init__(self, why: str, tls: bool = False) -> None:
        super().__init__(why)
        self.tls = tls


def parse_endpoints(endpoint: str, scheme: str = "http") -> list[Member]:
    """The members named by ``--rdzv-endpoint``: ``host[:port][,host[:port]...]``.

    ``scheme://`` prefixes (``scheme``: ``http`` or ``https``, ``--rdzv-conf protocol``) and
    bracketed IPv6 addresses are accepted; the port defaults to 2379. Returns them in order,
    without repeats.

    Raises:
        ValueError: none is named, a port is not a number in 1..65535, or one names the
            other scheme.
    """
    out: list[Member] = []
    for raw in endpoint.split(","):
        item = raw.strip().rstrip("/")
        if "://" in item and not item.startswith(f"{scheme}://"):
            raise ValueError(
                f"etcd-v3: {item!r} is not {scheme} (set --rdzv-conf protocol=http or https)"
            )
        item = item.removeprefix(f"{scheme}://")
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


def tls_context(cacert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A TLS client context that verifies etcd's certificate and host name against the CA
    file ``cacert`` (None: the system's CAs) and presents the certificate ``cert`` with its
    private key ``key`` (both or neither), which must be this user's private regular file.

    Raises:
        ValueError: ``cert`` without ``key`` (or the reverse), a key file too open or not
            this user's, or a file that cannot be loaded.
    """
    from ftmem.secure_fs import open_owned

    if bool(cert) != bool(key):
        raise ValueError("etcd-v3: give both ssl_cert and ssl_cert_key (or neither)")
    try:
        ctx = ssl.create_default_context(cafile=cacert or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"etcd-v3: cannot load ca_cert {cacert}: {exc}") from exc
    if cert and key:
        try:
            fd = open_owned(Path(key), "etcd client key (ssl_cert_key)", private=True)
        except UnsafePathError as exc:
            raise ValueError(f"etcd-v3: {exc}") from exc
        try:  # load the file checked (a path swapped since is not read)
            held = f"/proc/self/fd/{fd}"
            ctx.load_cert_chain(cert, held if os.path.exists(held) else key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"etcd-v3: cannot load ssl_cert {cert} / its key: {exc}") from exc
        finally:
            os.close(fd)
    return ctx


def _tls_why(exc: OSError) -> str:
    """What a TLS failure (or a TLS session the member closed at once) means for the user:
    which side refused which certificate."""
    reason = str(getattr(exc, "reason", "") or "")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"etcd's certificate is not trusted ({exc.verify_message}): check ca_cert"
    said = "refused this client's certificate" if "ALERT" in reason else "closed the TLS session"
    return (
        f"etcd {said} ({reason or type(exc).__name__}): it wants ssl_cert and ssl_cert_key "
        "to name a client certificate signed by a CA of its --trusted-ca-file"
    )


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


def member_endpoints(doc: dict[str, Any], scheme: str = "http") -> list[Member]:
    """The client endpoints of a ``/v3/cluster/member/list`` answer (``scheme`` ones only)."""
    out: list[Member] = []
    members = doc.get("members", [])
    for member in members if isinstance(members, list) else []:
        urls = member.get("clientURLs", []) if isinstance(member, dict) else []
        for url in urls if isinstance(urls, list) else []:
            if isinstance(url, str) and url.startswith(f"{scheme}://"):
                try:
                    out += [m for m in parse_endpoints(url, scheme) if m not in out]
                except ValueError:
                    log.warning("etcd-v3: ignoring member URL %r", url)
    return out


def b64(data: bytes) -> str:
    """``data`` as the gateway's base64 text."""
    return base64.b64encode(data).decode()


def _unb64(field: str) -> bytes:
    try:
        return base64.b64decode(field, validate=True)
    except binascii.Error as exc:
        raise EtcdV3Error(f"etcd sent bad base64: {field[:80]!r}") from exc


def int_field(doc: dict[str, Any], key: str) -> int:
    """An int64 field (the gateway writes them as strings and leaves out zeros)."""
    try:
        return int(doc.get(key, 0))
    except (TypeError, ValueError) as exc:
        raise EtcdV3Error(f"etcd sent a bad {key}: {doc.get(key)!r}") from exc


_Int64 = Annotated[int, Digits(19)] | Annotated[int, Range(0, MAX_INT)]
"""An int64 of a gateway answer: a decimal string, as the gateway writes them, or a number."""


@dataclass(frozen=True, slots=True)
class _KeyValue:
    """One ``kvs`` entry of a range answer (an empty value and a zero are left out)."""

    key: str
    value: str = ""
    mod_revision: _Int64 = 0


@dataclass(frozen=True, slots=True)
class _RangeAnswer:
    """A range answer, as far as ftmem reads it."""

    kvs: list[_KeyValue] = field(default_factory=list)


def decode_kvs(doc: dict[str, Any]) -> dict[bytes, tuple[bytes, int]]:
    """``{key: (value, mod_revision)}`` of a range answer (fields ftmem does not read, such
    as ``header`` and ``count``, are ignored)."""
    try:
        kvs = build(_RangeAnswer, doc, what="range answer", strict=False).kvs
    except ProtocolError as exc:
        raise EtcdV3Error(f"etcd sent a malformed kvs list: {exc}") from None
    return {_unb64(kv.key): (_unb64(kv.value), kv.mod_revision) for kv in kvs}


def _put(key: bytes, value: bytes) -> dict[str, Any]:
    return {"request_put": {"key": b64(key), "value": b64(value)}}


def _range(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


def _unchanged(key: bytes, mod_revision: int) -> dict[str, Any]:
    """The compare "``key`` was last written at ``mod_revision``" (0: it does not exist)."""
    if mod_revision == 0:
        return {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
    return {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(mod_revision)}


class _MemberView:
    """What a client and its clones know of the cluster (thread-safe): the members, in the
    order they were named or learned, and the one that answered last (tried first). Shared
    so that a client that has sent nothing yet (the store's, on a spare) knows the members
    another one learned."""

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
        tls: with https, the context of every connection (:func:`tls_context`); None: http.

    Resource handling: no connection outlives its request. Thread-safe.
    """

    def __init__(
        self,
        members: Sequence[Member],
        member_timeout: float = MEMBER_TIMEOUT_S,
        budget: float = REQUEST_BUDGET_S,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not members or member_timeout <= 0:
            raise ValueError("etcd-v3: need a member and a positive member_timeout")
        self._view = _MemberView(members)
        self.member_timeout = member_timeout
        self.budget = max(budget, member_timeout)
        self.tls = tls

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``."""
        return "http" if self.tls is None else "https"

    @property
    def members(self) -> list[Member]:
        """The members known, the one that answered last first."""
        return self._view.ordered()

    def clone(self) -> EtcdV3Client:
        """A new client of the same members and TLS settings, sharing what they know of the
        cluster."""
        twin = EtcdV3Client(self.members, self.member_timeout, self.budget, self.tls)
        twin._view = self._view
        return twin

    def close(self) -> None:
        """Nothing to release: no connection outlives its request."""

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` (``/v3/kv/range``...) on the first member that answers.

        Raises:
            EtcdUnavailableError: no member answered within the budget.
            EtcdV3Error: etcd refused the request, answered garbage, or every member
                failed the TLS handshake (the message says whose certificate was refused).
        """
        out = self._call(path, body)
        if not self._view.discovered:
            try:
                learned = member_endpoints(self._call("/v3/cluster/member/list", {}), self.scheme)
            except EtcdV3Error as exc:
                log.debug("etcd-v3: no member list yet: %s", exc)
                return out
            new = self._view.learn(learned)
            if new:
                log.info("etcd-v3: learned members %s", ", ".join(f"{h}:{p}" for h, p in new))
        return out

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        deadline = time.monotonic() + self.budget
        why: dict[Member, str] = {}
        while True:
            tls_only = True  # every member of this pass failed its TLS session
            for member in self.members:
                try:
                    out = self._post(member, path, payload)
                except _MemberFailed as exc:
                    why[member] = str(exc)
                    tls_only = tls_only and exc.tls
                    continue
                if self._view.answered(member):
                    log.info("etcd-v3: %s:%d answers; trying it first from now on", *member)
                return out
            said = "; ".join(f"{h}:{p}: {e}" for (h, p), e in why.items())
            if tls_only:
                raise EtcdV3Error(f"etcd-v3: no member accepted the TLS session: {said}")
            if time.monotonic() + _PASS_PAUSE_S >= deadline:
                raise EtcdUnavailableError(
                    f"no etcd member answered {path} within {self.budget:g} s "
                    f"({self.member_timeout:g} s each): {said}"
                )
            time.sleep(_PASS_PAUSE_S)

    def _post(self, member: Member, path: str, payload: bytes) -> dict[str, Any]:
        # A connection per request: a kept-alive one to a member gone silent would cost a
        # whole read timeout before failing over; a fresh connect fails within
        # CONNECT_TIMEOUT_S.
        conn = http.client.HTTPConnection(
            *member, timeout=min(CONNECT_TIMEOUT_S, self.member_timeout)
        )
        shaken = False  # the TLS handshake is done
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self.member_timeout)  # the TLS handshake's too
            if self.tls is not None:
                conn.sock = self.tls.wrap_socket(conn.sock, server_hostname=member[0])
                shaken = True
            conn.request("POST", path, payload, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return parse_response(resp.status, read_bounded(resp))
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as exc:
            # With TLS 1.3 etcd checks the client's certificate after the handshake: a refusal
            # comes as an alert, or as the session closed before any answer.
            if isinstance(exc, ssl.SSLError) or shaken:
                raise _MemberFailed(_tls_why(exc), tls=True) from exc
            raise _MemberFailed(f"{type(exc).__name__}: {exc}") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise _MemberFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()

    # -- the key-value calls ------------------------------------------------------------------

    def get(self, key: bytes) -> tuple[bytes, int] | None:
        """``(value, mod_revision)`` of ``key``, None if it does not exist."""
        return decode_kvs(self.call("/v3/kv/range", {"key": b64(key)})).get(key)

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
            return True, (value, int_field(doc.get("header", {}), "revision"))
        answers = doc.get("responses") or [{}]
        return False, decode_kvs(answers[0].get("response_range", {})).get(key)
