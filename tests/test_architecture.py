"""The package's import structure, as DESIGN.md ("Layers") states it, measured from the code's own imports.

Run ``python -m tests.test_architecture`` for the report (modules per layer, every import edge between layers,
cycles, function-level imports); the tests below assert it. Imports are read from the source (``ast``),
so a lazy ``importlib`` load is not seen: the only ones allowed are listed in `LAZY`.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import sys
from collections import defaultdict

PKG = pathlib.Path(__file__).resolve().parent.parent / "asyncgrad"

# the layers, bottom up: a module may import its own layer and the ones below, never one above
LAYERS = [
    ("_openblas_env",),  # imports numpy only, first of all (see its docstring)
    ("actors",),
    ("devices",),
    ("kernels",),  # compiled kernels and their numpy twins: plain functions on arrays
    ("runtime",),
    ("ops",),
    ("autograd",),
    ("_tensor_methods",),
    ("nn", "optim", "utils", "hosting", "distributed", "cuda"),
    ("__init__",),
]
# imports between packages of the top layer, which build on each other as PyTorch's do
SIBLINGS = {("nn", "distributed"), ("distributed", "optim"), ("utils", "nn"), ("distributed", "utils")}
# core layers (runtime, ops, autograd) build on each other's private modules; the layers above them use only
# the names a package's __init__ exports
CORE = {"_openblas_env", "actors", "devices", "kernels", "runtime", "ops", "autograd", "_tensor_methods"}
# the places allowed to load asyncgrad modules lazily: the public face (heavy optional subpackages) and nn's
# (`nn.parallel`, which builds on the distributed layer)
LAZY = {"asyncgrad/__init__.py", "asyncgrad/nn/__init__.py"}
# the one allowed cycle: Device and Stream name each other, one side only for type checking
TYPE_ONLY_PAIR = {"asyncgrad.devices._device", "asyncgrad.devices._stream"}


def _modname(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer_of(mod: str) -> tuple[int, str]:
    parts = mod.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i, top
    raise AssertionError(f"{mod}: no layer for {top!r}; add it to LAYERS")


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    """Absolute names of the asyncgrad modules an ``from X import a, b`` statement loads."""
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("asyncgrad"):
        return []
    out = []
    for a in node.names:  # `from . import _grad_mode` loads a submodule, not the package's other names
        cand = f"{target}.{a.name}"
        if (PKG.parent / cand.replace(".", "/")).with_suffix(".py").exists() or (
            PKG.parent / cand.replace(".", "/") / "__init__.py"
        ).exists():
            out.append(cand)
        elif target not in out:
            out.append(target)
    return out


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    """A module's syntax tree, parsed once per process (each test builds its own `Graph`; nothing mutates
    the trees)."""
    return ast.parse(path.read_text(), str(path))


class Graph:
    """Every import between asyncgrad modules: module-level (with type-only ones apart) and function-level."""

    def __init__(self) -> None:
        self.modules: dict[str, pathlib.Path] = {}
        self.edges: dict[str, set[str]] = defaultdict(set)  # module-level, executed at import
        self.type_only: dict[str, set[str]] = defaultdict(set)
        self.nested: list[tuple[str, int, str]] = []  # (module, line, target) inside a function
        for path in sorted(PKG.rglob("*.py")):
            mod = _modname(path)
            self.modules[mod] = path
            tree = _tree(path)
            is_pkg = path.name == "__init__.py"
            self._walk(mod, is_pkg, tree.body, nested=False, type_only=False)

    def _walk(self, mod: str, is_pkg: bool, body: list[ast.stmt], nested: bool, type_only: bool) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) or isinstance(node, ast.Import):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names if a.name.startswith("asyncgrad")]
                else:
                    targets = _resolve(mod, is_pkg, node)
                for t in targets:
                    if nested:
                        self.nested.append((mod, node.lineno, t))
                    elif type_only:
                        self.type_only[mod].add(t)
                    else:
                        self.edges[mod].add(t)
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                self._walk(mod, is_pkg, node.body, nested, True)
                self._walk(mod, is_pkg, node.orelse, nested, type_only)
                continue
            inner = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or nested
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    stmts = [h for h in sub if isinstance(h, ast.stmt)]
                    for h in sub:
                        if isinstance(h, ast.ExceptHandler):
                            stmts.extend(h.body)
                    self._walk(mod, is_pkg, stmts, inner, type_only)

    def upward(self) -> list[str]:
        """Module-level imports that run from a lower layer to a higher one (or between top-layer packages
        that `SIBLINGS` does not allow)."""
        bad = []
        for src, targets in self.edges.items():
            ls, ps = _layer_of(src)
            for t in targets:
                lt, pt = _layer_of(t)
                if lt > ls or (lt == ls and ps != pt and (ps, pt) not in SIBLINGS and ls == len(LAYERS) - 2):
                    bad.append(f"{src} -> {t} (layer {ps} imports {pt})")
        return sorted(bad)

    def private_reach(self) -> list[str]:
        """Imports of another package's private module by a module above the core."""
        bad = []
        for src, targets in self.edges.items():
            _, ps = _layer_of(src)
            if ps in CORE:
                continue
            for t in targets:
                _, pt = _layer_of(t)
                if pt != ps and any(p.startswith("_") for p in t.split(".")[2:]):
                    bad.append(f"{src} -> {t}")
        return sorted(bad)

    def cycles(self) -> list[list[str]]:
        """Strongly connected components of more than one module (Tarjan), type-only imports included."""
        graph = {m: set(self.edges.get(m, ())) | set(self.type_only.get(m, ())) for m in self.modules}
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on: set[str] = set()
        out: list[list[str]] = []
        counter = [0]
        sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

        def visit(v: str) -> None:
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on.add(v)
            for w in graph.get(v, ()):
                if w not in graph:
                    continue
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

        for m in graph:
            if m not in index:
                visit(m)
        return out

    def nested_imports(self) -> list[str]:
        allowed = {m for m, path in self.modules.items() if str(path.relative_to(PKG.parent)) in LAZY}
        return [f"{m}:{line} imports {t}" for m, line, t in self.nested if m not in allowed]


def test_no_import_runs_upward() -> None:
    assert Graph().upward() == []


def test_layers_above_the_core_use_only_package_faces() -> None:
    assert Graph().private_reach() == []


def test_no_import_cycle_but_the_type_only_devices_pair() -> None:
    g = Graph()
    cycles = g.cycles()
    assert all(set(c) == TYPE_ONLY_PAIR for c in cycles), cycles
    # and that pair is a cycle only through a type-only import
    assert not any(set(c) == TYPE_ONLY_PAIR for c in _cycles_without_type_only(g))


def _cycles_without_type_only(g: Graph) -> list[list[str]]:
    g2 = Graph.__new__(Graph)
    g2.modules, g2.edges, g2.type_only, g2.nested = g.modules, g.edges, defaultdict(set), g.nested
    return g2.cycles()


def test_no_function_level_import_of_asyncgrad_modules() -> None:
    assert Graph().nested_imports() == []


# a layer above may register a kernel-only op (no backward rule) to queue its own transfers in stream order
KERNEL_ONLY_OPS = {"asyncgrad.distributed._streams"}  # RPC: staging a tensor's copy-out into a wire buffer


def test_every_op_is_defined_in_an_op_family() -> None:
    """``defop`` is called only in ``asyncgrad/ops/``: one file per family holds every op's kernel and rule."""
    outside = []
    for mod, path in Graph().modules.items():
        if mod.startswith("asyncgrad.ops") or mod in KERNEL_ONLY_OPS:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "defop":
                outside.append(f"{mod}:{node.lineno}")
    assert outside == []


def test_every_module_has_a_layer() -> None:
    for mod in Graph().modules:
        _layer_of(mod)


def main() -> None:
    g = Graph()
    per: dict[str, int] = defaultdict(int)
    for m in g.modules:
        per[_layer_of(m)[1]] += 1
    print("modules per package:", dict(per))
    between: dict[tuple[str, str], int] = defaultdict(int)
    for src, targets in g.edges.items():
        for t in targets:
            a, b = _layer_of(src)[1], _layer_of(t)[1]
            if a != b:
                between[(a, b)] += 1
    print("imports between packages (module-level):")
    for (a, b), n in sorted(between.items()):
        print(f"  {a:>16} -> {b:<16} {n}")
    print("upward imports:", g.upward() or "none")
    print("private modules reached from above the core:", g.private_reach() or "none")
    print("cycles:", g.cycles() or "none", "(type-only imports counted)")
    print("function-level imports of asyncgrad modules:", g.nested_imports() or "none",
          f"(allowed lazy loads: {sorted(LAZY)})")


if __name__ == "__main__":
    main()
