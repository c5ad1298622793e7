"""Disk tiers: what ftmem writes to disk (stock DCP format). export.py: memory -> DCP."""
