"""The ftmem client: runs inside each training rank.

snapshotter.py (Checkpointer), save_plan.py (which tensors a save copies when),
sharding.py (this replica's share of replicated tensors), slot_maps.py (mapped slot files,
staging a save into one), flatten.py (state <-> tensors + skeleton), staging.py (lazy copy
and fence), loading.py (load), restore.py (verify, plan, apply), agreement.py (which step
all ranks load), rng.py (RNGState).
"""

from ftmem.client.rng import RNGState
from ftmem.client.snapshotter import Checkpointer, SnapshotHandle

__all__ = ["Checkpointer", "RNGState", "SnapshotHandle"]
