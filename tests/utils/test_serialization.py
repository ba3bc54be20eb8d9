"""`ag.save` / `ag.load`: safetensors checkpoints without pickle (issue 20, part 2)."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn


def _eq(a: Any, b: Any) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.numpy(), b.numpy())


async def test_roundtrip_nested_plain_and_tensors(rt: ag.Runtime, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    obj: dict[Any, Any]
    t64 = ag.tensor(rng.standard_normal((3, 4)), dtype=ag.float64)
    obj = {
        "model": OrderedDict(w=ag.tensor(rng.standard_normal((2, 2)).astype(np.float32)), b=ag.zeros(2)),
        "ints": ag.arange(5), "mask": ag.tensor([True, False]), "half": ag.ones(3, dtype=ag.float16),
        "u8": ag.tensor(np.arange(4, dtype=np.uint8)), "i32": ag.tensor(np.arange(3, dtype=np.int32)),
        "scalar0d": ag.tensor(3.5),
        "empty": ag.zeros(0, 3),
        "plain": [None, True, 3, 2.5, "text", (1, (2, "x")), float("inf")],
        0: "int key", 1.5: "float key", None: "none key",
        "same": [t64, t64],
        "ndarray": np.arange(6.0).reshape(2, 3),
        "np_scalar": np.float32(1.25),
        "dtype": ag.float64, "device": ag.device("cpu"),
    }
    path = tmp_path / "ckpt.safetensors"
    ag.save(obj, path)
    back = ag.load(path)
    assert set(back) == set(obj)
    assert isinstance(back["model"], OrderedDict) and list(back["model"]) == ["w", "b"]
    for k in ("ints", "mask", "half", "u8", "i32", "scalar0d", "empty"):
        assert isinstance(back[k], ag.Tensor)
        _eq(back[k], obj[k])
    _eq(back["model"]["w"], obj["model"]["w"])
    assert back["plain"] == [None, True, 3, 2.5, "text", (1, (2, "x")), float("inf")]
    assert type(back["plain"][2]) is int and type(back["plain"][3]) is float
    assert back[0] == "int key" and back[1.5] == "float key" and back[None] == "none key"
    assert back["same"][0] is back["same"][1]  # one object in, one object out
    assert isinstance(back["ndarray"], np.ndarray)
    np.testing.assert_array_equal(back["ndarray"], obj["ndarray"])
    assert back["np_scalar"] == np.float32(1.25) and back["np_scalar"].dtype == np.float32
    assert back["dtype"] == np.float64 and back["device"] == ag.device("cpu")
    # loaded tensors own writable memory: in-place ops work
    with ag.no_grad():
        back["model"]["w"].add_(1.0)


async def test_layouts_come_back(rt: ag.Runtime) -> None:
    base = np.random.default_rng(1).standard_normal((2, 3, 4, 5))
    cl = ag.tensor(base).contiguous()
    cl = ag.tensor(np.ascontiguousarray(base.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2))  # channels-last
    tr = ag.tensor(np.asfortranarray(base[0, 0]))
    sliced = ag.tensor(base)[:, ::2]  # not dense: stored C-contiguous
    buf = io.BytesIO()
    ag.save({"cl": cl, "tr": tr, "sliced": sliced}, buf)
    buf.seek(0)
    back = ag.load(buf)
    assert back["cl"].stride() == cl.stride() == (60, 1, 15, 3)
    assert back["tr"].stride() == tr.stride()
    for k in ("cl", "tr", "sliced"):
        np.testing.assert_array_equal(back[k].numpy(), {"cl": cl, "tr": tr, "sliced": sliced}[k].numpy())
    assert back["sliced"].is_contiguous()


async def test_parameters_requires_grad_and_map_location(rt: ag.Runtime, tmp_path: Path) -> None:
    m = nn.Linear(3, 2)
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2  # a non-leaf saves its value and loads as a leaf, as in PyTorch
    p = tmp_path / "p.st"
    ag.save({"w": m.weight, "x": x, "y": y, "sd": m.state_dict()}, str(p))
    for loc in (None, "cpu", ag.device("cpu"), {"cpu:0": "cpu"}, {"cpu": "cpu"}):
        back: Any = ag.load(p, map_location=loc, weights_only=True)
        assert isinstance(back["w"], ag.Tensor) and isinstance(back["w"], nn.Parameter)
        assert back["w"].requires_grad
        assert back["x"].requires_grad and back["x"].is_leaf and not back["y"].requires_grad
        _eq(back["w"], m.weight)
    seen: list[str] = []
    def remap(t: ag.Tensor, loc: str) -> ag.Tensor:
        seen.append(loc)
        return t * 1

    back = ag.load(p, map_location=remap, weights_only=False)
    assert seen and set(seen) == {"cpu"}
    with pytest.raises(RuntimeError, match="map_location='cpu'"):
        ag.load(p, map_location="cuda")
    with pytest.raises(TypeError, match="unexpected keyword"):
        ag.load(p, bogus=1)


async def test_module_and_optimizer_checkpoint(rt: ag.Runtime, tmp_path: Path) -> None:
    ag.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = ag.optim.Adam(m.parameters(), lr=1e-2)
    x = ag.randn(5, 4)
    for _ in range(2):
        opt.zero_grad()
        await m(x).pow(2).sum().backward()
        opt.step()
    ckpt = {"model": m.state_dict(), "optim": opt.state_dict(), "epoch": 2}
    ag.save(ckpt, tmp_path / "c.st")
    back = ag.load(tmp_path / "c.st")
    m2 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt2 = ag.optim.Adam(m2.parameters(), lr=1e-2)
    m2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optim"])
    assert back["epoch"] == 2
    for mm, oo in ((m, opt), (m2, opt2)):
        oo.zero_grad()
        await mm(x).pow(2).sum().backward()
        oo.step()
    np.testing.assert_array_equal(m2(x).numpy(), m(x).numpy())


async def test_other_tools_read_and_write_the_format(rt: ag.Runtime, tmp_path: Path, torch_ref) -> None:
    import safetensors.numpy

    rng = np.random.default_rng(2)
    m = nn.Linear(3, 2, dtype=ag.float64)
    # fixed weights: the file's bytes are the recorded input of the torch side
    m.load_state_dict({"weight": rng.standard_normal((2, 3)), "bias": rng.standard_normal(2)})
    ag.save(m.state_dict(), tmp_path / "m.st")
    m_st = np.frombuffer((tmp_path / "m.st").read_bytes(), dtype=np.uint8).copy()
    x = np.random.default_rng(2).standard_normal((4, 3))

    def reference(torch: Any) -> Any:
        import safetensors.torch

        (tmp_path / "m_for_torch.st").write_bytes(m_st.tobytes())
        sd = safetensors.torch.load_file(str(tmp_path / "m_for_torch.st"))  # PyTorch reads it as a state dict
        tm = torch.nn.Linear(3, 2, dtype=torch.float64)
        tm.load_state_dict(sd)
        # and a file PyTorch writes (its bytes, for asyncgrad to load)
        safetensors.torch.save_file(tm.state_dict(), str(tmp_path / "t_by_torch.st"))
        t_st = np.frombuffer((tmp_path / "t_by_torch.st").read_bytes(), dtype=np.uint8).copy()
        return tm(torch.from_numpy(x)).detach(), t_st

    tout, t_st = torch_ref("safetensors_torch", reference, m_st=m_st, x=x)
    # the same weights through two BLAS libraries: torch's 3-term dot products round differently from
    # OpenBLAS's in the last bit (exact equality held only when torch happened to take the same kernel)
    np.testing.assert_allclose(tout, m(ag.tensor(x)).numpy(), rtol=1e-14, atol=1e-15)
    assert set(safetensors.numpy.load_file(str(tmp_path / "m.st"))) == {"weight", "bias"}
    # and a file PyTorch wrote loads as {name: Tensor}, into a strict load_state_dict
    (tmp_path / "t.st").write_bytes(t_st.tobytes())
    back = ag.load(tmp_path / "t.st")
    assert list(back) == ["bias", "weight"] or set(back) == {"weight", "bias"}
    m2 = nn.Linear(3, 2, dtype=ag.float64)
    m2.load_state_dict(back)
    np.testing.assert_array_equal(m2(ag.tensor(x)).numpy(), m(ag.tensor(x)).numpy())


async def test_bad_objects_are_refused_on_save(rt: ag.Runtime) -> None:
    with pytest.raises(TypeError, match=r"obj\['a'\]\['b'\] is a set"):
        ag.save({"a": {"b": {1, 2}}}, io.BytesIO())
    with pytest.raises(TypeError, match="is a object"):
        ag.save([object()], io.BytesIO())
    with pytest.raises(TypeError, match="has a key of type tuple"):
        ag.save({(1, 2): 3}, io.BytesIO())
    with pytest.raises(TypeError, match="cannot store"):
        ag.save(np.array(["a"]), io.BytesIO())
    deep: list = []
    cur = deep
    for _ in range(100):
        cur.append([])
        cur = cur[0]
    with pytest.raises(TypeError, match="nested more than"):
        ag.save(deep, io.BytesIO())
    with pytest.raises(TypeError, match="unexpected keyword"):
        ag.save({}, io.BytesIO(), protocol=2)


# ---- crafted files are refused and run nothing ------------------------------------------------------


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _header_file(header: object, data: bytes = b"", *, claim: int | None = None) -> bytes:
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(h) if claim is None else claim) + h + data


def _good(tmp_path: Path) -> bytes:
    import safetensors.numpy

    return safetensors.numpy.save({"a": np.arange(4, dtype=np.float32)})


async def test_malicious_files_are_refused(rt: ag.Runtime, tmp_path: Path, torch_ref) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps({"w": _Evil(str(marker))})
    assert b"system" in evil
    cases: dict[str, tuple[bytes, str]] = {
        "pickle": (evil, "looks like a pickle"),
        "pickle0": (pickle.dumps(_Evil(str(marker)), protocol=0), "looks like a pickle|not valid"),
        "empty": (b"", "fewer than the 8-byte"),
        "huge header": (struct.pack("<Q", 1 << 40) + b"{}", "over the .*-byte limit"),
        "header past the end": (_header_file({}, claim=4096), "the file has only"),
        "not json": (_header_file(b"{not json}   "), "not valid UTF-8 JSON"),
        "not an object": (_header_file(b"[1, 2]"), "does not start with a JSON object"),
        "unknown dtype": (_header_file({"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}, b"\0\0"),
                          "dtype 'BF16'"),
        "size lie": (_header_file({"a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 8]}}, b"\0" * 8),
                     "needs 4000 bytes but claims 8"),
        "offsets past data": (_header_file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
                              "data section has 8 bytes"),
        "overlap": (_header_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
                    "overlap"),
        "negative shape": (_header_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}),
                           "bad shape"),
        "extra field": (_header_file({"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0], "x": 1}}),
                        "exactly dtype, shape and data_offsets"),
        "bad metadata": (_header_file({"__metadata__": {"asyncgrad": 3}}), "string-to-string"),
        "bad structure json": (_header_file({"__metadata__": {"asyncgrad": "{nope"}}), "not valid JSON"),
        "unknown tag": (_header_file({"__metadata__": {"asyncgrad": json.dumps(
            {"version": 1, "obj": {"T": "pickle", "v": "cos\nsystem\n"}})}}), "unknown tag 'pickle'"),
        "missing tensor": (_header_file({"__metadata__": {"asyncgrad": json.dumps(
            {"version": 1, "obj": {"T": "tensor", "k": "nope"}})}}), "does not hold"),
        "bad version": (_header_file({"__metadata__": {"asyncgrad": json.dumps({"version": 99, "obj": 1})}}),
                        "unknown layout or version"),
        "deep structure": (_header_file({"__metadata__": {"asyncgrad": json.dumps(
            {"version": 1, "obj": json.loads('{"T": "list", "items": [' * 80 + "]}" * 80)})}}), "nested more"),
    }

    def torch_zip(torch: Any) -> np.ndarray:
        zbuf = io.BytesIO()
        torch.save({"w": torch.zeros(2)}, zbuf)
        return np.frombuffer(zbuf.getvalue(), dtype=np.uint8).copy()

    cases["torch zip"] = (torch_ref("torch_save_zip", torch_zip).tobytes(), "zip archive.*pickles")
    for name, (data, msg) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.bin"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=msg):
            ag.load(path)
        with pytest.raises(ValueError, match=msg):
            ag.load(io.BytesIO(data))
    assert not marker.exists()  # nothing ran
    # a good file still loads, from a path and from an open file
    (tmp_path / "ok.st").write_bytes(_good(tmp_path))
    np.testing.assert_array_equal(ag.load(tmp_path / "ok.st")["a"].numpy(), np.arange(4))
    with open(tmp_path / "ok.st", "rb") as fh:
        np.testing.assert_array_equal(ag.load(fh)["a"].numpy(), np.arange(4))
    with open(tmp_path / "ok.st") as text_fh, pytest.raises(TypeError, match="binary mode"):
        ag.load(text_fh)  # type: ignore[arg-type]


_PROG = textwrap.dedent(
    """
    import sys
    import numpy as np
    import asyncgrad as ag
    from asyncgrad import nn

    def build():
        return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))

    async def main(mode, path):
        if mode == "save":
            ag.manual_seed(7)
            model = build()
            model.to(ag.float64)
            x = ag.randn(2, 2, 6, 6, dtype=ag.float64)
            ag.save({"model": model.state_dict(), "x": x, "y": model(x)}, path)
        else:
            ck = ag.load(path, map_location="cpu", weights_only=True)
            model = build().to(ag.float64)
            model.load_state_dict(ck["model"])
            y = model(ck["x"])
            assert np.array_equal(y.numpy(), ck["y"].numpy()), (y.numpy(), ck["y"].numpy())
            print("identical", float(abs(y - ck["y"]).max()))

    ag.run(main, sys.argv[1], sys.argv[2])
    """
)


def test_save_in_one_process_load_in_another(tmp_path: Path) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(_PROG)
    ck = tmp_path / "ck.safetensors"
    env = {**os.environ, "PYTHONPATH": str(Path(ag.__file__).parents[1])}
    for mode in ("save", "load"):
        r = subprocess.run(
            [sys.executable, str(prog), mode, str(ck)], capture_output=True, text=True, timeout=120, env=env
        )
        assert r.returncode == 0, r.stderr
    assert "identical 0.0" in r.stdout


# ---- views of one buffer keep aliasing (PyTorch stores one storage for them) ------------------------------


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return dict(json.loads(raw[8 : 8 + n]))


def _views_of(base: ag.Tensor, kind: str) -> dict[str, ag.Tensor]:
    return {
        "transpose": {"x": base, "t": base.t()},
        "slices": {"a": base[1:, ::2], "b": base[:, 1:3]},  # two overlapping slices, the base not saved
        "unfold": {"x": base, "u": base.reshape(-1).unfold(0, 4, 2)},  # overlapping windows
        "mixed": {"row": base[1], "x": base, "col": base[:, 2], "u": base.unfold(1, 2, 1), "n": base.numpy()[::2]},
        "expand": {"v": base[0], "e": base[0].expand(3, 4)},
        "detached": {"x": base, "d": base.detach(), "c": ag.from_numpy(base.numpy())},
    }[kind]


def _np(v: Any) -> np.ndarray:
    return v if isinstance(v, np.ndarray) else v.numpy()


@pytest.mark.parametrize("kind", ["transpose", "slices", "unfold", "mixed", "expand", "detached"])
async def test_views_come_back_as_views_of_one_buffer(rt: ag.Runtime, tmp_path: Path, kind: str) -> None:
    base = ag.tensor(np.arange(12.0).reshape(3, 4), dtype=ag.float64)
    obj = _views_of(base, kind)
    path = tmp_path / "views.safetensors"
    ag.save(obj, path)
    back = ag.load(path)
    assert list(back) == list(obj)
    for k, v in obj.items():
        got, want = _np(back[k]), _np(v)
        assert got.shape == want.shape and got.strides == want.strides, (k, got.strides, want.strides)
        np.testing.assert_array_equal(got, want)
    # the loaded tensors are views of one buffer: memory shared, writes seen, one version counter
    tensors = [v for v in back.values() if isinstance(v, ag.Tensor)]
    arrays = [_np(v) for v in back.values()]
    ref = _np(back["x"]) if "x" in back else arrays[0]
    for a in arrays:
        assert np.shares_memory(a, ref) or kind == "slices"
    if kind == "slices":  # base[1:, ::2] and base[:, 1:3] share the element at [1, 2]
        back["a"][0, 1] = -5.0
        assert back["b"][1, 1].item() == -5.0
    else:
        back["x" if "x" in back else "v"].mul_(2)  # the tensor holding every element of the buffer
        want = {k: _np(v) * 2 for k, v in obj.items()}
        for k, v in back.items():
            np.testing.assert_array_equal(_np(v), want[k])
    assert len({id(t._vc) for t in tensors}) == 1 and tensors[0]._version == 1
    # the buffer is stored once: the file is not bigger than one copy of it and the structure
    entries = {k: v for k, v in _header(path).items() if k != "__metadata__"}
    assert sum(math.prod(e["shape"]) for e in entries.values()) <= 12
    # the original objects were not touched
    np.testing.assert_array_equal(base.numpy(), np.arange(12.0).reshape(3, 4))


async def test_a_saved_view_check_sees_writes_through_loaded_aliases(rt: ag.Runtime, tmp_path: Path) -> None:
    w = nn.Parameter(ag.tensor(np.arange(6.0).reshape(2, 3), dtype=ag.float64))
    ag.save({"w": w, "wt": w.detach().t(), "rows": w.detach().unfold(0, 1, 1)}, tmp_path / "p.st")
    back = ag.load(tmp_path / "p.st")
    assert isinstance(back["w"], nn.Parameter) and back["w"].requires_grad
    assert back["wt"].stride() == (1, 3) and back["rows"].stride() == (3, 1, 3)
    x = ag.tensor(np.ones((3, 2)), dtype=ag.float64, requires_grad=True)
    y = (x * back["wt"]).sum()  # mul saves the loaded transpose
    with ag.no_grad():
        back["w"].add_(1.0)  # a write to the loaded parameter: the transpose sees it
    np.testing.assert_array_equal(back["wt"].numpy(), np.arange(6.0).reshape(2, 3).T + 1)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        await y.backward()


async def test_files_without_views_are_written_as_before(rt: ag.Runtime, tmp_path: Path) -> None:
    a = ag.tensor(np.arange(6.0).reshape(2, 3), dtype=ag.float64)
    obj = {"a": a, "at": a.t().contiguous(), "f": ag.tensor(np.asfortranarray(np.ones((3, 2)))), "same": [a, a]}
    ag.save(obj, tmp_path / "plain.st")
    h = _header(tmp_path / "plain.st")
    assert "view" not in h["__metadata__"]["asyncgrad"]
    assert {k: v["shape"] for k, v in h.items() if k != "__metadata__"} == {"a": [2, 3], "at": [3, 2], "f": [2, 3]}
    back = ag.load(tmp_path / "plain.st")
    assert back["same"][0] is back["same"][1] is back["a"]
    assert back["f"].stride() == (1, 3)  # the permutation still carries the layout
    assert not np.shares_memory(back["a"].numpy(), back["at"].numpy())
    assert back["a"]._vc is None or back["a"]._vc is not back["at"]._vc
    # an array that cannot be a view of what it spans (negative strides, a huge expansion) is stored dense
    base = np.arange(5.0)
    ag.save({"b": ag.from_numpy(base), "r": ag.from_numpy(base[::-1]), "e": ag.from_numpy(base[:1]).expand(500)},
            tmp_path / "dense.st")
    back = ag.load(tmp_path / "dense.st")
    np.testing.assert_array_equal(back["r"].numpy(), base[::-1])
    np.testing.assert_array_equal(back["e"].numpy(), np.zeros(500))
    assert back["r"].stride() == (1,) and not np.shares_memory(back["r"].numpy(), back["b"].numpy())


async def test_file_size_does_not_double_with_views(rt: ag.Runtime, tmp_path: Path) -> None:
    x = ag.randn(100, 100, dtype=ag.float64)
    ag.save({"x": x}, tmp_path / "one.st")
    ag.save({"x": x, "t": x.t(), "u": x.unfold(1, 10, 5), "s": x[::2, 3:]}, tmp_path / "views.st")
    one, views = (tmp_path / "one.st").stat().st_size, (tmp_path / "views.st").stat().st_size
    assert one > 80_000 and views - one < 1024, (one, views)


def _view_file(structure: Any, entries: dict[str, tuple[str, list[int]]] | None = None) -> bytes:
    """A file holding a 12-element F64 entry "x" (or ``entries``: name -> (dtype, shape), packed in order)
    and the asyncgrad ``structure``."""
    header: dict[str, Any] = {"__metadata__": {"asyncgrad": json.dumps({"version": 1, "obj": structure})}}
    at = 0
    for name, (dt, shape) in (entries or {"x": ("F64", [12])}).items():
        n = math.prod(shape) * {"F64": 8, "F32": 4}[dt]
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    return _header_file(header, b"\0" * at)


def _v(of: str = "x", offset: Any = 0, shape: Any = (3,), stride: Any = (1,), **extra: Any) -> dict[str, Any]:
    view = {"of": of, "offset": offset, "shape": list(shape), "stride": list(stride), **extra}
    return {"T": "tensor", "k": "v", "device": "cpu", "view": view}


async def test_crafted_view_metadata_is_refused(rt: ag.Runtime, tmp_path: Path) -> None:
    def two(a: Any, b: Any) -> Any:
        return {"T": "list", "items": [a, b]}

    cases: dict[str, tuple[bytes, str]] = {
        "offset past the end": (_view_file(_v(offset=12, shape=[1])), "reaching element 12 of 'x', which has 12"),
        "end past the end": (_view_file(_v(offset=10, shape=[3])), "reaching element 12"),
        "stride past the end": (_view_file(_v(shape=[4, 3], stride=[3, 2])), "reaching element 13"),
        "empty view past the end": (_view_file(_v(offset=13, shape=[0])), "reaching element 13"),
        "negative stride": (_view_file(_v(offset=11, shape=[3], stride=[-1])), "bad offset"),
        "negative offset": (_view_file(_v(offset=-1)), "bad offset"),
        "float offset": (_view_file(_v(offset=1.0)), "bad offset"),
        "bool shape": (_view_file(_v(shape=[True])), "bad offset"),
        "strides and dims differ": (_view_file(_v(shape=[2, 2], stride=[1])), "as many strides as dims"),
        "huge shape": (_view_file(_v(shape=[1 << 40, 1 << 40], stride=[0, 0])), "bad offset"),
        "huge dim of an empty view": (_view_file(_v(shape=[1 << 70, 0], stride=[1, 1])), "bad offset"),
        "huge stride of a size-1 dim": (_view_file(_v(shape=[1, 2], stride=[1 << 70, 1])), "bad offset"),
        "too many dims": (_view_file(_v(shape=[1] * 65, stride=[0] * 65)), "at most 64 dims"),
        "expansion": (_view_file(_v(shape=[1000, 12], stride=[0, 1])), "more than 64 times"),
        "view of a missing entry": (_view_file(_v(of="nope")), "which the file does not hold"),
        "view named as an entry": (_view_file({**_v(), "k": "x"}), "not a fresh name"),
        "view defined twice": (_view_file(two(_v(), _v(offset=1))), "defines tensor 'v' twice"),
        "extra view field": (_view_file(_v(code="x")), "exactly of, offset, shape and stride"),
        "view not a dict": (_view_file({**_v(), "view": [0, 1]}), "exactly of, offset, shape and stride"),
        "overlapping storages": (
            _header_file({
                "x": {"dtype": "F64", "shape": [4], "data_offsets": [0, 32]},
                "y": {"dtype": "F64", "shape": [4], "data_offsets": [16, 48]},
                "__metadata__": {"asyncgrad": json.dumps({"version": 1, "obj": two(_v(), {**_v(of="y"), "k": "w"})})},
            }, b"\0" * 48),
            "overlap",
        ),
    }
    for data, msg in cases.values():
        with pytest.raises(ValueError, match=msg):
            ag.load(io.BytesIO(data))
        (tmp_path / "c.st").write_bytes(data)
        with pytest.raises(ValueError, match=msg):
            ag.load(tmp_path / "c.st")
    # the honest neighbours load: the last element, an empty view at the end, a stride-0 view (read-only)
    ok = two(_v(offset=11, shape=[1]), {**_v(offset=12, shape=[0]), "k": "w"})
    back = ag.load(io.BytesIO(_view_file(ok)))
    assert back[0].shape == (1,) and back[1].shape == (0,)
    rep = ag.load(io.BytesIO(_view_file(_v(shape=[64, 12], stride=[0, 1]))))
    assert rep.shape == (64, 12) and not rep.numpy().flags.writeable
