"""ftmem-launch: a torchrun drop-in that restarts every rank from in-memory snapshots.

Layout: cli.py (flags, ``main``), config.py (ftmem settings, safe elastic defaults),
launch.py (``launch_agent``), agent.py (FtmemElasticAgent on torch.distributed.elastic),
rendezvous.py (slots, master address and generation through the round's store),
rank_watch.py (stopped and hung ranks), smp_runner.py (the node's SMP), monitor.py (SMP status, hang detection, no-progress guard,
event log), report.py (log lines and the final report), workers.py and _exec_shim.py (rank
spawning with a parent-death signal, stable rank slots, the ranks' environment).
Importing this package does not import torch.
"""

__all__: list[str] = []
