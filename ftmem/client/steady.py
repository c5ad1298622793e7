"""The steady-state save: re-read a state whose structure the last full save planned.

Most saves see the structure of the last full save again, with new values for a few small
objects. :class:`SteadyState` remembers what that save found and walks the next save's
``state_dict()`` outputs once against it:

- every container must have the same type, keys (in order) or length;
- every tensor copied lazily or sharded (the optimizer's parameters and state, replicated
  parameters) must be the very same memory (data pointer, shape, strides, dtype, device,
  type; a DTensor also its mesh, placements and global shape): the plan, the slot views and
  the replica slices stay valid;
- every other tensor must have the same shape, dtype, device and type; it is taken as it is
  now and copied eagerly;
- the optimizers must hold as many groups, parameters and states as before;
- the maximal subtrees without a tensor ("plain": ``param_groups``, counters) may change:
  only they are encoded again, spliced into the skeleton's encoding kept from the full save.

Anything else makes :meth:`SteadyState.refresh` return None and the save walks the state in
full. A full walk every ``FULL_EVERY`` saves re-derives what the check cannot see cheaply
(which tensors the optimizers own): a tensor the optimizer no longer owns must not be copied
lazily, since something else may change it before the fence.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ftmem.client.flatten import Flat, dtensor_type, optimizer_storage_ptrs, storage_ptr
from ftmem.format.tensors import TENSOR_MARK, encode_skeleton

FULL_EVERY = 1000
"""Saves between two full walks of an unchanged state (see the module docstring)."""

_SENTINEL = f"@@ftmem-plain-{secrets.token_hex(8)}-"
"""Marks a plain subtree in the template encoding (a random nonce: no state holds it)."""

# Node kinds of the remembered structure (tuples: the check is the hot loop).
_DICT, _LIST, _TUPLE, _PLAIN, _STRICT, _FRESH = range(6)


_TENSOR = torch.Tensor


def _strict_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What must stay equal for a tensor whose memory the plan and the slot views refer to.
    The data pointer says which memory: the remembered tensor keeps that memory alive, so an
    equal pointer cannot be a new allocation at an old address (``is_cuda``: which address
    space)."""
    if type(t) is _TENSOR:
        return (t.data_ptr(), t.stride(), t.shape, t.dtype, t.is_cuda)
    if type(t) is dtensor_type():
        local = t._local_tensor  # type: ignore[attr-defined]
        return (
            type(t),
            local.data_ptr(),
            local.stride(),
            local.shape,
            local.dtype,
            local.is_cuda,
            t.shape,
            t.placements,  # type: ignore[attr-defined]
            id(t.device_mesh),  # type: ignore[attr-defined]
        )
    return (type(t),)  # never equal to a remembered key of another type: a full save says why


def _fresh_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What must stay equal for a tensor taken anew each save (copied eagerly)."""
    if type(t) is _TENSOR:
        return (t.shape, t.dtype, t.is_cuda, t.layout)
    if type(t) is dtensor_type():
        local = t._local_tensor  # type: ignore[attr-defined]
        return (type(t), t.shape, t.placements, id(t.device_mesh), local.shape, local.dtype)  # type: ignore[attr-defined]
    return (type(t),)


def _local(t: torch.Tensor) -> torch.Tensor:
    if type(t) is dtensor_type():
        return t._local_tensor.detach()  # type: ignore[attr-defined,no-any-return]
    return t.detach()


def _optimizer_counts(optimizers: list[torch.optim.Optimizer]) -> tuple[int, ...]:
    out: list[int] = []
    for opt in optimizers:
        out.append(len(opt.state))
        out.extend(len(g["params"]) for g in opt.param_groups)
    return tuple(out)


@dataclass(eq=False)
class SteadyState:
    """What the last full save found, to re-read the next saves cheaply (module docstring).

    Made by :meth:`build` after a full save; :meth:`refresh` gives the next save's tensors
    and encoded skeleton, or None when a full save is needed.
    """

    top: tuple[tuple[str, Any], ...]
    nodes: Any
    flat: Flat
    fresh: list[tuple[int, int]]
    template: list[bytes]
    optimizers: tuple[int, ...]
    given: Any
    saves: int = 0

    @classmethod
    def build(
        cls,
        state: Mapping[str, Any],
        sds: list[tuple[str, Any]],
        whole: Flat,
        flat: Flat,
        optimizers: list[torch.optim.Optimizer],
        given: Any,
    ) -> SteadyState | None:
        """Remember a full save: ``sds`` what it read (:func:`state_dicts`), ``whole`` its
        flattening, ``flat`` what it saved (this replica's share), ``given`` its
        ``replicated_over``. None if the state has no structure worth remembering."""
        owned = optimizer_storage_ptrs(optimizers)
        kept = {id(t): j for j, t in enumerate(flat.tensors)}
        fresh: list[tuple[int, int]] = []
        """(index in ``whole``, index in ``flat``) of the tensors taken anew each save."""
        counter = iter(range(len(whole.tensors)))

        def node(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                i = next(counter)
                j = kept.get(id(whole.tensors[i]))
                if j is None or storage_ptr(obj) in owned:  # sliced, or the optimizer's
                    return (_STRICT, _strict_key(obj))
                fresh.append((i, j))
                return (_FRESH, _fresh_key(obj))
            if type(obj) in (dict, list, tuple) or isinstance(obj, Mapping):
                vals = list(obj.values()) if isinstance(obj, Mapping) else list(obj)
                kids = tuple(node(v) for v in vals)
                if any(k[0] != _PLAIN for k in kids):
                    if isinstance(obj, Mapping):
                        return (_DICT, type(obj), tuple(obj), kids)
                    return (_LIST if type(obj) is list else _TUPLE, len(obj), kids)
            return (_PLAIN,)

        plains = iter(range(1 << 62))

        def mark(obj: Any, n: Any) -> Any:
            """The skeleton of ``obj`` with each plain subtree replaced by its sentinel, in
            the order a depth-first walk (and the encoding) meets them."""
            if n[0] == _PLAIN:
                return f"{_SENTINEL}{next(plains)}@@"
            if n[0] in (_STRICT, _FRESH):
                return (TENSOR_MARK, 0)  # _mark_like keeps the saved skeleton's mark
            if n[0] == _DICT:
                return {k: mark(v, c) for (k, v), c in zip(obj.items(), n[3], strict=True)}
            seq = [mark(v, c) for v, c in zip(obj, n[2], strict=True)]
            return seq if n[0] == _LIST else tuple(seq)

        top = tuple((k, state[k]) for k, _ in sds)
        nodes = tuple(node(sd) for _, sd in sds)
        if next(counter, None) is not None or not nodes:
            return None  # the walk and the flattening disagree: never guess
        marked = {key: mark(sd, n) for (key, sd), n in zip(sds, nodes, strict=True)}
        count = next(plains)
        skeleton = _mark_like(flat.skeleton, marked)
        text = encode_skeleton(skeleton)
        template = _split(text, count)
        if template is None:
            return None
        return cls(top, nodes, flat, fresh, template, _optimizer_counts(optimizers), given)

    def refresh(
        self,
        state: Mapping[str, Any],
        sds: list[tuple[str, Any]],
        optimizers: list[torch.optim.Optimizer],
        given: Any,
    ) -> tuple[Flat, bytes] | None:
        """The next save of ``state`` (``sds``: what it reads, :func:`state_dicts`): this
        replica's tensors (as a full save would have them) and the encoded skeleton; None
        when the structure differs (the save walks the state in full)."""
        self.saves += 1
        if self.saves >= FULL_EVERY or given is not self.given:
            return None
        top = self.top
        if len(state) != len(top):
            return None
        for (k, v), (k0, v0) in zip(state.items(), top, strict=True):
            if k != k0 or v is not v0:
                return None
        if _optimizer_counts(optimizers) != self.optimizers:
            return None
        found: list[torch.Tensor] = []
        plains: list[bytes] = []
        for (_, sd), n in zip(sds, self.nodes, strict=True):
            if not _check(sd, n, found, plains):
                return None
        tensors = list(self.flat.tensors)
        for (_, j), t in zip(self.fresh, found, strict=True):
            tensors[j] = t
        out = [self.template[0]]
        for p, rest in zip(plains, self.template[1:], strict=True):
            out.append(p)
            out.append(rest)
        f = self.flat
        return Flat(tensors, f.names, f.skeleton, f.chunks, f.replica_groups), b"".join(out)


def _check(obj: Any, n: Any, fresh: list[torch.Tensor], plains: list[bytes]) -> bool:
    """Whether ``obj`` has the structure of node ``n``; collects the fresh tensors and the
    encodings of the plain subtrees, in order (the hot loop of a steady-state save)."""
    kind = n[0]
    if kind == _DICT:
        if type(obj) is not n[1] or tuple(obj) != n[2]:
            return False
        children: Any = obj.values()
        kids = n[3]
    elif kind == _LIST or kind == _TUPLE:
        if type(obj) is not (list if kind == _LIST else tuple) or len(obj) != n[1]:
            return False
        children, kids = obj, n[2]
    else:
        return _leaf(obj, n, fresh, plains)
    for v, c in zip(children, kids, strict=True):
        k = c[0]
        if k == _STRICT:
            if type(v) is _TENSOR:  # inlined _strict_key: most leaves are plain tensors
                if (v.data_ptr(), v.stride(), v.shape, v.dtype, v.is_cuda) != c[1]:
                    return False
            elif not isinstance(v, _TENSOR) or _strict_key(v) != c[1]:
                return False
        elif not _check(v, c, fresh, plains):
            return False
    return True


def _leaf(obj: Any, n: Any, fresh: list[torch.Tensor], plains: list[bytes]) -> bool:
    kind = n[0]
    if kind == _STRICT:
        return isinstance(obj, _TENSOR) and _strict_key(obj) == n[1]
    if kind == _FRESH:
        if not isinstance(obj, _TENSOR) or _fresh_key(obj) != n[1]:
            return False
        fresh.append(_local(obj))
        return True
    if isinstance(obj, _TENSOR):  # a plain subtree
        return False
    try:
        plains.append(encode_skeleton(obj))
    except ValueError:
        return False  # e.g. a tensor inside now, or an object: the full save says why
    return True


def _mark_like(saved: Any, marked: Any) -> Any:
    """The saved skeleton (this replica's: its tensor marks) with the plain subtrees replaced
    by the sentinels of ``marked`` (the same structure, from the whole state)."""
    if isinstance(marked, str) and marked.startswith(_SENTINEL):
        return marked
    if isinstance(marked, dict) and isinstance(saved, dict):
        out = dict(saved)  # keys only the saved skeleton has (the replica table) stay
        for k, v in marked.items():
            out[k] = _mark_like(saved[k], v)
        return out
    if isinstance(marked, (list, tuple)) and type(saved) is type(marked):
        if len(marked) == 2 and marked[0] == TENSOR_MARK:
            return saved  # a tensor's mark as the saved skeleton has it
        seq = [_mark_like(s, m) for s, m in zip(saved, marked, strict=True)]
        return seq if isinstance(saved, list) else tuple(seq)
    return saved


def _split(text: bytes, count: int) -> list[bytes] | None:
    """``text`` cut at each plain subtree's sentinel (in order); None if one is missing."""
    parts = []
    rest = text
    for k in range(count):
        mark = f'"{_SENTINEL}{k}@@"'.encode()
        head, sep, rest = rest.partition(mark)
        if not sep:
            return None
        parts.append(head)
    parts.append(rest)
    return parts
