"""The ftmem client: runs inside each training rank.

snapshotter.py (Checkpointer), flatten.py (state <-> tensors + skeleton), staging.py (lazy
copy and fence), restore.py (verify, plan, apply), agreement.py (which step all ranks load),
rng.py (RNGState).
"""

from ftmem.client.rng import RNGState
from ftmem.client.snapshotter import Checkpointer, SnapshotHandle

__all__ = ["Checkpointer", "RNGState", "SnapshotHandle"]
