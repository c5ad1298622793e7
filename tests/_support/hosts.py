"""Several hosts on one machine: network namespaces on a private bridge, for the tests and
benchmarks of machine loss and partitions.

Each host is a network namespace with its own address on a bridge that lives in a namespace
of its own (so nothing is reachable from outside and nothing leaves the machine), its own
host name (a UTS namespace), its own ``/etc/hosts`` (``ip netns exec`` bind-mounts
``/etc/netns/<ns>/hosts``) naming every host, and its own ``/dev/shm`` (a tmpfs of its own,
bind-mounted in a mount namespace of the host's processes). Every process started on a host
runs inside all of these, so a host can be lost for real: its link cut (silent), every
process in it SIGKILLed, and its shared memory wiped.

Links can also be slowed and made lossy (:meth:`Hosts.impair`): this kernel has no netem, so
iptables in the bridge's namespace hands the host's forwarded packets to an NFQUEUE served by
:mod:`tests._support.delayer` (needs iptables with ``physdev`` and the NetfilterQueue
package; :func:`impair_unavailable` says why not).

Needs root and iproute2 (``ip``) and util-linux (``unshare``); :func:`unavailable` says why
not, for a test to skip with that reason.

Resource handling: :class:`Hosts` is a context manager; :meth:`Hosts.close` (idempotent)
SIGKILLs every process in its namespaces, unmounts the tmpfs, deletes the namespaces and the
``/etc/netns`` entries, also after a failed test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

SUBNET = "10.99.0"
"""The bridge's /24 (private to the harness's own namespaces)."""
DELAYER = Path(__file__).resolve().with_name("delayer.py")
"""The link delayer, run by its path (it imports nothing from the checkout)."""


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"network-namespace hosts need {tool!r}"
    return None


def impair_unavailable() -> str | None:
    """Why :meth:`Hosts.impair` cannot work here (None: it can)."""
    if shutil.which("iptables") is None:
        return "impairing a link needs iptables"
    try:
        import netfilterqueue  # noqa: F401  (only whether it imports)
    except ImportError:
        return "impairing a link needs the NetfilterQueue package (libnetfilter-queue)"
    return None


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class Hosts:
    """``n`` hosts named ``h0``.. ``h<n-1>`` at ``10.99.0.10+i`` on one private bridge.

    Args:
        n: how many hosts.
        shm_size: each host's /dev/shm size (a tmpfs option such as ``"1g"``).
    """

    def __init__(self, n: int, shm_size: str = "1g") -> None:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        self.tag = "ftm" + uuid.uuid4().hex[:6]
        self.n = n
        self.bridge_ns = f"{self.tag}-br"
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp"))
        self._made: list[str] = []
        self._mounted: list[Path] = []
        self._delayers: dict[int, subprocess.Popen[bytes]] = {}
        self._closed = False
        try:
            self._make(shm_size)
        except BaseException:
            self.close()
            raise

    # -- names ----------------------------------------------------------------------------

    def name(self, i: int) -> str:
        """Host ``i``'s host name."""
        return f"h{i}"

    def addr(self, i: int) -> str:
        """Host ``i``'s address."""
        return f"{SUBNET}.{10 + i}"

    def netns(self, i: int) -> str:
        """Host ``i``'s network namespace."""
        return f"{self.tag}-h{i}"

    def shm_dir(self, i: int) -> Path:
        """Host ``i``'s /dev/shm as seen from outside (its tmpfs)."""
        return self.root / self.name(i) / "shm"

    # -- setup ----------------------------------------------------------------------------

    def _make(self, shm_size: str) -> None:
        _run("ip", "netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.addr(i)} {self.name(i)}\n" for i in range(self.n)
        )
        for i in range(self.n):
            ns = self.netns(i)
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            port = f"p{i}"
            _run(
                "ip", "link", "add", "veth0", "netns", ns, "type", "veth",
                "peer", "name", port, "netns", self.bridge_ns,
            )  # fmt: skip
            _run("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.bridge_ns, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "veth0")
            _run("ip", "-n", ns, "link", "set", "veth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            shm = self.shm_dir(i)
            shm.mkdir(parents=True)
            _run("mount", "-t", "tmpfs", "-o", f"size={shm_size},mode=1777", "tmpfs", str(shm))
            self._mounted.append(shm)

    # -- processes ------------------------------------------------------------------------

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``i``: in its network namespace (and /etc/hosts), with its
        host name and its /dev/shm. The process that runs ``argv`` keeps the wrapper's pid."""
        setup = f'mount --bind {self.shm_dir(i)} /dev/shm && hostname {self.name(i)} && exec "$@"'
        return [
            "ip", "netns", "exec", self.netns(i),
            "unshare", "--uts", "sh", "-c", setup, "sh", *argv,
        ]  # fmt: skip

    def pids(self, i: int) -> set[int]:
        """Every process running on host ``i``."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns(i)], capture_output=True, text=True, timeout=30
        ).stdout
        return {int(p) for p in out.split()}

    def kill(self, i: int, timeout: float = 10.0) -> None:
        """Host ``i`` dies: every process on it SIGKILLed (until none is left or ``timeout``),
        then its shared memory wiped (a dead machine takes its memory with it)."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids(i)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for entry in self.shm_dir(i).iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    # -- links ----------------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Cut host ``i``'s link at the bridge: its packets are dropped silently both ways."""
        _run("ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        """Restore host ``i``'s link."""
        _run("ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "up")

    def impair(self, i: int, delay_ms: float, loss: float = 0.0, seed: int = 0) -> None:
        """Delay every packet to and from host ``i`` by ``delay_ms`` and drop a share
        ``loss`` of them (each direction passes the delayer once: a round trip between two
        hosts gains ``2 * delay_ms``). Replaces an earlier impairment of the host.

        Raises:
            RuntimeError: :func:`impair_unavailable` says why it cannot work here.
        """
        why = impair_unavailable()
        if why:
            raise RuntimeError(why)
        self.unimpair(i)
        br = ("ip", "netns", "exec", self.bridge_ns)
        _run(*br, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")
        proc = subprocess.Popen(
            [*br, sys.executable, str(DELAYER), str(i + 1), f"{delay_ms:g}",
             f"{loss:g}", str(seed)],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        self._delayers[i] = proc
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"READY":
            self.unimpair(i)
            raise RuntimeError(f"the delayer of host {i} did not start")
        for way in ("--physdev-in", "--physdev-out"):
            _run(*br, "iptables", "-A", "FORWARD", "-m", "physdev", way, f"p{i}",
                 "-j", "NFQUEUE", "--queue-num", str(i + 1))  # fmt: skip

    def unimpair(self, i: int) -> None:
        """Undo :meth:`impair` of host ``i`` (nothing if it is not impaired)."""
        proc = self._delayers.pop(i, None)
        if proc is None:
            return
        br = ("ip", "netns", "exec", self.bridge_ns)
        for way in ("--physdev-in", "--physdev-out"):
            with contextlib.suppress(subprocess.SubprocessError):
                _run(*br, "iptables", "-D", "FORWARD", "-m", "physdev", way, f"p{i}",
                     "-j", "NFQUEUE", "--queue-num", str(i + 1))  # fmt: skip
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process on every host, unmount, delete the namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for i in list(self._delayers):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.unimpair(i)
        for i in range(self.n):
            if self.netns(i) in self._made:
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    self.kill(i)
        for shm in self._mounted:
            with contextlib.suppress(subprocess.SubprocessError):
                _run("umount", "-l", str(shm))
        for ns in self._made:
            with contextlib.suppress(subprocess.SubprocessError):
                _run("ip", "netns", "del", ns)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
