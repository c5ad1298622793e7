"""Testing aids: N ftmem-launch agents on loopback (cluster.py) and the chaos runner
(chaos.py, ``python -m ftmem.testing.chaos``). The fault points they arm live in
:mod:`ftmem.faults` (production code passes them; they cost two comparisons when unarmed)."""
