"""`compile`: record one training step's kernels as a flat program over buffer slots, then replay it.

Recording runs the step eagerly while the hooks of `runtime._capture` hand each kernel to a `_Recorder`:
forward op kernels (`apply`), backward rule kernels (`apply_op_kernel`), gradient accumulation, in-place
updates and the optimizer's fused updates. Every tensor a kernel reads or writes gets a slot: an
argument of the step, a tensor from outside (a parameter, a `.grad`, optimizer state, a constant made in
the step: read live when the program runs) or an output of an earlier kernel. A replay checks the guards,
re-makes the optimizers' update kernels (their constants, e.g. Adam's bias corrections, depend on Python
state that changes every step), and submits the whole program as ONE job on the task's stream: no meta,
no nodes, no Tensor objects for intermediates, and the loop is not woken per op.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import numpy as np
import trio

from ..devices import HOST_CACHE_MIN_BYTES, add_scaled, lane_empty, private_base
from ..runtime import _capture, _grad_mode
from ..runtime._capture import CaptureFallback
from ..runtime._dispatch import _cast_kernel, apply, wait_for
from ..runtime._factories import default_generator
from ..runtime._inplace import inplace
from ..runtime._layout import empty_like_contract, obeys_contract
from ..runtime._runtime import current_stream
from ..runtime._tensor import Tensor
from ..runtime._xp import NP, sum_to
from ._accumulate import accumulate
from ._run_node import _NodeView, apply_op_kernel

__all__ = ["CaptureFallback", "CompileStatistics", "CompiledStep", "compile"]

_ARG, _EXT, _OUT = 0, 1, 2
_NPX: Any = NP  # the rule namespace, with the functions ops register into it (`register_xp`)
_RUN_AHEAD = 2  # replays queued ahead of their lane at most (each holds its step's arrays)


class _Unsupported(Exception):
    """Raised by a guard check that found the step's state changed (the program does not apply)."""


@attrs.frozen
class CompileStatistics:
    """Counters of a compiled step (see `CompiledStep.statistics`)."""

    calls: int
    eager_calls: int
    recordings: int
    replays: int
    guard_failures: int
    programs: int
    instructions: int
    fallback_reason: str | None


# ---- recording ------------------------------------------------------------------------------------------


class _Recorder:
    """Collects one step's kernels while it runs eagerly (set as `runtime._capture.active`)."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.tid = threading.get_ident()
        # the recording task: other tasks of this thread run their own ops meanwhile (trainings side by
        # side in one runtime), and those must neither be recorded nor see the recorder
        self.task = trio.lowlevel.current_task()
        self.depth = 0  # > 0 while the eager code a hook wraps runs (its nested hooks pass through)
        self.reason: str | None = None
        self.slot_of: dict[int, int] = {}
        self.keep: list[Any] = []  # tensors from outside, arguments, leaves (held: the program reads them)
        # a kernel's output is held weakly (its slot forgotten when it dies): holding it would change eager's
        # steal-or-copy decisions (they count references), and with them `.grad`'s version counter
        self.slot_ref: list[Callable[[], Any]] = []
        self.slot_meta: list[tuple[Any, ...]] = []
        self.kinds: list[int] = []
        self.ext_start_version: dict[int, int] = {}
        self.arg_slots: list[tuple[int, int]] = []
        self.instrs: list[Any] = []  # closures f(slots, aliased), or an int: the index of a host segment
        self.producer: dict[int, int] = {}  # a kernel output's slot -> the index of its instruction
        self.segments: list[list[Any]] = []  # [obj, grads at its start, guard]
        self.in_segment = False
        self.segment_tensors: set[int] = set()
        self.ext_written: set[int] = set()  # slots of tensors from outside written in place
        self.leaves: dict[int, list[Any]] = {}  # id(leaf) -> [leaf, its .grad when first seen]
        self.grad_objects: set[int] = set()  # ids of tensors that were some leaf's .grad
        self.modules: dict[int, Any] = {}
        self.n_kernels = 0
        # seeds random ops drew from the default generator while recording, in order (value -> its index):
        # a replay draws as many again, in the same order, as the eager step would
        self.seed_index: dict[int, int] = {}
        for pos, a in enumerate(args):
            if isinstance(a, Tensor):
                if a._rg:
                    self.unsupported(f"argument {pos} (shape {a._shape}) requires grad")
                if id(a) not in self.slot_of:
                    self.arg_slots.append((pos, self._slot(a, _ARG)))

    # ---- the seam's protocol -------------------------------------------------------------------------

    def wants(self) -> bool:
        if self.depth or threading.get_ident() != self.tid:
            return False
        try:
            return trio.lowlevel.current_task() is self.task
        except RuntimeError:  # no trio run on this thread
            return False

    def unsupported(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def generator(self, g: Any) -> Any:
        return _SeedDraws(self, g)

    def note_seed(self, seed: int) -> None:
        if seed in self.seed_index:  # (a 63-bit draw repeated: the two ops could not be told apart)
            self.unsupported("two random ops drew the same seed")
        self.seed_index[seed] = len(self.seed_index)

    def _seed_of(self, op: Any, kw: dict[str, Any]) -> int | None:
        """The replay's index of the seed in ``kw``; None when there is none to draw (dropout p=0, no seed)."""
        if "seed" not in kw:
            return None
        k = self.seed_index.get(kw["seed"])
        if k is None and kw.get("p", 1.0) != 0.0:
            self.unsupported(f"random op {op.name} with a seed not drawn from the default generator")
        return k

    def host_read(self, t: Tensor) -> None:
        # an op function that reads values to decide its output's shape (nonzero, masked_select, repeat with
        # tensor repeats, boolean indexing) reads from inside asyncgrad/ops
        f: Any = sys._getframe(2)
        for _ in range(4):
            if f is None:
                break
            mod = f.f_globals.get("__name__", "")
            if mod.startswith("asyncgrad.ops."):
                self.unsupported(
                    f"data-dependent shape: {f.f_code.co_name}() reads a tensor's values to decide its result's shape"
                )
                return
            f = f.f_back
        f = sys._getframe(2)
        while f is not None and f.f_globals.get("__name__", "").startswith("asyncgrad.runtime."):
            f = f.f_back
        where = "" if f is None else f" in {f.f_code.co_qualname} ({f.f_code.co_filename}:{f.f_lineno})"
        self.unsupported(
            f"reads a value on the host (.item(), .numpy(), float(), .tolist(), bool()) of a tensor of shape "
            f"{t._shape}{where}: the step's Python depends on values"
        )

    def grad_set(self, t: Tensor) -> None:
        self._watch(t)

    def module_called(self, module: Any, hooked: bool) -> None:
        self.modules[id(module)] = module
        if hooked:
            self.unsupported(f"a Python forward hook on module {type(module).__name__} (not replayed)")

    # ---- slots -----------------------------------------------------------------------------------------

    def _slot(self, t: Tensor, kind: int) -> int:
        i = len(self.kinds)
        self.slot_of[id(t)] = i
        if kind == _OUT:
            self.slot_ref.append(weakref.ref(t, functools.partial(self._forget, id(t), i)))
        else:
            self.keep.append(t)
            self.slot_ref.append(functools.partial(_same, t))
        self.slot_meta.append((t._shape, t._dtype, t._dev))
        self.kinds.append(kind)
        if kind == _EXT:
            self.ext_start_version[i] = t._version
            if t._dev.type != "cpu":
                self.unsupported(f"a tensor on {t._dev}: capture covers CPU tensors")
        return i

    def _forget(self, key: int, i: int, _: Any) -> None:
        if self.slot_of.get(key) == i:
            del self.slot_of[key]

    def _ref(self, t: Tensor) -> int:
        i = self.slot_of.get(id(t))
        return self._slot(t, _EXT) if i is None else i

    def _spec(self, args: Any) -> tuple[tuple[int, Any], ...]:
        return tuple((self._ref(a), None) if isinstance(a, Tensor) else (-1, a) for a in args)

    def _watch(self, leaf: Tensor) -> None:
        if id(leaf) not in self.leaves:
            self.leaves[id(leaf)] = [leaf, leaf._grad]
            self.keep.append(leaf)
            if leaf._grad is not None:
                self.grad_objects.add(id(leaf._grad))
        if leaf._hooks or leaf._post_hooks:
            self.unsupported(f"a Python hook on a leaf tensor of shape {leaf._shape} (not replayed)")

    def _eager(self, fn: Callable[..., Any], *a: Any) -> Any:
        self.depth += 1
        try:
            return fn(*a)
        finally:
            self.depth -= 1

    # ---- kernels ---------------------------------------------------------------------------------------

    def apply(self, op: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        out = self._eager(apply, op, args, kw)
        if self.reason is not None:
            return out
        seed_k = self._seed_of(op, kw)
        if self.reason is not None:
            return out
        if self.in_segment:
            self.unsupported(f"the optimizer's step runs op {op.name} (only fused in-place updates replay)")
            return out
        spec = self._spec(args)
        dtype = out._dtype
        kernel = _cast_kernel(op.kernel, args, dtype) if op.cast_in else op.kernel
        o = self._slot(out, _OUT)
        if seed_k is not None:
            self.instrs.append(_k_seed_instr(kernel, spec, kw, dtype, o, seed_k))
        elif op.fills_out and out._dtype.itemsize * int(np.prod(out._shape)) >= HOST_CACHE_MIN_BYTES:
            # as `_dispatch._enqueue` does: the output from the lane's host cache (no page faults per step)
            self.instrs.append(_k_out_instr(kernel, spec, kw, dtype, out._shape, o))
        else:
            self.instrs.append(_k_instr(kernel, spec, kw, dtype, o))
        self.producer[o] = len(self.instrs) - 1
        self.n_kernels += 1
        return out

    def rule(self, node: Any, g: Tensor, task_stream: Any) -> list[Any]:
        if node._hooked:
            self.unsupported(f"a Python hook on a tensor or node ({node.name()}) (not replayed)")
        results: list[Any] = self._eager(apply_op_kernel, node, g, task_stream)
        if self.reason is not None:
            return results
        gi = self._ref(g)
        spec = self._spec(node.args)
        oi = -1 if node.out is None else self._ref(node.out)
        rs = tuple(-1 if r is None else self._slot(r, _OUT) for r in results)
        seed_k = self._seed_of(node.op, node.kw)
        if self.reason is not None:
            return results
        view = _NodeView(node.op, node.kw, node.needs)
        self.instrs.append(_rule_instr(view, gi, spec, oi, rs, -1 if seed_k is None else seed_k))
        self.n_kernels += 1
        return results

    def accumulate(self, rt: Any, leaf: Tensor, g: Tensor, create_graph: bool, unique: Any, batches: Any) -> None:
        if create_graph:
            self.unsupported("backward(create_graph=True)")
        self._watch(leaf)
        old = leaf._grad
        # slots first: a tensor from outside keeps the version it had before this step wrote to it
        gi = self._ref(g)
        pi = self._ref(leaf)
        if old is not None:
            self.grad_objects.add(id(old))
            oi = self._ref(old)
        self._eager(accumulate, rt, leaf, g, create_graph, unique, batches)
        if self.reason is not None:
            return
        if old is None:
            new = leaf._grad
            assert new is not None  # accumulate set it
            o = self._slot(new, _OUT)  # a new slot even when `new is g`: the .grad the replay hands out
            self.grad_objects.add(id(new))
            self.instrs.append(_acc_new_instr(gi, pi, o, self.kinds[gi] == _OUT))
        else:
            if self.kinds[oi] == _EXT:
                self.ext_written.add(oi)
            self.instrs.append(_acc_add_instr(oi, gi))
        self.n_kernels += 1

    def inplace(self, t: Tensor, fn: Callable[..., Any], others: tuple[Any, ...], write: bool) -> Tensor:
        # slots first: a tensor from outside keeps the version it had before this step wrote to it
        ti = self._ref(t)
        spec = self._spec(others)
        res: Tensor = self._eager(_capture_free_inplace, t, fn, others, write)
        if self.reason is not None:
            return res
        if self.in_segment:
            self.segment_tensors.add(id(t))
            self.segment_tensors.update(id(o) for o in others if isinstance(o, Tensor))
            return res
        if self.kinds[ti] == _EXT and write:
            self.ext_written.add(ti)
        self.instrs.append(_inplace_instr(fn, ti, spec))
        self.n_kernels += 1
        return res

    def scaled_update(self, p: Tensor, tmp: Tensor, ufunc: Any, run: Callable[..., Any]) -> Tensor | None:
        """``p -= k * g`` with ``k * g`` queued (`_inplace.scaled_update`): whether its kernel updates ``p`` in
        one pass or computes the temporary is decided when it runs; the replay repeats that choice, so it
        stays bit for bit the eager step (the one-pass update rounds differently). None: not this pattern."""
        mi = self.slot_of.get(id(tmp))
        k = self.producer.get(mi) if mi is not None else None
        if mi is None or k is None or self.in_segment:
            return None  # (made outside the step, or in an optimizer's step: recorded as a plain update)
        g, scale = tmp.__dict__["_scaled"]
        ti, gi = self._ref(p), self._ref(g)
        decided: list[bool] = []
        res: Tensor | None = self._eager(run, p, tmp, ufunc, decided)
        if res is None or self.reason is not None:
            return res
        if self.kinds[ti] == _EXT:
            self.ext_written.add(ti)
        self.instrs[k] = _unless_fused(self.instrs[k], decided)
        alpha = -scale if ufunc is np.subtract else scale
        self.instrs.append(_scaled_instr(ufunc, alpha, ti, gi, mi, decided))
        self.n_kernels += 1
        return res

    def host_segment(self, obj: Any, closure: Any, run: Callable[[Any], Any]) -> Any:
        """An optimizer's step: run now; the replay calls ``obj.step()`` again to re-make its kernels."""
        if closure is not None:
            self.unsupported(f"{type(obj).__name__}.step(closure)")
        if self.in_segment:
            return run(closure)
        grads = {k: self._classify(v[0]._grad) for k, v in self.leaves.items()}
        self.segments.append([obj, grads, obj._capture_guard()])
        self.instrs.append(len(self.segments) - 1)
        self.in_segment = True
        try:
            return run(closure)
        finally:
            self.in_segment = False

    def _classify(self, t: Any) -> tuple[Any, ...]:
        if t is None:
            return ("none",)
        i = self.slot_of.get(id(t))
        if i is not None and self.kinds[i] == _OUT:
            return ("slot", i)
        return ("obj", t)


def _same(t: Any) -> Any:
    return t


def _capture_free_inplace(t: Tensor, fn: Callable[..., Any], others: tuple[Any, ...], write: bool) -> Tensor:
    return inplace(t, fn, *others, write=write)


# ---- instructions: closures over slot indices -------------------------------------------------------


def _k_instr(kernel: Any, spec: tuple[tuple[int, Any], ...], kw: dict[str, Any], dtype: Any, o: int) -> Any:
    if len(spec) == 1 and spec[0][0] >= 0 and not kw:
        (i, _), = spec

        def run1(s: list[Any], al: set[int]) -> None:
            res = kernel(s[i])
            if type(res) is not np.ndarray:
                res = np.asarray(res)
            s[o] = res if res.dtype == dtype else res.astype(dtype)

        return run1
    if len(spec) == 2 and spec[0][0] >= 0 and spec[1][0] >= 0 and not kw:
        (i, _), (j, _) = spec

        def run2(s: list[Any], al: set[int]) -> None:
            res = kernel(s[i], s[j])
            if type(res) is not np.ndarray:
                res = np.asarray(res)
            s[o] = res if res.dtype == dtype else res.astype(dtype)

        return run2
    if len(spec) == 2 and not kw and (spec[0][0] >= 0) != (spec[1][0] >= 0):
        # a tensor and a Python number (``y * 1.0001``): W2's every other op
        first = spec[0][0] >= 0
        i, c = (spec[0][0], spec[1][1]) if first else (spec[1][0], spec[0][1])

        def run2c(s: list[Any], al: set[int]) -> None:
            res = kernel(s[i], c) if first else kernel(c, s[i])
            if type(res) is not np.ndarray:
                res = np.asarray(res)
            s[o] = res if res.dtype == dtype else res.astype(dtype)

        return run2c

    template, places = _arg_template(spec)

    def run(s: list[Any], al: set[int]) -> None:
        # the arguments filled in by a loop: a list comprehension is a frame of its own on CPython 3.11
        arrays = template.copy()
        for i, k in places:
            arrays[k] = s[i]
        res = kernel(*arrays, **kw)
        if type(res) is not np.ndarray:
            res = np.asarray(res)
        s[o] = res if res.dtype == dtype else res.astype(dtype)

    return run


def _arg_template(spec: tuple[tuple[int, Any], ...]) -> tuple[list[Any], tuple[tuple[int, int], ...]]:
    """An instruction's argument list with its constants in place, and (slot, position) for the rest."""
    return [c for _, c in spec], tuple((i, k) for k, (i, _) in enumerate(spec) if i >= 0)


def _k_seed_instr(
    kernel: Any, spec: tuple[tuple[int, Any], ...], kw: dict[str, Any], dtype: Any, o: int, k: int
) -> Any:
    # a random op: its seed is the replay's k-th draw (the job puts the replay's seeds last in the slots)
    template, places = _arg_template(spec)

    def run(s: list[Any], al: set[int]) -> None:
        arrays = template.copy()
        for i, j in places:
            arrays[j] = s[i]
        res = kernel(*arrays, **{**kw, "seed": s[-1][k]})
        if type(res) is not np.ndarray:
            res = np.asarray(res)
        s[o] = res if res.dtype == dtype else res.astype(dtype)

    return run


def _k_out_instr(
    kernel: Any, spec: tuple[tuple[int, Any], ...], kw: dict[str, Any], dtype: Any, shape: tuple[int, ...], o: int
) -> Any:
    template, places = _arg_template(spec)

    def run(s: list[Any], al: set[int]) -> None:
        arrays = template.copy()
        for i, k in places:
            arrays[k] = s[i]
        if all(x.dtype == dtype and x.flags.c_contiguous for x in arrays if isinstance(x, np.ndarray)):
            s[o] = kernel(*arrays, out=lane_empty(shape, dtype), **kw)
            return
        res = kernel(*arrays, **kw)
        s[o] = res if res.dtype == dtype else res.astype(dtype)

    return run


def _rule_instr(
    view: Any, gi: int, spec: tuple[tuple[int, Any], ...], oi: int, rs: tuple[int, ...], seed_k: int = -1
) -> Any:
    # `run_rule`'s work, less its checks of what the rule returns (the recording passed them with these shapes)
    rule, kw, needs = view.op.rule, view.kw, view.needs
    wanted = tuple((k, r) for k, r in enumerate(rs) if r >= 0)
    if seed_k < 0 and len(wanted) == 1 and len(spec) <= 2:
        return _rule1_instr(rule, kw, needs, gi, spec, oi, wanted[0])

    template, places = _arg_template(spec)

    def run(s: list[Any], al: set[int]) -> None:
        arrays = template.copy()
        for i, k in places:
            arrays[k] = s[i]
        gd = s[gi]
        kwr = kw if seed_k < 0 else {**kw, "seed": s[-1][seed_k]}
        gs = rule(NP, gd, arrays, None if oi < 0 else s[oi], kwr, needs)
        seen: list[Any] = [gd, *arrays]
        for k, r in wanted:
            x = gs[k]
            a = arrays[k]
            if x.shape != a.shape or x.dtype != a.dtype:
                x = _fit(x, a)
            s[r] = x
            # the rule handed back the incoming grad or one array for two inputs: never steal it
            for y in seen:
                if x is y:
                    al.add(r)
                    break
            seen.append(x)

    return run


def _fit(x: Any, a: Any) -> Any:
    """A rule's gradient ``x`` reduced to its input ``a``'s (broadcast) shape and cast to its dtype (called
    only when one differs: the checks stay inline in the instructions)."""
    if x.shape != a.shape:
        x = sum_to(NP, x, tuple(a.shape))
    if x.dtype != a.dtype:
        x = _NPX.astype(x, a.dtype)
    return x


def _rule1_instr(
    rule: Any, kw: Any, needs: Any, gi: int, spec: tuple[tuple[int, Any], ...], oi: int, want: tuple[int, int]
) -> Any:
    # `_rule_instr` for the usual node (one or two inputs, one gradient wanted), written out: no list
    # comprehension (a frame of its own on CPython 3.11) and no `seen` list; W2's replay spent ~40% here
    k, r = want
    (i0, c0) = spec[0]
    if len(spec) == 1:

        def run1(s: list[Any], al: set[int]) -> None:
            gd = s[gi]
            a = s[i0] if i0 >= 0 else c0
            x = rule(NP, gd, [a], None if oi < 0 else s[oi], kw, needs)[k]
            if x.shape != a.shape or x.dtype != a.dtype:
                x = _fit(x, a)
            s[r] = x
            if x is gd or x is a:  # the rule handed back the incoming grad or its input: never steal it
                al.add(r)

        return run1
    (i1, c1) = spec[1]

    def run2(s: list[Any], al: set[int]) -> None:
        gd = s[gi]
        arrays = [s[i0] if i0 >= 0 else c0, s[i1] if i1 >= 0 else c1]
        x = rule(NP, gd, arrays, None if oi < 0 else s[oi], kw, needs)[k]
        a = arrays[k]
        if x.shape != a.shape or x.dtype != a.dtype:
            x = _fit(x, a)
        s[r] = x
        if x is gd or x is arrays[0] or x is arrays[1]:
            al.add(r)

    return run2


def _acc_new_instr(gi: int, pi: int, o: int, produced: bool) -> Any:
    def run(s: list[Any], al: set[int]) -> None:
        garr, param = s[gi], s[pi]
        # steal (as eager does) only an array this program made, held by no other slot, of the contract's
        # layout; else copy: the values are the same either way
        if produced and gi not in al and private_base(garr) and obeys_contract(garr, param):
            # referenced only by its slot, this local and getrefcount's argument: no other slot holds it or a
            # view of it (a view refers to its base), so the scan below would find none; it cost ~15 us a
            # leaf over the char GPT's few hundred slots
            if sys.getrefcount(garr) <= 3:
                s[o] = garr
                return
            for j, x in enumerate(s):
                if j != gi and x is not None and type(x) is not list and (x is garr or x.base is garr):
                    break
            else:
                s[o] = garr
                return
        buf = empty_like_contract(param)
        np.copyto(buf, garr)
        s[o] = buf

    return run


def _acc_add_instr(oi: int, gi: int) -> Any:
    def run(s: list[Any], al: set[int]) -> None:
        a = s[oi]
        np.add(a, s[gi], out=a, casting="unsafe")

    return run


def _unless_fused(ins: Any, decided: list[bool]) -> Any:
    # ``decided`` is filled by the recording's own update kernel, which ran before any replay (the replay
    # waits for the parameter it updated)
    def run(s: list[Any], al: set[int]) -> None:
        if not (decided and decided[0]):
            ins(s, al)

    return run


def _scaled_instr(ufunc: Any, alpha: Any, ti: int, gi: int, mi: int, decided: list[bool]) -> Any:
    def run(s: list[Any], al: set[int]) -> None:
        a = s[ti]
        if decided and decided[0]:
            add_scaled(a, alpha, s[gi])
        else:
            ufunc(a, s[mi], out=a, casting="unsafe")

    return run


def _inplace_instr(fn: Any, ti: int, spec: tuple[tuple[int, Any], ...]) -> Any:
    if len(spec) == 1 and spec[0][0] >= 0:  # an optimizer's update of a parameter by its .grad
        (i, _), = spec

        def run1(s: list[Any], al: set[int]) -> None:
            fn(s[ti], s[i])

        return run1
    template, places = _arg_template(spec)

    def run(s: list[Any], al: set[int]) -> None:
        arrays = template.copy()
        for i, k in places:
            arrays[k] = s[i]
        fn(s[ti], *arrays)

    return run


# ---- the program ------------------------------------------------------------------------------------


class _SeedDraws:
    """The default generator as a recording step sees it: a random op's seed (``integers(0, 2**63 - 1)``)
    is noted, to be drawn again on each replay; any other draw happens in Python, where a replay cannot
    repeat it, so the step runs eagerly."""

    def __init__(self, rec: _Recorder, g: Any) -> None:
        self._rec = rec
        self._g = g

    def integers(self, low: Any, high: Any = None, *args: Any, **kwargs: Any) -> Any:
        v = self._g.integers(low, high, *args, **kwargs)
        if low == 0 and high == 2**63 - 1 and not args and not kwargs:
            self._rec.note_seed(int(v))
        else:
            self._rec.unsupported("draws random numbers in Python at call time (integers)")
        return v

    def __getattr__(self, name: str) -> Any:
        self._rec.unsupported(f"draws random numbers in Python at call time ({name}: randn, rand, ...)")
        return getattr(self._g, name)


class _Regen:
    """Set as `runtime._capture.active` while a replay re-runs an optimizer's step: its in-place updates
    become instructions of the program instead of kernels."""

    def __init__(self, slot_of: dict[int, int], thread: int) -> None:
        self.slot_of = slot_of
        self.tid = thread
        self.instrs: list[Any] = []
        self.reason: str | None = None

    def wants(self) -> bool:
        return threading.get_ident() == self.tid

    def unsupported(self, reason: str) -> None:
        self.reason = self.reason or reason

    def generator(self, g: Any) -> Any:
        return g  # an optimizer drawing random numbers on replay: as eager would

    def host_read(self, t: Tensor) -> None:
        pass

    def grad_set(self, t: Tensor) -> None:
        pass

    def module_called(self, module: Any, hooked: bool) -> None:
        pass

    def host_segment(self, obj: Any, closure: Any, run: Callable[[Any], Any]) -> Any:
        return run(closure)

    def _ix(self, t: Tensor) -> int:
        i = self.slot_of.get(id(t))
        if i is None:
            raise RuntimeError(
                f"compile: the optimizer's step touched a tensor of shape {t._shape} it did not touch while "
                "recording (report this: the guards should have caught the change)"
            )
        return i

    def inplace(self, t: Tensor, fn: Callable[..., Any], others: tuple[Any, ...], write: bool) -> Tensor:
        spec = tuple((self._ix(o), None) if isinstance(o, Tensor) else (-1, o) for o in others)
        self.instrs.append(_inplace_instr(fn, self._ix(t), spec))
        return t

    def scaled_update(self, *a: Any) -> None:
        return None  # (an optimizer's step records its updates as plain ones)

    def apply(self, op: Any, args: Any, kw: Any) -> Any:
        raise RuntimeError(f"compile: the optimizer's step ran op {op.name} on replay, not while recording")

    def rule(self, *a: Any) -> Any:
        raise RuntimeError("compile: a backward node ran inside an optimizer's step on replay")

    def accumulate(self, *a: Any) -> Any:
        raise RuntimeError("compile: .grad accumulation inside an optimizer's step on replay")


class _Program:
    """One recorded step: instructions over slots, the guards, and what a replay hands back."""

    def __init__(self, rec: _Recorder, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        self.result_slots: list[int] = []
        self.n = len(rec.kinds)
        self.n_seeds = len(rec.seed_index)
        self.instrs = rec.instrs
        # the instructions as runs between the host segments: a replay extends its list by whole runs
        self.runs: list[Any] = []  # a list of closures, or an int: the index of a host segment
        for ins in rec.instrs:
            if type(ins) is int:
                self.runs.append(ins)
            elif self.runs and type(self.runs[-1]) is list:
                self.runs[-1].append(ins)
            else:
                self.runs.append([ins])
        self.n_instrs = rec.n_kernels
        self.segments = rec.segments
        self.slot_of = rec.slot_of
        self.arg_slots = rec.arg_slots
        self.grad_mode = _grad_mode._grad_enabled.get()
        self.arg_sig = _arg_signature(args, kwargs)
        self.kwargs_sig = kwargs
        self.modules = list(rec.modules.values())
        kinds = rec.kinds
        st = [r() for r in rec.slot_ref]  # None: an intermediate that died
        self.ext = [(i, st[i]) for i in range(self.n) if kinds[i] == _EXT]
        devs = {m[2] for m in rec.slot_meta}
        if len(devs) > 1:
            raise _Unsupported(f"tensors on more than one device ({sorted(map(str, devs))})")
        self.dev = next(iter(devs)) if devs else None
        # tensors from outside written in place: parameters, .grad tensors, optimizer state, buffers of the
        # modules called (a tensor made in the step and written in place would be replayed on its recorded values)
        buffers = {id(b) for m in self.modules for b in m._buffers.values() if b is not None}
        for i in rec.ext_written:
            t = st[i]
            if not (getattr(t, "_is_param", False) or id(t) in rec.grad_objects or id(t) in rec.segment_tensors
                    or (t._grad_fn is None and t._rg) or id(t) in buffers):
                raise _Unsupported(
                    f"writes in place to a tensor of shape {t._shape} that is neither a parameter, a .grad nor "
                    "optimizer state nor a buffer of a module called in the step (a tensor made in the step?)"
                )
        self.written = [st[i] for i in sorted(rec.ext_written | {rec.slot_of[k] for k in rec.segment_tensors})]
        deltas: dict[int, list[Any]] = {}
        for i in range(self.n):
            if kinds[i] == _EXT:
                t = st[i]
                d = t._version - rec.ext_start_version[i]
                if d and t._vc is not None:
                    deltas.setdefault(id(t._vc), [t, d])
        self.deltas = list(deltas.values())
        # leaves whose .grad the step changed: as it was at the start (guards) and at the end (the replay's)
        self.leaves: list[tuple[Tensor, Any, bool, tuple[Any, ...]]] = []
        for leaf, start in rec.leaves.values():
            read = start is not None and id(start) in rec.slot_of
            self.leaves.append((leaf, start, read, rec._classify(leaf._grad)))
            if leaf._hooks or leaf._post_hooks:
                raise _Unsupported(f"a Python hook on a leaf tensor of shape {leaf._shape} (not replayed)")
        self.result = _template(result, rec, self)
        fresh: set[int] = set()
        for _, _, _, fin in self.leaves:
            if fin[0] == "slot":
                fresh.add(fin[1])
        for seg in self.segments:
            fresh.update(c[1] for c in seg[1].values() if c[0] == "slot")
        fresh.update(self.result_slots)
        self.fresh = sorted(fresh)
        self.fresh_meta = {}
        for i in self.fresh:
            t = st[i]
            if t is None:  # a .grad the step set and then dropped (zero_grad after step)
                shape, dtype, _ = rec.slot_meta[i]
                self.fresh_meta[i] = (shape, dtype, False, None, 0)
                continue
            gf = t._grad_fn
            if gf is not None and not getattr(gf, "_released", False):
                raise _Unsupported(
                    f"the step returns a tensor of shape {t._shape} whose graph is still kept (no backward "
                    "through it, or retain_graph=True): replay cannot rebuild a graph"
                )
            self.fresh_meta[i] = (t._shape, t._dtype, t._rg, gf, t._version)
        self.ext_tensors = [t for _, t in self.ext]
        self.ext_guard = [(t, t._shape, t._dtype, t._dev) for t in self.ext_tensors]
        self.last_seqs: collections.deque[int] = collections.deque(maxlen=_RUN_AHEAD)
        self.regen_cache: dict[int, tuple[Any, list[Any]]] = {}  # segment's instruction -> (key, its kernels)

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """None when this program applies to a call with these arguments now, else why not."""
        if _arg_signature(args, kwargs) != self.arg_sig:
            return "the arguments' shapes, dtypes, devices, requires_grad or values changed"
        if _grad_mode._grad_enabled.get() != self.grad_mode:
            return "grad mode changed"
        for t, shape, dtype, dev in self.ext_guard:
            if t._shape != shape or t._dtype != dtype or t._dev is not dev:
                return f"a tensor the step reads changed shape, dtype or device (shape {shape} -> {t._shape})"
            if t._hooks or t._post_hooks:
                return f"a Python hook was registered on a tensor of shape {shape}"
        for leaf, start, read, _ in self.leaves:
            g = leaf._grad
            if (g is None) != (start is None) or (read and g is not start):
                return f"the .grad of a parameter of shape {leaf._shape} changed (None or not, or replaced)"
            if leaf._hooks or leaf._post_hooks:
                return f"a Python hook was registered on a leaf of shape {leaf._shape}"
        for m in self.modules:
            if m._forward_pre_hooks or m._forward_hooks:
                return f"a forward hook was registered on module {type(m).__name__}"
        return None

    async def replay(self, args: tuple[Any, ...]) -> Any:
        dev = self.dev
        assert dev is not None  # a program reads at least its arguments or parameters
        stream = current_stream(dev)
        if len(self.last_seqs) == _RUN_AHEAD and not stream.is_done(self.last_seqs[0]):
            await stream.synchronize(self.last_seqs[0])
        else:
            await trio.lowlevel.checkpoint()  # a replay can be cancelled before it changes anything
            stream.check_error()
        bound = [(i, args[pos]) for pos, i in self.arg_slots]
        for t in self.ext_tensors:
            wait_for(t, stream)
        for _, a in bound:
            wait_for(a, stream)
        fresh = {i: Tensor._pending(m[0], m[1], dev, stream) for i, m in self.fresh_meta.items()}
        saved = [(leaf, leaf._grad) for leaf, _, _, _ in self.leaves]
        # the optimizers' guards, with each leaf's .grad as the step had it when the optimizer ran
        for seg in self.segments:
            self._set_grads(seg[1], fresh)
            if seg[0]._capture_guard() != seg[2]:
                for leaf, g in saved:
                    leaf._grad = g
                return _NO_REPLAY
        slot_of = dict(self.slot_of)
        for i, t in fresh.items():
            slot_of[id(t)] = i
        flat: list[Any] = []
        for ins in self.runs:
            if type(ins) is int:
                seg = self.segments[ins]
                # an optimizer whose step has no Python state of its own to advance (`_capture_replay_key`)
                # makes the same kernels while its key stays the same: reuse them, without re-running it
                key = seg[0]._capture_replay_key()
                made = self.regen_cache.get(ins)
                if key is not None and made is not None and made[0] == key:
                    flat.extend(made[1])
                    continue
                self._set_grads(seg[1], fresh)
                regen = _Regen(slot_of, threading.get_ident())
                # (synchronous: no other task runs meanwhile; another task's recording is put back after)
                prev, _capture.active = _capture.active, regen
                try:
                    seg[0].step()
                finally:
                    _capture.active = prev
                flat.extend(regen.instrs)
                if key is not None:
                    self.regen_cache[ins] = (key, regen.instrs)
            else:
                flat.extend(ins)
        for leaf, _, _, fin in self.leaves:
            leaf._grad = _resolve(fin, fresh)
        ext = self.ext
        n = self.n
        fresh_items = list(fresh.items())
        # the random ops' seeds, drawn here on the loop thread as the eager step would draw them, in order
        gen = default_generator()
        seeds = [int(gen.integers(0, 2**63 - 1)) for _ in range(self.n_seeds)]

        def job() -> None:
            s: list[Any] = [None] * n
            s.append(seeds)  # last: the seeded instructions read s[-1]
            for i, t in ext:
                s[i] = t._data
            for i, a in bound:
                s[i] = a._data
            al: set[int] = set()
            for f in flat:
                f(s, al)
            for i, t in fresh_items:
                t._data = s[i]

        seq = stream.submit(job)
        self.last_seqs.append(seq)
        for t in fresh.values():
            t._seq = seq
        for t in self.written:
            t._stream = stream
            t._seq = seq
        for i, t in fresh_items:
            _, _, rg, gf, version = self.fresh_meta[i]
            t._rg = rg
            t._grad_fn = gf
            if version:
                t._vc = [version]
        for t, d in self.deltas:
            t._vc[0] += d
        return _fill(self.result, fresh, args)

    def _set_grads(self, grads: dict[int, tuple[Any, ...]], fresh: dict[int, Tensor]) -> None:
        for leaf, _, _, _ in self.leaves:
            c = grads.get(id(leaf))
            if c is not None:
                leaf._grad = _resolve(c, fresh)


_NO_REPLAY = object()


def _resolve(c: tuple[Any, ...], fresh: dict[int, Tensor]) -> Any:
    if c[0] == "none":
        return None
    if c[0] == "slot":
        return fresh[c[1]]
    return c[1]


def _arg_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def sig(a: Any) -> Any:
        if isinstance(a, Tensor):
            return ("T", a._shape, a._dtype, a._dev, a._rg, a._grad_fn is None)
        if a is None or isinstance(a, (bool, int, float, str)):
            return ("V", type(a), a)
        raise _Unsupported(f"an argument of type {type(a).__name__} (only Tensors and Python numbers/strings)")

    return (tuple(sig(a) for a in args), tuple((k, sig(v)) for k, v in sorted(kwargs.items())))


def _template(result: Any, rec: _Recorder, prog: _Program) -> Any:
    """``result`` with each tensor replaced by where a replay finds it (a new tensor, an argument, itself)."""
    prog.result_slots = []
    args_of = {i: pos for pos, i in rec.arg_slots}

    def walk(x: Any) -> Any:
        if isinstance(x, Tensor):
            i = rec.slot_of.get(id(x))
            if i is None:
                raise _Unsupported(f"the step returns a tensor of shape {x._shape} made without a recorded kernel")
            if rec.kinds[i] == _OUT:
                prog.result_slots.append(i)
                return ("slot", i)
            if i in args_of:
                return ("arg", args_of[i])
            return ("obj", x)
        if isinstance(x, (tuple, list)):
            return (type(x), [walk(v) for v in x])
        if isinstance(x, dict):
            return (dict, {k: walk(v) for k, v in x.items()})
        if x is None or isinstance(x, (bool, int, float, str)):
            return ("const", x)
        raise _Unsupported(f"the step returns a {type(x).__name__} (only Tensors, numbers, tuples, lists, dicts)")

    return walk(result)


def _fill(tpl: Any, fresh: dict[int, Tensor], args: tuple[Any, ...]) -> Any:
    kind, v = tpl
    if kind == "slot":
        return fresh[v]
    if kind == "arg":
        return args[v]
    if kind in ("obj", "const"):
        return v
    if kind is dict:
        return {k: _fill(x, fresh, args) for k, x in v.items()}
    return kind(_fill(x, fresh, args) for x in v)


# ---- the public face ------------------------------------------------------------------------------------


class CompiledStep:
    """A step function whose kernels are recorded once and replayed (see `compile`)."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], *, warmup: int, max_programs: int,
                 max_recaptures: int) -> None:
        if warmup < 0 or max_programs < 1 or max_recaptures < 0:
            raise ValueError(
                f"compile: warmup ({warmup}) and max_recaptures ({max_recaptures}) must be >= 0, "
                f"max_programs ({max_programs}) >= 1"
            )
        self.fn = fn
        self.warmup = warmup
        self.max_programs = max_programs
        self.max_recaptures = max_recaptures
        self.fallback_reason: str | None = None
        self.last_guard_failure: str | None = None
        self._programs: collections.OrderedDict[int, _Program] = collections.OrderedDict()
        self._ids = 0
        self._calls = self._eager = self._recordings = self._replays = self._guard_failures = 0
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def statistics(self) -> CompileStatistics:
        """Counters: calls, eager ones (warm-up, fallback), recordings, replays, guard failures, programs
        kept, the kernels of the latest program, and why the step falls back to eager (None if it does not)."""
        last = next(reversed(self._programs.values()), None)
        return CompileStatistics(
            calls=self._calls, eager_calls=self._eager, recordings=self._recordings, replays=self._replays,
            guard_failures=self._guard_failures, programs=len(self._programs),
            instructions=last.n_instrs if last is not None else 0, fallback_reason=self.fallback_reason,
        )

    def reset(self) -> None:
        """Forget every recorded program and any fallback: the next call records again."""
        self._programs.clear()
        self.fallback_reason = None

    def _fall_back(self, reason: str, stacklevel: int = 4) -> None:
        self.fallback_reason = reason
        self._programs.clear()
        warnings.warn(
            f"asyncgrad.compile({getattr(self.fn, '__qualname__', self.fn)!r}): runs eagerly from now on: {reason}",
            CaptureFallback,
            stacklevel=stacklevel,  # the caller's `await step(...)`
        )

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        rec = _capture.active
        # inside this task's own recording (a compiled step called by another): eager, so it is recorded;
        # another task's recording does not stop a replay here (a replay dispatches no op)
        if self.fallback_reason is not None or self._calls <= self.warmup or (rec is not None and rec.wants()):
            self._eager += 1
            return await self.fn(*args, **kwargs)
        why = None
        for key, prog in list(self._programs.items()):
            why = prog.check(args, kwargs)
            if why is None:
                res = await prog.replay(args)
                if res is not _NO_REPLAY:
                    self._programs.move_to_end(key)
                    self._replays += 1
                    return res
                why = "an optimizer's parameters, their .grad (None or not) or state keys changed"
        if why is not None:
            self._guard_failures += 1
            self.last_guard_failure = why
            if self._recordings > self.max_recaptures:
                self._fall_back(f"recorded {self._recordings} times and the guards still fail ({why})", 3)
                self._eager += 1
                return await self.fn(*args, **kwargs)
        return await self._record(args, kwargs)

    async def _record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._recordings += 1
        try:
            _arg_signature(args, kwargs)
        except _Unsupported as e:
            self._fall_back(str(e))
            return await self.fn(*args, **kwargs)
        if _capture.active is not None:
            # another task records now (one recording at a time per process): run this call eagerly and
            # record a later one
            self._recordings -= 1
            self._eager += 1
            return await self.fn(*args, **kwargs)
        rec = _Recorder(args)
        _capture.active = rec
        try:
            result = await self.fn(*args, **kwargs)
        finally:
            _capture.active = None
        if rec.reason is not None:
            self._fall_back(rec.reason)
            return result
        try:
            prog = _Program(rec, args, kwargs, result)
        except _Unsupported as e:
            self._fall_back(str(e))
            return result
        if len(self._programs) >= self.max_programs:
            self._programs.popitem(last=False)
        self._ids += 1
        self._programs[self._ids] = prog
        return result


def compile(
    fn: Callable[..., Awaitable[Any]] | None = None,
    *,
    warmup: int = 1,
    max_programs: int = 4,
    max_recaptures: int = 8,
) -> Any:
    """Capture an async training step and replay its kernels, like CUDA graphs / ``torch.compile``.

    ``step = ag.compile(fn)`` (or ``@ag.compile``): the first ``warmup`` calls run ``fn`` eagerly (an
    optimizer creates its state), the next one runs it eagerly while recording every kernel it queues
    (forward ops, backward rules, `.grad` accumulation, in-place updates, the optimizers' fused updates);
    later calls whose guards hold replay the recording as one job on the task's stream, with no per-op
    dispatch. The results are the eager ones bit for bit: returned tensors, `.grad`, parameters,
    optimizer state (an optimizer's ``step()`` re-runs its Python on replay, so step counts, bias
    corrections and learning-rate schedules stay exact), module buffers and the version counters of
    parameters and buffers. A new ``.grad``'s version counter is the recording's: eager's own is 0 or 1
    depending on whether it stole or copied the gradient, which depends on timing.

    Guards (checked per call; a failing one records again, keeping at most ``max_programs`` programs):
    the arguments' shapes, dtypes, devices, requires_grad and (for numbers) values; grad mode; the shape,
    dtype and device of every tensor the step read; whether each parameter's `.grad` is None; each
    optimizer's parameters and state keys; no hook registered since on the tensors and modules used.
    After ``max_recaptures`` recordings whose guards keep failing, the step runs eagerly for good.

    Falls back to eager for good, with a `CaptureFallback` warning once and the reason in
    ``step.fallback_reason`` / ``step.statistics()``, when the step: reads a value on the host
    (``.item()``, ``.numpy()``, ``float()``, ``bool()``); has data-dependent shapes (``nonzero``, masked
    selection); has Python hooks on a tensor, node or module (they are not replayed); draws random numbers
    in Python (``randn`` inside the step, a random op given its own ``generator``); writes in place to a
    tensor that is not a parameter, `.grad`, optimizer state or a module's buffer (a tensor made in the step); uses
    ``create_graph=True``, an argument that requires grad, ``step(closure)``, or returns a tensor whose
    graph is still kept. Module buffers written in the step (BatchNorm's running statistics) are replayed,
    and so are random ops drawing their seed from the default generator (dropout, attention dropout): each
    replay draws the seeds the eager step would draw, in the same order, on the calling thread.

    Limits: ``fn``'s other Python side effects are not re-run on replay (only the optimizers' ``step``
    is); the tensors a replay reads are the objects the recording saw (replace a parameter *object* and
    call ``step.reset()``; changing its values, in place or by ``.data``, is fine); the recording runs
    alone (another task's ops on this thread while it records are recorded too); CPU only.

    Args:
        fn: ``async def fn(*args)``: a step (zero_grad, forward, ``await backward()``, ``opt.step()``).
        warmup: Eager calls before the one that records.
        max_programs: Programs kept (one per guard set), least recently used dropped first.
        max_recaptures: Recordings after which a step whose guards keep failing runs eagerly.

    Returns:
        A `CompiledStep`: ``await step(*args)`` returns what ``fn`` returns.
    """
    if fn is None:
        return functools.partial(compile, warmup=warmup, max_programs=max_programs, max_recaptures=max_recaptures)
    return CompiledStep(fn, warmup=warmup, max_programs=max_programs, max_recaptures=max_recaptures)

