"""Registering hooks on tensors: `register_hook`, `register_post_accumulate_grad_hook`, `retain_grad`.

A leaf's hook tables are owned by the leaf's `LeafOwner` (`_leaf_owner`): adding or removing one of its
hooks is a message to that owner, in order with its commits. A non-leaf's hooks live on its grad_fn node,
keyed by its output slot; the engine runs them on the gradient arriving there (`_hooks`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ..runtime import HookTable, RemovableHandle, Tensor, add_hook
from ._leaf_owner import register_leaf_hook, remove_leaf_hook


def _add_leaf_hook(leaf: Tensor, table: HookTable, fn: Callable[..., Any]) -> RemovableHandle:
    """Add ``fn`` to a table of ``leaf``'s through its owner; the handle holds the leaf weakly."""
    ref = weakref.ref(leaf)

    def register(table: HookTable, hook_id: int, fn: Callable[..., Any]) -> None:
        register_leaf_hook(leaf, table, hook_id, fn)

    def remove(table: HookTable, hook_id: int) -> None:
        t = ref()
        if t is None:
            table.pop(hook_id, None)
        else:
            remove_leaf_hook(t, table, hook_id)

    return add_hook(table, fn, register=register, remove=remove)


def _check_rg(t: Tensor, what: str) -> None:
    if not t._rg:
        raise RuntimeError(
            f"cannot register a {what} on a tensor that doesn't require gradient; call .requires_grad_() first"
        )



def register_hook(t: Tensor, fn: Callable[..., Any]) -> RemovableHandle:
    """Call ``hook(grad)`` when the gradient w.r.t. this tensor is computed; it may return a new grad.

    Returns a handle whose ``remove()`` removes exactly this hook.
    """
    _check_rg(t, "hook")
    node = t._grad_fn
    if node is None:
        if t._hooks is None:
            t._hooks = HookTable()
        return _add_leaf_hook(t, t._hooks, fn)
    # a non-leaf's hooks run on the gradient arriving at its grad_fn, for its output slot
    node._hooked = True
    if node._tensor_pre_hooks is None:
        node._tensor_pre_hooks = {}
    table = node._tensor_pre_hooks.get(t._out_nr)
    if table is None:
        table = node._tensor_pre_hooks[t._out_nr] = HookTable()
    return add_hook(table, fn)



def register_post_accumulate_grad_hook(t: Tensor, fn: Callable[..., Any]) -> RemovableHandle:
    """Call ``hook(tensor)`` after `.grad` of this leaf has been updated by a backward pass."""
    if t._grad_fn is not None:
        raise RuntimeError(
            "post accumulate grad hooks cannot be registered on non-leaf tensors (they have no .grad to "
            "accumulate into); use register_hook instead"
        )
    _check_rg(t, "post accumulate grad hook")
    if t._post_hooks is None:
        t._post_hooks = HookTable()
    return _add_leaf_hook(t, t._post_hooks, fn)



def retain_grad(t: Tensor) -> None:
    """Keep `.grad` for this non-leaf tensor after backward."""
    if not t._rg:
        raise RuntimeError(
            "retain_grad() on a tensor that does not require grad: it will never get a gradient; "
            "make the tensors it comes from require grad first"
        )
    node = t._grad_fn
    if node is None or t._retains_grad:
        return
    t._retains_grad = True
    node._hooked = True
    if node._retained is None:
        node._retained = {}
    node._retained[t._out_nr] = weakref.ref(t)
