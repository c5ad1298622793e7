"""The snapshot management process (SMP): one per node, ``python -m ftmem.smp``.

Modules: store.py (per-rank slot state machine, pure), daemon.py (SmpDaemon: sockets and
the poll loop), spawn.py (start one with a readiness handshake), __main__.py (its CLI).
"""
