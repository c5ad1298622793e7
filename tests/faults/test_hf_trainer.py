"""The Hugging Face Trainer under ftmem-launch (``FtmemTrainer``): 2 ranks with the Trainer's
DDP over gloo, gradient accumulation 2, one rank SIGKILLed mid-epoch; the run resumes from
memory at the killed step and ends bitwise equal to the plain Trainer's failure-free run under
torchrun."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests._support.launcher import Launcher, digests, failure_free_digests
from tests._support.procs import REPO

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="needs ftmem[hf] (transformers, accelerate)",
)

SCRIPT = [str(REPO / "examples" / "train_hf.py"), "--steps", "16", "--grad-accum", "2"]


def test_trainer_resumes_from_memory_at_the_killed_step_bitwise(launcher_env: Launcher) -> None:
    want = failure_free_digests(launcher_env, [*SCRIPT, "--no-ftmem"], timeout=240)
    agent = launcher_env.single_node(
        launcher_env.new_run_id(), 2, [], [*SCRIPT, "--fail-at-step", "6", "--fail-rank", "1"]
    )
    assert agent.wait(300) == 0, agent.text()[-3000:]
    text = agent.text()
    assert re.search(
        # as the SMP saw it when the death was detected: rank 1's step-6 commit may still be
        # in flight then (both ranks resume from step 6, checked below)
        r"\[n0/1\] FAILED: signal SIGKILL .*newest committed step on this node: [56];",
        text,
    ), re.findall(r".*FAILED: .*", text)
    assert re.search(r"RESUMED after signal SIGKILL", text), text[-3000:]
    assert sorted(re.findall(r"\[rank \d\] resumed from step (\d+)", text)) == ["6", "6"]
    assert "PITFALL" not in text, text[-3000:]
    assert digests(text) == want
