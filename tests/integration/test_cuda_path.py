"""The CUDA path of snapshots (ftmem/client/staging.py) in one process against a real SMP.

Device tensors are copied device-to-host on a side stream into the slot's shared memory, which
is page-locked (cudaHostRegister) so that the copy is asynchronous; the SMP checksums the
snapshot after its commit.
These tests need a CUDA device and are skipped without one (CI has none); on a machine with a
GPU: ``python -m pytest -q tests/integration/test_cuda_path.py``.

The first save of a process is skipped while the SMP allocates the slots; ``wait()`` then
saves that newest step again (:func:`commit`). Where a test needs to know where bytes live in
shared memory it finds them by content in the run's slot files (``harness.shm_files``), not
through the slot format.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import ftmem
from ftmem.client.device_restore import STAGING_BYTES
from ftmem.config import ClientConfig
from ftmem.protocol.smp_client import SmpClient
from ftmem.smp.spawn import SmpProcess
from tests._support.launcher import shm_files, wait_slots_made

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
GiB = 1 << 30
SHM = Path("/dev/shm")


def make(seed: int, width: int = 256) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """A small MLP on the GPU and its Adam optimizer (no optimizer state yet)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 8)).to(DEVICE)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
    """One training step on a random batch (on the model's device)."""
    first = model[0]
    assert isinstance(first, nn.Linear)
    x = torch.randn(16, first.in_features, device=DEVICE)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def tensors_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of every tensor of the model (parameters, buffers) and the optimizer's state."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for idx, st in opt.state_dict()["state"].items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{idx}.{key}"] = v.detach().clone()
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, devices, dtypes and bits (``torch.equal`` on the tensors' own device)."""
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.device == w.device, f"{name}: on {g.device}, expected {w.device}"
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name} differs"


def raw(t: torch.Tensor) -> bytes:
    """The bytes of a tensor (copied to the host)."""
    host = t.detach().contiguous().cpu()
    return ctypes.string_at(host.data_ptr(), host.nbytes)


def slot_holding(run_id: str, sample: bytes) -> tuple[Path, int]:
    """The one slot file of the run that holds ``sample``, and where it starts in it."""
    found = []
    for name in shm_files(run_id):
        path = Path(name)
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                at = mm.find(sample)
        except (OSError, ValueError):  # removed meanwhile, or empty (cannot map 0 bytes)
            continue
        if at >= 0:
            found.append((path, at))
    assert len(found) == 1, f"{len(sample)} bytes of the saved state found in {found}"
    return found[0]


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte of a file in place (the mapped pages are the same)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def mapped_at(path: Path) -> list[int]:
    """Start addresses of this process's mappings of ``path`` (/proc/self/maps)."""
    real = os.path.realpath(path)
    starts = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                starts.append(int(fields[0].split("-")[0], 16))
    return starts


def page_locked(address: int) -> bool:
    """True if host memory at ``address`` is page-locked for CUDA (cudaHostRegister or
    cudaHostAlloc): ``Tensor.is_pinned`` asks cudaPointerGetAttributes."""
    buf = (ctypes.c_uint8 * 64).from_address(address)
    return bool(torch.frombuffer(buf, dtype=torch.uint8).is_pinned())


@pytest.fixture
def ckpt(smp: SmpProcess, run_dir: Path) -> Iterator[ftmem.Checkpointer]:
    c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    yield c
    c.close()


def commit(ckpt: ftmem.Checkpointer, state: dict[str, object], step: int) -> None:
    """Save ``step`` and make sure it is committed (the first save of a process is skipped
    while the SMP allocates the slots; ``wait()`` then saves the newest step again), and that
    the next save finds a slot made."""
    ckpt.save(state, step=step)
    assert ckpt.wait(120) is True
    wait_slots_made(ckpt.config.run_dir, ckpt.rank, 120)


def wait_verified(run_dir: Path, step: int, timeout: float = 60.0) -> None:
    """Wait until the SMP has checksummed rank 0's snapshot of ``step``."""
    deadline = time.monotonic() + timeout
    with SmpClient(run_dir) as c:
        while c.status().ranks[0].newest_verified != step:
            assert time.monotonic() < deadline, f"step {step} not verified in {timeout} s"
            time.sleep(0.02)


def restore(run_dir: Path, state: dict[str, object]) -> int:
    """``load`` with a fresh Checkpointer (what a restarted rank does); return the step."""
    other = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    try:
        return other.load(state)
    finally:
        other.close()


def test_slot_is_page_locked_and_save_returns_before_the_copy_is_done(
    ckpt: ftmem.Checkpointer, run_id: str
) -> None:
    """A 1 GiB CUDA state: the slot mapping the copy goes to is page-locked (so the D2H copy
    is asynchronous), and ``save`` returns while the snapshot is still being copied."""
    if shutil.disk_usage(SHM).free < 4 * GiB:
        pytest.skip("needs 4 GiB free in /dev/shm (two 1 GiB slots and headroom)")
    torch.manual_seed(0)
    big = torch.randn(GiB // 4, device=DEVICE)  # 1 GiB of float32
    state = {"big": big}
    commit(ckpt, state, 1)  # allocates the slots
    big.mul_(-1.0)  # step 2's bytes differ from step 1's
    torch.cuda.synchronize()
    h = ckpt.save(state, step=2)
    assert not h.skipped, h.reason
    assert not h.done(), "save() of a 1 GiB CUDA state returned after its snapshot was done"
    assert h.wait(300) is True
    path, at = slot_holding(run_id, raw(big[:1024]))
    starts = mapped_at(path)
    assert starts, f"{path} is not mapped by this process"
    assert any(page_locked(a) for a in starts), (
        f"no mapping of {path} is page-locked: the device-to-host copy was synchronous"
    )
    # What landed is the whole tensor.
    with open(path, "rb") as f:
        f.seek(at + big.nbytes - 4096)
        assert f.read(4096) == raw(big[-1024:])


def test_cuda_model_adam_and_cpu_tensor_round_trip_bitwise(
    ckpt: ftmem.Checkpointer, run_dir: Path
) -> None:
    """Saved at steps 1..3 with training steps between (and one after the last save, which
    the fence holds back until the copy is done); a fresh model and optimizer on the GPU get
    back exactly the state of step 3, on the GPU, and the CPU tensor its value at step 3."""
    model, opt = make(seed=0)
    extra = torch.arange(10, dtype=torch.int64)  # a CPU tensor beside the CUDA ones
    state = {"model": model, "optim": opt, "extra": extra}
    for step in (1, 2, 3):
        train(model, opt)
        extra.add_(1)
        if step == 1:
            commit(ckpt, state, step)  # allocates the slots
            continue
        h = ckpt.save(state, step=step)
        assert not h.skipped, f"step {step} skipped: {h.reason}"
    want = tensors_of(model, opt)
    want_extra = extra.clone()
    assert any(k.startswith("optim.") and v.is_cuda for k, v in want.items())
    train(model, opt)  # changes parameters and optimizer state right after the last save
    extra.add_(1)
    assert h.wait(60) is True
    assert not torch.equal(model[0].weight, want["model.0.weight"])

    model2, opt2 = make(seed=1)  # other weights, no optimizer state yet
    extra2 = torch.zeros(10, dtype=torch.int64)
    state2 = {"model": model2, "optim": opt2, "extra": extra2}
    assert restore(run_dir, state2) == 3
    assert_same(tensors_of(model2, opt2), want)
    assert state2["extra"].device.type == "cpu" and torch.equal(state2["extra"], want_extra)
    train(model2, opt2)  # the restored optimizer state is usable where the parameters are


def test_buffers_changed_by_the_next_forward_are_saved_as_they_were_at_save(
    ckpt: ftmem.Checkpointer, run_dir: Path
) -> None:
    """BatchNorm statistics on the GPU change in the forward pass right after ``save`` (no
    optimizer step, so no fence): the snapshot still holds their values at ``save``. A large
    first layer keeps the device-to-host copies busy while that forward pass runs."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4096, 4096), nn.BatchNorm1d(4096), nn.ReLU(), nn.Linear(4096, 8)
    ).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    train(model, opt)
    commit(ckpt, state, 1)  # allocates the slots
    train(model, opt)
    # The second slot is made after the first and mapped (page-locked) by the copy thread
    # after the first commit; a save that comes sooner is skipped: wait() commits it.
    commit(ckpt, state, 2)
    train(model, opt)
    want = tensors_of(model, opt)
    h = ckpt.save(state, step=3)
    assert not h.skipped, h.reason
    with torch.no_grad():
        model(torch.randn(16, 4096, device=DEVICE))  # updates running_mean/var at once
    assert not torch.equal(model[1].running_mean, want["model.1.running_mean"])
    assert h.wait(60) is True

    torch.manual_seed(1)
    model2 = nn.Sequential(
        nn.Linear(4096, 4096), nn.BatchNorm1d(4096), nn.ReLU(), nn.Linear(4096, 8)
    ).to(DEVICE)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    assert restore(run_dir, {"model": model2, "optim": opt2}) == 3
    assert_same(tensors_of(model2, opt2), want)


def test_snapshot_corrupted_in_shared_memory_after_commit_is_not_restored(
    ckpt: ftmem.Checkpointer, run_dir: Path, run_id: str
) -> None:
    """One byte of step 2's copy of a CUDA parameter flipped in shared memory after the SMP
    checksummed it: load falls back to step 1, restored bitwise on the GPU."""
    model, opt = make(seed=0)
    state = {"model": model, "optim": opt}
    train(model, opt)
    commit(ckpt, state, 1)
    at1 = tensors_of(model, opt)
    train(model, opt)
    commit(ckpt, state, 2)
    wait_verified(run_dir, 2)  # corrupted later than that, the SMP would checksum the damage
    weight = model[0].weight  # the largest tensor of the state
    path, at = slot_holding(run_id, raw(weight.reshape(-1)[:1024]))
    flip_byte(path, at + weight.nbytes // 2)

    model2, opt2 = make(seed=1)
    assert restore(run_dir, {"model": model2, "optim": opt2}) == 1
    assert_same(tensors_of(model2, opt2), at1)


def odd_state(seed: int) -> dict[str, torch.Tensor]:
    """CUDA tensors that cross the restore's staging buffers unevenly: 2.5 buffers + 12 bytes
    of float32 (three runs, the last short), bf16, a transposed (strided) one, an empty one
    and many small ones, beside one CPU tensor."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = {
        "big": torch.randn(STAGING_BYTES * 5 // 8 + 3, device=DEVICE, generator=g),
        "half": torch.randn(3 << 20, device=DEVICE, generator=g).to(torch.bfloat16),
        "strided": torch.randn(512, 768, device=DEVICE, generator=g).t(),
        "empty": torch.empty(0, device=DEVICE),
        "cpu": torch.arange(1000, dtype=torch.int64) * (seed + 1),
    }
    out |= {f"small{i}": torch.randn(100 + i, device=DEVICE, generator=g) for i in range(50)}
    return out


def test_restore_through_staging_buffers_is_bitwise_and_a_corrupt_run_falls_back(
    ckpt: ftmem.Checkpointer, run_dir: Path, run_id: str
) -> None:
    """Restoring into CUDA tensors goes through page-locked staging buffers, a run of pieces
    at a time, each run checked before it is copied. Tensors of uneven sizes come back bitwise; with a
    byte of step 2's big tensor flipped in its third run, load falls back to step 1 and every
    tensor, those step 2 had already copied included, holds step 1's bytes."""
    state = odd_state(1)
    commit(ckpt, state, 1)
    at1 = {k: v.clone() for k, v in state.items()}
    for k, v in odd_state(2).items():
        state[k].copy_(v)
    torch.cuda.synchronize()
    commit(ckpt, state, 2)
    at2 = {k: v.clone() for k, v in state.items()}
    wait_verified(run_dir, 2)

    target = odd_state(3)
    assert restore(run_dir, target) == 2
    assert_same(target, at2)

    big = state["big"]
    path, at = slot_holding(run_id, raw(big[:1024]))
    flip_byte(path, at + big.nbytes - 100)  # the tensor's third run
    target = odd_state(3)
    assert restore(run_dir, target) == 1
    assert_same(target, at1)
