"""The op table: an `Op` couples a numpy kernel, a *meta* function and a backward *rule*.

The meta function gives the output's shape and dtype before the kernel runs, so an op can return a tensor
whose value is still being computed on a lane. Rules are written once against a small array namespace
``xp`` (`_xp`) and run two ways: with numpy arrays as one fused kernel on the node's stream (plain
backward), or with Tensors on the loop thread so the backward itself is recorded (``create_graph=True``).
Each op family (`asyncgrad.ops`) registers its ops here with `defop`, next to their kernels and rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

Rule = Callable[..., tuple[Any, ...]]



EMPTY: dict[str, Any] = {}



_NUMERIC_DTYPES = [np.dtype(c) for c in "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]]



_FLOAT_DTYPES = frozenset(d for d in _NUMERIC_DTYPES if d.kind == "f")



@attrs.define(eq=False, repr=False)
class Op:
    """A differentiable (or not) operation: kernel, meta and backward rule, registered by name.

    Built by `defop`; the fields after ``saves`` are derived from the others for the per-op fast paths.
    """

    name: str
    kernel: Callable[..., Any]
    meta: Callable[..., tuple[tuple[int, ...], np.dtype[Any]]]
    rule: Rule | None = None
    save_out: bool = False
    # with save_out: the rule reads only what the kernel left beside its output (in the output array's base,
    # e.g. layer norm's statistics) and works without it, so an in-place write to the output does not
    # invalidate the backward (its version is not checked), as for PyTorch's ops that save no output
    save_out_side: bool = False
    # the kernel computes in the result dtype: array operands of another dtype are cast first
    # (int / 2 divides in float32 like PyTorch, instead of in float64 and casting the result)
    cast_in: bool = False
    # elementwise ops (`apply1`/`apply2`): the dtype kinds for which the kernel, given operands of
    # one dtype (or a Python int/bool, or for "f"/"c" any Python number), already returns PyTorch's
    # result dtype, so the inline fast paths may skip the meta function
    fast_kinds: str = ""
    # the positional args whose values the rule reads (None: every tensor arg, the safe default): their
    # versions are recorded with the node and checked before its backward runs (PyTorch's "modified by
    # an inplace operation"); () for rules that read only shapes, dtypes or devices
    saves: tuple[int, ...] | None = None
    # the kernel returns a view of arg 0 (reshape, permute, ...): the output shares its version counter
    view: bool = False
    doc: str = ""  # what the op computes: the docstring of its public function where one is made from it
    # ``work(args, n, kw)``: the multiply-adds (or window reads) of a run with an output of ``n`` elements,
    # for ops whose cost is not bounded by their elements (products, convolutions, pools); beside other
    # trainings such an op runs inline only within `devices.SHARED_INLINE_MAX_MACS` (see `_dispatch`)
    work: Callable[[tuple[Any, ...], int, dict[str, Any]], int] | None = None
    saves_none: bool = attrs.field(init=False)
    saves0: bool = attrs.field(init=False)  # reads arg 0 (the fast initialisers' one tensor)
    # the same as ``fast_kinds`` as dtypes: a set lookup costs half of `dtype.kind in fast_kinds` on the
    # per-op path
    fast_dtypes: frozenset[np.dtype[Any]] = attrs.field(init=False)
    any_kind: bool = attrs.field(init=False)  # then same-dtype operands skip the dtype test
    # a ufunc can write a large result into a buffer from the lane's host cache (see `_enqueue`)
    fills_out: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.saves_none = self.saves == ()
        self.saves0 = self.saves is None or 0 in self.saves
        self.fast_dtypes = frozenset(d for d in _NUMERIC_DTYPES if d.kind in self.fast_kinds)
        self.any_kind = self.fast_kinds == "biufc"
        self.fills_out = isinstance(self.kernel, np.ufunc)

    def __repr__(self) -> str:
        return f"<Op {self.name}>"



OPS: dict[str, Op] = {}



def defop(
    name: str,
    kernel: Callable[..., Any],
    meta: Callable[..., Any],
    rule: Rule | None = None,
    *,
    save_out: bool = False,
    save_out_side: bool = False,
    cast_in: bool = False,
    fast_kinds: str = "",
    saves: tuple[int, ...] | None = None,
    view: bool = False,
    doc: str = "",
    work: Callable[[tuple[Any, ...], int, dict[str, Any]], int] | None = None,
) -> Op:
    """Register an op in the table (one entry per name; rules live next to their forwards)."""
    if name in OPS:
        raise ValueError(f"op {name!r} is already registered")
    op = OPS[name] = Op(
        name, kernel, meta, rule, save_out=save_out, save_out_side=save_out_side, cast_in=cast_in,
        fast_kinds=fast_kinds, saves=saves, view=view, doc=doc, work=work,
    )
    return op



class OpError(ValueError):
    """Bad input to an op: wrong shapes, dtypes or devices."""



def camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.split("_"))
