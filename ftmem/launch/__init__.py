"""ftmem-launch: a torchrun drop-in that restarts every rank from in-memory snapshots.

Entry: cli.py (flags, ``main``) -> launch.py (``launch_agent``) -> agent.py
(FtmemElasticAgent: it orchestrates the other modules from elastic's hooks, its state in
recovery.py). elastic_compat.py holds every use of elastic's private API, state_guard.py
its rendezvous state classes; each other module's docstring says what it owns.
Importing this package does not import torch.
"""

__all__: list[str] = []
