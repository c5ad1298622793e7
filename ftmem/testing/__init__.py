"""Testing aids: fault injection at named points (faults.py), N ftmem-launch agents on
loopback (cluster.py) and the chaos runner (chaos.py, ``python -m ftmem.testing.chaos``)."""
