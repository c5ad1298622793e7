"""ftmem-launch: a torchrun drop-in that restarts every rank from in-memory snapshots.

Layout: cli.py (flags, ``main``), __main__.py, config.py (ftmem settings, safe elastic
defaults), launch.py (``launch_agent``), agent.py (FtmemElasticAgent on
torch.distributed.elastic: it only orchestrates the rooms below from elastic's hooks),
recovery.py (the agent's recovery state machine), elastic_compat.py (every use of elastic's
private API), rendezvous.py (slots, master address and generation through the round's store),
node_slot.py (this node's slot across rounds, fencing), ranks.py (which global ranks each
node runs), membership.py (machines in the job, a store that does not answer), detector.py
(heartbeats, a lost machine declared on corroboration) and node_watch.py (the detector told
each round's ring neighbours), failures.py (what failed, each failure reported once),
rank_store.py (the store the ranks meet at), rank_watch.py (stopped and hung ranks),
smp_runner.py (the node's SMP), job_key.py (how the agents get the job's key), peers.py (the
peer mesh's endpoints and each generation's sync, :class:`~ftmem.launch.peers.PeerMesh`), reshape.py (a round of another size: the lost slots
rebuilt in guest SMPs, the ranks told to reshard), monitor.py (SMP status, hang detection,
no-progress guard), report.py (log lines and the final report), metrics.py (Prometheus),
standby.py and _standby.py (standby ranks), in_process.py (ranks kept across a restart),
workers.py and _exec_shim.py (rank spawning with a parent-death signal, the ranks'
environment).
Importing this package does not import torch.
"""

__all__: list[str] = []
