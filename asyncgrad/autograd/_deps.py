"""Dependency counting for a backward pass: how many senders each reachable node waits for, and which nodes
a pass with explicit inputs needs to run at all."""

from __future__ import annotations

from typing import Any

from ..runtime._node import Node, OpNode

RETAIN_MSG = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they "
    "have already been freed). Saved intermediate values of the graph are freed when you call "
    "backward() or grad(). Specify retain_graph=True if you need to backward through the graph a "
    "second time or if you need to access saved tensors after calling backward."
)


def count_dependencies(
    roots: list[tuple[Any, int]], targets: set[Any] | None
) -> tuple[dict[Node, int], set[Node] | None]:
    """How many edges lead into each node reachable from ``roots``; with ``targets`` (the keys of the
    inputs of a ``grad()`` / ``backward(inputs=...)``), also the nodes from which one of them is reachable
    (None: run every node)."""
    deps: dict[Node, int] = {}
    stack = [n for n, _ in roots if isinstance(n, Node)]
    # a node is seen once it has a count (no set of its own to fill per node), or when it is a root
    root_nodes: set[Node] = set(stack)
    order: list[Node] | None = None if targets is None else []
    get = deps.get
    while stack:
        node = stack.pop()
        if (node.args is None) if type(node) is OpNode else node._released:
            raise RuntimeError(RETAIN_MSG)
        if order is not None:
            order.append(node)
        for e in node.next:
            if e is not None:
                tgt = e[0]
                if isinstance(tgt, Node):
                    c = get(tgt)
                    if c is not None:
                        deps[tgt] = c + 1
                    else:
                        deps[tgt] = 1
                        if tgt not in root_nodes:
                            stack.append(tgt)
    if order is None:
        return deps, None
    # with explicit inputs, run only nodes from which some input is reachable (reverse topological)
    runs: set[Node] = set()
    assert targets is not None  # order exists only with targets
    for node in reversed(_topo(order, deps)):
        for e in node.next:
            if e is not None and (
                e[0] in runs or (e[0], e[1]) in targets
                if isinstance(e[0], Node)
                else id(e[0]) in targets
            ):
                runs.add(node)
                break
    return deps, runs


def _topo(order: list[Node], deps: dict[Node, int]) -> list[Node]:
    """Nodes such that each comes before the nodes it sends gradients to (Kahn's algorithm)."""
    indeg = dict(deps)
    ready = [n for n in order if indeg.get(n, 0) == 0]
    out = []
    while ready:
        n = ready.pop()
        out.append(n)
        for e in n.next:
            if e is not None and isinstance(e[0], Node):
                indeg[e[0]] -= 1
                if indeg[e[0]] == 0:
                    ready.append(e[0])
    return out
