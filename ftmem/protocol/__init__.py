"""Every message between ftmem's processes, typed and checked on arrival.

messages.py (a rank's requests to its SMP and their replies), status.py (the SMP's STATUS and
the PEER_START reply), peer.py (between SMPs), flush_jobs.py (the SMP and its flush process),
rejoin.py (the agent's order to a rank that rejoins in process), wire.py (the authenticated
frame), smp_client.py (the client of an SMP).
"""
