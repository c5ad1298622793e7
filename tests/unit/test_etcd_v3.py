"""The pure parts of ``--rdzv-backend etcd-v3`` (:mod:`ftmem.launch.etcd_v3`): endpoints,
response validation and bounds, settings, registration, and the per-member timeout against
local sockets that never answer, and failover between fake gateways (no etcd here:
tests/integration/test_etcd_v3.py runs one)."""

from __future__ import annotations

import base64
import io
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from ftmem.launch import etcd_client, etcd_v3
from ftmem.launch.etcd_client import (
    EtcdUnavailableError,
    EtcdV3Client,
    EtcdV3Error,
    decode_kvs,
    member_endpoints,
    parse_endpoints,
    parse_response,
    read_bounded,
)
from ftmem.launch.etcd_v3 import create_backend


def test_endpoints_name_one_or_more_members() -> None:
    assert parse_endpoints("a:1") == [("a", 1)]
    assert parse_endpoints("a") == [("a", 2379)]
    assert parse_endpoints(" a:1, http://b:2/ ,a:1,,[::1]:3,[fe80::1]") == [
        ("a", 1),
        ("b", 2),
        ("::1", 3),
        ("fe80::1", 2379),
    ]
    for bad in ("", " , ", "a:x", "a:0", "a:70000", ":1", "a:1:2"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    with pytest.raises(ValueError, match="protocol=http or https"):
        parse_endpoints("https://a:2379")
    assert parse_endpoints("https://a:1,b", "https") == [("a", 1), ("b", 2379)]
    with pytest.raises(ValueError, match="not https"):
        parse_endpoints("http://a:1", "https")


def test_responses_are_validated() -> None:
    assert parse_response(200, b'{"header": {}}') == {"header": {}}
    with pytest.raises(EtcdV3Error, match="malformed JSON"):
        parse_response(200, b"{not json")
    with pytest.raises(EtcdV3Error, match="not a JSON object"):
        parse_response(200, b"[1, 2]")
    with pytest.raises(EtcdV3Error, match=r"refused.*too large"):
        parse_response(400, b'{"error": "x", "message": "etcdserver: request is too large"}')
    with pytest.raises(etcd_client._MemberFailed, match="leader changed"):  # another may answer
        parse_response(503, b'{"error": "etcdserver: leader changed", "code": 14}')
    with pytest.raises(etcd_client._MemberFailed):
        parse_response(502, b"<html>bad gateway</html>")
    with pytest.raises(EtcdV3Error, match="bad base64"):
        decode_kvs({"kvs": [{"key": "!!!", "value": ""}]})
    with pytest.raises(EtcdV3Error, match="mod_revision"):
        decode_kvs({"kvs": [{"key": "YQ==", "mod_revision": "x"}]})
    with pytest.raises(EtcdV3Error, match="kvs"):
        decode_kvs({"kvs": "YQ=="})
    # int64s come as strings, zeros and empty values are left out.
    assert decode_kvs({"kvs": [{"key": "YQ==", "mod_revision": "7"}]}) == {b"a": (b"", 7)}
    assert decode_kvs({}) == {}


def test_response_bodies_are_bounded() -> None:
    assert read_bounded(io.BytesIO(b"x" * 10), cap=10) == b"x" * 10
    with pytest.raises(EtcdV3Error, match="larger than 10 bytes"):
        read_bounded(io.BytesIO(b"x" * 11), cap=10)
    assert etcd_client.MAX_RESPONSE_BYTES == 64 << 20


def test_members_are_learned_from_the_member_list() -> None:
    doc = {
        "members": [
            {"name": "e0", "clientURLs": ["http://10.0.0.1:2379", "https://10.0.0.1:2381"]},
            {"name": "e1", "clientURLs": ["http://10.0.0.2:2379", "http://10.0.0.1:2379"]},
            {"name": "learner, not started"},
            "garbage",
        ]
    }
    assert member_endpoints(doc) == [("10.0.0.1", 2379), ("10.0.0.2", 2379)]
    assert member_endpoints(doc, "https") == [("10.0.0.1", 2381)]
    assert member_endpoints({"members": "x"}) == []


def _params(endpoint: str = "127.0.0.1:2379", **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3", endpoint=endpoint, run_id="r", min_nodes=1, max_nodes=2, **conf
    )


def test_settings_come_from_rdzv_conf_and_nothing_is_sent_at_creation() -> None:
    backend, store = create_backend(_params("127.0.0.1:1,127.0.0.1:2", read_timeout="7"))
    try:
        assert backend.name == "etcd-v3"
        assert store.timeout.total_seconds() == 7
        assert store.client.members == [("127.0.0.1", 1), ("127.0.0.1", 2)]
        assert store.client.member_timeout == etcd_client.MEMBER_TIMEOUT_S
    finally:
        backend.close()
        store.close()
    _, store = create_backend(_params(member_timeout="0.25"))
    assert store.client.member_timeout == 0.25
    for bad in ({"read_timeout": "0"}, {"member_timeout": "x"}, {"protocol": "ftp"}):
        with pytest.raises(ValueError):
            create_backend(_params(**bad))
    with pytest.raises(ValueError, match="at least one"):
        create_backend(_params(""))


def test_tls_settings_are_checked_before_anything_is_sent(tmp_path: Path) -> None:
    """torch's etcd-v2 names (and its legacy backend's), https only, both halves of the
    client certificate, and a private key file of this user (no symlink)."""
    key = tmp_path / "client.key"
    key.write_text("not a key")
    key.chmod(0o600)
    cert = tmp_path / "client.crt"
    cert.write_text("not a cert")
    _, store = create_backend(_params(protocol="HTTPS"))  # the system's CAs, no client cert
    assert store.client.scheme == "https" and store.client.tls is not None
    assert store.client.tls.verify_mode == ssl.CERT_REQUIRED and store.client.tls.check_hostname
    for conf, why in (
        ({"ca_cert": str(cert)}, "ca_cert need protocol=https"),
        ({"protocol": "https", "ssl_cert": str(cert)}, "both ssl_cert and ssl_cert_key"),
        ({"protocol": "https", "cert": str(cert), "ssl_cert": str(key)}, "different files"),
        ({"protocol": "https", "cacert": str(cert)}, "cannot load ca_cert"),
        ({"protocol": "https", "cert": str(cert), "key": str(key)}, "cannot load ssl_cert"),
    ):
        with pytest.raises(ValueError, match=why):
            create_backend(_params(**conf))
    key.chmod(0o640)
    with pytest.raises(ValueError, match=r"client key.*open to others"):
        create_backend(_params(protocol="https", ssl_cert=str(cert), ssl_cert_key=str(key)))
    key.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(key)
    with pytest.raises(ValueError, match="symbolic link"):
        create_backend(_params(protocol="https", ssl_cert=str(cert), ssl_cert_key=str(link)))


def test_registered_as_etcd_v3_for_elastic() -> None:
    etcd_v3.register()  # idempotent
    handler = rendezvous_handler_registry.create_handler(_params("127.0.0.1:1"))
    assert isinstance(handler, DynamicRendezvousHandler)
    assert handler.get_backend() == "etcd-v3"


@pytest.fixture
def silent() -> Iterator[tuple[str, int]]:
    """A member that accepts connections (the kernel's backlog) and never answers, like a
    SIGSTOPped etcd."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield ("127.0.0.1", int(s.getsockname()[1]))


def test_no_member_answers_within_the_budget(silent: tuple[str, int]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = ("127.0.0.1", int(s.getsockname()[1]))  # nothing listens: refused at once
    client = EtcdV3Client([silent, closed], member_timeout=0.3, budget=1.0)
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=r"within 1 s \(0.3 s each\).*timed out") as e:
        client.get(b"k")
    took = time.monotonic() - t0
    client.close()
    assert 0.5 <= took < 3.0, took  # passes of 0.3 s + a refusal, within the 1 s budget
    # elastic's handler sees a RendezvousConnectionError, the store's callers a RuntimeError.
    assert isinstance(e.value, RendezvousConnectionError) and isinstance(e.value, RuntimeError)


class _Gateway(BaseHTTPRequestHandler):
    """A fake etcd gateway: the member list names ``server.members``; every key read holds
    ``b"v"`` (a range of the ``txn`` of ``get_many``, or a plain ``range``)."""

    server: _GatewayServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        kv = {"value": base64.b64encode(b"v").decode(), "mod_revision": "3"}
        if self.path == "/v3/cluster/member/list":
            urls = [f"http://{h}:{p}" for h, p in self.server.members]
            doc: dict[str, object] = {"members": [{"clientURLs": [u]} for u in urls]}
        elif self.path == "/v3/kv/txn":
            ranges = [op["request_range"]["key"] for op in body["success"]]
            doc = {"responses": [{"response_range": {"kvs": [{"key": k, **kv}]}} for k in ranges]}
        else:
            doc = {"kvs": [{"key": body["key"], **kv}]}
        out = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


class _GatewayServer(ThreadingHTTPServer):
    daemon_threads = True
    members: list[tuple[str, int]] = []


def _gateway() -> tuple[_GatewayServer, tuple[str, int]]:
    server = _GatewayServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, ("127.0.0.1", int(server.server_address[1]))


def test_the_store_fails_over_to_the_members_its_backend_learned() -> None:
    """A spare's agent: its rendezvous backend learns the members from the one named; its
    store sends nothing until the spare joins, when that member may be gone. The store's
    client knows the others all the same (clones share what they learn)."""
    named, named_at = _gateway()
    other, other_at = _gateway()
    named.members = other.members = [named_at, other_at]
    backend, store = create_backend(_params(f"{named_at[0]}:{named_at[1]}", read_timeout="3"))
    try:
        assert backend.get_state() == (b"v", 3)  # learns the members
        assert store.client.members == [named_at, other_at]
        assert store.clone().client.members == [named_at, other_at]
        named.shutdown()
        named.server_close()  # refused from now on
        t0 = time.monotonic()
        assert store.get("MASTER_ADDR") == b"v"
        assert time.monotonic() - t0 < 2
        assert backend.get_state() == (b"v", 3)
        assert backend._client.members[0] == other_at  # what one client found, all know
    finally:
        backend.close()
        store.close()
        other.shutdown()
        other.server_close()
