"""ftmem-launch: a torchrun drop-in that restarts every rank from in-memory snapshots.

Layout: cli.py (flags, ``main``), config.py (ftmem settings, safe elastic defaults),
agent.py (FtmemElasticAgent on torch.distributed.elastic, ``launch_agent``), smp_runner.py
(the node's SMP), monitor.py (hang detection, no-progress guard), workers.py and
_exec_shim.py (ranks die with their agent). Importing this package does not import torch.
"""

__all__: list[str] = []
