"""Committing gradients computed elsewhere: fold them into `.grad` now, then run post-accumulate hooks.

For a layer that stages leaf gradients itself and commits them later, outside any local pass (the
distributed backward: a worker stages its parameters' gradients during the pass and commits them when
the trainer says the whole pass succeeded). It folds as a local pass's leaf owner does: under the layout
contract (a gradient nobody else holds is stolen, no copy), then the leaves' post-accumulate-grad hooks
in staging order; a hook that raises puts every `.grad` of the commit back as it was and re-raises. The
tensor hooks (``register_hook``) of the leaves already ran when the gradients were computed (`grad`
runs them on its targets), as in a local pass's prepare phase.
"""

from __future__ import annotations

import sys
from typing import Any

from ..devices import private_base
from ..runtime import Tensor, current_runtime
from ._accumulate import accumulate, submit_steals, undo, undo_record
from ._hooks import run_post_accumulate_hooks


def commit_gradients(entries: list[list[Any]]) -> list[Tensor]:
    """Fold each ``[leaf, gradient]`` of ``entries`` into ``leaf.grad``, then run post-accumulate hooks.

    Plain (not async): it runs in order with whatever the caller does next. ``entries`` is consumed (each
    entry is cleared, so a gradient held nowhere else can be stolen rather than copied).

    Args:
        entries: ``[leaf, gradient]`` pairs, in the order the gradients were produced.

    Returns:
        The leaves whose ``.grad`` was None before (it now holds this commit's gradient alone: the
        gradient itself when stolen, else a copy).

    Raises:
        Exception: what a post-accumulate-grad hook raised; every ``.grad`` is then as it was before.
    """
    rt = current_runtime()
    records: list[Any] = []
    post: list[Tensor] = []
    fresh: list[Tensor] = []
    batches: dict[Any, list[Any]] = {}
    try:
        try:
            while entries:
                entry = entries.pop(0)
                leaf, g = entry
                entry.clear()
                was_none = leaf._grad is None
                arr = g._data
                unique: bool | None
                if arr is not None:  # the references: `g` here, getrefcount's argument (and g's own to arr)
                    unique = sys.getrefcount(g) == 2 and sys.getrefcount(arr) == 3 and private_base(arr)
                else:  # still computing: the queued steal-or-copy kernel counts the references
                    unique = None
                del arr
                records.append(undo_record(leaf, g, False))
                accumulate(rt, leaf, g, False, unique, batches)
                if was_none:
                    fresh.append(leaf)
                g = None
                if leaf._post_hooks:
                    post.append(leaf)
        finally:
            submit_steals(batches)
        run_post_accumulate_hooks(post, "this commit")
    except Exception:
        undo(records)
        raise
    return fresh
