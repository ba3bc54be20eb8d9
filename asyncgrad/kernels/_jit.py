"""Lazy numba compilation: kernels are plain Python at import and compile on their first call.

A family module writes its loop kernels as plain functions and registers them with ``@K.register``; it
calls them as ``K.name(...)``. The first call imports numba (not ``import asyncgrad``: numba's import
alone takes a few hundred ms), compiles the function with ``nogil=True`` (two lanes run two kernels at
once) and ``cache=True`` into a cache directory of the user's, never the installed package's, and rebinds
``K.name`` to the compiled dispatcher, so later calls pay numba's dispatch only.

``ASYNCGRAD_JIT=0``, or numba not installed, selects the numpy twins (``ENABLED`` is False); the twins
are the reference each compiled kernel is tested against.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENV = "ASYNCGRAD_JIT"


def _enabled() -> bool:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return importlib.util.find_spec("numba") is not None


ENABLED: bool = _enabled()


def cache_dir() -> Path:
    """Where compiled kernels are cached: ``$ASYNCGRAD_CACHE_DIR``, else the user's cache directory
    (``$XDG_CACHE_HOME`` or ``~/.cache``) under ``asyncgrad/numba``."""
    base = os.environ.get("ASYNCGRAD_CACHE_DIR")
    if base:
        return Path(base) / "numba"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg if xdg else Path.home() / ".cache") / "asyncgrad" / "numba"


_numba: Any = None
_import_lock = threading.Lock()


@contextlib.contextmanager
def _compile_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock file of kernel ``name`` in the cache directory for its first call.

    Processes that start together on a cold cache (a population's workers, pytest-xdist's) would each
    compile every kernel; with the lock, one compiles and writes the cache while the others wait, then load
    it. Only a kernel's first call in a process takes it. An unwritable cache directory means no lock (each
    process compiles, as numba alone would)."""
    try:
        d = cache_dir() / "locks"
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def _import_numba() -> Any:
    global _numba
    with _import_lock:
        if _numba is None:
            if "numba" not in sys.modules and not os.environ.get("NUMBA_CACHE_DIR"):
                # numba reads its cache directory when it is imported; a user's own setting wins
                os.environ["NUMBA_CACHE_DIR"] = str(cache_dir())
            import numba

            config: Any = numba.config
            if not config.CACHE_DIR:
                config.CACHE_DIR = str(cache_dir())
            _numba = numba
    return _numba


class Kernels:
    """The namespace of the compiled kernels: ``K.name`` is a stub until its first call, then numba's
    dispatcher (an attribute lookup and numba's argument typing per call, no lock)."""

    def __init__(self) -> None:
        self._sources: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self.compiled: list[str] = []  # names compiled in this process, in order (for tests and statistics)

    def register(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``fn`` (plain Python numba can compile) as ``K.<its name>``; returns ``fn`` unchanged."""
        name = fn.__name__
        if name in self._sources:
            raise ValueError(f"kernel {name!r} is registered twice")
        self._sources[name] = fn

        def first_call(*args: Any) -> Any:
            disp = self.compile(name)
            with _compile_lock(name):
                return disp(*args)  # numba compiles (or loads from the cache) on this first call

        first_call.__name__ = f"{name}_uncompiled"
        setattr(self, name, first_call)
        return fn

    def compile(self, name: str) -> Any:
        """Compile kernel ``name`` now (or return it compiled); later ``K.name`` calls go straight to it."""
        with self._lock:
            if name in self.compiled:
                return getattr(self, name)
            if not ENABLED:
                raise RuntimeError(
                    f"kernel {name}: compiled kernels are off ({ENV}=0 or numba is not installed); "
                    "this call should have taken the numpy twin"
                )
            numba = _import_numba()
            # error_model="numpy": a division by zero gives inf/nan as numpy does, and no exception check
            disp = numba.njit(nogil=True, cache=True, error_model="numpy")(self._sources[name])
            setattr(self, name, disp)
            self.compiled.append(name)
            return disp

    def names(self) -> list[str]:
        return sorted(self._sources)

    def __getattr__(self, name: str) -> Any:
        # only for names never registered (a registered kernel is an instance attribute)
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"no compiled kernel named {name!r}; registered: {', '.join(self.names())}")


K = Kernels()
