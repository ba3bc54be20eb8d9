"""Recorded torch references: the tests that compare with PyTorch run without torch installed.

A test asks for the ``torch_ref`` fixture and wraps everything it computes with torch in one function of
``torch`` that returns plain values (torch tensors, numpy arrays, scalars, strings, dtypes, and lists,
tuples and dicts of them)::

    async def test_addcmul(rt, torch_ref):
        a = np.random.default_rng(3).standard_normal((3, 4))
        want = torch_ref("addcmul", lambda torch: torch.addcmul(torch.tensor(a), ...), a=a)
        np.testing.assert_allclose(ag.addcmul(...).numpy(), want)

The keyword arguments are the case's inputs: they are stored beside the outputs, and a run whose inputs
differ from the recorded ones fails (the recording is stale). Where the torch function builds things of
its own (a module's initial weights from torch's generator), it returns them as outputs too.

One safetensors file per test case lives under ``tests/references/`` (the test module's path, then the
test's name with its parameters). What ``torch_ref`` returns depends on ``ASYNCGRAD_TORCH_REFERENCES``
and on whether torch can be imported:

- torch not installed: the recorded outputs. A missing file or case fails the test (never skips).
- torch installed: the function runs live and its result is returned, and the recorded outputs must match
  it (a missing or stale recording fails here too).
- ``ASYNCGRAD_TORCH_REFERENCES=record`` (what ``python -m tests.record_references`` sets): the function
  runs live and the case's file is written anew.

Live and recorded results have exactly the same Python types (live results go through the same encoding),
so a test cannot pass one way and fail the other by type alone. Recording is reproducible: torch runs on
one thread, seeded from the case's name before each function, in float32 by default, and the files are
written with a fixed layout, so recording twice gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REFERENCES = Path(__file__).resolve().parent / "references"
ENV = "ASYNCGRAD_TORCH_REFERENCES"
ENV_DIR = "ASYNCGRAD_TORCH_REFERENCES_DIR"  # record into another folder (the reproducibility check)
META_KEY = "asyncgrad-reference"
FORMAT = 1
# inputs up to this many bytes are stored as they are (readable when a stale case is debugged); larger
# ones by digest only, so the files stay small
INPUT_RAW_MAX_BYTES = 1 << 15
# recorded against live outputs: an old recording is caught, a last-bit difference between CPUs is not
LIVE_RTOL = 1e-5
LIVE_ATOL = 1e-7
RECORD_COMMAND = "python -m tests.record_references"


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def mode() -> str:
    """``record``, ``live`` (torch installed) or ``replay`` (torch not installed)."""
    if os.environ.get(ENV, "") == "record":
        if _torch() is None:
            raise RuntimeError(f"{ENV}=record needs torch: pip install -e '.[compare]'")
        return "record"
    return "live" if _torch() is not None else "replay"


def references_dir() -> Path:
    return Path(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else REFERENCES


def case_path(nodeid: str, root: Path | None = None) -> Path:
    """The file of one test case: ``tests/ops/test_x.py::test_y[a-b]`` -> ``ops/test_x/test_y[a-b].safetensors``."""
    module, _, name = nodeid.partition("::")
    rel = Path(module)
    if rel.parts and rel.parts[0] == "tests":
        rel = Path(*rel.parts[1:])
    rel = rel.with_suffix("")
    name = name.replace("::", ".")
    safe = re.sub(r"[^A-Za-z0-9_.,=+\-\[\]]", "_", name)
    if safe != name or len(safe) > 120:
        # a lossy or long name gets the original's digest, so two cases never share a file
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        safe = f"{safe[:100]}~{digest}"
    return (root or references_dir()) / rel / f"{safe}.safetensors"


# ---- encoding: plain values <-> a JSON skeleton plus named arrays ----------------------------------------


class _Encoder:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.arrays: dict[str, np.ndarray] = {}

    def array(self, a: np.ndarray, tag: str) -> dict[str, Any]:
        name = f"{self.prefix}{len(self.arrays)}"
        # (np.ascontiguousarray makes a 0-d array 1-d: the reshape keeps its shape)
        a = np.ascontiguousarray(a).reshape(a.shape)
        if a.dtype.kind == "c":
            # safetensors has no complex dtype: the (real, imag) pairs as floats
            self.arrays[name] = np.stack([a.real, a.imag], axis=-1)
            return {tag: name, "complex": a.dtype.str}
        self.arrays[name] = a
        return {tag: name}

    def encode(self, v: Any) -> Any:
        torch = _torch()
        if torch is not None:
            if isinstance(v, torch.Tensor):
                t = v.detach().cpu()
                if t.dtype == torch.bfloat16:
                    raise TypeError("torch_ref: bfloat16 has no numpy dtype; return t.float() and say so")
                if t.layout != torch.strided:
                    t = t.to_dense()
                return self.array(t.resolve_conj().resolve_neg().numpy().copy(), "$array")
            if isinstance(v, torch.dtype):
                return str(v)
            if isinstance(v, torch.Size):
                return {"$tuple": [int(d) for d in v]}
            if isinstance(v, torch.device):
                return str(v)
        # numpy scalars first: np.float64 is also a Python float, and must come back as itself
        if isinstance(v, np.generic):
            return self.array(np.asarray(v), "$scalar")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, np.ndarray):
            return self.array(v, "$array")
        if isinstance(v, tuple):
            return {"$tuple": [self.encode(x) for x in v]}
        if isinstance(v, list):
            return [self.encode(x) for x in v]
        if isinstance(v, dict):
            return {"$dict": [[self.encode(k), self.encode(x)] for k, x in v.items()]}
        if isinstance(v, np.dtype):
            return {"$dtype": v.str}
        raise TypeError(
            f"torch_ref: cannot record a {type(v).__name__}; return arrays, tensors, scalars, strings, dtypes, "
            "or lists, tuples and dicts of them"
        )


def _decode(v: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(v, list):
        return [_decode(x, arrays) for x in v]
    if not isinstance(v, dict):
        return v
    if "$tuple" in v:
        return tuple(_decode(x, arrays) for x in v["$tuple"])
    if "$dict" in v:
        return {_hashable(_decode(k, arrays)): _decode(x, arrays) for k, x in v["$dict"]}
    if "$dtype" in v:
        return np.dtype(v["$dtype"])
    tag = "$array" if "$array" in v else "$scalar"
    a = arrays[v[tag]]
    if "complex" in v:
        a = np.asarray(a[..., 0] + 1j * a[..., 1]).astype(np.dtype(v["complex"]))
    a = a.copy()  # writeable, owned by the test
    return a if tag == "$array" else a[()]


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _digest(a: np.ndarray) -> str:
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())  # C order whatever the layout
    return h.hexdigest()


def _encode_inputs(inputs: dict[str, Any], prefix: str) -> tuple[Any, dict[str, np.ndarray]]:
    """Inputs as a skeleton: small arrays stored, large ones by digest."""
    enc = _Encoder(prefix)

    def walk(v: Any) -> Any:
        if isinstance(v, np.ndarray) and v.nbytes > INPUT_RAW_MAX_BYTES:
            return {"$digest": _digest(v), "dtype": v.dtype.str, "shape": list(v.shape)}
        if isinstance(v, (list, tuple)):
            items = [walk(x) for x in v]
            return {"$tuple": items} if isinstance(v, tuple) else items
        if isinstance(v, dict):
            return {"$dict": [[enc.encode(k), walk(x)] for k, x in v.items()]}
        return enc.encode(v)

    return walk(inputs), enc.arrays


def _inputs_equal(recorded: Any, given: Any, arrays: dict[str, np.ndarray]) -> str | None:
    """None when ``given`` is what was recorded, else where they differ."""

    def walk(r: Any, g: Any, where: str) -> str | None:
        if isinstance(r, dict) and "$digest" in r:
            if not isinstance(g, np.ndarray) or _digest(g) != r["$digest"]:
                return f"{where}: a {r['dtype']} array of shape {tuple(r['shape'])} with other values"
            return None
        if isinstance(r, dict) and "$tuple" in r:
            if not isinstance(g, tuple) or len(g) != len(r["$tuple"]):
                return f"{where}: recorded a tuple of {len(r['$tuple'])}, given {g!r:.80}"
            return next((e for i, (a, b) in enumerate(zip(r["$tuple"], g)) if (e := walk(a, b, f"{where}[{i}]"))),
                        None)
        if isinstance(r, list):
            if not isinstance(g, list) or len(g) != len(r):
                return f"{where}: recorded a list of {len(r)}, given {g!r:.80}"
            return next((e for i, (a, b) in enumerate(zip(r, g)) if (e := walk(a, b, f"{where}[{i}]"))), None)
        if isinstance(r, dict) and "$dict" in r:
            if not isinstance(g, dict) or len(g) != len(r["$dict"]):
                return f"{where}: recorded a dict of {len(r['$dict'])} items"
            for (k, x), gk in zip(r["$dict"], g):
                if _hashable(_decode(k, arrays)) != gk:
                    return f"{where}: recorded key {k!r}, given {gk!r}"
                if e := walk(x, g[gk], f"{where}[{gk!r}]"):
                    return e
            return None
        want = _decode(r, arrays)
        if isinstance(want, (np.ndarray, np.generic)):
            ga = np.asarray(g)
            if ga.dtype != want.dtype or ga.shape != np.shape(want) or not np.array_equal(ga, want, equal_nan=True):
                return f"{where}: recorded {want!r:.120}, given {g!r:.120}"
            return None
        same = want == g or (isinstance(want, float) and isinstance(g, float) and want != want and g != g)
        return None if same and type(want) is type(g) else f"{where}: recorded {want!r}, given {g!r}"

    return walk(recorded, given, "inputs")


def _outputs_close(recorded: Any, live: Any, where: str = "output") -> str | None:
    """None when a recorded output matches the live one (floats within LIVE_RTOL/ATOL), else where not."""
    if type(recorded) is not type(live):
        return f"{where}: recorded a {type(recorded).__name__}, live gives a {type(live).__name__}"
    if isinstance(recorded, (list, tuple)):
        if len(recorded) != len(live):
            return f"{where}: recorded {len(recorded)} items, live gives {len(live)}"
        return next((e for i, (a, b) in enumerate(zip(recorded, live)) if (e := _outputs_close(a, b, f"{where}[{i}]"))),
                    None)
    if isinstance(recorded, dict):
        if list(recorded) != list(live):
            return f"{where}: recorded keys {list(recorded)}, live gives {list(live)}"
        return next((e for k in recorded if (e := _outputs_close(recorded[k], live[k], f"{where}[{k!r}]"))), None)
    if isinstance(recorded, (np.ndarray, np.generic)):
        r, g = np.asarray(recorded), np.asarray(live)
        if r.dtype != g.dtype or r.shape != g.shape:
            return f"{where}: recorded {r.dtype}{r.shape}, live gives {g.dtype}{g.shape}"
        if r.dtype.kind in "fc":
            ok = np.allclose(r, g, rtol=LIVE_RTOL, atol=LIVE_ATOL, equal_nan=True)
        else:
            ok = np.array_equal(r, g)
        return None if ok else f"{where}: recorded values differ from live torch's (max |diff| {np.abs(r - g).max()})"
    if isinstance(recorded, float) and recorded != recorded and live != live:
        return None
    if isinstance(recorded, float):
        return None if np.isclose(recorded, live, rtol=LIVE_RTOL, atol=LIVE_ATOL) else f"{where}: {recorded} vs {live}"
    return None if recorded == live else f"{where}: recorded {recorded!r}, live gives {live!r}"


# ---- one test case's file ------------------------------------------------------------------------------


def _read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = json.loads((f.metadata() or {})[META_KEY])
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != FORMAT:
        raise RuntimeError(f"{path}: reference format {meta.get('format')}, this suite reads {FORMAT}")
    return meta, arrays


def _write(path: Path, cases: dict[str, Any], arrays: dict[str, np.ndarray], torch_version: str) -> None:
    from safetensors.numpy import save

    meta = {"format": FORMAT, "torch": torch_version, "cases": cases}
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = save(dict(sorted(arrays.items())), metadata={META_KEY: text})
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


class TorchRef:
    """The ``torch_ref`` fixture's object: call it once per reference value of a test case."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.mode = mode()
        self.path = case_path(nodeid)
        self._recorded: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None
        self._cases: dict[str, Any] = {}
        self._arrays: dict[str, np.ndarray] = {}

    @property
    def torch(self) -> Any:
        """The torch module when it runs live (installed), else None."""
        return _torch() if self.mode != "replay" else None

    def __call__(self, key: str, fn: Callable[[Any], Any], /, **inputs: Any) -> Any:
        """The reference value ``fn(torch)`` for this case's ``key``: recorded, or live and checked.

        Args:
            key: names the value within the test case (unique in the case).
            fn: computes it with torch; gets the torch module, returns plain values or torch tensors.
            **inputs: the values the computation depends on (numpy arrays, scalars, ...): recorded and
                compared, so a test whose inputs changed fails until it is recorded again.
        """
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", key):
            raise ValueError(f"torch_ref: key {key!r} must be letters, digits, '_', '.' or '-'")
        if key in self._cases:
            raise ValueError(f"torch_ref: key {key!r} used twice in {self.nodeid}")
        if self.mode == "replay":
            self._cases[key] = None
            return self._replay(key, inputs)
        live_skeleton, live_arrays = self._run_live(key, fn)
        # through JSON as a recording goes, so live and replayed results have the same types
        live_skeleton = json.loads(json.dumps(live_skeleton, allow_nan=True))
        result = _decode(live_skeleton, live_arrays)
        in_skeleton, in_arrays = _encode_inputs(inputs, f"{key}/in")
        self._cases[key] = {"inputs": in_skeleton, "outputs": live_skeleton}
        self._arrays.update(in_arrays)
        self._arrays.update(live_arrays)
        if self.mode == "live":
            recorded = self._replay(key, inputs)
            if err := _outputs_close(recorded, result):
                pytest.fail(f"{self.path}: case {key!r} is stale against live torch ({err}); run {RECORD_COMMAND}")
        return result

    def _run_live(self, key: str, fn: Callable[[Any], Any]) -> tuple[Any, dict[str, np.ndarray]]:
        torch = _torch()
        threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
        rng_state = torch.random.get_rng_state()
        # a seed of the case's own, so what torch draws does not depend on which tests ran before
        torch.manual_seed(zlib.crc32(f"{self.nodeid}/{key}".encode()))
        torch.set_num_threads(1)
        try:
            value = fn(torch)
            enc = _Encoder(f"{key}/out")
            return enc.encode(value), enc.arrays
        finally:
            torch.set_num_threads(threads)
            torch.set_default_dtype(dtype)
            torch.random.set_rng_state(rng_state)

    def _replay(self, key: str, inputs: dict[str, Any]) -> Any:
        if self._recorded is None:
            if not self.path.exists():
                pytest.fail(f"no recorded torch reference for {self.nodeid} ({self.path}); run {RECORD_COMMAND}")
            self._recorded = _read(self.path)
        meta, arrays = self._recorded
        case = meta["cases"].get(key)
        if case is None:
            pytest.fail(f"{self.path} has no case {key!r} (recorded: {sorted(meta['cases'])}); run {RECORD_COMMAND}")
        _encode_inputs(inputs, "")  # what could not be recorded fails in replay too, not only in live runs
        if err := _inputs_equal(case["inputs"], inputs, arrays):
            pytest.fail(f"{self.path}: case {key!r} was recorded with other inputs ({err}); run {RECORD_COMMAND}")
        return _decode(case["outputs"], arrays)

    def finish(self, passed: bool) -> None:
        """Write the case's file (record mode), or check no recorded case went unused (live and replay)."""
        if self.mode == "record":
            if self._cases:
                _write(self.path, self._cases, self._arrays, str(_torch().__version__))
            elif self.path.exists():
                self.path.unlink()
            return
        if passed and self._recorded is not None:
            unused = set(self._recorded[0]["cases"]) - set(self._cases)
            if unused:
                pytest.fail(f"{self.path} has cases this test no longer asks for: {sorted(unused)}; run "
                            f"{RECORD_COMMAND}")


@pytest.fixture
def torch_ref(request: pytest.FixtureRequest) -> Iterator[TorchRef]:
    """Reference values from torch: live where torch is installed, recorded otherwise (see tests/_reference.py)."""
    ref = TorchRef(request.node.nodeid)
    yield ref
    rep = getattr(request.node, "rep_call", None)
    ref.finish(passed=rep is not None and rep.passed)
