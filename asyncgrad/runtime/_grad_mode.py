"""Grad modes, scoped per trio task with a context variable (each task runs in its own context copy)."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

_grad_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("asyncgrad_grad_enabled", default=True)

F = TypeVar("F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    """Whether operations in the current task record a graph."""
    return _grad_enabled.get()


class _GradMode:
    __slots__ = ("_more", "_prev")
    _flag: bool

    def __init__(self) -> None:
        # the mode to restore on exit of the innermost open `with` (a bool: no token object per `with`,
        # which a deep reentrant chain would keep per level), and a list of the outer ones only when the
        # same instance is entered again before it exits
        self._prev: bool | None = None
        self._more: list[bool] | None = None

    def _push(self, prev: bool) -> None:
        if self._prev is not None:
            if self._more is None:
                self._more = []
            self._more.append(self._prev)
        self._prev = prev

    def _pop(self) -> bool:
        prev = self._prev
        if prev is None:
            raise RuntimeError("a grad mode context was exited more often than it was entered")
        self._prev = self._more.pop() if self._more else None
        return prev

    def __enter__(self) -> None:
        self._push(_grad_enabled.get())
        _grad_enabled.set(self._flag)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        _grad_enabled.set(self._pop())

    def __call__(self, fn: F) -> F:
        import inspect

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*a: Any, **k: Any) -> Any:
                with self.__class__(*self._args()):
                    return await fn(*a, **k)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            with self.__class__(*self._args()):
                return fn(*a, **k)

        return wrapper  # type: ignore[return-value]

    def _args(self) -> tuple[Any, ...]:
        return ()


class _NoArgGradMode(_GradMode):
    """A grad mode that also decorates without parentheses (``@ag.no_grad``), as PyTorch's do."""

    __slots__ = ()

    def __new__(cls, orig_func: Callable[..., Any] | None = None) -> Any:
        if orig_func is None:
            return super().__new__(cls)
        return cls()(orig_func)

    def __init__(self, orig_func: Callable[..., Any] | None = None) -> None:
        super().__init__()


class no_grad(_NoArgGradMode):
    """Context manager (or decorator) that disables graph recording in the current task."""

    __slots__ = ()

    _flag = False


class enable_grad(_NoArgGradMode):
    """Context manager (or decorator) that enables graph recording in the current task."""

    __slots__ = ()

    _flag = True


class inference_mode(_GradMode):
    """``no_grad`` under PyTorch's other name (here they are the same): ``inference_mode(False)`` leaves
    the mode as it is. A context manager or a decorator, with or without parentheses."""

    __slots__ = ("_flag",)

    def __new__(cls, mode: Any = True) -> Any:
        if callable(mode):
            return cls()(mode)
        return super().__new__(cls)

    def __init__(self, mode: Any = True) -> None:
        super().__init__()
        self._flag = not bool(mode)

    def __enter__(self) -> None:
        prev = _grad_enabled.get()
        self._push(prev)
        _grad_enabled.set(self._flag and prev)

    def _args(self) -> tuple[Any, ...]:
        return (not self._flag,)


class set_grad_enabled(_GradMode):
    """Set grad mode on or off. Works as a function call, a context manager, or a decorator.

    Called plainly (``ag.set_grad_enabled(False)``) it changes the mode of the current task at once;
    used with ``with`` it restores the previous mode on exit.
    """

    __slots__ = ("_before", "_flag")

    def __init__(self, mode: bool) -> None:
        super().__init__()
        self._flag = bool(mode)
        self._before = _grad_enabled.get()
        _grad_enabled.set(self._flag)

    # entering (`_GradMode.__enter__`) sets the mode again, which __init__ already set
    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pop()
        _grad_enabled.set(self._before)

    def __call__(self, fn: F) -> F:
        # decorating: the mode set by __init__ is undone, each call of ``fn`` sets it for its duration
        _grad_enabled.set(self._before)
        return super().__call__(fn)

    def _args(self) -> tuple[Any, ...]:
        return (self._flag,)
