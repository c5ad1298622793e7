"""Observability tools on top of the event logs and the benchmarks' figures.

- :mod:`ftmem.observe.timeline`: a run's marks (or a text summary) from the agents'
  ``events.jsonl`` and the SMPs' ``smp-events.jsonl``; :mod:`ftmem.observe.timeline_plot` is
  the ``ftmem timeline`` command and draws the picture;
- :mod:`ftmem.observe.plan`: ``ftmem plan``, a goodput model of ftmem against periodic disk
  checkpoints at the Young/Daly interval.

Nothing here is imported by the ranks or the SMP; matplotlib (the ``plot`` extra) is imported
only when a picture is drawn.
"""
