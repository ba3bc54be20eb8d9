"""Module state dicts: numpy round trips, .npz files without pickle, strict-mode errors, layouts."""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag
from asyncgrad import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
        self.emb = nn.Embedding(5, 8)
        self.register_buffer("steps", ag.zeros(1, dtype=np.int64))
        self.register_buffer("cache", ag.zeros(3), persistent=False)

    def forward(self, idx: np.ndarray) -> ag.Tensor:
        return self.body(self.emb(idx))


async def test_save_load_npz_identical_outputs(tmp_path) -> None:
    idx = np.array([[0, 3, 4], [1, 1, 2]])
    async with ag.open_runtime():
        ag.manual_seed(0)
        m1 = Model()
        m1.steps.fill_(7)
        path = tmp_path / "ckpt" / "model.npz"
        m1.save(path)
        out1 = m1(idx).numpy()
        ag.manual_seed(1)  # a fresh model with other weights
        m2 = Model()
        assert not np.array_equal(m2(idx).numpy(), out1)
        res = m2.load(path)
        assert res.missing_keys == [] and res.unexpected_keys == []
        assert np.array_equal(m2(idx).numpy(), out1)
        assert m2.steps.numpy().tolist() == [7]
        # the file holds plain arrays only: loadable with allow_pickle=False, keys are the dotted names
        with np.load(path, allow_pickle=False) as z:
            assert sorted(z.files) == sorted(m1.state_dict())
            assert "cache" not in z.files
            assert all(z[k].dtype != object for k in z.files)
        sd = nn.load_state_dict_file(path)
        assert list(sd) == list(m1.state_dict())


async def test_state_dict_values_are_copies() -> None:
    async with ag.open_runtime():
        lin = nn.Linear(3, 2)
        sd = lin.state_dict()
        # values are detached Tensor copies, as PyTorch's values are Tensors (issue 20)
        assert isinstance(sd["weight"], ag.Tensor) and not sd["weight"].requires_grad
        assert sd["weight"].size() == (2, 3) and sd["weight"].clone().shape == (2, 3)
        sd["weight"][:] = 123.0
        assert not np.any(lin.weight.numpy() == 123.0)
        kv = lin.state_dict(keep_vars=True)
        assert kv["weight"] is lin.weight
        # load from Tensors as well as arrays, with a dtype cast to the parameter's dtype
        src = {"weight": ag.tensor(np.full((2, 3), 0.5), dtype=np.float64), "bias": np.array([1.0, 2.0])}
        lin.load_state_dict(src)
        assert lin.weight.dtype == np.float32 and np.all(lin.weight.numpy() == 0.5)
        assert lin.bias.numpy().tolist() == [1.0, 2.0]


async def test_strict_errors_name_missing_unexpected_and_mismatched_keys() -> None:
    async with ag.open_runtime():
        m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        sd = m.state_dict()
        before = m.state_dict()
        bad = dict(sd)
        del bad["2.bias"]
        bad["extra.weight"] = np.zeros(3)
        with pytest.raises(RuntimeError) as ei:
            m.load_state_dict(bad)
        msg = str(ei.value)
        assert "Error(s) in loading state_dict for Sequential" in msg
        assert 'Missing key(s) in state_dict: "2.bias"' in msg
        assert 'Unexpected key(s) in state_dict: "extra.weight"' in msg
        for k, v in m.state_dict().items():  # nothing was loaded
            assert np.array_equal(v, before[k])
        res = m.load_state_dict(bad, strict=False)
        assert res.missing_keys == ["2.bias"] and res.unexpected_keys == ["extra.weight"]
        wrong = dict(sd)
        wrong["0.weight"] = np.zeros((4, 3))
        with pytest.raises(
            RuntimeError, match=r"size mismatch for 0\.weight: copying a param with shape \(4, 3\)"
        ):
            m.load_state_dict(wrong, strict=False)  # shape mismatches raise even when not strict
        with pytest.raises(TypeError, match="mapping"):
            m.load_state_dict([1, 2])  # type: ignore[arg-type]


async def test_load_keeps_parameter_layout(tmp_path) -> None:
    async with ag.open_runtime():
        lin = nn.Linear(6, 5, dtype=np.float64)
        # give the weight a Fortran layout, as a user might for a transposed parameter
        lin.weight = nn.Parameter(ag.from_numpy(np.asfortranarray(lin.weight.numpy())))
        strides = lin.weight.strides
        arr = lin.weight.numpy()
        other = nn.Linear(6, 5, dtype=np.float64)
        lin.load_state_dict(other.state_dict())
        assert lin.weight.strides == strides and lin.weight.numpy() is arr
        assert np.array_equal(lin.weight.numpy(), other.weight.numpy())
        x = ag.tensor(np.random.default_rng(0).standard_normal((3, 6)))
        assert np.array_equal(lin(x).numpy(), other(x).numpy())


async def test_save_state_dict_rejects_non_numeric(tmp_path) -> None:
    async with ag.open_runtime():
        with pytest.raises(TypeError, match="numeric"):
            nn.save_state_dict(tmp_path / "x.npz", {"a": np.array(["text"])})
        p = tmp_path / "plain_name"  # written exactly at the given path (no .npz appended)
        nn.save_state_dict(p, {"a": np.arange(3)})
        assert p.exists() and nn.load_state_dict_file(p)["a"].tolist() == [0, 1, 2]


# ---- fixes: load_state_dict's result ------------------------------------------------------------------


async def test_load_state_dict_result_repr(rt) -> None:
    m = nn.Linear(2, 2)
    r = m.load_state_dict(m.state_dict())
    assert repr(r) == "<All keys matched successfully>"
    assert r.missing_keys == [] and r.unexpected_keys == []
    r2 = m.load_state_dict({"weight": np.zeros((2, 2), np.float32)}, strict=False)
    assert repr(r2) == "_IncompatibleKeys(missing_keys=['bias'], unexpected_keys=[])"
