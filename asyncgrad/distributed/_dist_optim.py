"""`DistributedOptimizer`: step parameters where they live, every worker in parallel (issue 19)."""

from __future__ import annotations

from typing import Any

import trio

from ._peer import target_of, this_node
from ._rref import RRef


class _LocalOptimizer:
    """Made on a worker: the worker's own optimizer over the parameters of the objects given."""

    def __init__(self, optim: str, kwargs: dict[str, Any], *objects: Any) -> None:
        cls = this_node().resolve(optim)
        params: list[Any] = []
        for obj in objects:
            got = obj.parameters() if hasattr(obj, "parameters") else [obj]
            params.extend(got)
        self.opt = cls(params, **kwargs)

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()


class DistributedOptimizer:
    """An optimizer over parameters on several workers: one local optimizer per owner, stepped there.

    Args:
        optimizer_class: A module-level optimizer class, e.g. ``ag.optim.SGD`` (sent by name).
        params_rref: RRefs of remote objects with a ``parameters()`` method (or of tensors).
        **kwargs: The optimizer's arguments (``lr=...``).

    Example::

        opt = dist.optim.DistributedOptimizer(ag.optim.SGD, [table_rref], lr=0.1)
        await loss.backward()
        await opt.step()
    """

    def __init__(self, optimizer_class: Any, params_rref: list[RRef], **kwargs: Any) -> None:
        if not params_rref:
            raise ValueError("DistributedOptimizer needs at least one RRef of parameters")
        for r in params_rref:
            if not isinstance(r, RRef):
                raise TypeError(f"DistributedOptimizer takes RRefs of remote parameters, got {type(r).__name__}")
        self._target = target_of(optimizer_class)
        self._kwargs = kwargs
        self._by_owner: dict[str, list[RRef]] = {}
        for r in params_rref:
            self._by_owner.setdefault(r.owner.name, []).append(r)
        self._remote: dict[str, RRef] | None = None

    async def _ensure(self) -> dict[str, RRef]:
        if self._remote is None:
            made: dict[str, RRef] = {}

            async def make(name: str, refs: list[RRef]) -> None:
                made[name] = await refs[0].owner.remote(
                    _LocalOptimizer, self._target, self._kwargs, *refs  # top level: each arrives as the object
                )

            async with trio.open_nursery() as n:
                for name, refs in self._by_owner.items():
                    n.start_soon(make, name, refs)
            self._remote = made
        return self._remote

    async def _each(self, method: str) -> None:
        remote = await self._ensure()
        if len(remote) == 1:  # one owner (a parameter server): no task to start
            (r,) = remote.values()
            await r.call(method)
            return
        async with trio.open_nursery() as n:
            for r in remote.values():
                n.start_soon(r.call, method)

    async def step(self) -> None:
        """One step of every worker's optimizer, in parallel; returns when all have stepped."""
        await self._each("step")

    async def zero_grad(self) -> None:
        """Reset the gradients of every remote parameter."""
        await self._each("zero_grad")
