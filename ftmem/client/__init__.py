"""The ftmem client: runs inside each training rank.

snapshotter.py (Checkpointer: grants, staging, commit), planner.py (the one door a save
plans through: this replica's share of replicated tensors, their places in a slot, which
are copied when, and the caches of the walk and of steady.py), slot_maps.py (mapped slot files,
staging a save into one), flatten.py (state <-> tensors + skeleton), staging.py (lazy copy
and fence), loading.py (load), restore.py (verify, plan, apply), agreement.py (which step
all ranks load), rng.py (RNGState), sampler.py (ElasticSampler: a data position that survives a new world size), reshard.py (load a step saved at another world size, resharded from memory), checkfree.py (CheckFreeStage: a lost pipeline stage
rebuilt from its neighbours), steady.py (the steady-state save of an already planned state),
pitfalls.py (loop mistakes that break an exact resume, caught at run time), in_process.py
(``ftmem.run``: in-process restart).
"""

from ftmem.client.checkfree import CheckFreeStage
from ftmem.client.rng import RNGState
from ftmem.client.sampler import ElasticSampler
from ftmem.client.snapshotter import Checkpointer, SnapshotHandle

__all__ = ["CheckFreeStage", "Checkpointer", "ElasticSampler", "RNGState", "SnapshotHandle"]
