"""Support code of the tests (plain modules, no tests): what several test modules share.

Shared fixtures live in ``tests/conftest.py``; processes are started, watched and reaped with
the package's harness (:mod:`ftmem.testing.harness`). No ``test_*.py`` module imports another.
"""
