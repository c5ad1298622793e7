"""Support code of the tests (plain modules, no tests): what several test modules share, and
the harness the chaos runner, the benchmarks and the demo use from the checkout.

Shared fixtures live in ``tests/conftest.py``. Processes are started, watched and reaped with
:mod:`tests._support.launcher`; several hosts on one machine: hosts.py (network namespaces on a
bridge), machines.py (one job across them), delayer.py (packet delay and loss through
NFQUEUE); the chaos runner: chaos/ (``python -m tests._support.chaos``); the training job the
tests, chaos and the benchmarks run: workload/. The fault points they arm live in
:mod:`ftmem.faults`. No ``test_*.py`` module imports another.
"""
