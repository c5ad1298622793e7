"""The benchmark state and the baselines measured on it: torch.save and DCP.

The state is a model of ``nn.Linear`` layers with AdamW state (:func:`build_state`); the
``bench_*`` functions time the baselines of ``bench/snapshot.py`` on it, in seconds, one entry per
repeat, into :class:`Timings`; :func:`dcp_async_saves` is also the data path rank's baseline.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
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


@dataclass(kw_only=True, slots=True)
class BenchState:
    """A model of large ``nn.Linear`` layers with AdamW state (one step taken, no gradients)."""

    model: nn.Module
    optimizer: torch.optim.AdamW
    nbytes: int  # Bytes of every tensor in the model and optimizer state dicts.

    def state_dicts(self) -> dict[str, Any]:
        """Return ``{"model": ..., "optim": ...}`` state dicts (tensors shared, not copied)."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


@dataclass(kw_only=True)
class Timings:
    """Durations (seconds) per (system, metric), one entry per repeat; one-off figures apart."""

    values: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    once: dict[str, float] = field(default_factory=dict)

    def add(self, system: str, metric: str, seconds: float) -> None:
        """Append one measured duration to (``system``, ``metric``)."""
        self.values.setdefault((system, metric), []).append(seconds)

    def timed(self, system: str, metric: str, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` and add its duration."""
        t0 = time.perf_counter()
        fn()
        self.add(system, metric, time.perf_counter() - t0)


def state_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor nested in dicts/lists/tuples of ``obj``, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for v in obj for t in state_tensors(v)] if isinstance(obj, list | tuple) else []


def linear_state(
    width: int, n_layers: int, *, seed: int = 0, device: str = "cpu"
) -> tuple[nn.Sequential, torch.optim.AdamW]:
    """``n_layers`` square ``nn.Linear(width, width)`` (weights N(0, 0.02), biases 0) and AdamW
    with its moments allocated (one step taken on gradients of 1e-3, gradients dropped)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = [nn.Linear(width, width, device=device) for _ in range(n_layers)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.normal_(0.0, 0.02, generator=gen)
            layer.bias.zero_()
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
    width = 4096 if param_bytes >= 8 * 64 * 2**20 else 2048
    if narrow and param_bytes < 16 * 2**20:
        width = next((w for w in (1024, 512, 256, 128) if 2 * w * w * 4 <= param_bytes), 64)
    n_layers = max(1, round(param_bytes / (width * width * 4)))
    model, optimizer = linear_state(width, n_layers, seed=seed)
    state = BenchState(model=model, optimizer=optimizer, nbytes=0)
    state.nbytes = sum(t.nbytes for t in state_tensors(state.state_dicts()))
    gib = state.nbytes / 2**30
    logger.info(
        "state: %d x Linear(%d, %d), %.3f GiB with AdamW state", n_layers, width, width, gib
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


def bench_torch_save(
    state: BenchState, *, shm_dir: str, disk_dir: str, repeats: int, out: Timings
) -> None:
    """Time torch.save to /dev/shm and to disk (+fsync), then torch.load (of the /dev/shm file,
    ``weights_only=True``) + load_state_dict of the model and the optimizer."""
    sd = state.state_dicts()
    shm, disk = (os.path.join(d, "torch_save.pt") for d in (shm_dir, disk_dir))

    def save_disk() -> None:
        with open(disk, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    def restore() -> None:
        loaded = torch.load(shm, weights_only=True)
        state.model.load_state_dict(loaded["model"])
        state.optimizer.load_state_dict(loaded["optim"])

    try:
        for metric, path, save in (
            ("/dev/shm", shm, functools.partial(torch.save, sd, shm)),
            ("disk+fsync", disk, save_disk),
        ):
            for _ in range(repeats):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                out.timed("torch.save", metric, save)
        os.unlink(disk)
        for _ in range(repeats):
            out.timed("torch.load", "+ load_state_dict (/dev/shm)", restore)
    finally:
        for path in (shm, disk):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def bench_dcp_save(
    state: BenchState, *, shm_dir: str, disk_dir: str, repeats: int, out: Timings
) -> None:
    """Time sync ``dcp.save`` (no process group, FileSystemWriter's defaults) to /dev/shm and
    disk, and ``dcp.load`` of the last /dev/shm one in place into the live tensors."""
    sd = state.state_dicts()
    last = os.path.join(shm_dir, f"dcp_{repeats - 1}")
    try:
        for metric, base in (("/dev/shm", shm_dir), ("disk+fsync", disk_dir)):
            for i in range(repeats):
                path = os.path.join(base, f"dcp_{i}")
                save = functools.partial(dcp_save, sd, checkpoint_id=path, no_dist=True)
                out.timed("dcp.save", metric, save)
                if path != last:
                    shutil.rmtree(path)
        for _ in range(repeats):
            load = functools.partial(
                dcp_load, state.state_dicts(), checkpoint_id=last, no_dist=True
            )
            out.timed("dcp.load", "in place (/dev/shm)", load)
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


def dcp_async_once(
    sd: dict[str, Any], path: str, stager: DefaultStager, work: Callable[[], Any] = lambda: None
) -> tuple[float, float, float]:
    """One ``dcp.async_save`` of ``sd`` to ``path``: seconds blocking in the call, until staged
    and until written, from the call; ``work()`` runs after the call, before the staging wait,
    and is not counted."""
    t0 = time.perf_counter()
    resp = dcp_async_save(sd, checkpoint_id=path, async_stager=stager, no_dist=True)
    blocking = time.perf_counter() - t0
    work()
    t1 = time.perf_counter()
    if isinstance(resp, AsyncSaveResponse):
        resp.staging_completion.result()
    staged = blocking + time.perf_counter() - t1
    (resp.upload_completion if isinstance(resp, AsyncSaveResponse) else resp).result()
    return blocking, staged, blocking + time.perf_counter() - t1


def dcp_async_saves(
    sd: dict[str, Any], disk_dir: str, n: int, stager: DefaultStager
) -> dict[str, Any]:
    """A warm-up :func:`dcp_async_once` into ``disk_dir``, then ``n`` timed ones, each removed
    after: ``blocking``, ``staged``, ``done`` (lists of seconds), ``first`` (the warm-up's three),
    ``cpu`` (this process's CPU seconds over the ``n``, the removals left out) and ``wall``."""
    out: dict[str, Any] = {"blocking": [], "staged": [], "done": []}
    first = os.path.join(disk_dir, "dcp_async_0")
    out["first"] = dcp_async_once(sd, first, stager)  # allocates the staging buffers
    shutil.rmtree(first, ignore_errors=True)
    rm_cpu, c0, w0 = 0.0, time.process_time(), time.perf_counter()
    for i in range(1, n + 1):
        path = os.path.join(disk_dir, f"dcp_async_{i}")
        times = dcp_async_once(sd, path, stager)
        for key, value in zip(("blocking", "staged", "done"), times, strict=True):
            out[key].append(value)
        c1 = time.process_time()
        shutil.rmtree(path, ignore_errors=True)
        rm_cpu += time.process_time() - c1
    out["cpu"] = time.process_time() - c0 - rm_cpu
    out["wall"] = time.perf_counter() - w0
    return out


def bench_dcp_async_save(
    state: BenchState,
    *,
    disk_dir: str,
    repeats: int,
    async_staging: bool,
    simulate: Callable[[], None],
    out: Timings,
) -> None:
    """Time ``dcp.async_save`` with one reused ``DefaultStager`` (thread executor, to disk):
    blocking, until staged and until done (from the call), and with ``async_staging`` the stall
    when the step waits for staging after ``simulate()``. The first call is a warm-up, apart."""
    system = f"dcp.async_save ({'async' if async_staging else 'sync'} staging)"
    stager = cpu_stager(async_staging)
    sd = state.state_dicts()
    try:
        r = dcp_async_saves(sd, disk_dir, repeats, stager)
        out.once[f"{system} warm-up: blocking"] = r["first"][0]
        out.once[f"{system} warm-up: until staged"] = r["first"][1]
        out.values[(system, "blocking")] = r["blocking"]
        if async_staging:
            out.values[(system, "until staged")] = r["staged"]
        out.values[(system, "until done")] = r["done"]
        for i in range(repeats if async_staging else 0):
            # As ftmem: call, forward/backward, then wait for staging before the optimizer may
            # change the tensors (DCP leaves that wait to the user).
            path = os.path.join(disk_dir, f"dcp_async_fence_{i}")
            out.add(system, "stall with fence", dcp_async_once(sd, path, stager, simulate)[1])
            shutil.rmtree(path)
    finally:
        stager.close()
