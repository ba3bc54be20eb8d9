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
from typing import Any

_ids = itertools.count()


class HookTable(dict):  # type: ignore[type-arg]
    """An ordered id -> hook table that handles can refer to weakly."""

    __slots__ = ("__weakref__",)


class RemovableHandle:
    """Removes one registered hook. Also a context manager that removes it on exit."""

    __slots__ = ("_remove", "_table", "id")

    def __init__(self, table: HookTable, remove: Callable[[HookTable, int], None] | None = None) -> None:
        self.id = next(_ids)
        self._table = weakref.ref(table)
        # a table that an owner actor changes (a leaf's hooks, see `autograd`) is changed through it
        self._remove = remove

    def remove(self) -> None:
        """Remove exactly this hook (a no-op if it is already gone)."""
        table = self._table()
        if table is None:
            return
        if self._remove is None:
            table.pop(self.id, None)
        else:
            self._remove(table, self.id)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        table = self._table()
        alive = table is not None and self.id in table
        return f"<RemovableHandle id={self.id} {'active' if alive else 'removed'}>"


def add_hook(
    table: HookTable,
    fn: Callable[..., Any],
    *,
    register: Callable[[HookTable, int, Callable[..., Any]], None] | None = None,
    remove: Callable[[HookTable, int], None] | None = None,
) -> RemovableHandle:
    """Add ``fn`` to ``table`` (through ``register`` when an owner changes the table); returns its handle."""
    if not callable(fn):
        raise TypeError(f"a hook must be callable, got {type(fn).__name__}")
    h = RemovableHandle(table, remove)
    if register is None:
        table[h.id] = fn
    else:
        register(table, h.id, fn)
    return h
