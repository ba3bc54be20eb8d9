"""`Module` (the base of every layer), `Parameter`, and saving state dicts to ``.npz`` files.

Semantics follow PyTorch's ``torch.nn.Module``: parameters and submodules are found through attribute
assignment, ``state_dict()`` maps dotted names to values, ``load_state_dict()`` copies values back in
place (keeping each parameter's memory layout), and ``__call__`` runs ``forward``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..runtime import (
    HookTable,
    RemovableHandle,
    Tensor,
    add_hook,
    capture_active,
    current_runtime,
    get_default_dtype,
    no_grad,
    zero_grads,
)

__all__ = ["Module", "Parameter", "load_state_dict_file", "save_state_dict"]


class _ParameterMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, Tensor) and bool(getattr(obj, "_is_param", False))


class Parameter(metaclass=_ParameterMeta):
    """A leaf `Tensor` that a `Module` registers as a parameter when assigned as an attribute.

    ``Parameter(t)`` returns a new leaf Tensor sharing ``t``'s value (like PyTorch's), marked as a
    parameter and requiring grad by default. It is a plain `Tensor` (``type(p) is Tensor``, so every
    fast path of the runtime applies); ``isinstance(p, nn.Parameter)`` recognises the mark.

    Args:
        data: A Tensor or anything ``numpy.asarray`` accepts (Python floats become the default dtype).
        requires_grad: Whether the parameter requires grad (default True).
        device: Device for non-Tensor ``data`` (default ``"cpu"``).
    """

    def __new__(cls, data: Any = None, requires_grad: bool = True, device: Any = None) -> Tensor:  # type: ignore[misc]
        if data is None:
            data = np.empty((0,), np.float32)
        if isinstance(data, Tensor):
            arr = data._value()
            dev = data._dev
        else:
            arr = np.asarray(data)
            if arr.dtype == np.float64 and not isinstance(data, np.ndarray):
                arr = arr.astype(get_default_dtype())
            dev = current_runtime("nn.Parameter").device("cpu" if device is None else device)
        p = Tensor._wrap(arr, dev)
        p._is_param = True  # type: ignore[attr-defined]
        if requires_grad:
            p.requires_grad_(True)
        return p


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]

    def __repr__(self) -> str:
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return f"_IncompatibleKeys(missing_keys={self.missing_keys!r}, unexpected_keys={self.unexpected_keys!r})"

    def __str__(self) -> str:
        return self.__repr__()


def _as_numpy(v: Any) -> np.ndarray:
    if isinstance(v, Tensor):
        return v.numpy()
    if hasattr(v, "detach") and hasattr(v, "numpy") and not isinstance(v, np.ndarray):
        # a torch tensor (a parameter from a torch state dict with keep_vars=True requires grad)
        return np.asarray(v.detach().cpu().numpy())
    return np.asarray(v)


def _is_dtype_like(x: Any) -> bool:
    if x is None:
        return False
    if isinstance(x, (np.dtype, type)):
        return True
    return isinstance(x, str) and not x.startswith(("cpu", "cuda"))


class Module:
    """Base class for all neural-network modules.

    Subclasses create parameters and submodules in ``__init__`` (after calling ``super().__init__()``)
    by assigning them as attributes, and define ``forward``. Calling the module runs ``forward``.

    Example::

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(64, 32)
                self.fc2 = nn.Linear(32, 10)

            def forward(self, x):
                return self.fc2(ag.relu(self.fc1(x)))
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", HookTable())
        object.__setattr__(self, "_forward_hooks", HookTable())

    # ---- attribute routing ----------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        if "_parameters" not in d:
            raise AttributeError(
                f"cannot assign {name!r} before Module.__init__() is called; call super().__init__() first"
            )
        params, buffers, modules = d["_parameters"], d["_buffers"], d["_modules"]
        if isinstance(value, Parameter):
            for table in (buffers, modules):
                table.pop(name, None)
            d.pop(name, None)
            params[name] = value
        elif isinstance(value, Module):
            for table in (params, buffers):
                table.pop(name, None)
            d.pop(name, None)
            modules[name] = value
        elif name in params:
            if value is not None:
                raise TypeError(
                    f"cannot assign {type(value).__name__} as parameter {name!r} "
                    "(nn.Parameter or None expected)"
                )
            params[name] = None
        elif name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(
                    f"cannot assign {type(value).__name__} as buffer {name!r} (Tensor or None expected)"
                )
            buffers[name] = value
        elif name in modules:
            if value is not None:
                raise TypeError(
                    f"cannot assign {type(value).__name__} as child module {name!r} (Module or None expected)"
                )
            modules[name] = None
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            t = d.get(table)
            if t is not None and name in t:
                return t[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                self._non_persistent.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        return sorted(
            set(super().__dir__()) | set(self._parameters) | set(self._buffers) | set(self._modules)
        )

    # ---- registration ---------------------------------------------------------------------------

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Add a parameter (or a None placeholder) under ``name``."""
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(
                f"cannot assign {type(param).__name__} as parameter {name!r} (nn.Parameter or None expected)"
            )
        self._check_name(name, "_parameters")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """Add a buffer: state that is not a parameter (e.g. running statistics).

        Args:
            name: Attribute name of the buffer.
            tensor: The buffer (or None).
            persistent: Whether it is part of ``state_dict()``.
        """
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(
                f"cannot assign {type(tensor).__name__} as buffer {name!r} (Tensor or None expected)"
            )
        self._check_name(name, "_buffers")
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        """Add a child module under ``name``."""
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._check_name(name, "_modules")
        self._modules[name] = module

    register_module = add_module

    def _check_name(self, name: str, table: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name should be a string, got {type(name).__name__}")
        if not name or "." in name:
            raise KeyError(f"invalid name {name!r}: a non-empty string without '.' is expected")
        # as PyTorch: re-registering under the same kind replaces; any other attribute (a parameter,
        # buffer or submodule of another kind, an instance or class attribute) is an error
        if hasattr(self, name) and name not in self.__dict__[table]:
            raise KeyError(f"attribute '{name}' already exists")

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f'Module [{type(self).__name__}] is missing the required "forward" function'
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = capture_active()
        if rec is not None:  # a compiled step records: it guards on this module's hooks
            rec.module_called(self, bool(self._forward_pre_hooks or self._forward_hooks))
        if self._forward_pre_hooks:
            for hook in list(self._forward_pre_hooks.values()):
                r = hook(self, args)
                if r is not None:
                    args = r if isinstance(r, tuple) else (r,)
        out = self.forward(*args, **kwargs)
        if self._forward_hooks:
            for hook in list(self._forward_hooks.values()):
                r = hook(self, args, out)
                if r is not None:
                    out = r
        return out

    def register_forward_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(module, args) -> None or new args`` runs before ``forward``; returns a removable handle."""
        return add_hook(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(module, args, output) -> None or new output`` runs after ``forward``; returns a handle."""
        return add_hook(self._forward_hooks, hook)

    # ---- traversal ------------------------------------------------------------------------------

    def named_modules(
        self, memo: set[int] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Module]]:
        """This module and all submodules (depth first) with their dotted names."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is None:
                continue
            sub = f"{prefix}.{name}" if prefix else name
            yield from m.named_modules(memo, sub, remove_duplicate)

    def modules(self) -> Iterator[Module]:
        """This module and all submodules."""
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """Direct submodules with their names."""
        seen: set[int] = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self) -> Iterator[Module]:
        """Direct submodules."""
        for _, m in self.named_children():
            yield m

    def _named_members(
        self, table: str, prefix: str, recurse: bool, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        seen: set[int] = set()
        mods = (
            self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
            if recurse
            else [(prefix, self)]
        )
        for mprefix, m in mods:
            for name, v in getattr(m, table).items():
                if v is None:
                    continue
                if remove_duplicate:
                    if id(v) in seen:
                        continue
                    seen.add(id(v))
                yield (f"{mprefix}.{name}" if mprefix else name), v

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        """Parameters with dotted names (shared parameters are listed once)."""
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)  # type: ignore[misc]

    def parameters(self, recurse: bool = True) -> Iterator[Tensor]:
        """All parameters of this module and (if ``recurse``) its submodules."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        """Buffers with dotted names."""
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        """All buffers."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target: str) -> Module:
        """The submodule at dotted path ``target`` (``""`` is this module)."""
        m: Module = self
        if not target:
            return m
        for part in target.split("."):
            nxt = m._modules.get(part)
            if nxt is None:
                raise AttributeError(f"{type(m).__name__} has no submodule {part!r} (looking up {target!r})")
            m = nxt
        return m

    def apply(self, fn: Callable[[Module], Any]) -> Module:
        """Call ``fn`` on every submodule (children first) and then on this module; returns self."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # ---- modes and gradients --------------------------------------------------------------------

    def train(self, mode: bool = True) -> Module:
        """Set training mode (affects Dropout and similar layers) on this module and all submodules.

        As in PyTorch, this sets ``self.training`` and calls ``child.train(mode)`` on each direct child,
        so a child that overrides ``train`` is respected.
        """
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        object.__setattr__(self, "training", mode)
        for m in self.children():
            m.train(mode)
        return self

    def eval(self) -> Module:
        """Set evaluation mode (``train(False)``)."""
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Set ``requires_grad`` on every parameter."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters.

        Args:
            set_to_none: Set ``.grad`` to None (default) instead of filling it with zeros; zeroing runs
                in stream order, after the work that produced the gradient.
        """
        zero_grads(self.parameters(), set_to_none)

    # ---- devices and dtypes ---------------------------------------------------------------------

    def _convert(self, fn: Callable[[Tensor], Tensor]) -> Module:
        # PyTorch's ``_apply``: a parameter that stays on its device keeps its identity (its value, and
        # its ``.grad``'s, are swapped through ``.data``), so optimizers built earlier still update it;
        # buffers are replaced by the converted tensors
        for m in self.modules():
            for name, p in list(m._parameters.items()):
                if p is None:
                    continue
                with no_grad():
                    new = fn(p)
                    g = p.grad
                    new_g = None if g is None else fn(g)
                if new is p:
                    continue
                if new._dev is p._dev:
                    p.data = new
                    if g is not None and new_g is not g:
                        assert new_g is not None
                        g.data = new_g
                    continue
                # a device move: a new Parameter (create optimizers after moving between devices)
                q = Parameter(new.detach(), requires_grad=p.requires_grad)
                if new_g is not None:
                    q.grad = new_g.detach()
                m._parameters[name] = q
            for name, b in list(m._buffers.items()):
                if b is not None:
                    with no_grad():
                        m._buffers[name] = fn(b)
        return self

    def to(self, *args: Any, **kwargs: Any) -> Module:
        """Move parameters and buffers to a device and/or cast floating ones to a dtype.

        Forms, as PyTorch's: ``to(device=None, dtype=None, non_blocking=False)``, ``to(dtype)``,
        ``to(tensor)`` (its device and dtype); a device is a name (``"cpu"``), an ``asyncgrad.device``
        or a runtime Device; ``non_blocking`` and ``memory_format`` are accepted.

        As in PyTorch, a dtype cast keeps every `Parameter` object (its value and its ``.grad`` are
        converted in place through ``.data``), so an optimizer created before ``to`` still updates the
        model. A move to another device replaces the parameters by new `Parameter` objects (an
        asyncgrad limitation), so create optimizers after moving between devices.
        ``module.to("float64")`` / ``module.to(ag.float64)`` casts only.
        """
        unknown = set(kwargs) - {"device", "dtype", "non_blocking", "memory_format"}
        if unknown:
            raise TypeError(f"Module.to() got unexpected keyword argument(s) {sorted(unknown)}")
        device, dtype = kwargs.get("device"), kwargs.get("dtype")
        rest = [a for a in args if not isinstance(a, bool)]  # a positional non_blocking
        if len(rest) > 2:
            raise TypeError(f"Module.to() takes a device, a dtype or a tensor, got {args!r}")
        if rest and isinstance(rest[0], Tensor):
            device, dtype = rest[0].device, rest[0].dtype
        elif rest:
            first = rest.pop(0)
            if _is_dtype_like(first) and not rest:
                dtype = first
            else:
                device = first
                if rest:
                    dtype = rest.pop(0)
        if dtype is not None and np.dtype(dtype).kind not in "fc":
            raise TypeError(
                f"nn.Module.to only accepts floating point or complex dtypes, but got desired dtype={dtype}"
            )

        def conv(t: Tensor) -> Tensor:
            out = t
            if dtype is not None and t.dtype.kind in "fc" and np.dtype(dtype) != t.dtype:
                out = out.to(dtype=np.dtype(dtype))
            if device is not None:
                out = out.to(device)
            return out

        return self._convert(conv)

    def type(self, dst_type: Any) -> Module:
        """Cast every parameter and buffer (floating or not) to ``dst_type``."""
        dt = np.dtype(dst_type)

        def conv(t: Tensor) -> Tensor:
            return t if t.dtype == dt else t.to(dtype=dt)

        return self._convert(conv)

    def cpu(self) -> Module:
        """Move parameters and buffers to the CPU device."""
        return self.to("cpu")

    def cuda(self, device: Any = None) -> Module:
        """Move parameters and buffers to a CUDA device (an index, a name or a device; default the first).

        Raises the runtime's clear error when asyncgrad has no CUDA device (no cupy or no GPU).
        """
        if device is None:
            device = "cuda"
        elif isinstance(device, int):
            device = f"cuda:{device}"
        return self.to(device)

    def double(self) -> Module:
        """Cast floating point parameters and buffers to float64."""
        return self.to(dtype=np.float64)

    def float(self) -> Module:
        """Cast floating point parameters and buffers to float32."""
        return self.to(dtype=np.float32)

    def half(self) -> Module:
        """Cast floating point parameters and buffers to float16."""
        return self.to(dtype=np.float16)

    def get_parameter(self, target: str) -> Tensor:
        """The parameter at dotted path ``target`` (e.g. ``"block.fc.weight"``)."""
        return self._get_member(target, "_parameters", "an nn.Parameter")

    def get_buffer(self, target: str) -> Tensor:
        """The buffer at dotted path ``target`` (e.g. ``"bn.running_mean"``)."""
        return self._get_member(target, "_buffers", "a buffer")

    def _get_member(self, target: str, table: str, what: str) -> Tensor:
        mod_path, _, name = target.rpartition(".")
        mod = self.get_submodule(mod_path)
        if not hasattr(mod, name):
            raise AttributeError(f"{mod._get_name()} has no attribute `{name}`")
        members = getattr(mod, table)
        if name not in members:
            raise AttributeError(f"`{name}` is not {what}")
        return members[name]  # type: ignore[no-any-return]

    # ---- state dicts ----------------------------------------------------------------------------

    def state_dict(self, prefix: str = "", keep_vars: bool = False) -> OrderedDict[str, Any]:
        """Parameters and persistent buffers by dotted name.

        Args:
            prefix: Prepended to every key.
            keep_vars: Return the Tensors themselves instead of detached copies.

        Returns:
            An ordered dict ``name -> Tensor``: detached copies (with the parameters' layouts) taken in
            stream order, so later in-place updates do not change them; as PyTorch's values they have
            ``size()``, ``clone()``, ``numpy()``, and numpy functions take them.
        """
        out: OrderedDict[str, Any] = OrderedDict()
        for mprefix, m in self.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
            for name, p in m._parameters.items():
                if p is not None:
                    out[f"{mprefix}.{name}" if mprefix else name] = p if keep_vars else p.detach().clone()
            for name, b in m._buffers.items():
                if b is not None and name not in m._non_persistent:
                    out[f"{mprefix}.{name}" if mprefix else name] = b if keep_vars else b.detach().clone()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> _IncompatibleKeys:
        """Copy values from ``state_dict`` into this module's parameters and buffers, in place.

        Copies run in stream order and keep each parameter's memory layout; values are cast to the
        parameter's dtype.

        Args:
            state_dict: ``name -> numpy array or Tensor`` (e.g. from `state_dict` or `load_state_dict_file`).
            strict: Raise if keys are missing or unexpected. Shape mismatches always raise.

        Returns:
            A named tuple ``(missing_keys, unexpected_keys)``.

        Raises:
            RuntimeError: Listing every missing key, unexpected key and shape mismatch.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"expected state_dict to be a mapping, got {type(state_dict).__name__}")
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors: list[str] = []
        pairs: list[tuple[Tensor, np.ndarray]] = []
        for k, t in own.items():
            if k not in state_dict:
                continue
            arr = _as_numpy(state_dict[k])
            if tuple(arr.shape) != tuple(t.shape):
                errors.append(
                    f"size mismatch for {k}: copying a param with shape {tuple(arr.shape)} from checkpoint, "
                    f"the shape in current model is {tuple(t.shape)}."
                )
                continue
            if arr.dtype.kind not in "biufc":
                errors.append(f"dtype error for {k}: cannot load a value of dtype {arr.dtype}")
                continue
            pairs.append((t, arr))
        if strict:
            if unexpected:
                errors.insert(
                    0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + "."
                )
            if missing:
                errors.insert(
                    0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + "."
                )
        if errors:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(errors)
            )
        with no_grad():
            for t, arr in pairs:
                src = np.array(arr, dtype=t.dtype, copy=True)  # the copy kernel may run later: own the source
                t.copy_(src)
        return _IncompatibleKeys(missing, unexpected)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save ``state_dict()`` to ``path`` as a numpy ``.npz`` file (no pickle)."""
        save_state_dict(path, self.state_dict())

    def load(self, path: str | os.PathLike[str], strict: bool = True) -> _IncompatibleKeys:
        """Load a state dict saved by `save` / `save_state_dict` from ``path`` into this module."""
        return self.load_state_dict(load_state_dict_file(path), strict=strict)

    # ---- repr -----------------------------------------------------------------------------------

    def extra_repr(self) -> str:
        """Extra text for ``repr`` (a layer's configuration)."""
        return ""

    def _get_name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        lines = []
        extra = self.extra_repr()
        if extra:
            lines = extra.split("\n")
        for name, m in self._modules.items():
            r = repr(m).replace("\n", "\n  ")
            lines.append(f"({name}): {r}")
        main = self._get_name() + "("
        if lines:
            if len(lines) == 1 and not self._modules:
                main += lines[0]
            else:
                main += "\n  " + "\n  ".join(lines) + "\n"
        return main + ")"


def save_state_dict(path: str | os.PathLike[str], state_dict: Mapping[str, Any]) -> None:
    """Write ``state_dict`` (``name -> array or Tensor``) to ``path`` as an uncompressed ``.npz``.

    The file is written exactly at ``path`` (no extension is added) and holds plain arrays only, so
    `load_state_dict_file` reads it with ``allow_pickle=False``.
    """
    arrays = {}
    for k, v in state_dict.items():
        a = _as_numpy(v)
        if a.dtype.kind not in "biufc":
            raise TypeError(
                f"save_state_dict: value {k!r} has dtype {a.dtype}; only numeric arrays can be saved"
            )
        arrays[k] = np.ascontiguousarray(a)
    d = os.path.dirname(os.fspath(path))
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool


def load_state_dict_file(path: str | os.PathLike[str]) -> OrderedDict[str, np.ndarray]:
    """Read a ``.npz`` state dict written by `save_state_dict` (``allow_pickle=False``)."""
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    with np.load(path, allow_pickle=False) as z:
        for k in z.files:
            out[k] = z[k]
    return out
