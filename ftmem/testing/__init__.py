"""Testing aids: the process harness (harness.py: the ftmem-launch command line, agents in
sessions of their own, bounded stops), N ftmem-launch agents on loopback (cluster.py), the
chaos runner (chaos.py, ``python -m ftmem.testing.chaos``; its parts _chaos_config.py,
_chaos_schedule.py, _chaos_inject.py, _chaos_runner.py, _chaos_report.py) and the training
job tests, chaos and the benchmarks run (workload/, shipped in the package). Several hosts
on one machine: hosts.py (network namespaces on a bridge), machines.py (one job across
them), delayer.py (packet delay and loss through NFQUEUE). The fault points they arm live in :mod:`ftmem.faults`
(production code passes them; they cost two comparisons when unarmed)."""
