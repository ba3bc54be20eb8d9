"""The `Optimizer` base: parameter groups, per-parameter state, ``zero_grad`` and state dicts.

``step()`` is a plain method: it only queues work. Each parameter is updated by ONE fused in-place
kernel on the calling task's stream, ordered after the work that produced its gradient (the backward
that the caller awaited) and before any later op that reads the parameter. Updates write into the
parameter's own array, so its memory layout (strides) never changes; state tensors (momentum buffers,
moment estimates) are allocated with the parameter's layout (`asyncgrad.runtime.empty_like_contract`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor, capture_active, empty_like_contract, inplace, no_grad, zero_grads
from ._port_common import ADAM_FAMILY_CHECKS, adam_family_hypers, check_hyper

__all__ = ["AdamFamily", "Optimizer", "count_step", "fused_update", "state_like"]


class _Required:
    def __repr__(self) -> str:
        return "<required parameter>"


required: Any = _Required()


def state_like(p: Tensor) -> Tensor:
    """An uninitialised state tensor with ``p``'s shape, dtype, device and memory layout.

    Reads only ``p``'s shape and strides (never waits for pending work on ``p``).
    """
    arr = p._data if p._data is not None else p._value()
    return Tensor._wrap(empty_like_contract(arr), p._dev)


def count_step(p: Tensor, state: dict[str, Any], *tensors: str, **scalars: float) -> bool:
    """Count one step in a parameter's ``state``; on its first, create ``state["step"]``, the ``scalars``
    and the state ``tensors`` (uninitialised, with ``p``'s layout: the update kernel fills them).

    Returns:
        Whether this is the parameter's first step (the kernel must then fill the new tensors).
    """
    first = "step" not in state
    if first:
        state["step"] = 0
        state.update(scalars)
        for name in tensors:
            state[name] = state_like(p)
    state["step"] += 1
    return first


def fused_update(p: Tensor, fn: Callable[..., None], *others: Any) -> None:
    """Queue ``fn(p_array, *other_arrays)`` as one in-place kernel on the calling task's stream.

    The kernel runs after the pending work on ``p`` and on every Tensor in ``others``. Tensors in
    ``others`` may be written by ``fn`` too (optimizer state) or only read (the gradient): both are
    marked pending until the kernel completes, so a later reader waits for the update and a later
    writer (``zero_()`` on the gradient, the next backward) cannot overtake the read.
    """
    inplace(p, fn, *others)
    s, seq = p._stream, p._seq
    if s is None:
        return
    for o in others:
        if isinstance(o, Tensor):
            o._stream = s
            o._seq = seq


class Optimizer:
    """Base class of optimizers (PyTorch's ``torch.optim.Optimizer`` API).

    Args:
        params: An iterable of Tensors, of ``(name, Tensor)`` pairs (``module.named_parameters()``; the
            names are kept in the group's ``"param_names"``), or of dicts defining parameter groups (each
            with a ``"params"`` entry, of Tensors or of pairs, and optional per-group hyper-parameters).
        defaults: Default hyper-parameters for groups that do not set them.
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        # as PyTorch's: ``self.state[p]`` is a new dict for a parameter seen for the first time
        self.state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        if isinstance(params, Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, "
                "but got a Tensor"
            )
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            self.add_param_group(g)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for k in sorted(g):
                if k != "params":
                    lines.append(f"    {k}: {g[k]}")
        lines.append(")")
        return "\n".join(lines)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters (with optional hyper-parameters) to optimize."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        ps = group.get("params")
        if isinstance(ps, Tensor):
            ps = [ps]
        elif isinstance(ps, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, not sets")
        ps = list(ps) if ps is not None else []
        # named parameters, as PyTorch 2 takes them: (name, tensor) pairs; names go to "param_names"
        names = [q[0] for q in ps if isinstance(q, tuple)]
        if names:
            if len(names) != len(ps):
                raise ValueError("all optimizer params should be with/without names. Some param names are missing")
            ps = [q[1] for q in ps]
            group["param_names"] = names
        for g in self.param_groups:
            if ("param_names" in group) != ("param_names" in g):
                which = "with names" if "param_names" in group else "without names"
                raise ValueError(
                    "all optimizer param groups should be with/without names. "
                    f"cannot add param group {which} to the optimizer"
                )
        for p in ps:
            if not isinstance(p, Tensor):
                raise TypeError(
                    f"optimizer can only optimize Tensors, but one of the params is {type(p).__name__}"
                )
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
        group["params"] = ps
        for k, v in self.defaults.items():
            if v is required and k not in group:
                raise ValueError(
                    f"parameter group didn't specify a value of required optimization parameter {k}"
                )
            group.setdefault(k, v)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in ps}) != len(ps):
            raise ValueError("optimizer contains a parameter group with duplicate parameters")
        if any(id(p) in seen for p in ps):
            raise ValueError("some parameters appear in more than one parameter group")
        self._check_group(group)
        self.param_groups.append(group)

    # PyTorch's checks of a group's hyper-parameters, in its order: (key, name in the error) of those that
    # must be >= 0, "betas" for the Adam family's pair (see `check_hyper`); subclasses add other checks
    _hyper_checks: tuple[tuple[str, str], ...] = ()

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate a group's hyper-parameters (`_hyper_checks`; subclasses override for other checks)."""
        check_hyper(group, self._hyper_checks)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all optimized parameters.

        Args:
            set_to_none: Set ``.grad`` to None (default) instead of filling it with zeros in stream order.
        """
        zero_grads((p for g in self.param_groups for p in g["params"]), set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Queue one update of every parameter that has a gradient (see the module docstring).

        Args:
            closure: Optional plain callable that re-evaluates the model and returns the loss; it runs
                before the update. (A closure that awaits ``backward()`` cannot be used here: call it
                yourself, then ``step()``.)

        Returns:
            The closure's loss, or None.
        """
        rec = capture_active()
        if rec is not None:  # a compiled step records: it replays this step's kernels, re-made each call
            return rec.host_segment(self, closure, self._step)
        return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            loss = closure()
            if hasattr(loss, "__await__"):
                raise TypeError(
                    "step(closure): the closure returned an awaitable; await your closure first, "
                    "then call step()"
                )
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                self._update(p, g, group, self.state[p])
        return loss

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _capture_replay_key(self) -> Any:
        """None: a compiled step's replay re-runs `step` every time to re-make its kernels (their constants can
        depend on Python state the step advances, e.g. a step count). An optimizer whose step advances no
        Python state of its own once its state exists returns what its kernels depend on besides
        `_capture_guard` (its hyperparameters): while that compares equal, the replay reuses the kernels the
        last re-run made, without running `step` again."""
        return None

    def _capture_guard(self) -> tuple[Any, ...]:
        """What a compiled step's replay of `step` depends on: each parameter, whether it has a ``.grad``,
        its state's keys (a first step creates state, so it is recorded again) and which tensors its state
        holds (a loaded state dict puts other ones there: the program reads the recorded ones)."""
        st = self.state
        return tuple(
            (id(p), p._grad is None,
             tuple((k, id(v)) if isinstance(v, Tensor) else k for k, v in st[p].items()) if p in st else ())
            for group in self.param_groups
            for p in group["params"]
        )

    # ---- state dicts ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters and state, with parameters replaced by their index (PyTorch's layout).

        Returns:
            ``{"state": {index: {name: numpy array or number}}, "param_groups": [{..., "params": [index]}]}``;
            arrays are copies, taken after the queued updates have run.
        """
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            ids = []
            for p in g["params"]:
                if id(p) not in index:
                    index[id(p)] = len(index)
                ids.append(index[id(p)])
            packed["params"] = ids
            groups.append(packed)
        state: dict[int, dict[str, Any]] = {}
        for p, st in self.state.items():
            if id(p) not in index or not st:
                continue
            state[index[id(p)]] = {
                k: (np.array(v.numpy(), copy=True) if isinstance(v, Tensor) else v) for k, v in st.items()
            }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict produced by `state_dict` (state tensors get their parameter's layout).

        Raises:
            ValueError: If the number of groups or of parameters per group differs, or a state array's
                shape does not match its parameter.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, "
                f"the optimizer has {len(self.param_groups)}"
            )
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict contains a parameter group ({i}) that doesn't match the size of the "
                    f"optimizer's group: {len(sg['params'])} vs {len(g['params'])} parameters"
                )
        id_map: dict[Any, Tensor] = {}
        for g, sg in zip(self.param_groups, saved_groups):
            for p, idx in zip(g["params"], sg["params"]):
                id_map[idx] = p
        new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for idx, st in state_dict["state"].items():
            p = id_map.get(idx)
            if p is None:
                p = id_map.get(int(idx)) if isinstance(idx, str) and idx.isdigit() else None
            if p is None:
                continue
            ns: dict[str, Any] = {}
            for k, v in st.items():
                if v is None:
                    ns[k] = None
                elif k in _TENSOR_KEYS or (isinstance(v, (np.ndarray, Tensor)) and np.ndim(v) > 0):
                    arr = v.numpy() if isinstance(v, Tensor) else np.asarray(v)
                    if tuple(arr.shape) != tuple(p.shape):
                        raise ValueError(
                            f"state {k!r} of parameter {idx} has shape {tuple(arr.shape)}, "
                            f"the parameter has {tuple(p.shape)}"
                        )
                    t = state_like(p)
                    src = np.array(arr, dtype=p.dtype, copy=True)
                    with no_grad():
                        t.copy_(src)
                    ns[k] = t
                else:
                    ns[k] = (
                        v.item()
                        if isinstance(v, np.generic) or (isinstance(v, np.ndarray) and v.ndim == 0)
                        else v
                    )
            new_state[p] = ns
        self.state = new_state
        for g, sg in zip(self.param_groups, saved_groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v


_TENSOR_KEYS = frozenset(
    {"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "grad_avg", "sum",
     "acc_delta", "exp_inf", "ax", "prev", "step_size"}
)


class AdamFamily(Optimizer):
    """The base of the Adam family (`Adam`, `AdamW`, `Adamax`, `NAdam`, `RAdam`): PyTorch's checks of
    ``lr``, ``eps``, ``betas`` and ``weight_decay`` (in its order), and the bookkeeping each of their
    updates starts with (`_begin_step`)."""

    _hyper_checks: tuple[tuple[str, str], ...] = ADAM_FAMILY_CHECKS

    @staticmethod
    def _begin_step(
        p: Tensor, group: dict[str, Any], state: dict[str, Any], *tensors: str, **scalars: float
    ) -> tuple[bool, tuple[float, float, float, float, float, bool]]:
        """Count one step of ``p`` (on its first, create the state ``tensors`` and ``scalars``: see
        `count_step`).

        Returns:
            Whether this is the parameter's first step, and the group's ``(lr, eps, beta1, beta2,
            weight_decay, maximize)`` as the update kernel uses them.
        """
        return count_step(p, state, *tensors, **scalars), adam_family_hypers(group)
