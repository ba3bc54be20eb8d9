"""Result dtypes follow PyTorch's type promotion (c10 ``result_type``), not numpy's.

Operands fall in three priority groups: dimensioned tensors, zero-dim tensors, and wrapped numbers
(Python and numpy scalars). A lower group only decides the dtype when its category (bool < int < float)
is higher; a wrapped float then gives the default dtype (float32). Ops that always compute in floating
point (true division, sqrt, exp, ...) turn bool and integer results into the default dtype.

The first tests hard-code PyTorch's answers; the parametrized ones at the end ask torch itself, on every
pair of operand kinds, for the dtype and the values (live where torch is installed, else the answers
recorded under ``tests/references/``: see ``tests/_reference.py``).
Every check runs on the inline path (small tensors on the loop thread) and on the queued one (lanes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import set_inline_limit

# int / 0 and log(0) in the value checks (kernels on the lanes are outside the test's np.errstate)
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture(params=["inline", "queued"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test's ops inline, or send every kernel to the worker lanes."""
    if request.param == "queued":
        set_inline_limit(monkeypatch, -1)
    return str(request.param)


def _i(*v: int, dtype: str = "int64") -> ag.Tensor:
    return ag.tensor(list(v), dtype=dtype)


def _f(*v: float, dtype: str = "float32") -> ag.Tensor:
    return ag.tensor(list(v), dtype=dtype)


def _mask() -> ag.Tensor:
    return ag.tensor([True, False, True])


# (name, expression, PyTorch's result dtype): each checked against torch 2.13 by hand, and again by
# `test_table_matches_torch` where torch is installed
TABLE: list[tuple[str, Callable[[], Any], str]] = [
    # the reported repros
    ("int tensor / int", lambda: ag.arange(4) / 4, "float32"),
    ("float32 / numpy float64 scalar", lambda: ag.randn(3) / np.sqrt(4.0), "float32"),
    ("float32 * int64 tensor", lambda: ag.randn(3) * _i(1, 0, 1), "float32"),
    ("float32 + zero-dim float64", lambda: _f(1.0, 2.0) + ag.tensor(1.0, dtype="float64"), "float32"),
    ("int32 + zero-dim int64", lambda: _i(1, 2, dtype="int32") + ag.tensor(1), "int32"),
    ("tensor([np.float64])", lambda: ag.tensor([np.float64(1.0)]), "float64"),
    # arithmetic
    ("int + float", lambda: _i(1, 2) + 0.5, "float32"),
    ("int + int", lambda: _i(1, 2) + 1, "int64"),
    ("int8 + int", lambda: _i(1, 2, dtype="int8") + 1, "int8"),
    ("int8 + numpy int64 scalar", lambda: _i(1, 2, dtype="int8") + np.int64(1), "int8"),
    ("uint8 + int8", lambda: _i(1, 2, dtype="uint8") + _i(1, 2, dtype="int8"), "int16"),
    ("int16 * float16", lambda: _i(1, 2, dtype="int16") * _f(1, 2, dtype="float16"), "float16"),
    ("int64 - float32", lambda: _i(1, 2) - _f(1, 2), "float32"),
    ("float32 + float64 tensor", lambda: _f(1, 2) + _f(1, 2, dtype="float64"), "float64"),
    ("bool + int", lambda: ag.tensor([True, False]) + 1, "int64"),
    ("bool * float", lambda: ag.tensor([True, False]) * 1.5, "float32"),
    ("bool + bool", lambda: ag.tensor([True, False]) + ag.tensor([True, True]), "bool"),
    ("int8 + zero-dim float64", lambda: _i(1, 2, dtype="int8") + ag.tensor(1.0, dtype="float64"), "float64"),
    ("int8 + zero-dim int64", lambda: _i(1, 2, dtype="int8") + ag.tensor(1), "int8"),
    ("zero-dim int32 + float", lambda: ag.tensor(1, dtype="int32") + 0.5, "float32"),
    ("zero-dim float64 + float", lambda: ag.tensor(1.0, dtype="float64") + 0.5, "float64"),
    ("zero-dim int32 + zero-dim int64", lambda: ag.tensor(1, dtype="int32") + ag.tensor(1), "int64"),
    ("int8 + numpy bool scalar", lambda: _i(1, 2, dtype="int8") + np.bool_(True), "int8"),  # torch: float32
    ("float16 + numpy float64 scalar", lambda: _f(1, 2, dtype="float16") + np.float64(1.0), "float16"),
    ("float32 + numpy 0-d float64 array", lambda: _f(1, 2) + np.array(2.0), "float32"),
    ("float32 + numpy float64 array", lambda: _f(1, 2) + np.array([2.0, 1.0]), "float64"),
    ("int / int tensor", lambda: _i(1, 2) / _i(2, 2), "float32"),
    ("bool / bool", lambda: ag.tensor([True]) / ag.tensor([True]), "float32"),
    ("float64 / int", lambda: _f(1, 2, dtype="float64") / 2, "float64"),
    ("int ** 0.5", lambda: _i(1, 4) ** 0.5, "float32"),
    ("int ** 2", lambda: _i(1, 4) ** 2, "int64"),
    ("2.0 ** int", lambda: 2.0 ** _i(1, 4), "float32"),
    ("2 ** int32", lambda: 2 ** _i(1, 4, dtype="int32"), "int32"),
    ("float16 ** 2", lambda: _f(1, 4, dtype="float16") ** 2, "float16"),
    # float-only unary ops
    ("sqrt(int)", lambda: ag.sqrt(_i(1, 4)), "float32"),
    ("exp(int)", lambda: ag.exp(_i(1, 4)), "float32"),
    ("log(int)", lambda: ag.log(_i(1, 4)), "float32"),
    ("tanh(int8)", lambda: ag.tanh(_i(1, 4, dtype="int8")), "float32"),
    ("sigmoid(int)", lambda: ag.sigmoid(_i(1, 4)), "float32"),
    ("sqrt(bool)", lambda: ag.sqrt(ag.tensor([True])), "float32"),
    ("exp(float16)", lambda: ag.exp(_f(1, dtype="float16")), "float16"),
    ("sqrt(zero-dim int)", lambda: ag.sqrt(ag.tensor(4)), "float32"),
    # dtype-keeping unary ops
    ("neg(int32)", lambda: -_i(1, 2, dtype="int32"), "int32"),
    ("abs(int8)", lambda: ag.abs(_i(1, -2, dtype="int8")), "int8"),
    ("relu(int)", lambda: ag.relu(_i(1, -2)), "int64"),
    ("sign(int)", lambda: ag.sign(_i(1, -2)), "int64"),
    # maximum / minimum / clamp
    ("maximum(int, float32)", lambda: ag.maximum(_i(1, 2), _f(1, 2)), "float32"),
    ("minimum(int8, zero-dim float64)", lambda: ag.minimum(_i(1, 2, dtype="int8"), ag.tensor(1.5, dtype="float64")),
     "float64"),
    ("maximum(float32, float)", lambda: ag.maximum(_f(1, 2), 1.5), "float32"),
    ("maximum(int32, int)", lambda: ag.maximum(_i(1, 2, dtype="int32"), 1), "int32"),
    ("clamp(int, 0.5)", lambda: ag.clamp(_i(1, 2), 0.5), "float32"),
    ("clamp(int32, 0, 1)", lambda: ag.clamp(_i(1, 2, dtype="int32"), 0, 1), "int32"),
    ("clamp(float32, zero-dim float64)", lambda: ag.clamp(_f(1, 2), min=ag.tensor(0.0, dtype="float64")),
     "float32"),
    ("clamp(int, float32 tensor)", lambda: ag.clamp(_i(1, 2), min=_f(0, 3)), "float32"),
    # where
    ("where(mask, 1.0, 0.0)", lambda: ag.where(_mask(), 1.0, 0.0), "float32"),
    ("where(mask, 1, 0)", lambda: ag.where(_mask(), 1, 0), "int64"),
    ("where(mask, True, False)", lambda: ag.where(_mask(), True, False), "bool"),
    ("where(mask, int, 0.5)", lambda: ag.where(_mask(), _i(1, 2, 3), 0.5), "float32"),
    ("where(mask, int8, 1)", lambda: ag.where(_mask(), _i(1, 2, 3, dtype="int8"), 1), "int8"),
    ("where(mask, float32, int)", lambda: ag.where(_mask(), _f(1, 2, 3), _i(1, 2, 3)), "float32"),
    ("where(mask, float32, zero-dim float64)",
     lambda: ag.where(_mask(), _f(1, 2, 3), ag.tensor(0.0, dtype="float64")), "float32"),
    # concat / stack
    ("concat(int, float32)", lambda: ag.concat([_i(1, 2), _f(1, 2)]), "float32"),
    ("concat(int8, uint8)", lambda: ag.concat([_i(1, dtype="int8"), _i(1, dtype="uint8")]), "int16"),
    ("concat(bool, int8)", lambda: ag.concat([ag.tensor([True]), _i(1, dtype="int8")]), "int8"),
    ("stack(int, float32)", lambda: ag.stack([_i(1, 2), _f(1, 2)]), "float32"),
    ("stack(float16, int32)", lambda: ag.stack([_f(1, 2, dtype="float16"), _i(1, 2, dtype="int32")]), "float16"),
    # comparisons stay bool
    ("int < float", lambda: _i(1, 2) < 1.5, "bool"),
    ("float32 == zero-dim float64", lambda: _f(1, 2) == ag.tensor(1.0, dtype="float64"), "bool"),
    ("int >= float32 tensor", lambda: _i(1, 2) >= _f(1, 2), "bool"),
    # reductions
    ("sum(int32)", lambda: ag.sum(_i(1, 2, dtype="int32")), "int64"),
    ("sum(uint8)", lambda: ag.sum(_i(1, 2, dtype="uint8")), "int64"),
    ("sum(bool)", lambda: ag.sum(ag.tensor([True, True])), "int64"),
    ("sum(float16)", lambda: ag.sum(_f(1, 2, dtype="float16")), "float16"),
    ("logsumexp(int)", lambda: ag.logsumexp(_i(1, 2), 0), "float32"),
    # tensor() inference
    ("tensor(float list)", lambda: ag.tensor([1.0, 2.0]), "float32"),
    ("tensor(int list)", lambda: ag.tensor([1, 2]), "int64"),
    ("tensor(bool, int)", lambda: ag.tensor([True, 1]), "int64"),
    ("tensor(mixed nested)", lambda: ag.tensor([[1, 2], [3.0, 4]]), "float32"),
    ("tensor(float, np.float64)", lambda: ag.tensor([1.0, np.float64(2.0)]), "float64"),
    ("tensor(np.float32, int)", lambda: ag.tensor([np.float32(1), 2]), "float32"),
    ("tensor(np.float16, int)", lambda: ag.tensor([np.float16(1), 2]), "float16"),
    ("tensor(np.int8, float)", lambda: ag.tensor([np.int8(1), 2.0]), "float32"),
    ("tensor(np.int32)", lambda: ag.tensor([np.int32(1)]), "int32"),
    ("tensor(np.int32, int)", lambda: ag.tensor([np.int32(1), 2]), "int64"),
    ("tensor(np.float64 scalar)", lambda: ag.tensor(np.float64(1.0)), "float64"),
    ("tensor(float64 arrays)", lambda: ag.tensor([np.array([1.0, 2.0])]), "float64"),
    ("tensor(float16 array)", lambda: ag.tensor(np.array([1.0], dtype=np.float16)), "float16"),
    ("tensor([])", lambda: ag.tensor([]), "float32"),
    ("tensor(complex)", lambda: ag.tensor([1 + 2j]), "complex64"),
    ("full(np.int32)", lambda: ag.full(2, np.int32(1)), "int64"),
    ("full(np.float64)", lambda: ag.full(2, np.float64(1.0)), "float32"),
    ("full(True)", lambda: ag.full(2, True), "bool"),
    ("full(1)", lambda: ag.full(2, 1), "int64"),
]


@pytest.mark.parametrize("name,expr,expected", TABLE, ids=[t[0] for t in TABLE])
async def test_result_dtype(rt: Any, path: str, name: str, expr: Callable[[], Any], expected: str) -> None:
    out = expr()
    assert out.dtype == np.dtype(expected), f"{name}: got {out.dtype}, PyTorch gives {expected}"
    assert out.numpy().dtype == np.dtype(expected)  # the computed array agrees with the meta


async def test_values_follow_promotion(rt: Any, path: str) -> None:
    i = _i(1, 2, 3, 4)
    np.testing.assert_allclose((i / 4).numpy(), np.array([0.25, 0.5, 0.75, 1.0], np.float32))
    np.testing.assert_allclose(ag.sqrt(i).numpy(), np.sqrt(np.arange(1, 5, dtype=np.float32)), rtol=1e-6)
    np.testing.assert_allclose((i + 0.5).numpy(), [1.5, 2.5, 3.5, 4.5])
    np.testing.assert_array_equal(ag.where(i > 2, 1.0, 0.0).numpy(), [0, 0, 1, 1])
    np.testing.assert_array_equal((_i(100, 120, dtype="int8") + ag.tensor(1)).numpy(), [101, 121])
    # a float64 zero-dim operand is cast to float32 like PyTorch's, not used at float64 precision
    third = ag.tensor(1 / 3, dtype="float64")
    np.testing.assert_array_equal((_f(1.0) * third).numpy(), np.float32(1.0) * np.float32(1 / 3))


async def test_gradients_keep_input_dtypes(rt: Any, path: str) -> None:
    x = ag.randn(3, requires_grad=True)  # float32
    s = ag.tensor(2.0, dtype="float64", requires_grad=True)  # zero-dim float64: result stays float32
    k = _i(1, 2, 3)
    y = (x * s + x / k + k * 0.5) ** 2
    assert y.dtype == np.float32
    await y.sum().backward()
    assert x.grad.dtype == np.float32
    assert s.grad.dtype == np.float64 and s.grad.shape == ()
    xv, sv, kv = x.numpy().astype(np.float64), 2.0, np.array([1.0, 2.0, 3.0])
    inner = xv * sv + xv / kv + kv * 0.5
    np.testing.assert_allclose(x.grad.numpy(), 2 * inner * (sv + 1 / kv), rtol=1e-5)
    np.testing.assert_allclose(s.grad.numpy(), np.sum(2 * inner * xv), rtol=1e-5)


async def test_default_dtype_drives_promotion(rt: Any) -> None:
    ag.set_default_dtype(np.float64)
    try:
        assert (ag.arange(4) / 4).dtype == np.float64
        assert (_i(1, 2) + 0.5).dtype == np.float64
        assert ag.where(_mask(), 1.0, 0.0).dtype == np.float64
        assert (_f(1, 2) + 0.5).dtype == np.float32  # a float32 tensor keeps its dtype
        assert ag.sqrt(_i(1, 2)).dtype == np.float64
    finally:
        ag.set_default_dtype(np.float32)
    assert (ag.arange(4) / 4).dtype == np.float32


async def test_relu_of_bool_raises_like_torch(rt: Any, path: str) -> None:
    with pytest.raises(ag.OpError, match="bool"):
        ag.relu(ag.tensor([True, False]))


async def test_table_matches_torch(torch_ref) -> None:
    """The hard-coded expectations are torch's (live where torch is installed, else as recorded)."""
    checks = {
        "int tensor / int": lambda torch: torch.arange(4) / 4,
        "float32 + zero-dim float64": lambda torch: torch.tensor([1.0, 2.0]) + torch.tensor(1.0, dtype=torch.float64),
        "int32 + zero-dim int64": lambda torch: torch.tensor([1, 2], dtype=torch.int32) + torch.tensor(1),
        "tensor([np.float64])": lambda torch: torch.tensor([np.float64(1.0)]),
        "where(mask, 1.0, 0.0)": lambda torch: torch.where(torch.tensor([True, False, True]), 1.0, 0.0),
        "sum(uint8)": lambda torch: torch.tensor([1, 2], dtype=torch.uint8).sum(),
        "logsumexp(int)": lambda torch: torch.logsumexp(torch.tensor([1, 2]), 0),
        "tensor(np.float16, int)": lambda torch: torch.tensor([np.float16(1), 2]),
        "2 ** int32": lambda torch: 2 ** torch.tensor([1, 4], dtype=torch.int32),
    }
    want = torch_ref("table_dtypes", lambda torch: {name: f(torch).dtype for name, f in checks.items()},
                     names=list(checks))
    expected = {name: dt for name, _, dt in TABLE}
    assert list(want) == list(checks)
    for name, dt in want.items():
        assert dt.removeprefix("torch.") == expected[name], name


# ---- against torch itself, every pair of operand kinds ---------------------------------------------

DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
# operand kinds: a dimensioned tensor, a zero-dim tensor (of each dtype), and wrapped numbers
TENSOR_SPECS = [f"{d}[3]" for d in DTYPES] + [f"{d}[]" for d in DTYPES]
SCALARS: dict[str, Any] = {
    "True": True,
    "2": 2,
    "2.5": 2.5,
    "np.float64(2.5)": np.float64(2.5),
    "np.float32(0.5)": np.float32(0.5),
    "np.int32(2)": np.int32(2),
}
# np.bool_ is left out: torch 2.13 takes a numpy bool scalar as a float (torch.result_type(int8 tensor,
# np.bool_(True)) is float32, while Python True gives int8); asyncgrad takes it as a bool, like True
# (see "int8 + numpy bool scalar" in TABLE)
SPECS = TENSOR_SPECS + list(SCALARS)


def _values(dtype: str, dims: bool) -> np.ndarray:
    if dtype == "bool":
        v = np.array([True, False, True]) if dims else np.array(True)
    else:
        v = np.array([1.0, 2.0, 3.0] if dtype.startswith("float") else [1, 2, 3]) if dims else np.array(2)
        if dtype.startswith("float"):
            v = v + 0.5
    return v.astype(dtype)


def _make(spec: str, lib: str, torch: Any = None) -> Any:
    if spec in SCALARS:
        return SCALARS[spec]
    dtype, dims = spec.split("[")[0], spec.endswith("[3]")
    v = _values(dtype, dims)
    if lib == "torch":
        return torch.tensor(v)
    return ag.tensor(v)


def _operands() -> dict[str, np.ndarray]:
    """The tensor operands' values by spec: the inputs the recorded torch results depend on."""
    return {s: np.asarray(_values(s.split("[")[0], s.endswith("[3]"))) for s in TENSOR_SPECS}


def _torch_results(torch: Any, f_torch: Callable[..., Any], cases: list[tuple[str, ...]]) -> dict[str, Any]:
    """Torch's answer for each tuple of operand specs (keyed ``"a|b"``): its result dtype (as a string)
    and values, or the name of the exception with which torch rejects the operands."""
    out: dict[str, Any] = {}
    for specs in cases:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = f_torch(*[_make(s, "torch", torch) for s in specs])
        except (RuntimeError, TypeError) as e:
            out["|".join(specs)] = type(e).__name__
            continue
        out["|".join(specs)] = (want.dtype, want)
    return out


def _compare(want: Any, f_ag: Callable[..., Any], specs: tuple[str, ...]) -> str | None:
    """None when asyncgrad matches torch's dtype and values (or torch rejects the operands), else why not.

    ``want`` is torch's answer from ``_torch_results``: ``(dtype string, values)`` or an exception's name.
    """
    if isinstance(want, str):
        return None  # torch rejects these operands (bool subtraction, uint8 negative powers, ...)
    want_dt, tv = want[0].removeprefix("torch."), want[1]
    try:
        with np.errstate(all="ignore"):
            got = f_ag(*[_make(s, "ag") for s in specs])
            got_v = got.numpy()
    except Exception as e:
        return f"{specs}: torch gives {want_dt}, asyncgrad raises {type(e).__name__}: {e}"
    if str(got.dtype) != want_dt or got_v.dtype != got.dtype:
        return f"{specs}: torch gives {want_dt}, asyncgrad {got.dtype} (array {got_v.dtype})"
    if got_v.shape != tv.shape:
        return f"{specs}: shape {got_v.shape} vs torch {tv.shape}"
    if tv.dtype.kind in "fc":
        rtol = 1e-3 if tv.dtype == np.float16 else 1e-6
        if not np.allclose(got_v, tv, rtol=rtol, atol=0, equal_nan=True):
            return f"{specs}: values {got_v} vs torch {tv}"
    elif not np.array_equal(got_v, tv):
        return f"{specs}: values {got_v} vs torch {tv}"
    return None


def _against_torch(torch_ref: Any, key: str, f_ag: Callable[..., Any], f_torch: Callable[..., Any],
                   cases: list[tuple[str, ...]]) -> list[str]:
    """The mismatches of asyncgrad against torch (``f_torch(torch, *operands)``) over ``cases``."""
    want = torch_ref(key, lambda torch: _torch_results(torch, lambda *a: f_torch(torch, *a), cases),
                     cases=[list(c) for c in cases], operands=_operands())
    assert list(want) == ["|".join(c) for c in cases]
    return [m for c in cases if (m := _compare(want["|".join(c)], f_ag, c))]


BINARY: dict[str, Callable[[Any, Any], Any]] = {  # the same operator on asyncgrad and torch operands
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a**b,
    "lt": lambda a, b: a < b,
    "eq": lambda a, b: a == b,
}


@pytest.mark.parametrize("op", list(BINARY))
async def test_binary_against_torch(rt: Any, path: str, op: str, torch_ref) -> None:
    f = BINARY[op]
    cases = []
    for a in SPECS:
        for b in SPECS:
            if a in SCALARS and b in SCALARS:
                continue
            if op == "pow" and a in SCALARS and SCALARS[a] is True:
                continue  # torch computes True ** tensor in the tensor's dtype; not worth a special case
            cases.append((a, b))
    bad = _against_torch(torch_ref, op, f, lambda torch, a, b: f(a, b), cases)
    assert not bad, f"{len(bad)} mismatches, e.g.:\n" + "\n".join(bad[:20])


def _torch_fn(name: str) -> Callable[..., Any]:
    def f(torch: Any, a: Any, b: Any) -> Any:
        if name == "where":
            return torch.where(torch.tensor([True, False, True]), a, b)
        if name == "clamp_min":
            return torch.clamp(a, min=b)
        if name in ("stack", "cat"):
            return getattr(torch, name)([a, b])
        return getattr(torch, name)(a, b)

    return f


TENSOR_FNS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "maximum": (ag.maximum, _torch_fn("maximum")),
    "minimum": (ag.minimum, _torch_fn("minimum")),
    "clamp_min": (lambda a, b: ag.clamp(a, min=b), _torch_fn("clamp_min")),
    "where": (lambda a, b: ag.where(ag.tensor([True, False, True]), a, b), _torch_fn("where")),
    "stack": (lambda a, b: ag.stack([a, b]), _torch_fn("stack")),
    "concat": (lambda a, b: ag.concat([a, b]), _torch_fn("cat")),
}


def _pairs(op: str) -> list[tuple[str, str]]:
    out = []
    for a in SPECS:
        for b in SPECS:
            if a in SCALARS and (op != "where" or b in SCALARS):
                continue  # only where takes a number first (two numbers: test_where_scalars_against_torch)
            if op in ("stack", "concat") and (b in SCALARS or a.endswith("[3]") != b.endswith("[3]")):
                continue
            if op == "concat" and a.endswith("[]"):
                continue
            out.append((a, b))
    return out


@pytest.mark.parametrize("op", list(TENSOR_FNS))
async def test_tensor_ops_against_torch(rt: Any, path: str, op: str, torch_ref) -> None:
    f_ag, f_torch = TENSOR_FNS[op]
    bad = _against_torch(torch_ref, op, f_ag, f_torch, _pairs(op))
    assert not bad, f"{len(bad)} mismatches, e.g.:\n" + "\n".join(bad[:20])


async def test_where_scalars_against_torch(rt: Any, path: str, torch_ref) -> None:
    bad = _against_torch(
        torch_ref,
        "where_scalars",
        lambda x, y: ag.where(ag.tensor([True, False, True]), x, y),
        lambda torch, x, y: torch.where(torch.tensor([True, False, True]), x, y),
        [(a, b) for a in SCALARS for b in SCALARS],
    )
    assert not bad, "\n".join(bad[:20])


UNARY = ["sqrt", "exp", "log", "tanh", "sigmoid", "abs", "neg", "relu", "sign"]


@pytest.mark.parametrize("op", UNARY)
async def test_unary_against_torch(rt: Any, path: str, op: str, torch_ref) -> None:
    f_ag = getattr(ag, op) if op != "neg" else (lambda a: -a)
    bad = _against_torch(torch_ref, op, f_ag, lambda torch, a: getattr(torch, op)(a), [(s,) for s in TENSOR_SPECS])
    assert not bad, "\n".join(bad[:20])


async def test_reductions_against_torch(rt: Any, path: str, torch_ref) -> None:
    fns = {  # name: (asyncgrad, torch, whole-tensor reduction: zero-dim inputs too)
        "sum": (ag.sum, lambda torch, a: torch.sum(a), True),
        "sum_dim0": (lambda a: ag.sum(a, 0), lambda torch, a: torch.sum(a, 0), False),
        "mean": (ag.mean, lambda torch, a: torch.mean(a), True),
        "logsumexp_dim0": (lambda a: ag.logsumexp(a, 0), lambda torch, a: torch.logsumexp(a, 0), False),
        "max": (ag.max, lambda torch, a: torch.max(a), True),
    }
    bad = []
    for name, (f_ag, f_torch, whole) in fns.items():
        cases = [(s,) for s in TENSOR_SPECS if whole or s.endswith("[3]")]
        bad += _against_torch(torch_ref, name, f_ag, f_torch, cases)
    assert not bad, "\n".join(bad[:20])


TENSOR_DATA: list[Any] = [
    [1.0, 2.0],
    [1, 2],
    [True, False],
    [True, 1],
    [True, 1.0],
    [[1, 2], [3.0, 4]],
    [1.0, np.float64(2.0)],
    [np.float64(2.0)],
    [np.float32(1), 2],
    [np.float32(1), 2.0],
    [np.float16(1), 2],
    [np.float16(1), 2.5],
    [np.int8(1), 2.0],
    [np.int8(1), np.uint8(2)],
    [np.int32(1)],
    [np.int32(1), 2],
    [np.int64(1), np.float32(2)],
    np.float64(1.0),
    np.float32(1.0),
    np.int32(3),
    2.5,
    3,
    [],
    [[]],
    [np.array([1.0, 2.0])],
    [np.array([1, 2], dtype=np.int32), [3.0, 4.0]],
    np.array([1.0], dtype=np.float16),
    [1 + 2j],
    [np.complex128(1 + 2j)],
]


def _describe(data: Any) -> Any:
    """``data`` as plain recordable values naming each item's type (the recorded inputs of the inference test)."""
    if isinstance(data, list):
        return [_describe(d) for d in data]
    if isinstance(data, np.ndarray):
        return f"np.array({data.tolist()!r}, dtype={data.dtype})"
    if isinstance(data, np.generic):
        return f"np.{type(data).__name__}({data.item()!r})"
    return f"{type(data).__name__}({data!r})"


async def test_tensor_inference_against_torch(rt: Any, torch_ref) -> None:
    def reference(torch: Any) -> list[Any]:
        out = []
        for data in TENSOR_DATA:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(torch.tensor(data).dtype)
        return out

    wants = torch_ref("tensor_dtypes", reference, data=_describe(TENSOR_DATA))
    assert len(wants) == len(TENSOR_DATA)
    bad = []
    for data, want_dt in zip(TENSOR_DATA, wants):
        want = want_dt.removeprefix("torch.")
        got = ag.tensor(data)
        if str(got.dtype) != want:
            bad.append(f"tensor({data!r}): torch {want}, asyncgrad {got.dtype}")
    assert not bad, "\n".join(bad)
