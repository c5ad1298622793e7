"""Testing aids: the process harness (harness.py: the ftmem-launch command line, agents in
sessions of their own, bounded stops), N ftmem-launch agents on loopback (cluster.py), the
chaos runner (chaos.py, ``python -m ftmem.testing.chaos``) and the training job it runs
(workload/, shipped in the package). The fault points they arm live in :mod:`ftmem.faults`
(production code passes them; they cost two comparisons when unarmed)."""
