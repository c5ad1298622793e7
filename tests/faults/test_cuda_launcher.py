"""The CUDA path under ftmem-launch: two ranks training on the GPU (gloo), one SIGKILLed; the
launcher restarts both from the node's memory and the run ends bitwise equal to one without
failure. Skipped without a CUDA device (CI has none); `bench/device_check.sh` runs it on a lent
GPU machine. With one GPU both ranks share it (NCCL refuses two ranks on one device, gloo
does not)."""

from __future__ import annotations

import re

import pytest
import torch

from tests._support.launcher import TINY, WORKLOAD, Launcher, digests, reference_digests, shm_files

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 12


def test_a_killed_cuda_rank_resumes_from_memory_bitwise(launcher_env: Launcher) -> None:
    """Rank 1 is SIGKILLed after step 6 is committed; both ranks (forked by the fork server,
    each creating its CUDA context after the fork) restore step 6 from the SMP onto the GPU
    and end with the reference's parameters and optimizer state."""
    ref = reference_digests(launcher_env, STEPS, extra=["--cuda"])
    rid = launcher_env.new_run_id()
    args = ["--steps", str(STEPS), *TINY, "--cuda", "--fail-at-step", "6", "--fail-rank", "1"]
    agent = launcher_env.single_node(rid, 2, [], [str(WORKLOAD), *args])
    assert agent.wait(240) == 0, agent.text()[-3000:]
    text = agent.text()
    assert re.search(r"\[n0/1\] FAILED: signal SIGKILL", text), text[-3000:]
    assert text.count("resumed from step 6") == 2, text[-3000:]
    assert digests(text) == ref
    assert shm_files(rid) == []
