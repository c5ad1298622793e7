"""The chaos runner's cluster trains a workload shipped inside the ``ftmem`` package, so
``python -m ftmem.testing.chaos`` runs from an installed wheel, without the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import ftmem
from ftmem.testing import chaos
from ftmem.testing.cluster import ClusterConfig
from ftmem.testing.harness import shm_files
from ftmem.testing.workload import SCRIPT

# Run from a copy of the package alone (what a wheel installs): a one-node, two-rank run of
# the cluster's default script; prints what the test checks as one JSON line.
DRIVER = """
import json, sys
from datetime import timedelta
from pathlib import Path
import ftmem.testing.cluster as cluster
from ftmem.testing._chaos_report import RESUMED_RE, STEP_RE, digests
config = cluster.ClusterConfig(workdir=Path(sys.argv[1]), nodes=1, nproc=2, parity=0)
config.script += ["--steps=4"]
with cluster.LoopbackCluster(config) as c:
    agent = c.start(0)
    code = agent.wait(timedelta(seconds=150))
    text = agent.text()
print(json.dumps({
    "cluster": cluster.__file__, "script": config.script[0], "run_id": c.run_id, "code": code,
    "digests": digests(text), "steps": len(STEP_RE.findall(text)),
    "resumed": RESUMED_RE.findall(text), "tail": text[-3000:],
}))
"""


def test_the_default_workload_lies_inside_the_package() -> None:
    package = Path(ftmem.__file__).resolve().parent
    assert SCRIPT.is_file() and SCRIPT.is_relative_to(package)
    config = ClusterConfig(workdir=Path("/tmp/x"), nodes=1)
    assert config.script == [str(SCRIPT)]
    assert chaos.ChaosConfig().script == SCRIPT


@pytest.mark.timeout(300)  # an agent, its SMP and two ranks on a loaded 2-core machine
def test_a_cluster_runs_its_workload_from_a_copy_of_the_package_alone() -> None:
    base = Path(tempfile.mkdtemp(prefix="ftw-", dir="/tmp"))
    try:
        site = base / "site"
        shutil.copytree(
            Path(ftmem.__file__).resolve().parent,
            site / "ftmem",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        (base / "work").mkdir()
        env = {**os.environ, "PYTHONPATH": str(site)}
        out = subprocess.run(
            [sys.executable, "-c", DRIVER, str(base / "work")],
            cwd=site,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["cluster"].startswith(str(site)), result["cluster"]
        assert result["script"].startswith(str(site / "ftmem" / "testing")), result["script"]
        assert result["code"] == 0, result["tail"]
        digests = result["digests"]
        assert len(digests) == 2 and len(set(digests.values())) == 1, result["tail"]
        assert result["steps"] == 8 and sorted(result["resumed"]) == [["0", "0"], ["1", "0"]]
        assert shm_files(result["run_id"]) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)
