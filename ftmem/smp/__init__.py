"""The snapshot management process (SMP): one per node, ``python -m ftmem.smp``.

Modules: store.py (per-rank slot state machine, pure), slot_store.py (SlotStore: every
rank's slots behind one lock, the only way any thread changes them), daemon.py (SmpDaemon:
sockets and the poll loop), handlers.py (request kind -> handler, deferred replies),
allocation.py (slot files and their creation off the loop), spawn.py (start one with a
readiness handshake), __main__.py (its CLI).
"""
