"""Running hooks during a pass: tensor hooks, node pre- and post-hooks, and checking what they return.

Order, as PyTorch documents it: tensor hooks -> node pre-hooks -> retain_grad -> the node -> node
post-hooks; post-accumulate-grad hooks after a leaf's `.grad` is updated (by its owner, `_leaf_owner`).
"""

from __future__ import annotations

from typing import Any

from ..runtime import Node, Tensor
from ._run_node import BackwardError, note_failure


def call_hook(fn: Any, node: Node | None, arg: Any) -> Any:
    """Call a tensor hook or a node pre-hook; an exception it raises propagates as itself, with a note."""
    try:
        return fn(arg)
    except Exception as e:
        if node is not None:
            note_failure(e, f"raised in a hook on {node.name()}")
        else:
            note_failure(e, f"raised in a hook on a leaf tensor of shape {arg._shape}")
        raise



def check_hook_grad(node: Node | None, old: Tensor, new: Any) -> Tensor:
    if not isinstance(new, Tensor) or new._shape != old._shape:
        where = node.name() if node is not None else "a leaf tensor"
        got = new._shape if isinstance(new, Tensor) else type(new).__name__
        # PyTorch: a TypeError for a non-Tensor, a RuntimeError for a wrong size
        err = BackwardError if isinstance(new, Tensor) else TypeError
        raise err(
            f"a hook on {where} returned {got} but the gradient has shape {old._shape}; "
            "a hook must return None or a Tensor of the same shape"
        )
    return new



def run_post_hooks(node: Node, gins: list[Any], gouts: list[Any]) -> list[Any]:
    # hooks see one gradient per tensor input, as in PyTorch (Python numbers are not inputs there)
    pos = node.tensor_positions()
    full = gins
    gins = [full[i] for i in pos]
    for fn in list(node._post_hooks.values()):
        try:
            r = fn(tuple(gins), tuple(gouts))
        except Exception as e:
            note_failure(e, f"raised in a hook on {node.name()}")
            raise
        if r is not None:
            gins = check_hook_grads(node, "hook", gins, r)
    full = list(full)
    for i, g in zip(pos, gins):
        full[i] = g
    return full



def run_post_accumulate_hooks(leaves: list[Tensor], what: str) -> None:
    """Run each leaf's post-accumulate-grad hooks in turn; the first to raise is noted and re-raised (the
    caller then undoes the .grad writes of ``what``: "this backward pass", "this commit")."""
    for leaf in leaves:
        for fn in list(leaf._post_hooks.values()):
            try:
                fn(leaf)
            except Exception as e:
                note_failure(
                    e,
                    f"raised in a post-accumulate-grad hook on a leaf tensor of shape {leaf._shape}; "
                    f"every .grad {what} had written was put back as it was",
                )
                raise


def check_hook_grads(node: Node, kind: str, old: list[Any], new: Any) -> list[Any]:
    """A node hook must return one Tensor (or None) per gradient, each of the old one's shape."""
    new = list(new) if isinstance(new, (tuple, list)) else [new]
    if len(new) != len(old):
        raise BackwardError(
            f"a {kind} on {node.name()} returned {len(new)} gradients, expected {len(old)}"
        )
    for o, n in zip(old, new):
        if n is None:
            continue
        if not isinstance(n, Tensor) or (o is not None and n._shape != o._shape):
            got = n._shape if isinstance(n, Tensor) else type(n).__name__
            want = o._shape if o is not None else "a Tensor"
            raise BackwardError(
                f"a {kind} on {node.name()} returned {got} where a gradient of shape {want} was expected; "
                "return None or Tensors of the same shapes"
            )
    return new


def run_pre_hooks(task: Any, node: Node, gouts: list[Any]) -> list[Any]:
    """What runs before ``node`` in pass ``task``, in PyTorch's order: tensor hooks, then retain_grad and node
    pre-hooks; then the pass captures the gradients of its `grad()` inputs that are non-leaves."""
    tph = node._tensor_pre_hooks
    if tph:
        for nr, table in tph.items():
            for fn in list(table.values()):
                r = call_hook(fn, node, gouts[nr])
                if r is not None:
                    gouts[nr] = check_hook_grad(node, gouts[nr], r)
    if node._retained:
        for nr, ref in node._retained.items():
            t = ref()
            if t is not None and gouts[nr] is not None:
                if task.retained is None:
                    task.retained = []
                task.retained.append((t, gouts[nr]))
    if node._pre_hooks:
        for fn in list(node._pre_hooks.values()):
            r = call_hook(fn, node, tuple(gouts))
            if r is not None:
                gouts = check_hook_grads(node, "pre-hook", gouts, r)
    if task.targets is not None:
        for nr in range(len(gouts)):
            if (node, nr) in task.targets and gouts[nr] is not None:
                if task.capture is None:
                    task.capture = {}
                task.capture[(node, nr)] = gouts[nr]
    return gouts
