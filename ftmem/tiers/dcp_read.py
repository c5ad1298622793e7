"""Read checked checkpoints with DCP without unpickling anything a checkpoint holds.

DCP's stock reader unpickles ``.metadata`` and non-tensor entries. ftmem reads only
checkpoints that passed :func:`ftmem.tiers.checkpoints.read_checkpoint` (ours, signed), takes
the metadata from the JSON in the signed manifest (:mod:`ftmem.tiers.dcp_meta`) and loads
non-tensor entries with ``weights_only=True``. A checkpoint of an older ftmem has no JSON copy:
its ``.metadata`` is read by DCP, safe only because its signature and owner were checked.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from ftmem.tiers.checkpoints import Checkpoint
from ftmem.tiers.dcp_meta import metadata_from_json


@contextmanager
def in_one_process() -> Iterator[None]:
    """Silence DCP's warning that it saves or loads in one process (``no_dist``, as meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class CheckedReader(FileSystemReader):
    """DCP's file reader over a checked checkpoint, with the metadata from its manifest."""

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__(str(ckpt.path))
        self._dcp_json = ckpt.dcp_json

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint's DCP ``Metadata``, rebuilt from the signed manifest's JSON."""
        if self._dcp_json is None:
            return super().read_metadata(*args, **kwargs)
        md = metadata_from_json(self._dcp_json)
        md.storage_meta = StorageMeta(checkpoint_id=str(self.path), load_id=self.load_id)
        return md


class _WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
    """Loads a whole checkpoint into an empty dict; non-tensor entries with weights_only."""

    def __init__(self, keys: set[str] | None = None) -> None:
        super().__init__(keys)  # type: ignore[no-untyped-call]

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_into(targets: dict[str, Any], ckpt: Checkpoint) -> None:
    """Load ``targets`` (fqn -> tensor, in place) from ``ckpt`` in this process."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    with in_one_process():
        dcp_load(targets, storage_reader=CheckedReader(ckpt), no_dist=True)


def load_whole(ckpt: Checkpoint, keys: set[str] | None = None) -> dict[str, Any]:
    """Every entry of ``ckpt`` (or those whose fqn is in ``keys``) as a nested state dict
    (what ``dcp_to_torch_save`` saves)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    with in_one_process():
        _load_state_dict(
            sd, storage_reader=CheckedReader(ckpt), planner=_WeightsOnlyPlanner(keys), no_dist=True
        )
    return sd
