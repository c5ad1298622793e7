"""Baseline checkpointing systems measured by ``bench/snapshot.py``: torch.save and DCP.

Every function takes the benchmark state (see :class:`BenchState`) and returns raw timings in
seconds (one entry per repeat); ``bench/snapshot.py`` turns them into medians and ranges.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

logger = logging.getLogger(__name__)

# no_dist=True is the intent here: single-process DCP, no process group.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")

_LAYER_BYTES_MAX = 64 * 2**20


@dataclass(kw_only=True, slots=True)
class BenchState:
    """A model of large ``nn.Linear`` layers with initialised AdamW state."""

    model: nn.Module  # The model; its parameters hold about a third of :attr:`nbytes`.
    optimizer: torch.optim.AdamW
    """AdamW with ``exp_avg``/``exp_avg_sq`` allocated (one step taken, gradients dropped)."""
    nbytes: int  # Bytes of every tensor in the model and optimizer state dicts.

    def state_dicts(self) -> dict[str, Any]:
        """Return ``{"model": ..., "optim": ...}`` state dicts (tensors shared, not copied)."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    @property
    def gib(self) -> float:
        """The state's size in GiB."""
        return self.nbytes / 2**30


@dataclass(kw_only=True, slots=True)
class Timings:
    """Named lists of durations (seconds), one entry per repeat."""

    values: dict[str, list[float]] = field(default_factory=dict)
    """Metric name -> one duration per repeat."""
    once: dict[str, float] = field(default_factory=dict)
    """One-off figures (warm-up calls), in seconds."""

    def add(self, name: str, seconds: float) -> None:
        """Append one measured duration to ``name``."""
        self.values.setdefault(name, []).append(seconds)


def state_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor nested in dicts/lists/tuples of ``obj``, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for v in obj for t in state_tensors(v)] if isinstance(obj, list | tuple) else []


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor nested in dicts/lists/tuples of ``obj``."""
    return sum(t.nbytes for t in state_tensors(obj))


def linear_state(
    width: int, n_layers: int, *, seed: int = 0, device: str = "cpu"
) -> tuple[nn.Sequential, torch.optim.AdamW]:
    """``n_layers`` square ``nn.Linear(width, width)`` (weights N(0, 0.02), biases 0) and AdamW
    with its moments allocated (one step taken on gradients of 1e-3, gradients dropped)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        layer = nn.Linear(width, width, device=device)
        with torch.no_grad():
            layer.weight.normal_(0.0, 0.02, generator=gen)
            layer.bias.zero_()
        layers.append(layer)
    model = nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def build_state(size_gib: float, *, seed: int = 0, narrow: bool = False) -> BenchState:
    """A model + AdamW whose parameters are ``size_gib / 3`` GiB, optimizer state 2x that:
    square ``nn.Linear`` layers (with bias) of at most 64 MiB of weights each. ``narrow``:
    below 16 MiB of parameters, layers narrower than 2048 (else at least one, 48 MiB)."""
    if size_gib <= 0:
        raise ValueError(f"size must be positive, got {size_gib}")
    param_bytes = size_gib * 2**30 / 3
    width = 4096 if param_bytes >= 8 * _LAYER_BYTES_MAX else 2048
    if narrow and param_bytes < 16 * 2**20:
        width = next((w for w in (1024, 512, 256, 128) if 2 * w * w * 4 <= param_bytes), 64)
    n_layers = max(1, round(param_bytes / (width * width * 4)))
    model, optimizer = linear_state(width, n_layers, seed=seed)
    state = BenchState(model=model, optimizer=optimizer, nbytes=0)
    state.nbytes = tensor_bytes(state.state_dicts())
    logger.info(
        "state: %d x Linear(%d, %d), %.3f GiB with AdamW state", n_layers, width, width, state.gib
    )
    return state


def check_restore(load: Callable[[], Any], state: BenchState) -> bool:
    """Clobber one weight and its ``exp_avg_sq``, ``load()``, and say whether both came back
    bitwise."""
    weight = next(iter(state.model.parameters()))
    moment = state.optimizer.state[weight]["exp_avg_sq"]
    want_w, want_m = weight.detach().clone(), moment.clone()
    with torch.no_grad():
        weight.fill_(123.0)
        moment.fill_(-1.0)
    load()
    weight = next(iter(state.model.parameters()))
    moment = state.optimizer.state[weight]["exp_avg_sq"]
    return bool(torch.equal(weight, want_w) and torch.equal(moment, want_m))


def make_simulator(kind: str, seconds: float) -> Callable[[], None]:
    """A stand-in for forward + backward lasting ``seconds``: 256x256 matmuls on this thread
    (``compute``) or a sleep."""
    if kind == "sleep":
        return lambda: time.sleep(seconds)
    a = torch.randn(256, 256) / 16

    def compute() -> None:
        x = a
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            x = torch.tanh(x @ a)

    return compute


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_torch_save(
    state: BenchState, *, shm_dir: str, disk_dir: str, repeats: int, out: Timings
) -> None:
    """Measure torch.save to /dev/shm and to disk (+fsync), then torch.load (of the /dev/shm
    file, ``weights_only=True``) + load_state_dict of the model and the optimizer."""
    sd = state.state_dicts()
    shm_path = os.path.join(shm_dir, "torch_save.pt")
    disk_path = os.path.join(disk_dir, "torch_save.pt")

    def save_disk() -> None:
        with open(disk_path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    try:
        for _ in range(repeats):
            if os.path.exists(shm_path):
                os.unlink(shm_path)
            out.add("torch.save /dev/shm", _timed(lambda: torch.save(sd, shm_path)))
        for _ in range(repeats):
            if os.path.exists(disk_path):
                os.unlink(disk_path)
            out.add("torch.save disk+fsync", _timed(save_disk))
        os.unlink(disk_path)

        def restore() -> None:
            loaded = torch.load(shm_path, weights_only=True)
            state.model.load_state_dict(loaded["model"])
            state.optimizer.load_state_dict(loaded["optim"])

        for _ in range(repeats):
            out.add("torch.load + load_state_dict (/dev/shm)", _timed(restore))
    finally:
        for path in (shm_path, disk_path):
            if os.path.exists(path):
                os.unlink(path)


def bench_dcp_save(
    state: BenchState, *, shm_dir: str, disk_dir: str, repeats: int, out: Timings
) -> None:
    """Measure sync ``dcp.save`` (no process group, FileSystemWriter's defaults) to /dev/shm
    and disk, and ``dcp.load`` of the /dev/shm one in place into the live tensors."""
    sd = state.state_dicts()
    for label, base in (("/dev/shm", shm_dir), ("disk+fsync", disk_dir)):
        for i in range(repeats):
            path = os.path.join(base, f"dcp_{i}")
            t0 = time.perf_counter()
            dcp_save(sd, checkpoint_id=path, no_dist=True)
            out.add(f"dcp.save {label}", time.perf_counter() - t0)
            if i < repeats - 1 or base != shm_dir:
                shutil.rmtree(path)
    last = os.path.join(shm_dir, f"dcp_{repeats - 1}")
    try:
        for _ in range(repeats):
            target = state.state_dicts()
            t0 = time.perf_counter()
            dcp_load(target, checkpoint_id=last, no_dist=True)
            out.add("dcp.load in place (/dev/shm)", time.perf_counter() - t0)
    finally:
        shutil.rmtree(last, ignore_errors=True)


def cpu_stager(async_staging: bool) -> DefaultStager:
    """A ``DefaultStager`` for CPU tensors (pinned memory and non-blocking copies need an
    accelerator), staging in its own thread with ``async_staging``."""
    options = StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=False,
        use_async_staging=async_staging,
        use_non_blocking_copy=False,
    )
    return DefaultStager(options)


def bench_dcp_async_save(
    state: BenchState,
    *,
    disk_dir: str,
    repeats: int,
    async_staging: bool,
    simulate: Callable[[], None],
    out: Timings,
) -> None:
    """Measure ``dcp.async_save`` with one reused ``DefaultStager`` (thread executor, to disk):
    blocking, until staged and until done (from the call), and with ``async_staging`` the stall
    when the step waits for staging after ``simulate()``. The first call is a warm-up, apart."""
    tag = "async staging" if async_staging else "sync staging"
    stager = cpu_stager(async_staging)
    sd = state.state_dicts()
    try:
        for i in range(repeats + 1):
            path = os.path.join(disk_dir, f"dcp_async_{i}")
            t0 = time.perf_counter()
            resp = dcp_async_save(sd, checkpoint_id=path, async_stager=stager, no_dist=True)
            t_block = time.perf_counter() - t0
            if async_staging:
                assert isinstance(resp, AsyncSaveResponse)
                resp.staging_completion.result()
                t_staged = time.perf_counter() - t0
                resp.upload_completion.result()
            else:
                t_staged = t_block
                assert isinstance(resp, Future)
                resp.result()
            t_done = time.perf_counter() - t0
            shutil.rmtree(path)
            if i == 0:
                out.once[f"dcp.async_save ({tag}) warm-up: blocking"] = t_block
                out.once[f"dcp.async_save ({tag}) warm-up: until staged"] = t_staged
                continue
            out.add(f"dcp.async_save ({tag}) blocking", t_block)
            if async_staging:
                out.add(f"dcp.async_save ({tag}) until staged", t_staged)
            out.add(f"dcp.async_save ({tag}) until done", t_done)
        if async_staging:
            # Same pattern as ftmem: call, forward/backward, then wait for staging before the
            # optimizer may change the tensors (DCP leaves that wait to the user).
            for i in range(repeats):
                path = os.path.join(disk_dir, f"dcp_async_fence_{i}")
                t0 = time.perf_counter()
                resp = dcp_async_save(sd, checkpoint_id=path, async_stager=stager, no_dist=True)
                t_block = time.perf_counter() - t0
                simulate()
                t1 = time.perf_counter()
                assert isinstance(resp, AsyncSaveResponse)
                resp.staging_completion.result()
                out.add(
                    f"dcp.async_save ({tag}) stall with fence", t_block + time.perf_counter() - t1
                )
                resp.upload_completion.result()
                shutil.rmtree(path)
    finally:
        stager.close()


def make_temp_dirs(disk_root: str | None) -> tuple[str, str]:
    """Return fresh (shm_dir, disk_dir) temp directories for one size's baseline files."""
    shm_dir = tempfile.mkdtemp(prefix="ftmem-bench-", dir="/dev/shm")
    disk_dir = tempfile.mkdtemp(prefix="ftmem-bench-", dir=disk_root)
    return shm_dir, disk_dir
