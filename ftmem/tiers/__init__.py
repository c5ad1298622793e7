"""Disk tiers: what ftmem writes to disk (stock DCP format).

Modules: export.py (memory -> DCP), flush_worker.py (the SMP's flush worker process),
dcp_writer.py (DCP's file writer, streaming and checksummed), dcp_meta.py (metadata as
JSON), assemble.py (nodes' parts -> one global checkpoint), checkpoints.py (names, manifests,
listing, pruning), signing.py (manifest signatures), dcp_read.py (reading without
unpickling), disk_restore.py (``ftmem.load``'s disk fallback), combine.py and
combine_search.py (checkpoint arithmetic)."""
