"""Custom differentiable operations: subclass `Function`, define `forward` and `backward`.

``backward`` may be ``async def``: it can then ``await ag.grad(...)`` or ``await t.backward()`` on another
graph (a reentrant backward) without blocking anything else.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..runtime import _grad_mode
from ..runtime._factories import zeros
from ..runtime._grad_mode import no_grad
from ..runtime._node import Node, edges_of
from ..runtime._runtime import current_stream
from ..runtime._tensor import Tensor


class FunctionCtx:
    """The ``ctx`` passed to `Function.forward` and `Function.backward`."""

    def __init__(self) -> None:
        self._saved: tuple[Tensor | None, ...] = ()
        self._saved_versions: tuple[int, ...] = ()  # the saved tensors' versions when saved
        self._node_name = "Function"  # the node's name, for errors (set when the node is recorded)
        self._freed = False
        self.needs_input_grad: tuple[bool, ...] = ()
        self.materialize_grads = True
        self._non_diff: set[int] | None = None  # ids of outputs marked non-differentiable (made on first use)
        self._dirty: tuple[Tensor, ...] = ()  # inputs forward changed in place (`mark_dirty`)

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        """Save tensors (or None) for `backward`; read them back with `saved_tensors`."""
        for t in tensors:
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(
                    f"save_for_backward can only save tensors or None, got {type(t).__name__}; "
                    "store other values as attributes of ctx"
                )
        self._saved = tensors
        self._saved_versions = tuple(0 if t is None else t._version for t in tensors)

    @property
    def saved_tensors(self) -> tuple[Tensor | None, ...]:
        if self._freed:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or to access saved tensors after they "
                "have been freed). Saved values are freed when you call backward() or grad(); pass "
                "retain_graph=True if you need to backward through the graph a second time."
            )
        for i, (t, was) in enumerate(zip(self._saved, self._saved_versions)):
            if t is not None and t._version != was:
                raise RuntimeError(
                    f"a tensor that {self._node_name} needs for its gradient was modified by an in-place "
                    f"operation: saved tensor {i}, of shape {tuple(t._shape)} and dtype {t._dtype}, is at "
                    f"version {t._version} but was at version {was} when it was saved; use an out-of-place op "
                    "instead of the in-place one, or change a clone() of the tensor in place"
                )
        return self._saved

    def set_materialize_grads(self, value: bool) -> None:
        """If False, undefined output grads reach `backward` as None instead of zeros."""
        self.materialize_grads = bool(value)

    def mark_dirty(self, *tensors: Tensor) -> None:
        """Say that ``forward`` changed these inputs in place (and returns them): each returned one then
        gets this Function's node as its ``grad_fn``, its earlier history feeding the node, as in PyTorch."""
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"mark_dirty takes tensors, got {type(t).__name__}")
        self._dirty = tensors

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        if self._non_diff is None:
            self._non_diff = set()
        self._non_diff.update(id(t) for t in tensors)


class FunctionNode(Node):
    """The backward node of one `Function.apply` call."""

    __slots__ = ("ctx", "fn_cls", "in_shapes", "n_args", "n_outputs", "out_meta")

    def __init__(self, fn_cls: type[Function], ctx: FunctionCtx, args: tuple[Any, ...], stream: Any) -> None:
        self._init_node(stream)
        self.fn_cls = fn_cls
        self.ctx = ctx
        ctx._node_name = self.name()
        self.next, ctx.needs_input_grad = edges_of(args)
        self.n_args = len(args)
        self.in_shapes = tuple(a._shape if isinstance(a, Tensor) else None for a in args)
        # (shape, dtype, device) per output; device None: the node's stream's device (then the entries
        # hold no object the garbage collector tracks, and neither does the tuple)
        self.out_meta: tuple[tuple[tuple[int, ...], Any, Any], ...] = ()
        self.n_outputs = 0

    @property
    def is_async(self) -> bool:  # type: ignore[override]
        return self.fn_cls._backward_is_async

    def name(self) -> str:
        return f"{self.fn_cls.__name__}Backward"

    def tensor_positions(self) -> list[int]:
        return [i for i, shape in enumerate(self.in_shapes) if shape is not None]

    def release(self) -> None:
        self._released = True
        self.ctx._freed = True
        self.ctx._saved = ()

    def prepare_grads(self, gouts: list[Any]) -> list[Any]:
        """The gradients `backward` gets: ``gouts`` itself when none is missing (or none is to be made)."""
        if not self.ctx.materialize_grads:
            return gouts
        for g in gouts:
            if g is None:
                break
        else:
            return gouts
        home = self.stream.device if self.stream is not None else None
        return [
            g if g is not None or dtype is None else zeros(shape, dtype=dtype, device=home if dev is None else dev)
            for g, (shape, dtype, dev) in zip(gouts, self.out_meta)
        ]


class _FunctionMeta(type):
    def __init__(cls, name: str, bases: tuple[type, ...], ns: dict[str, Any]) -> None:
        super().__init__(name, bases, ns)
        for meth in ("forward", "backward"):
            f = ns.get(meth)
            if f is not None and not isinstance(f, (staticmethod, classmethod)):
                # allow plain `def forward(ctx, ...)` like `@staticmethod def forward(ctx, ...)`
                setattr(cls, meth, staticmethod(f))
        cls._backward_is_async = inspect.iscoroutinefunction(getattr(cls, "backward", None))


class Function(metaclass=_FunctionMeta):
    """Base class of custom ops.

    Example::

        class Square(ag.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x

            @staticmethod
            def backward(ctx, g):      # or: async def backward(ctx, g)
                (x,) = ctx.saved_tensors
                return 2 * x * g
    """

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any) -> Any:
        raise NotImplementedError("a Function subclass must define forward(ctx, *args)")

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Any) -> Any:
        raise NotImplementedError("a Function subclass must define backward(ctx, *grads)")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run `forward` without recording its inside, and record one node for the whole call.

        Arguments given by keyword are bound to `forward`'s parameters and count as the positional inputs
        they name (so `backward` returns a gradient, or None, for each of them), as in PyTorch.
        """
        if kwargs:
            args = _bind_positional(cls, args, kwargs)
        ctx = FunctionCtx()
        ctx.needs_input_grad = tuple(isinstance(a, Tensor) and bool(a._rg) for a in args)
        any_rg = any(ctx.needs_input_grad)
        dev = next((a._dev for a in args if isinstance(a, Tensor)), None)
        mode = _grad_mode._grad_enabled
        record = mode.get()
        token = mode.set(False)  # forward runs under no_grad
        try:
            result = cls.forward(ctx, *args)
        finally:
            mode.reset(token)
        single = not isinstance(result, tuple)
        outs = (result,) if single else result
        if record and not any_rg:  # (forward may have made an input require grad)
            any_rg = any(isinstance(a, Tensor) and a._rg for a in args)
        if not (record and any_rg):
            return result
        dirty = ctx._dirty
        if dirty:
            _check_dirty(cls, dirty, args, outs)
        if dev is None:
            dev = next(o._dev for o in outs if isinstance(o, Tensor))
        node = FunctionNode(cls, ctx, args, current_stream(dev))
        home = dev  # the device of the node's stream
        wrapped = []
        meta: list[tuple[tuple[int, ...], Any, Any]] = []
        for i, o in enumerate(outs):
            if not isinstance(o, Tensor):
                wrapped.append(o)
                meta.append(((), None, None))
                continue
            marked = ctx._non_diff is not None and id(o) in ctx._non_diff  # before it may get a new identity
            if any(o is d for d in dirty):
                pass  # changed in place: the input itself, its history rebased onto this node
            elif any(o is a for a in args) or o._grad_fn is not None:
                o = o.detach()  # an input returned as-is: give the output its own identity
            if not marked and o._dtype.kind in "fc":
                o._grad_fn = node
                o._out_nr = i
                o._rg = True
            meta.append((o._shape, o._dtype, None if o._dev is home else o._dev))
            wrapped.append(o)
        node.out_meta = tuple(meta)
        node.n_outputs = len(outs)
        return wrapped[0] if single else tuple(wrapped)


def _check_dirty(cls: type[Function], dirty: tuple[Tensor, ...], args: tuple[Any, ...], outs: tuple[Any, ...]) -> None:
    """PyTorch's rules for `mark_dirty`: only inputs, each returned, none a leaf that requires grad."""
    for t in dirty:
        if not any(t is a for a in args):
            raise RuntimeError(
                f"{cls.__name__}.forward marked a tensor of shape {tuple(t._shape)} dirty that is not one of its "
                "inputs; mark_dirty is for inputs the forward changed in place"
            )
        if not any(t is o for o in outs):
            raise RuntimeError(
                f"{cls.__name__}.forward marked an input of shape {tuple(t._shape)} dirty but did not return it; "
                "some elements marked as dirty during the forward method were not returned as output"
            )
        if t._rg and t._grad_fn is None:
            raise RuntimeError(
                f"{cls.__name__}: a leaf tensor that requires grad (shape {tuple(t._shape)}) is being used in an "
                "in-place operation (mark_dirty); change a clone() of it instead"
            )


def once_differentiable(backward: Any) -> Any:
    """Decorate a `Function`'s ``backward`` that is not itself differentiable (PyTorch's decorator): it
    runs under ``no_grad``, so a double backward through it finds no graph instead of a wrong one."""
    import functools
    import inspect

    if inspect.iscoroutinefunction(backward):

        @functools.wraps(backward)
        async def awrapper(ctx: Any, *grads: Any) -> Any:
            with no_grad():
                return await backward(ctx, *grads)

        return awrapper

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        with no_grad():
            return backward(ctx, *grads)

    return wrapper


def _bind_positional(cls: type[Function], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    import inspect

    try:
        bound = inspect.signature(cls.forward).bind(None, *args, **kwargs)  # None: the ctx slot
    except TypeError as e:
        raise TypeError(f"{cls.__name__}.apply: the arguments do not fit {cls.__name__}.forward: {e}") from None
    if bound.kwargs:
        raise TypeError(
            f"{cls.__name__}.apply: keyword-only arguments {sorted(bound.kwargs)} of forward are not supported; "
            "make them positional-or-keyword parameters"
        )
    return tuple(bound.args[1:])
