"""nn.RNN / LSTM / GRU and their cells against torch in float64: outputs, final states, every gradient."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn
from tests._util import (
    assert_close,
    assert_grads_match,
    load_from_torch,
    pair,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)

torch = pytest.importorskip("torch")

KINDS = {"rnn": ("RNN", {}), "rnn_relu": ("RNN", {"nonlinearity": "relu"}), "lstm": ("LSTM", {}), "gru": ("GRU", {})}


def _pair_modules(kind: str, *args: object, **kw: object) -> tuple[object, object]:
    name, extra = KINDS[kind]
    tm = getattr(torch.nn, name)(*args, **extra, **kw).double()
    am = getattr(nn, name)(*args, **extra, **kw, dtype=ag.float64)
    load_from_torch(am, tm)
    return am, tm


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    "layers,bidir,batch_first,bias,with_h0",
    [
        (1, False, False, True, False),
        (2, True, False, True, True),
        (2, False, True, False, True),
        (3, True, True, True, False),
    ],
)
async def test_recurrent_layers_match_torch(rt, rng, kind, layers, bidir, batch_first, bias, with_h0) -> None:
    with trio.fail_after(60):
        am, tm = _pair_modules(kind, 3, 5, layers, bias=bias, batch_first=batch_first, bidirectional=bidir)
        d = 2 if bidir else 1
        t_len, n = 6, 4
        ax, tx = pair(rng, (n, t_len, 3) if batch_first else (t_len, n, 3), torch)
        ahx = thx = None
        if with_h0:
            ah, th = pair(rng, (layers * d, n, 5), torch)
            if kind == "lstm":
                ac, tc = pair(rng, (layers * d, n, 5), torch)
                ahx, thx = (ah, ac), (th, tc)
            else:
                ahx, thx = ah, th
        ay, ast = am(ax, ahx)
        ty, tst = tm(tx, thx)
        assert ay.shape == tuple(ty.shape)
        assert_close(ay, ty, "output")
        wy = rng.standard_normal(tuple(ty.shape))
        if kind == "lstm":
            assert_close(ast[0], tst[0], "h_n")
            assert_close(ast[1], tst[1], "c_n")
            wh, wc = rng.standard_normal(tuple(tst[0].shape)), rng.standard_normal(tuple(tst[1].shape))
            aloss = (ay * ag.tensor(wy)).sum() + (ast[0] * ag.tensor(wh)).sum() + (ast[1] * ag.tensor(wc)).sum()
            tw = [torch.tensor(w) for w in (wy, wh, wc)]
            tloss = (ty * tw[0]).sum() + (tst[0] * tw[1]).sum() + (tst[1] * tw[2]).sum()
        else:
            assert_close(ast, tst, "h_n")
            wh = rng.standard_normal(tuple(tst.shape))
            aloss = (ay * ag.tensor(wy)).sum() + (ast * ag.tensor(wh)).sum()
            tloss = (ty * torch.tensor(wy)).sum() + (tst * torch.tensor(wh)).sum()
        await aloss.backward()
        tloss.backward()
        assert_close(ax.grad, tx.grad, "input grad")
        if with_h0:
            if kind == "lstm":
                assert_close(ahx[0].grad, thx[0].grad, "h0 grad")
                assert_close(ahx[1].grad, thx[1].grad, "c0 grad")
            else:
                assert_close(ahx.grad, thx.grad, "h0 grad")
        assert_grads_match(am, tm)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
async def test_unbatched_input(rt, rng, kind) -> None:
    with trio.fail_after(30):
        am, tm = _pair_modules(kind, 3, 4, 2, bidirectional=True)
        ax, tx = pair(rng, (5, 3), torch)
        ay, ast = am(ax)
        ty, tst = tm(tx)
        assert_close(ay, ty, "output")
        if kind == "lstm":
            assert ast[0].shape == (4, 4) and ast[1].shape == (4, 4)
            assert_close(ast[1], tst[1])
            ah, th = pair(rng, (4, 4), torch)
            ac, tc = pair(rng, (4, 4), torch)
            ay2, _ = am(ax, (ah, ac))
            ty2, _ = tm(tx, (th, tc))
        else:
            assert ast.shape == (4, 4)
            ah, th = pair(rng, (4, 4), torch)
            ay2, _ = am(ax, ah)
            ty2, _ = tm(tx, th)
        assert_close(ay2, ty2)
        await ay2.sum().backward()
        ty2.sum().backward()
        assert_close(ah.grad, th.grad)
        assert_grads_match(am, tm)


async def test_state_dict_keys_and_shapes_are_torchs(rt) -> None:
    with trio.fail_after(30):
        for kind in KINDS:
            am, tm = _pair_modules(kind, 7, 3, 2, bidirectional=True)
            assert [(k, v.shape) for k, v in am.state_dict().items()] == [
                (k, tuple(v.shape)) for k, v in tm.state_dict().items()
            ]
        lstm = nn.LSTM(4, 6)
        bound = 1 / np.sqrt(6)
        for p in lstm.parameters():
            v = p.numpy()
            assert np.all(np.abs(v) <= bound) and v.std() > 0
        assert len(lstm.all_weights) == 1 and len(lstm.all_weights[0]) == 4
    lstm.flatten_parameters()  # accepted, as programs written for cuDNN call it
    assert [id(p) for p in lstm._flat_weights] == [id(p) for p in lstm.parameters()]


async def test_dropout_between_layers(rt, rng) -> None:
    with trio.fail_after(30):
        am, tm = _pair_modules("lstm", 3, 4, 2, dropout=0.5)
        ax, tx = pair(rng, (5, 2, 3), torch)
        am.eval()
        tm.eval()
        assert_close(am(ax)[0], tm(tx)[0], "eval: no dropout")
        am.train()
        y1 = am(ax)[0].numpy()
        y2 = am(ax)[0].numpy()
        assert not np.allclose(y1, y2), "training mode must drop between layers"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            nn.GRU(3, 4, 1, dropout=0.3)
        assert any("num_layers greater than 1" in str(x.message) for x in w)


@pytest.mark.parametrize("kind", ["rnn", "rnn_relu", "lstm", "gru"])
@pytest.mark.parametrize("batched", [True, False])
async def test_cells_match_torch(rt, rng, kind, batched) -> None:
    with trio.fail_after(30):
        name, extra = KINDS[kind]
        tm = getattr(torch.nn, name + "Cell")(3, 5, **extra).double()
        am = getattr(nn, name + "Cell")(3, 5, **extra, dtype=ag.float64)
        load_from_torch(am, tm)
        shp = (4,) if batched else ()
        ax, tx = pair(rng, (*shp, 3), torch)
        ah, th = pair(rng, (*shp, 5), torch)
        if kind == "lstm":
            ac, tc = pair(rng, (*shp, 5), torch)
            # two steps, so gradients flow through the states
            ah1, ac1 = am(ax, (ah, ac))
            ah2, ac2 = am(ax * 2, (ah1, ac1))
            th1, tc1 = tm(tx, (th, tc))
            th2, tc2 = tm(tx * 2, (th1, tc1))
            assert_close(ah2, th2)
            assert_close(ac2, tc2)
            await ((ah2 * ah2).sum() + ac2.sum()).backward()
            ((th2 * th2).sum() + tc2.sum()).backward()
            assert_close(ac.grad, tc.grad, "c grad")
            assert_close(am(ax)[0], tm(tx)[0], "zero state")
        else:
            ah2 = am(ax * 2, am(ax, ah))
            th2 = tm(tx * 2, tm(tx, th))
            assert_close(ah2, th2)
            await (ah2 * ah2).sum().backward()
            (th2 * th2).sum().backward()
            assert_close(am(ax), tm(tx), "zero state")
        assert_close(ax.grad, tx.grad, "x grad")
        assert_close(ah.grad, th.grad, "h grad")
        assert_grads_match(am, tm)


async def test_bad_arguments_raise_clear_errors(rt) -> None:
    with trio.fail_after(30):
        with pytest.raises(ValueError, match="nonlinearity"):
            nn.RNN(3, 4, nonlinearity="sigmoid")
        with pytest.raises(ValueError, match="hidden_size must be a positive int"):
            nn.LSTM(3, 0)
        with pytest.raises(ValueError, match="dropout"):
            nn.GRU(3, 4, 2, dropout=1.5)
        with pytest.raises(ValueError, match="proj_size"):
            nn.GRU(3, 4, proj_size=2)
        lstm = nn.LSTM(3, 4, 2, dtype=ag.float64)
        x = ag.zeros((5, 2, 3), dtype=ag.float64)
        with pytest.raises(ValueError, match=r"input_size\. Expected 3, got 6"):
            lstm(ag.zeros((5, 2, 6), dtype=ag.float64))
        with pytest.raises(ValueError, match="2D or 3D"):
            lstm(ag.zeros((5,), dtype=ag.float64))
        with pytest.raises(ValueError, match=r"h_0 of size \(2, 2, 4\), got \(1, 2, 4\)"):
            lstm(x, (ag.zeros((1, 2, 4), dtype=ag.float64), ag.zeros((2, 2, 4), dtype=ag.float64)))
        with pytest.raises(TypeError, match="tuple"):
            lstm(x, ag.zeros((2, 2, 4), dtype=ag.float64))
        with pytest.raises(ag.OpError, match="one floating point dtype"):
            lstm(ag.zeros((5, 2, 3), dtype=ag.float32))
        with pytest.raises(ValueError, match="inconsistent input_size"):
            nn.GRUCell(3, 4)(ag.zeros((2, 5)))
        with pytest.raises(ValueError, match=r"hx of size \(2, 4\)"):
            nn.RNNCell(3, 4)(ag.zeros((2, 3)), ag.zeros((3, 4)))


async def test_one_op_per_layer_direction(rt, rng) -> None:
    """The fused recurrence: the graph of a 2-layer bidirectional LSTM over 50 steps holds 4 recurrence
    nodes (one per layer and direction), however long the sequence."""
    with trio.fail_after(30):
        lstm = nn.LSTM(3, 4, 2, bidirectional=True, dtype=ag.float64)
        x = ag.tensor(rng.standard_normal((50, 2, 3)), requires_grad=True)
        y, _ = lstm(x)
        seen, stack, rec = set(), [y.grad_fn], 0
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            rec += node.name() == "RecurrentLayerBackward0"
            stack.extend(fn for fn, _ in node.next_functions if fn is not None and hasattr(fn, "next_functions"))
        assert rec == 4
        assert len(seen) < 40  # a handful of views and cats, not hundreds of per-step ops


@pytest.mark.parametrize("limit", [-1, 10**9])
async def test_lanes_and_inline_give_the_same_values(rt, rng, monkeypatch, limit) -> None:
    """Every kernel queued on the lanes (pending inputs, views of a pending packed buffer) or every kernel
    inline: the same outputs and gradients as torch."""
    from tests._util import set_inline_limit

    set_inline_limit(monkeypatch, limit)
    with trio.fail_after(60):
        am, tm = _pair_modules("lstm", 3, 4, 2, bidirectional=True, batch_first=True)
        ax, tx = pair(rng, (2, 7, 3), torch)
        ay, (ah, ac) = am(ax * 1.5)  # a pending input when queued
        ty, (th, tc) = tm(tx * 1.5)
        await ((ay * ay).sum() + ah.sum() + (ac * ac).sum()).backward()
        ((ty * ty).sum() + th.sum() + (tc * tc).sum()).backward()
        assert_close(ay, ty)
        assert_close(ax.grad, tx.grad)
        assert_grads_match(am, tm)


async def test_float32_default_dtype(rt, rng) -> None:
    with trio.fail_after(30):
        tm = torch.nn.GRU(3, 4, 2)
        am = nn.GRU(3, 4, 2)
        load_from_torch(am, tm)
        x = rng.standard_normal((5, 2, 3)).astype(np.float32)
        ay, ah = am(ag.tensor(x))
        ty, th = tm(torch.tensor(x))
        assert ay.dtype == np.float32 and ah.dtype == np.float32
        assert_close(ay, ty, rtol=1e-5, atol=1e-6)
        assert_close(ah, th, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bidir,batch_first,with_h0", [(False, False, True), (True, True, False)])
async def test_lstm_with_projection_matches_torch(rt, rng, bidir, batch_first, with_h0) -> None:
    with trio.fail_after(60):
        am, tm = _pair_modules("lstm", 3, 5, 2, bidirectional=bidir, batch_first=batch_first, proj_size=2)
        assert "weight_hr_l1" in am.state_dict() and am.state_dict()["weight_hh_l0"].shape == (20, 2)
        d = 2 if bidir else 1
        ax, tx = pair(rng, (4, 6, 3) if batch_first else (6, 4, 3), torch)
        ahx = thx = None
        if with_h0:
            ah, th = pair(rng, (2 * d, 4, 2), torch)
            ac, tc = pair(rng, (2 * d, 4, 5), torch)
            ahx, thx = (ah, ac), (th, tc)
        ay, (ahn, acn) = am(ax, ahx)
        ty, (thn, tcn) = tm(tx, thx)
        assert ay.shape == tuple(ty.shape) and ahn.shape == tuple(thn.shape) and acn.shape == tuple(tcn.shape)
        assert_close(ay, ty)
        assert_close(ahn, thn)
        assert_close(acn, tcn)
        await ((ay * ay).sum() + ahn.sum() + (acn * acn).sum()).backward()
        ((ty * ty).sum() + thn.sum() + (tcn * tcn).sum()).backward()
        assert_close(ax.grad, tx.grad)
        if with_h0:
            assert_close(ahx[0].grad, thx[0].grad)
            assert_close(ahx[1].grad, thx[1].grad)
        assert_grads_match(am, tm)
    with pytest.raises(ValueError, match="proj_size has to be smaller than hidden_size"):
        nn.LSTM(3, 4, proj_size=4)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
async def test_gradient_penalty_through_recurrence_matches_torch(rt, rng, kind) -> None:
    """create_graph=True through a 2-layer bidirectional recurrence, then backward of the gradient's norm
    (WGAN-GP's penalty): the same values and parameter gradients as torch."""
    with trio.fail_after(60):
        am, tm = _pair_modules(kind, 3, 4, 2, bidirectional=True)
        ax, tx = pair(rng, (5, 2, 3), torch)
        ay, _ = am(ax)
        ty, _ = tm(tx)
        (agx,) = await ag.grad((ay * ay).sum(), [ax], create_graph=True)
        (tgx,) = torch.autograd.grad((ty * ty).sum(), [tx], create_graph=True)
        assert_close(agx, tgx, "first gradient")
        await ((agx * agx).sum()).backward()
        ((tgx * tgx).sum()).backward()
        assert_grads_match(am, tm, rtol=1e-9)
        assert_close(ax.grad, tx.grad, rtol=1e-9)
