"""The snapshot format, shared by the client, the SMP and the disk tiers; imports no torch.

* :mod:`ftmem.format.layout`: where each tensor lives in a slot, its checksum, the objects
  extent; one parser (:func:`~ftmem.format.layout.parse_layout`) validates every layout read
  from another process or file.
* :mod:`ftmem.format.skeleton`: the codec of a state's non-tensor structure (JSON with tags,
  never pickle).
* :mod:`ftmem.format.record`: the commit record written next to a committed slot.
* :mod:`ftmem.format.tensors`: the torch side (dtype names, the skeleton's tensor markers);
  the only module here that imports torch, and only the client and the tiers import it.
"""
