"""Hook tables and removable handles.

Every registration returns a `RemovableHandle` holding a unique id and a *weak* reference to its table,
so `remove()` deletes exactly that hook and a removed hook (with its closure) is not kept alive.
Order, as PyTorch documents it: tensor hooks -> node pre-hooks -> retain_grad -> the node -> node
post-hooks; post-accumulate-grad hooks after a leaf's `.grad` is updated. Within a kind: registration order.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._tensor import Tensor

_ids = itertools.count()


class HookTable(dict):  # type: ignore[type-arg]
    """An ordered id -> hook table that handles can refer to weakly."""

    __slots__ = ("__weakref__",)


class RemovableHandle:
    """Removes one registered hook. Also a context manager that removes it on exit."""

    __slots__ = ("_leaf", "_table", "id")

    def __init__(self, table: HookTable, leaf: Any = None) -> None:
        self.id = next(_ids)
        self._table = weakref.ref(table)
        # hooks on a leaf are owned by the leaf's owner actor: removal goes through it (see _registry)
        self._leaf = None if leaf is None else weakref.ref(leaf)

    def remove(self) -> None:
        """Remove exactly this hook (a no-op if it is already gone)."""
        table = self._table()
        if table is None:
            return
        leaf = None if self._leaf is None else self._leaf()
        if leaf is None:
            table.pop(self.id, None)
        else:
            from ._registry import remove_leaf_hook

            remove_leaf_hook(leaf, table, self.id)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        alive = self._table() is not None and self.id in self._table()  # type: ignore[operator]
        return f"<RemovableHandle id={self.id} {'active' if alive else 'removed'}>"


def add_hook(table: HookTable, fn: Callable[..., Any], leaf: Any = None) -> RemovableHandle:
    if not callable(fn):
        raise TypeError(f"a hook must be callable, got {type(fn).__name__}")
    h = RemovableHandle(table, leaf)
    if leaf is None:
        table[h.id] = fn
    else:
        from ._registry import register_leaf_hook

        register_leaf_hook(leaf, table, h.id, fn)
    return h


def _check_rg(t: Tensor, what: str) -> None:
    if not t._rg:
        raise RuntimeError(
            f"cannot register a {what} on a tensor that doesn't require gradient; call .requires_grad_() first"
        )


def tensor_register_hook(t: Tensor, fn: Callable[..., Any]) -> RemovableHandle:
    _check_rg(t, "hook")
    node = t._grad_fn
    if node is None:
        if t._hooks is None:
            t._hooks = HookTable()
        return add_hook(t._hooks, fn, t)
    # a non-leaf's hooks run on the gradient arriving at its grad_fn, for its output slot
    node._hooked = True
    if node._tensor_pre_hooks is None:
        node._tensor_pre_hooks = {}
    table = node._tensor_pre_hooks.get(t._out_nr)
    if table is None:
        table = node._tensor_pre_hooks[t._out_nr] = HookTable()
    return add_hook(table, fn)


def tensor_register_post_accumulate_hook(t: Tensor, fn: Callable[..., Any]) -> RemovableHandle:
    if t._grad_fn is not None:
        raise RuntimeError(
            "post accumulate grad hooks cannot be registered on non-leaf tensors (they have no .grad to "
            "accumulate into); use register_hook instead"
        )
    _check_rg(t, "post accumulate grad hook")
    if t._post_hooks is None:
        t._post_hooks = HookTable()
    return add_hook(t._post_hooks, fn, t)


def tensor_retain_grad(t: Tensor) -> None:
    node = t._grad_fn
    node._hooked = True
    if node._retained is None:
        node._retained = {}
    node._retained[t._out_nr] = weakref.ref(t)
