"""``--rdzv-backend etcd-v3``: elastic's dynamic rendezvous on etcd's v3 API.

torch's ``etcd-v2`` backend speaks the v2 API, which etcd removed in 3.6. This backend speaks
v3 through etcd's gRPC-JSON gateway (etcd 3.4 and later) with the client of
:mod:`ftmem.launch.etcd_client`.

What a caller should know: reads are linearizable (a member cut off from the quorum does not
answer them); nothing is ever unpickled here (the rendezvous state is opaque bytes); keys are
not deleted when the job ends (``etcdctl del --prefix /torch/elastic/`` clears them); a
write whose reply was lost may still have been applied (the compare-and-set writes, ``add``
and ``compare_set`` included, re-read and try again; a retried ``add`` may count twice, as
with any etcd client).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

from ftmem.launch.etcd_client import (
    MEMBER_TIMEOUT_S,
    EtcdUnavailableError,
    EtcdV3Client,
    b64,
    int_field,
    parse_endpoints,
    tls_context,
)

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
DEFAULT_READ_TIMEOUT_S = 60
"""The store's timeout for a blocking ``get``/``wait`` (``read_timeout`` in ``--rdzv-conf``)."""
STATE_PREFIX = "/torch/elastic/rendezvous/"
STORE_PREFIX = "/torch/elastic/store/"
TLS_SETTINGS = {"ca_cert": "cacert", "ssl_cert": "cert", "ssl_cert_key": "key"}
"""The ``--rdzv-conf`` TLS settings: torch's etcd-v2 names, and the names of its legacy
``etcd`` backend accepted for them."""
_POLL_S = (0.01, 0.2)


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
    ``DistStoreError`` (a request no member answers is polled again until then; elsewhere it
    raises :class:`EtcdUnavailableError`); ``add`` and ``compare_set`` are atomic.

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
        """Write every key, atomically per :data:`~ftmem.launch.etcd_client.MAX_TXN_OPS`
        (ValueError: not as many values as keys)."""
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
        doc = self.client.call("/v3/kv/deleterange", {"key": b64(self._key(key))})
        return int_field(doc, "deleted") > 0

    def num_keys(self) -> int:
        """How many keys this run's store holds."""
        root = self._root
        end = root[:-1] + bytes([root[-1] + 1])  # the prefix's range end ("/" + 1 = "0")
        doc = self.client.call(
            "/v3/kv/range", {"key": b64(root), "range_end": b64(end), "count_only": True}
        )
        return int_field(doc, "count")

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
    ``member_timeout`` (s, default :data:`MEMBER_TIMEOUT_S`), ``protocol`` (``http``, the
    default, or ``https``) and with https ``ca_cert``, ``ssl_cert`` and ``ssl_cert_key``
    (:func:`~ftmem.launch.etcd_client.tls_context`; also spelt ``cacert``, ``cert``,
    ``key``). The files are read here; nothing is sent to etcd.

    Raises:
        ValueError: a bad endpoint or setting, TLS files with http, or a TLS file refused.
    """
    read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    try:
        member_timeout = float(params.get("member_timeout", MEMBER_TIMEOUT_S))
    except (TypeError, ValueError) as exc:
        raise ValueError("etcd-v3: member_timeout must be a number of seconds") from exc
    scheme = str(params.get("protocol", "http")).strip().lower()
    if scheme not in ("http", "https"):
        raise ValueError("etcd-v3: protocol must be http or https")
    tls: dict[str, str | None] = {}
    for name, alias in TLS_SETTINGS.items():
        given = {params.get(name), params.get(alias)} - {None, ""}
        if len(given) > 1:
            raise ValueError(f"etcd-v3: {name} and {alias} name different files")
        tls[name] = given.pop() if given else None
    if scheme == "http" and any(tls.values()):
        raise ValueError(
            f"etcd-v3: {', '.join(k for k, v in tls.items() if v)} need protocol=https"
        )
    members = parse_endpoints(params.endpoint, scheme)
    context = (
        tls_context(tls["ca_cert"], tls["ssl_cert"], tls["ssl_cert_key"])
        if scheme == "https"
        else None
    )
    client = EtcdV3Client(members, member_timeout, tls=context)
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
