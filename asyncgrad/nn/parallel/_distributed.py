"""DistributedDataParallel: average gradients over a process group while the backward pass runs.

How a step goes (PyTorch's Reducer, on asyncgrad's streams):

* At construction, parameters and buffers are broadcast from rank 0, after checking that every rank has
  the same parameters (names, shapes, dtypes, strides). Parameters are grouped into *buckets*, flat
  buffers in reverse parameter order (about the order gradients arrive): the first holds about 1 MiB, the
  others ``bucket_cap_mb``. Each parameter has a *view* into its bucket with the parameter's own strides
  (the gradient layout contract: a channels-last weight gets a channels-last view).
* One post-accumulate-grad hook per parameter, registered through handles the reducer keeps. When a
  backward pass commits, each hook marks its parameter ready (or, when every ``.grad`` was None before the
  pass, a hook that the forward put on the graph node computing each parameter's gradient marks it ready
  during the graph walk, as soon as that gradient's kernel is queued); a bucket whose parameters are all
  ready is *launched*: one job on the group's comm stream (ordered after the kernels producing the gradients, by
  events) copies each gradient into the bucket while dividing it by the world size (one pass), all-reduces
  the bucket in place, and copies the result back into ``.grad``. Buckets launch in index order on every
  rank. The jobs run on the comm lane while the compute lane is still working through the backward's
  kernels: the first buckets' all-reduces overlap the rest of the backward.
* The first hook also queues a callback of the pass (`asyncgrad.queue_callback`): ``await loss.backward()``
  returns only once every bucket is reduced and written back. If that fails (a peer died: the group's
  timeout), or the caller is cancelled meanwhile, the pass's `.grad` writes are undone and the error raised.
* After the first synchronized step the buckets are rebuilt once, in the order the gradients arrived
  (rank 0's order, broadcast).

`close()` (also ``async with``, and the reducer being garbage-collected) removes exactly the hooks this
instance added: wrapping the module again, or two instances over one module, never stack or lose hooks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import attrs
import numpy as np

from ... import autograd, runtime
from ... import distributed as dist
from .._module import Module

FIRST_BUCKET_BYTES = 1 << 20  # PyTorch's kDefaultFirstBucketBytes


@attrs.frozen
class ReducerStatistics:
    """Counters of one DistributedDataParallel instance."""

    buckets: int
    bucket_sizes: tuple[int, ...]  # elements per bucket, in bucket order
    bucket_params: tuple[tuple[str, ...], ...]  # parameter names per bucket
    hooks: int
    synced_passes: int
    local_passes: int  # passes inside no_sync()
    rebuilt: bool
    closed: bool


def _strided_view(flat: np.ndarray, param: np.ndarray) -> np.ndarray:
    """A view of ``flat`` (``param.size`` elements) shaped like ``param``, with the layout the gradient
    layout contract gives ``param``'s gradient: its own strides if dense, row-major otherwise."""
    order = dist.memory_order(param) or list(range(param.ndim))
    mem = flat.reshape([param.shape[i] for i in order])
    return mem.transpose(np.argsort(order)) if param.ndim else mem.reshape(())


class _Bucket:
    __slots__ = ("array", "dtype", "index", "members", "offsets", "tensor", "view_arrays", "views")

    def __init__(self, index: int, members: list[int], params: list[runtime.Tensor]) -> None:
        self.index = index
        self.members = members
        self.dtype = params[members[0]].dtype
        sizes = [params[j].numel() for j in members]
        self.offsets = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
        self.array = np.zeros(sum(sizes), self.dtype)
        self.tensor = runtime.from_numpy(self.array)
        self.view_arrays = []
        self.views = []
        for j, off, n in zip(members, self.offsets, sizes):
            v = _strided_view(self.array[off : off + n], params[j].numpy())
            self.view_arrays.append(v)
            self.views.append(runtime.from_numpy(v))


def assign_buckets(params: list[runtime.Tensor], order: list[int], cap_bytes: int, first_bytes: int) -> list[list[int]]:
    """Group parameter indices (taken in ``order``) into buckets of one dtype each: the first bucket closes
    once it holds ``first_bytes``, the others at ``cap_bytes`` (PyTorch's compute_bucket_assignment_by_size)."""
    done: list[list[int]] = []
    open_: dict[Any, list[Any]] = {}  # dtype -> [members, bytes]
    for i in order:
        p = params[i]
        cur = open_.setdefault(p.dtype, [[], 0])
        cur[0].append(i)
        cur[1] += p.numel() * p.element_size()
        if cur[1] >= (first_bytes if not done else cap_bytes):
            done.append(cur[0])
            del open_[p.dtype]
    done.extend(m for m, _ in open_.values() if m)
    return done


class _Pass:
    """One synchronized backward pass of the reducer."""

    __slots__ = (
        "arrival", "callback_queued", "delivered", "early", "early_pass", "finished", "launched", "next_launch",
        "pending", "ready", "source", "waiting", "works",
    )

    def __init__(self, n_params: int, buckets: list[_Bucket]) -> None:
        self.ready = [False] * n_params
        self.source: list[Any] = [None] * n_params  # the gradient each parameter contributes
        self.early = [False] * n_params  # marked ready during the graph walk (before the commit)
        self.delivered = [False] * n_params
        self.launched = [False] * len(buckets)
        self.waiting: list[list[int]] = [[] for _ in buckets]  # early params to deliver once launched
        self.early_pass = False
        self.pending = [len(b.members) for b in buckets]
        self.next_launch = 0
        self.works: list[Any] = []  # per launched bucket: (awaitable, grads written, hook result?)
        self.arrival: list[int] = []
        self.callback_queued = False
        self.finished = False


def _remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class _Reducer:
    """The buckets, hooks and per-pass state of one DistributedDataParallel (see the module docstring)."""

    def __init__(
        self,
        names: list[str],
        params: list[runtime.Tensor],
        group: dist.ProcessGroup,
        cap_bytes: int,
        gradient_as_bucket_view: bool,
        find_unused: bool,
    ) -> None:
        self.names = names
        self.params = params
        self.group = group
        self.world = group.size
        self.cap_bytes = cap_bytes
        self.as_view = gradient_as_bucket_view
        self.find_unused = find_unused
        device = params[0].device if params else runtime.current_runtime("DistributedDataParallel").cpu
        self.stream = group.comm_stream(device)
        self.comm_hook: Callable[..., Any] | None = None
        self.comm_state: Any = None
        self.rebuilt = False
        self.synced = 0
        self.local = 0
        self.sync_next = True  # set by each forward (no_sync clears it)
        self.unused: list[int] = []  # found at the last forward (find_unused_parameters)
        self.pass_: _Pass | None = None
        self._build(assign_buckets(params, list(range(len(params)))[::-1], cap_bytes, FIRST_BUCKET_BYTES))
        self.handles: list[Any] = []
        me = weakref.ref(self)
        for i, p in enumerate(params):
            self.handles.append(p.register_post_accumulate_grad_hook(_make_hook(me, i)))
        # the reducer being collected (its DDP dropped without close) removes exactly its own hooks
        self._finalizer = weakref.finalize(self, _remove_handles, self.handles)

    def _build(self, groups: list[list[int]]) -> None:
        self.buckets = [_Bucket(k, m, self.params) for k, m in enumerate(groups)]
        self.where = [(0, 0)] * len(self.params)
        for b in self.buckets:
            for slot, j in enumerate(b.members):
                self.where[j] = (b.index, slot)

    def close(self) -> None:
        self._finalizer()  # removes the hooks (once)

    # ---- per pass ----------------------------------------------------------------------------------

    def prepare_forward(self, sync: bool) -> None:
        self.sync_next = sync
        self.pass_ = _Pass(len(self.params), self.buckets) if sync else None

    def watch_graph(self, outputs: Any) -> None:
        """Start each bucket during the graph walk: a hook on every node that computes a parameter's gradient
        marks the parameter ready as soon as that gradient is queued, long before the pass commits.

        Only where it gives what averaging `.grad` gives: every `.grad` is None before the pass (the usual
        ``zero_grad()`` loop), each parameter is an input of exactly one node, and no comm hook is set.
        Otherwise the post-accumulate hooks do it all at the commit.
        """
        ps = self.pass_
        if ps is None or self.comm_hook is not None or any(p.grad is not None for p in self.params):
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        edges: dict[int, list[tuple[Any, int]]] = {}
        for node, k, var in _leaf_edges(outputs):
            i = index.get(id(var))
            if i is not None:
                edges.setdefault(i, []).append((node, k))
        if any(len(e) > 1 for e in edges.values()):
            return  # a shared parameter: its gradient is a sum the walk sees in parts
        by_node: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for i, ((node, k),) in edges.items():
            by_node.setdefault(id(node), (node, []))[1].append((k, i))
        ps.early_pass = True
        me = weakref.ref(self)
        for node, slots in by_node.values():
            node.register_hook(_make_node_hook(me, ps, slots))

    def on_walk(self, ps: _Pass, slots: list[tuple[int, int]], grad_inputs: tuple[Any, ...]) -> None:
        if ps is not self.pass_ or ps.finished:
            return
        if not ps.arrival:
            for j in self.unused:
                self._mark_ready(ps, j, None)
        for k, i in slots:
            g = grad_inputs[k]
            if g is not None and not ps.ready[i]:
                ps.early[i] = True
                self._mark_ready(ps, i, g)

    def on_grad(self, i: int, p: runtime.Tensor) -> None:
        """A parameter's post-accumulate hook: mark it ready; launch every bucket that is full, in order."""
        if not self.sync_next:
            return  # no_sync(): gradients accumulate locally
        ps = self.pass_
        if ps is None or ps.finished:  # a backward without a new forward (retain_graph): a new iteration
            ps = self.pass_ = _Pass(len(self.params), self.buckets)
        if not ps.callback_queued:
            autograd.queue_callback(lambda ps=ps: self.finalize(ps))
            ps.callback_queued = True
            if not ps.arrival:
                for j in self.unused:  # find_unused_parameters: parameters the forward did not reach
                    self._mark_ready(ps, j, None)
        if ps.early[i] and not ps.delivered[i]:
            # its share went into the bucket during the walk: the committed .grad gets the average
            ps.delivered[i] = True
            b, _ = self.where[i]
            if ps.launched[b]:
                self._deliver(i)
            else:
                ps.waiting[b].append(i)
            return
        if ps.ready[i]:
            raise RuntimeError(
                f"DistributedDataParallel: expected to mark parameter {self.names[i]!r} ready only once per "
                "iteration, but its gradient arrived twice (used by two backward passes of one forward, or by "
                "a reentrant checkpoint); run one backward per forward, or use no_sync() for the extra passes"
            )
        self._mark_ready(ps, i, p.grad)

    def _mark_ready(self, ps: _Pass, i: int, source: Any) -> None:
        ps.ready[i] = True
        ps.source[i] = source
        ps.arrival.append(i)
        b, _ = self.where[i]
        ps.pending[b] -= 1
        while ps.next_launch < len(self.buckets) and ps.pending[ps.next_launch] == 0:
            b = ps.next_launch
            self._launch(ps, self.buckets[b])
            ps.launched[b] = True
            ps.next_launch += 1
            for j in ps.waiting[b]:
                self._deliver(j)
            ps.waiting[b].clear()

    def _deliver(self, i: int) -> None:
        """Give parameter ``i`` (whose share was copied in during the walk) its averaged gradient."""
        b, slot = self.where[i]
        bucket = self.buckets[b]
        p = self.params[i]
        if self.as_view or p.grad is None:
            p.grad = bucket.views[slot]
            return
        view = bucket.view_arrays[slot]

        def back(buf: np.ndarray, garr: np.ndarray) -> None:
            np.copyto(garr, view)

        runtime.submit_on(self.stream, back, [bucket.tensor, p.grad], writes=[p.grad], after_caller=False)  # type: ignore[arg-type]

    def _launch(self, ps: _Pass, bucket: _Bucket) -> None:
        """Queue the bucket's copy-in (dividing by the world size), all-reduce and copy-back."""
        params = self.params
        grads: list[runtime.Tensor | None] = [ps.source[j] for j in bucket.members]
        modes = []  # per member: 0 no grad (zeros), 1 copy into the bucket, 2 .grad is the bucket view already
        for slot, g in enumerate(grads):
            modes.append(0 if g is None else 2 if g is bucket.views[slot] else 1)
        late = [not ps.early[j] for j in bucket.members]
        if self.as_view:
            for slot, j in enumerate(bucket.members):
                if modes[slot] == 1 and late[slot]:
                    params[j].grad = bucket.views[slot]  # from now on backward accumulates into the bucket
        live: list[runtime.Tensor] = [g for g, m in zip(grads, modes) if m == 1 and g is not None]
        # early members get theirs when their .grad is committed (`_deliver`)
        copy_back: list[runtime.Tensor] = (
            [] if self.as_view else [g for g, m, lt in zip(grads, modes, late) if m == 1 and lt and g is not None]
        )
        back_slots = [slot for slot, (m, lt) in enumerate(zip(modes, late)) if m == 1 and lt]
        scale = 1.0 if self.comm_hook is not None else 1.0 / self.world
        views = bucket.view_arrays
        hooked = self.comm_hook is not None

        def copy_in(buf: np.ndarray, *garrs: np.ndarray) -> None:
            k = 0
            for slot, m in enumerate(modes):
                v = views[slot]
                if m == 1:
                    np.multiply(garrs[k], scale, out=v)  # divide while copying: one pass
                    k += 1
                elif m == 2:
                    if scale != 1.0:
                        np.multiply(v, scale, out=v)
                else:
                    v.fill(0)

        # the copy-in (one pass, dividing unless a hook decides), then the reduction, on the comm stream
        # ordered after the kernels producing these gradients only, not after the whole backward queued on
        # this stream: that is the overlap (the backward's later kernels never touch the bucket)
        runtime.submit_on(
            self.stream, copy_in, [bucket.tensor, *live], writes=[bucket.tensor, *bucket.views], after_caller=False
        )
        if hooked:
            gb = dist.comm_hooks.GradBucket(
                bucket.index, bucket.tensor, [params[j] for j in bucket.members], list(bucket.offsets),
                bucket.index == len(self.buckets) - 1, self.group,
            )
            ps.works.append((self.comm_hook(self.comm_state, gb), bucket, copy_back, modes))  # type: ignore[misc]
            return
        # every rank built the same buckets from verified parameters: no per-step layout check
        work = dist.all_reduce_nowait(bucket.tensor, "sum", self.group, check=False, after_caller=False)
        if copy_back:

            def back(buf: np.ndarray, *garrs: np.ndarray) -> None:
                for garr, slot in zip(garrs, back_slots):
                    np.copyto(garr, views[slot])

            runtime.submit_on(self.stream, back, [bucket.tensor, *copy_back], writes=copy_back, after_caller=False)
        ps.works.append((work, bucket, copy_back, modes))

    async def finalize(self, ps: _Pass) -> None:
        """The pass's queued callback: wait for every bucket, write hook results back; fail clearly."""
        try:
            if ps.next_launch < len(self.buckets):
                missing = [self.names[j] for j, r in enumerate(ps.ready) if not r]
                raise RuntimeError(
                    "DistributedDataParallel: this backward pass produced no gradient for parameters "
                    f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, so their buckets could not be reduced; "
                    "construct it with find_unused_parameters=True if some parameters do not take part in the "
                    "loss (or make them take part)"
                )
            for work, bucket, copy_back, modes in ps.works:
                result = await work
                if self.comm_hook is not None:
                    await self._write_hook_result(result, bucket, copy_back, modes)
            if ps.works and self.comm_hook is None:
                # the copy-backs queued after the last all-reduce: .grad is final when backward returns
                await self.stream.synchronize()  # type: ignore[union-attr]
            if self.unused:
                await self._settle_unused(ps)
            self.synced += 1
            if not self.rebuilt:
                await self._rebuild(ps.arrival)
        finally:
            ps.finished = True
            for work, *_ in ps.works:
                close = getattr(work, "close", None)  # a hook's coroutine never awaited (the pass failed)
                if close is not None and not isinstance(work, dist.Work):
                    close()
            ps.works.clear()

    async def _write_hook_result(self, result: Any, bucket: _Bucket, copy_back: list[Any], modes: list[int]) -> None:
        if not isinstance(result, runtime.Tensor) or result.shape != bucket.tensor.shape:
            raise TypeError(
                "DistributedDataParallel: a communication hook must return an awaitable of a tensor shaped like "
                f"bucket.buffer() ({bucket.tensor.shape}), got {type(result).__name__}"
                f"{'' if not isinstance(result, runtime.Tensor) else ' of shape ' + str(result.shape)}"
            )
        views = bucket.view_arrays

        def back(buf: np.ndarray, res: np.ndarray, *garrs: np.ndarray) -> None:
            if res is not buf:
                np.copyto(buf, res, casting="unsafe")
            k = 0
            for slot, m in enumerate(modes):
                if m == 1 and copy_back:
                    np.copyto(garrs[k], views[slot])
                    k += 1

        seq = runtime.submit_on(self.stream, back, [bucket.tensor, result, *copy_back],  # type: ignore[arg-type]
                           writes=[bucket.tensor, *bucket.views, *copy_back])
        await self.stream.synchronize(seq)  # type: ignore[union-attr]

    async def _settle_unused(self, ps: _Pass) -> None:
        """Parameters unused here but used on another rank get the average; unused everywhere keep `.grad`."""
        used = runtime.tensor([0.0 if j in self.unused else 1.0 for j in range(len(self.params))], dtype=np.float64)
        await dist.all_reduce(used, "sum", self.group)
        flags = used.numpy()
        for j in self.unused:
            if flags[j] > 0:
                b, slot = self.where[j]
                view = self.buckets[b].views[slot]
                self.params[j].grad = view if self.as_view else view.clone()

    async def _rebuild(self, arrival: list[int]) -> None:
        """Rebuild the buckets once, in rank 0's arrival order (every rank must bucket alike)."""
        self.rebuilt = True
        order = runtime.tensor(arrival + [j for j in range(len(self.params)) if j not in arrival], dtype=np.int64)
        await dist.broadcast(order, 0, self.group)
        new = assign_buckets(self.params, [int(x) for x in order.numpy()], self.cap_bytes, FIRST_BUCKET_BYTES)
        if new == [b.members for b in self.buckets]:
            return
        old_views = {j: self.buckets[b].views[s] for j, (b, s) in enumerate(self.where)}
        self._build(new)
        if self.as_view:  # move the current gradients into their new views
            for j, p in enumerate(self.params):
                if p.grad is not None and p.grad is old_views[j]:
                    b, s = self.where[j]
                    nv = self.buckets[b].views[s]
                    nv.copy_(p.grad)
                    p.grad = nv


def _make_hook(me: weakref.ref[_Reducer], i: int) -> Callable[[runtime.Tensor], None]:
    # holds the reducer weakly: a hook must never keep its owner (and its buckets) alive
    def hook(p: runtime.Tensor) -> None:
        r = me()
        if r is not None:
            r.on_grad(i, p)

    return hook


def _make_node_hook(me: weakref.ref[_Reducer], ps: _Pass, slots: list[tuple[int, int]]) -> Callable[..., None]:
    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        r = me()
        if r is not None:
            r.on_walk(ps, slots, grad_inputs)

    return hook


def _leaf_edges(outputs: Any) -> Iterator[tuple[Any, int, runtime.Tensor]]:
    """(node, input position, leaf) for every leaf input of every node of the graph of ``outputs``."""
    seen: set[int] = set()
    stack = [t.grad_fn for t in _tensors_in(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                yield node, k, var
            else:
                stack.append(nxt)


def _reachable_params(outputs: Any) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``outputs`` reaches."""
    return {id(leaf) for _, _, leaf in _leaf_edges(outputs)}


def _tensors_in(x: Any) -> Iterator[runtime.Tensor]:
    if isinstance(x, runtime.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors_in(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors_in(y)


class DistributedDataParallel(Module):
    """Data-parallel training of ``module`` over a process group: gradients averaged during backward.

    Build it on every rank (after `asyncgrad.distributed.init_process_group`); call it like the module;
    ``await loss.backward()`` returns with every ``.grad`` averaged over the ranks.

    Args:
        module: The module to train (its parameters must be on the CPU for the MPI backend).
        process_group: The group to average over (default: the default group).
        bucket_cap_mb: Size of the buckets after the first (which holds about 1 MiB).
        gradient_as_bucket_view: Make each ``.grad`` a strided view into its bucket (saves a copy and the
            memory of all gradients; ``.grad.detach_()`` must not be used then).
        find_unused_parameters: Walk the graph of each forward's output and count the parameters it does
            not reach as ready at once (needed when some parameters do not take part in the loss).
        broadcast_buffers: Broadcast rank 0's buffers (running statistics) at each synchronized forward.

    The constructor checks across ranks that the parameters agree (names, shapes, dtypes, strides) and
    broadcasts rank 0's parameters and buffers; it blocks until then (at most the group's timeout).
    """

    def __init__(
        self,
        module: Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        group = process_group if process_group is not None else dist.get_default_group()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for n, p in named:
            if p.device.type != "cpu":
                raise ValueError(
                    f"DistributedDataParallel: parameter {n!r} is on {p.device}; the MPI backend reduces CPU "
                    "tensors (move the module with .to('cpu'))"
                )
        self._ddp_group = group
        self._ddp_broadcast_buffers = broadcast_buffers
        self._ddp_find_unused = find_unused_parameters
        self._ddp_require_sync = True
        self._verify_and_broadcast(named, group)
        self._ddp_reducer: _Reducer | None = _Reducer(
            [n for n, _ in named], [p for _, p in named], group, int(bucket_cap_mb * (1 << 20)),
            gradient_as_bucket_view, find_unused_parameters,
        )

    # ---- construction ----------------------------------------------------------------------------

    def _verify_and_broadcast(self, named: list[tuple[str, runtime.Tensor]], group: dist.ProcessGroup) -> None:
        """Compare every rank's parameter list with rank 0's, then broadcast rank 0's values (blocking)."""
        mine = [f"{n}:{tuple(p.shape)}:{p.dtype.str}:{_layout_desc(p.numpy())}" for n, p in named]
        every = _gather_strings("\n".join(mine), group)
        for r, text in enumerate(every):
            theirs = text.split("\n") if text else []
            if theirs != mine:
                diff = next(
                    (f"{a!r} here but {b!r} on rank {r}" for a, b in zip(mine, theirs) if a != b),
                    f"{len(mine)} parameters here but {len(theirs)} on rank {r}",
                )
                raise ValueError(
                    f"DistributedDataParallel: rank {group.rank} and rank {r} have different parameters "
                    f"(name:shape:dtype:layout): {diff}; build the same model on every rank (same parameter "
                    "order, shapes, dtypes and memory layouts)"
                )
        works = [dist.broadcast_nowait(p.detach(), 0, group) for _, p in named]
        works += [dist.broadcast_nowait(b, 0, group) for b in self.module.buffers()]
        for w in works:
            w.wait_blocking()

    # ---- use ---------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        reducer = self._ddp_reducer
        if reducer is None:
            raise RuntimeError("DistributedDataParallel was closed: wrap the module again to train it")
        sync = self._ddp_require_sync and runtime.is_grad_enabled()
        if sync and self._ddp_broadcast_buffers:
            for b in self.module.buffers():
                dist.broadcast_nowait(b, 0, self._ddp_group)  # queued; the forward's ops wait for it by events
        reducer.prepare_forward(sync)
        if not sync:
            reducer.local += 1
        out = self.module(*args, **kwargs)
        if sync and self._ddp_find_unused:
            reached = _reachable_params(out)
            reducer.unused = [j for j, p in enumerate(reducer.params) if id(p) not in reached]
        if sync:
            reducer.watch_graph(out)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: forwards and backwards accumulate gradients locally, without communication; the first
        synchronized backward after it averages the accumulated gradients."""
        old = self._ddp_require_sync
        self._ddp_require_sync = False
        try:
            yield
        finally:
            self._ddp_require_sync = old

    def register_comm_hook(self, state: Any, hook: Callable[[Any, Any], Any]) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (see `asyncgrad.distributed.comm_hooks`); once only."""
        reducer = self._live("register_comm_hook")
        if reducer.comm_hook is not None:
            raise RuntimeError("DistributedDataParallel.register_comm_hook can be called only once")
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        reducer.comm_hook = hook
        reducer.comm_state = state

    def _live(self, what: str) -> _Reducer:
        if self._ddp_reducer is None:
            raise RuntimeError(f"DistributedDataParallel.{what}: it was closed")
        return self._ddp_reducer

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self._ddp_group

    def buckets(self) -> list[runtime.Tensor]:
        """The flat bucket tensors, in bucket order."""
        return [b.tensor for b in self._live("buckets").buckets]

    def statistics(self) -> ReducerStatistics:
        r = self._ddp_reducer
        if r is None:
            return ReducerStatistics(0, (), (), 0, 0, 0, False, True)
        return ReducerStatistics(
            buckets=len(r.buckets),
            bucket_sizes=tuple(int(b.array.size) for b in r.buckets),
            bucket_params=tuple(tuple(r.names[j] for j in b.members) for b in r.buckets),
            hooks=len(r.handles),
            synced_passes=r.synced,
            local_passes=r.local,
            rebuilt=r.rebuilt,
            closed=False,
        )

    def close(self) -> None:
        """Remove exactly the hooks this instance added and drop its buckets (the module is untouched)."""
        r = self._ddp_reducer
        if r is not None:
            self._ddp_reducer = None
            r.close()

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> DistributedDataParallel:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _layout_desc(a: np.ndarray) -> str:
    order = dist.memory_order(a)
    if order is None:
        return "strided"
    # only dims of size > 1 matter (the contract compares strides there)
    return ",".join(str(i) for i in order if a.shape[i] > 1)


def _split_desc(s: str) -> list[tuple[str, str]]:
    out = []
    for item in s.split(";"):
        if item:
            name, _, rest = item.partition(":")
            out.append((name, rest))
    return out


def _gather_strings(text: str, group: dist.ProcessGroup) -> list[str]:
    """Every rank's ``text`` (utf-8 bytes in tensors, no pickle), blocking: construction-time set-up."""
    data = np.frombuffer(text.encode(), np.uint8)
    n = runtime.tensor([data.size], dtype=np.int64)
    lens = [runtime.zeros(1, dtype=np.int64) for _ in range(group.size)]
    dist.all_gather_nowait(lens, n, group).wait_blocking()
    width = max(1, *(int(x.item()) for x in lens))
    mine = np.zeros(width, np.uint8)
    mine[: data.size] = data
    outs = [runtime.zeros(width, dtype=np.uint8) for _ in range(group.size)]
    dist.all_gather_nowait(outs, runtime.from_numpy(mine), group).wait_blocking()
    return [bytes(o.numpy()[: int(k.item())]).decode() for o, k in zip(outs, lens)]
