"""Checkpoint arithmetic: a new DCP checkpoint from a linear combination of flushed ones
(LCSC; an EMA is one such combination). See docs/api.md, "ftmem combine".

* **Inputs** are checked before any byte is used (signed manifest, owner, every file's hash);
  their metadata comes from the manifest's JSON (:class:`~ftmem.tiers.dcp_read.CheckedReader`)
  and non-tensor entries load with ``weights_only``.
* Every floating-point tensor (optionally only those under ``keys``) is combined in float64
  (or float32) and cast back; it must have the same size and dtype in every input. Everything
  else comes from the *base* checkpoint, whose step and world size the output carries.
* **Streaming**: stock DCP writes the output (a file per tensor) from a state dict of
  meta-device placeholders; the planner computes each tensor when DCP asks for it
  (``resolve_data``), so memory stays near a few times the largest tensor.
* **Exactness**: a term of coefficient 0 is skipped and the sum starts from the first term,
  so ``(1, 0, ...)`` reproduces an input bit for bit; each operation is separately rounded (no
  fused multiply-add), so a float64 reference with the same formula matches exactly.

The output is written as ``<out>.tmp-<host>-<pid>`` and renamed into place once its signed
manifest (which records the inputs and coefficients) is fsynced.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftmem._logging import get_logger
from ftmem.errors import FtmemError
from ftmem.tiers.checkpoints import (
    Checkpoint,
    fsync_dir,
    read_checkpoint,
    temp_name,
    verify_checkpoint,
    write_manifest,
)
from ftmem.tiers.dcp_meta import metadata_to_json
from ftmem.tiers.dcp_read import CheckedReader, in_one_process, load_whole

log = get_logger(__name__)

ACCUMULATE = {"float64": torch.float64, "float32": torch.float32}


class CombineError(FtmemError):
    """The checkpoints cannot be combined as asked (they differ, a coefficient is missing, the
    output exists...)."""


@dataclass(frozen=True, slots=True)
class Linear:
    """``sum(coeffs[i] * input[i])``; terms with coefficient 0 are skipped."""

    coeffs: tuple[float, ...]

    def describe(self) -> dict[str, Any]:
        """The combination as JSON (for the output's manifest)."""
        return {"kind": "linear", "coeffs": list(self.coeffs)}


@dataclass(frozen=True, slots=True)
class Ema:
    """The exponential moving average of the inputs in order: ``e = x[0]``, then
    ``e = decay * e + (1 - decay) * x[i]`` for each next input."""

    decay: float

    def describe(self) -> dict[str, Any]:
        """The combination as JSON (for the output's manifest)."""
        return {"kind": "ema", "decay": self.decay}


Combination = Linear | Ema


def ema_coefficients(decay: float, n: int) -> tuple[float, ...]:
    """The weights of :class:`Ema` over ``n`` inputs as a linear combination (sum 1)."""
    if n == 1:
        return (1.0,)
    return (decay ** (n - 1), *((1 - decay) * decay ** (n - 1 - i) for i in range(1, n)))


class InputSet:
    """Checked input checkpoints and the entries they share; reads one tensor at a time.

    The inputs keep the order given (``by_step``: oldest step first). The base is ``base``, or
    else the input of the newest step.

    Raises (from the constructor):
        CorruptSnapshotError / UnsafePathError: an input fails its checks (see the module
            docstring); nothing of it was used.
        CombineError: fewer than one input, a part of a multi-node checkpoint, or a combined
            tensor whose size or dtype differs between inputs.
    """

    def __init__(
        self,
        paths: Sequence[Path],
        base: Path | None = None,
        keys: Sequence[str] = (),
        by_step: bool = False,
    ) -> None:
        if not paths:
            raise CombineError("no checkpoints to combine")
        self.ckpts: list[Checkpoint] = []
        for p in paths:
            ckpt = read_checkpoint(Path(p))
            if ckpt.is_part:
                raise CombineError(f"{p} is a node's part: assemble the parts first")
            if ckpt.dcp_json is None:
                raise CombineError(f"{p} has no DCP metadata in its manifest (an older ftmem)")
            verify_checkpoint(ckpt)
            self.ckpts.append(ckpt)
        if by_step:
            self.ckpts.sort(key=lambda c: c.step)
        self.readers = [_CachedReader(c) for c in self.ckpts]
        self.base = self._base(base)
        self.metadata = [r.read_metadata() for r in self.readers]
        self.tensors = _tensors_of(self.metadata[self.base])
        """fqn -> (size, dtype) of every tensor of the base (combined or not)."""
        self.combined = self._combined(keys)
        """fqn -> (size, dtype) of every tensor that is combined."""

    def _base(self, base: Path | None) -> int:
        if base is None:
            return max(range(len(self.ckpts)), key=lambda i: self.ckpts[i].step)
        for i, c in enumerate(self.ckpts):
            if os.path.samefile(c.path, base):
                return i
        raise CombineError(f"the base {base} is not one of the checkpoints combined")

    def _combined(self, keys: Sequence[str]) -> dict[str, tuple[torch.Size, torch.dtype]]:
        out: dict[str, tuple[torch.Size, torch.dtype]] = {}
        each = [_tensors_of(md) for md in self.metadata]
        for fqn, want in self.tensors.items():
            if not want[1].is_floating_point or not _selected(fqn, keys):
                continue
            for ckpt, theirs in zip(self.ckpts, each, strict=True):
                other = theirs.get(fqn)
                if other is None:
                    raise CombineError(f"{ckpt.path} has no tensor {fqn!r}")
                if other != want:
                    raise CombineError(
                        f"{fqn!r} is {list(other[0])} {other[1]} in "
                        f"{ckpt.path} but {list(want[0])} {want[1]} in the base"
                    )
            out[fqn] = want
        if keys and not out:
            raise CombineError(f"no floating-point tensor matches --keys {list(keys)}")
        return out

    def read(self, i: int, fqn: str, into: torch.Tensor) -> torch.Tensor:
        """Tensor ``fqn`` of input ``i``, read into ``into`` (of its size and dtype)."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        with in_one_process():
            dcp_load({fqn: into}, storage_reader=self.readers[i], no_dist=True)
        return into

    def path_of(self, fqn: str) -> tuple[Any, ...]:
        """Where entry ``fqn`` sits in the base's nested state dict."""
        planner = self.metadata[self.base].planner_data or {}
        return tuple(planner.get(fqn, (fqn,)))

    def skeleton(self) -> dict[str, Any]:
        """The base's state dict with its non-tensor entries loaded (``weights_only``) and a
        meta-device placeholder (size and dtype only) in place of every tensor."""
        from torch.distributed.checkpoint._traverse import set_element

        md = self.metadata[self.base]
        rest = {fqn for fqn in md.state_dict_metadata if fqn not in self.tensors}
        sd: dict[str, Any] = load_whole(self.ckpts[self.base], keys=rest) if rest else {}
        for fqn, (size, dtype) in self.tensors.items():
            set_element(sd, self.path_of(fqn), torch.empty(size, dtype=dtype, device="meta"))
        return sd

    def output_tensor(
        self, fqn: str, how: Combination, accumulate: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Tensor ``fqn`` of the output: the combination if it is combined, else the base's."""
        if fqn in self.combined:
            return combine_tensor(self, fqn, how, accumulate)
        size, dtype = self.tensors[fqn]
        return self.read(self.base, fqn, torch.empty(size, dtype=dtype))


def _tensors_of(md: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """fqn -> (size, dtype) of every tensor entry of a DCP ``Metadata``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        fqn: (e.size, e.properties.dtype)
        for fqn, e in md.state_dict_metadata.items()
        if isinstance(e, TensorStorageMetadata)
    }


def _check_fits(inputs: InputSet, how: Combination) -> None:
    """A linear combination has one coefficient per input (else CombineError)."""
    if isinstance(how, Linear) and len(how.coeffs) != len(inputs.ckpts):
        raise CombineError(f"{len(how.coeffs)} coefficients for {len(inputs.ckpts)} checkpoints")


def _selected(fqn: str, keys: Sequence[str]) -> bool:
    return not keys or any(fqn == k or fqn.startswith(k + ".") for k in keys)


class _CachedReader(CheckedReader):
    """A checked reader that rebuilds the metadata once (each tensor read asks for it)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__(ckpt)
        self._md: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._md is None:
            self._md = super().read_metadata(*args, **kwargs)
        return self._md


_CHUNK = 4 << 20
"""Elements converted to the accumulation dtype at a time (32 MiB of float64)."""


def _add_scaled(acc: torch.Tensor, x: torch.Tensor, c: float, first: bool) -> None:
    """``acc = x * c`` (``first``) or ``acc += x * c``, converting ``x`` a chunk at a time;
    each product and sum is its own rounded operation (no fused multiply-add)."""
    a, b = acc.view(-1), x.reshape(-1)
    for s in range(0, a.numel(), _CHUNK):
        part = b[s : s + _CHUNK].to(acc.dtype, copy=True)
        if c != 1.0:
            part.mul_(c)
        if first:
            a[s : s + _CHUNK].copy_(part)
        else:
            a[s : s + _CHUNK].add_(part)


def combine_tensor(
    inputs: InputSet,
    fqn: str,
    how: Combination,
    accumulate: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Tensor ``fqn`` of the combination ``how`` of the inputs, in its own dtype (a linear
    combination must have one coefficient per input: checked once by the callers).

    Memory: one read buffer, the sum in ``accumulate`` and the result (plus a chunk).
    """
    size, dtype = inputs.combined[fqn]
    buf = torch.empty(size, dtype=dtype)
    acc = torch.zeros(size, dtype=accumulate)
    if isinstance(how, Ema):
        for i in range(len(inputs.ckpts)):
            inputs.read(i, fqn, buf)
            if i > 0:
                acc.mul_(how.decay)
            _add_scaled(acc, buf, 1.0 if i == 0 else 1.0 - how.decay, first=i == 0)
        return acc.to(dtype)
    first = True
    for i, c in enumerate(how.coeffs):
        if c != 0.0:
            _add_scaled(acc, inputs.read(i, fqn, buf), c, first)
            first = False
    return acc.to(dtype)  # every coefficient 0: zeros


def _combining_planner(compute: Callable[[str], torch.Tensor]) -> Any:
    """DCP's default save planner, computing each combined tensor when DCP writes it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class _CombiningPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            obj = self.lookup_object(write_item.index)
            if write_item.type != WriteItemType.BYTE_IO and obj.is_meta:
                return compute(write_item.index.fqn)
            return super().resolve_data(write_item)

    return _CombiningPlanner()


@dataclass(frozen=True, slots=True)
class CombineResult:
    """What :func:`write_combined` wrote."""

    path: Path
    step: int
    combined: int
    """How many tensors were combined (the rest came from the base)."""
    nbytes: int


def write_combined(
    inputs: InputSet,
    how: Combination,
    out: Path,
    accumulate: torch.dtype = torch.float64,
) -> CombineResult:
    """Write the combination ``how`` of ``inputs`` as a DCP checkpoint at ``out`` (which must
    not exist), with a signed manifest; see the module docstring for what is combined.

    Raises:
        CombineError: ``out`` exists, or the combination does not fit the inputs.
        OSError: writing failed (nothing is left under ``out``).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    out = Path(out)
    if os.path.lexists(out):
        raise CombineError(f"{out} exists")
    _check_fits(inputs, how)
    base = inputs.ckpts[inputs.base]
    tmp = out.parent / temp_name(out.name)
    tmp.mkdir(mode=0o700)
    try:
        planner = _combining_planner(lambda fqn: inputs.output_tensor(fqn, how, accumulate))
        # A file per tensor: DCP's writer holds every tensor of a file until it closes the file.
        with in_one_process():
            md = dcp_save(
                inputs.skeleton(),
                storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=False),
                planner=planner,
                no_dist=True,
            )
        record = {
            **how.describe(),
            "inputs": [{"path": str(c.path), "step": c.step} for c in inputs.ckpts],
            "base": str(base.path),
            "accumulate": str(accumulate).removeprefix("torch."),
        }
        write_manifest(
            tmp, base.step, base.world_size, extra={"dcp": metadata_to_json(md), "combined": record}
        )
        fsync_dir(tmp)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    nbytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log.info(
        "combined %d tensors of %d checkpoints into %s",
        len(inputs.combined),
        len(inputs.ckpts),
        out,
    )
    return CombineResult(out, base.step, len(inputs.combined), nbytes)


def combined_state(
    inputs: InputSet, how: Combination, accumulate: torch.dtype = torch.float64
) -> dict[str, Any]:
    """The combination as an in-memory state dict (nested as the base was saved: what
    ``dcp_to_torch_save`` would give), e.g. for an evaluation."""
    from torch.distributed.checkpoint._traverse import set_element

    sd = inputs.skeleton()
    _check_fits(inputs, how)
    for fqn in inputs.tensors:
        set_element(sd, inputs.path_of(fqn), inputs.output_tensor(fqn, how, accumulate))
    return sd
