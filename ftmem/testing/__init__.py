"""Testing aids: deterministic fault injection (faults.py)."""
