"""The benchmark suite starts and writes its output: ``python -m bench --smoke`` on a tiny state.

No figure is checked (benchmarks are not run in CI); only that the suite runs to its end,
writes its results JSON, sections and summary into a temporary directory (never docs/), draws the stall plot
when matplotlib is installed, and leaves no process or shared memory behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ftmem.config import default_shm_dir
from ftmem.shm import parse_slot_name
from tests._support.procs import REPO

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
SUITE_TIMEOUT_S = 100.0


@dataclass
class SuiteRun:
    """The finished smoke run: exit code, output and the files it wrote."""

    returncode: int
    output: str
    out: Path
    img_dir: Path


def _shm_names() -> set[str]:
    """The benchmarks' slot files (their run ids start with ``bs``)."""
    d = default_shm_dir()
    names = os.listdir(d) if d.is_dir() else []
    return {n for n in names if (p := parse_slot_name(n)) is not None and p.run_id.startswith("bs")}


def _bench_env() -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH (``bench`` imports)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SuiteRun]:
    """Run ``python -m bench --smoke`` once, in its own session, killed if it overruns."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "benchmarks.md"
    out.write_text("# Benchmarks\n\nhand-written text that must stay\n")
    env = _bench_env()
    shm_before = _shm_names()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=SUITE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the smoke suite ran over {SUITE_TIMEOUT_S} s:\n{output[-3000:]}")
    yield SuiteRun(proc.returncode, output, out, tmp / "img")
    assert _shm_names() <= shm_before, "the suite left shared memory behind"
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        pass
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("processes of the suite's session outlived it")


def test_suite_writes_sections_and_summary(suite: SuiteRun) -> None:
    assert suite.returncode == 0, suite.output[-3000:]
    text = suite.out.read_text()
    assert "hand-written text that must stay" in text
    for name in ("summary", "snapshot", "memory"):
        assert f"<!-- bench:{name}:start -->" in text
        assert f"<!-- bench:{name}:end -->" in text
    # the hand-written first page stays first; a new summary goes among the results
    assert text.index("hand-written text") < text.index("bench:snapshot:start")
    assert text.index("bench:snapshot:start") < text.index("bench:summary:start")
    summary = text[text.index("bench:summary:start") : text.index("bench:summary:end")]
    for goal in ("stall per snapshot", "overhead with a snapshot every step", "flush throughput"):
        assert goal in summary
    assert "not measured" in summary  # parts the smoke profile leaves out
    results = suite.out.parent / "bench-results"
    assert (results / "snapshot.json").is_file() and (results / "suite.json").is_file()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (the plot extra)")
def test_suite_draws_the_stall_plot(suite: SuiteRun) -> None:
    png = suite.img_dir / "bench-stall.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "img/bench-stall.png" in suite.out.read_text()


SAVE_COST_TIMEOUT_S = 120.0


def test_save_cost_smoke_writes_its_figures_and_section(tmp_path: Path) -> None:
    """``python -m bench.save_cost --smoke``: tiny states, 3 saves each, against this checkout;
    the JSON holds every figure's key for each state (no figure is checked), the section is
    written beside the hand-written text, and nothing is left behind."""
    out, res = tmp_path / "benchmarks.md", tmp_path / "save-cost.json"
    out.write_text("# Benchmarks\n\nhand-written text that must stay\n")
    env = _bench_env()
    shm_before = _shm_names()
    cmd = [sys.executable, "-m", "bench.save_cost", "--smoke", "--json", str(res)]
    proc = subprocess.Popen(
        [*cmd, "--out", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=SAVE_COST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"save_cost --smoke ran over {SAVE_COST_TIMEOUT_S} s:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-3000:]
    doc = json.loads(res.read_text())
    assert doc["part"] == "save-cost"
    (tree,) = doc["result"]["trees"]
    assert tree["label"] == "this checkout" and tree["error"] == ""
    assert [s["name"] for s in tree["states"]] == ["small", "many"]
    for s in tree["states"]:
        assert s["committed"] + s["skipped"] == 3 == len(s["save_wall"]) == len(s["train_cpu"])
        for key in ("ftmem_threads_cpu", "rank_other_cpu", "smp_cpu_raw", "memcpy_cpu"):
            assert key in s, key
        assert "ftmem-copy" in s["ftmem_threads_cpu"] and s["messages"], s
        assert s["restore_check"] == "ok" and s["error"] == ""
    text = out.read_text()
    assert "hand-written text that must stay" in text
    assert "<!-- bench:save-cost:start -->" in text and "<!-- bench:save-cost:end -->" in text
    assert _shm_names() <= shm_before, "save_cost left shared memory behind"
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        pass
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("processes of save_cost's session outlived it")


def test_reshard_smoke_loads_bitwise_and_writes_its_section(tmp_path: Path) -> None:
    """``bench/reshard.py`` on a tiny state: both paths load the saved state bitwise (the
    part records an error otherwise) and its section is written; no timing is checked."""
    out, res = tmp_path / "benchmarks.md", tmp_path / "reshard.json"
    out.write_text("# Benchmarks\n\nhand-written text that must stay\n")
    env = _bench_env()
    shm_before = _shm_names()
    cmd = [sys.executable, "bench/reshard.py", "--size-gib", "0.01", "--repeats", "2"]
    proc = subprocess.run(
        [*cmd, "--json", str(res), "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    doc = json.loads(res.read_text())
    runs = doc["result"]["runs"]
    assert runs["exact"] is True and len(runs["memory"]) == len(runs["disk"]) == 2
    text = out.read_text()
    assert "hand-written text that must stay" in text and "<!-- bench:reshard:end -->" in text
    assert _shm_names() == shm_before


def test_scale_smoke_meshes_protects_and_rebuilds_a_few_smps(tmp_path: Path) -> None:
    """``bench/scale.py`` at its smallest (4 SMPs, no namespace hosts): the mesh forms, a
    round is protected and the lost node's rebuilt bytes are the committed ones (the harness
    asserts each SMP gone at its end); no figure is checked."""
    res = tmp_path / "scale.json"
    env = _bench_env()
    cmd = [sys.executable, "bench/scale.py", "--smps", "4", "--hosts", "", "--rounds", "1"]
    proc = subprocess.run(
        [*cmd, "--idle-s", "0.2", "--no-write", "--json", str(res)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (row,) = json.loads(res.read_text())["smps"]
    assert row["n"] == 4 and row["rebuilt_ok"] is True and len(row["lag_s"]) == 1, row
