"""AccumulateGrad under the gradient layout contract (see DESIGN.md and `runtime._layout`).

A dense, non-overlapping parameter gets a `.grad` with its own strides (C, Fortran, channels-last, any
permutation); any other parameter gets a C-contiguous `.grad`. An incoming gradient that already obeys
and has no other owner is stolen; otherwise it is copied into a contract-obeying buffer. Accumulating onto
an existing `.grad` is in place (keeping that tensor's layout), or out of place under create_graph.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..devices import private_base
from ..ops._convert import copy_to_layout
from ..runtime import _capture, _grad_mode
from ..runtime._dispatch import wait_for
from ..runtime._inplace import inplace
from ..runtime._layout import empty_like_contract, obeys_contract
from ..runtime._runtime import current_stream
from ..runtime._tensor import Tensor, is_ready


def accumulate(
    rt: Any, leaf: Any, g: Any, create_graph: bool, unique: bool | None, batches: dict[Any, list[Any]]
) -> None:
    """Fold gradient ``g`` into ``leaf.grad`` following the layout contract (see module docstring).

    ``unique``: nobody but the caller holds ``g`` (so its buffer may be stolen if its layout obeys);
    None when ``g`` is still being computed: the queued steal-or-copy kernel then counts its references.
    When ``g`` is still being computed, the steal-or-copy decision runs as a kernel on the stream, so the
    backward pass never waits for its kernels; such decisions are collected in ``batches`` (per stream)
    and queued as one kernel per stream by `submit_steals`.
    """
    rec = _capture.active
    if rec is not None and rec.wants():  # a compiled step records (`autograd._compile`)
        rec.accumulate(rt, leaf, g, create_graph, unique, batches)
        return
    old = leaf._grad
    if old is None:
        if create_graph and g._rg:
            param = leaf._value()
            if unique and obeys_contract(g._value(), param):
                leaf._grad = g
                rt.grads_stolen += 1
            else:
                leaf._grad = copy_to_layout(g, param)
                rt.grads_copied += 1
            return
        if is_ready(g) and is_ready(leaf):
            garr, param = g._value(), leaf._value()
            if unique and obeys_contract(garr, param):
                leaf._grad = g if g._grad_fn is None else Tensor._wrap(garr, g._dev)
                rt.grads_stolen += 1
            else:
                buf = Tensor._wrap(empty_like_contract(param), leaf._dev)
                leaf._grad = inplace(buf, np.copyto, g)
                rt.grads_copied += 1
            return
        leaf._grad = _steal_or_copy_queued(rt, leaf, g, unique, batches)
        return
    if create_graph or (_grad_mode.is_grad_enabled() and g._rg):
        leaf._grad = old + g
    else:
        inplace(old, _add_into, g)
    rt.grads_accumulated += 1


def undo_record(leaf: Any, g: Any, create_graph: bool) -> tuple[Any, Tensor | None, list[Any] | None]:
    """What `undo` needs to put ``leaf.grad`` back as it is now, before `accumulate` folds ``g`` into it.

    ``.grad`` is kept as an object; when `accumulate` will add into it in place, a copy of its values (in
    its own layout) is taken too, in stream order before the add.
    """
    old = leaf._grad
    if old is None or create_graph or (_grad_mode.is_grad_enabled() and g._rg):
        return (leaf, old, None)  # no .grad yet, or out-of-place accumulation: the old object is untouched
    box: list[Any] = []
    inplace(old, lambda a: box.append(a.copy(order="K")), write=False)  # a read: no version bump
    return (leaf, old, box)


def undo(records: list[tuple[Any, Tensor | None, list[Any] | None]]) -> None:
    """Put every ``.grad`` in ``records`` back: the same tensor object, with its values (and strides) as
    they were when its record was taken, whatever was written into it or into ``.grad`` since."""
    for leaf, old, box in reversed(records):
        if box is not None:
            inplace(old, lambda a, box=box: np.copyto(a, box[0]))  # type: ignore[misc]
        leaf._grad = old


def _steal_or_copy_queued(
    rt: Any, leaf: Any, g: Any, unique: bool | None, batches: dict[Any, list[Any]]
) -> Any:
    # queue it behind g's own kernel, on g's stream: a leaf's owner that got the commit in its own task
    # (not started yet, or busy, when the pass finished) would otherwise take a stream of its own, and every such
    # commit would cost a cross-stream event and a lane blocked on it
    gs = g._stream
    stream = gs if gs is not None and gs.device is leaf._dev else current_stream(leaf._dev)
    wait_for(g, stream)
    wait_for(leaf, stream)
    out = Tensor._pending(leaf._shape, leaf._dtype, leaf._dev, stream)
    batch = batches.get(stream)
    if batch is None:
        batch = batches[stream] = []
    batch.append([rt, leaf, g, out, unique])
    return out


def submit_steals(batches: dict[Any, list[Any]]) -> None:
    """Queue the steal-or-copy decisions collected by `accumulate`: one kernel per stream for all its leaves
    (the `.grad` tensors it fills are pending on it until then)."""
    for stream, items in batches.items():

        def job(items: list[Any] = items) -> None:
            for item in items:
                _steal_or_copy(item)

        seq = stream.submit(job)
        for item in items:
            item[3]._seq = seq
    batches.clear()


def _steal_or_copy(item: list[Any]) -> None:
    rt, leaf, out, unique = item[0], item[1], item[3], item[4]
    g = item[2]
    item.clear()  # g is held by the local `g` alone now (the kernel that computed it has let go of it)
    garr, param = g._data, leaf._data
    steal = unique
    if steal is None:
        # the kernel that computed g has run (stream order) and let go of it: g is held by `g` alone
        # (+ getrefcount's argument), its array by g and `garr`; the kernel marked g if its rule handed one
        # array back for two inputs
        steal = sys.getrefcount(g) == 2 and sys.getrefcount(garr) == 3 and not g.__dict__.get("_aliased", False)
    if steal and private_base(garr) and obeys_contract(garr, param):
        out._data = garr
        rt.grads_stolen += 1
    else:
        buf = empty_like_contract(param)
        np.copyto(buf, garr)
        out._data = buf
        rt.grads_copied += 1


def _add_into(a: np.ndarray, b: np.ndarray) -> None:
    np.add(a, b, out=a, casting="unsafe")
