"""The chaos runner's cluster trains the test workload by its path, from the checkout
(``python -m tests._support.chaos`` from the repository root); the ranks it starts need an
installed ftmem only, not the checkout on ``sys.path``."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import ftmem
from tests._support import chaos
from tests._support.chaos.cluster import ClusterConfig
from tests._support.launcher import shm_files
from tests._support.procs import REPO
from tests._support.workload import SCRIPT

# Run in a child from the repository root with a copy of the package alone (what a wheel
# installs) on PYTHONPATH, so the ranks find ftmem there and nothing of the checkout: a
# one-node, two-rank run of the cluster's default script; prints what the test checks as one
# JSON line.
DRIVER = """
import json, sys
from datetime import timedelta
from pathlib import Path
import tests._support.chaos.cluster as cluster
from tests._support.workload import RESUMED_RE, STEP_RE, digests
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


def test_the_default_workload_is_the_checkouts_and_imports_nothing_from_it() -> None:
    assert SCRIPT.is_file() and SCRIPT.is_relative_to(REPO / "tests" / "_support" / "workload")
    config = ClusterConfig(workdir=Path("/tmp/x"), nodes=1)
    assert config.script == [str(SCRIPT)]
    assert chaos.ChaosConfig().script == SCRIPT
    # A rank runs it by path: it may import torch and ftmem, nothing of the checkout's.
    tree = ast.parse(SCRIPT.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("tests", "bench")}, imported


@pytest.mark.timeout(300)  # an agent, its SMP and two ranks on a loaded 2-core machine
def test_a_cluster_runs_its_workload_with_only_an_installed_ftmem() -> None:
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
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["cluster"].startswith(str(REPO / "tests")), result["cluster"]
        assert result["script"] == str(SCRIPT), result["script"]
        assert result["code"] == 0, result["tail"]
        digests = result["digests"]
        assert len(digests) == 2 and len(set(digests.values())) == 1, result["tail"]
        assert result["steps"] == 8 and sorted(result["resumed"]) == [["0", "0"], ["1", "0"]]
        assert shm_files(result["run_id"]) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)
