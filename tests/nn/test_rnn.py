"""nn.RNN / LSTM / GRU and their cells against torch in float64: outputs, final states, every gradient.

The torch side runs in ``torch_ref`` functions (live where torch is installed, recorded otherwise): torch
builds each module, its initial weights come back as a state dict that the asyncgrad module loads.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn
from tests._util import (
    ATOL,
    RTOL,
    grads_of,
    load_state,
    state_from_torch,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)

KINDS = {"rnn": ("RNN", {}), "rnn_relu": ("RNN", {"nonlinearity": "relu"}), "lstm": ("LSTM", {}), "gru": ("GRU", {})}


def _torch_module(torch, kind: str, *args: object, state=None, **kw: object):
    """torch's module of ``kind`` in float64, with ``state`` loaded when given (else torch's own init)."""
    name, extra = KINDS[kind]
    tm = getattr(torch.nn, name)(*args, **extra, **kw).double()
    if state is not None:
        tm.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    return tm


def _ag_module(kind: str, state, *args: object, **kw: object):
    """asyncgrad's module of ``kind`` in float64 with torch's (recorded) ``state`` loaded strictly."""
    name, extra = KINDS[kind]
    am = getattr(nn, name)(*args, **extra, **kw, dtype=ag.float64)
    load_state(am, state)
    return am


def _tleaf(torch, a):
    """A float64 torch leaf of ``a`` that requires grad (None for None)."""
    return None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=True)


def _leaf(a):
    """A float64 asyncgrad leaf of ``a`` that requires grad (None for None)."""
    return None if a is None else ag.tensor(a, dtype=ag.float64, requires_grad=True)


def _close(got, want, what: str = "", rtol: float = RTOL, atol: float = ATOL) -> None:
    """An asyncgrad tensor against a (recorded) torch value, as numpy."""
    np.testing.assert_allclose(got.numpy(), want, rtol=rtol, atol=atol, err_msg=what)


def _assert_grads_equal(amod, grads, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every parameter's ``.grad`` of ``amod`` equals torch's (``grads_of``, recorded): both None, or close.

    (``tests._util.assert_grads_equal`` compares through ``to_numpy``, which takes no numpy arrays.)
    """
    ap = dict(amod.named_parameters())
    assert list(ap) == list(grads)
    for k, g in grads.items():
        if g is None:
            assert ap[k].grad is None, f"{k}: asyncgrad has a grad, torch has none"
            continue
        assert ap[k].grad is not None, f"{k}: torch has a grad, asyncgrad has none"
        _close(ap[k].grad, g, f"grad of {k}", rtol, atol)


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
async def test_recurrent_layers_match_torch(
    rt, rng, torch_ref, kind, layers, bidir, batch_first, bias, with_h0
) -> None:
    cfg = {"bias": bias, "batch_first": batch_first, "bidirectional": bidir}
    with trio.fail_after(60):
        state = torch_ref("init", lambda torch: state_from_torch(_torch_module(torch, kind, 3, 5, layers, **cfg)))
        am = _ag_module(kind, state, 3, 5, layers, **cfg)
        d = 2 if bidir else 1
        t_len, n = 6, 4
        x = rng.standard_normal((n, t_len, 3) if batch_first else (t_len, n, 3))
        h0 = c0 = None
        if with_h0:
            h0 = rng.standard_normal((layers * d, n, 5))
            if kind == "lstm":
                c0 = rng.standard_normal((layers * d, n, 5))
        ax, ah0, ac0 = _leaf(x), _leaf(h0), _leaf(c0)
        ahx = None if h0 is None else (ah0, ac0) if kind == "lstm" else ah0
        ay, ast = am(ax, ahx)
        ast = list(ast) if kind == "lstm" else [ast]
        # the output weightings, drawn for asyncgrad's shapes (which must be torch's: checked below)
        wy = rng.standard_normal(ay.shape)
        ws = [rng.standard_normal(s.shape) for s in ast]

        def reference(torch):
            tm = _torch_module(torch, kind, 3, 5, layers, state=state, **cfg)
            tx, th0, tc0 = (_tleaf(torch, a) for a in (x, h0, c0))
            thx = None if th0 is None else (th0, tc0) if kind == "lstm" else th0
            ty, tst = tm(tx, thx)
            tst = list(tst) if kind == "lstm" else [tst]
            tloss = (ty * torch.tensor(wy)).sum()
            for s, w in zip(tst, ws):
                tloss = tloss + (s * torch.tensor(w)).sum()
            tloss.backward()
            h0_grads = [t.grad for t in (th0, tc0) if t is not None]
            return {"y": ty, "states": tst, "x_grad": tx.grad, "h0_grads": h0_grads, "params": grads_of(tm)}

        want = torch_ref("forward_backward", reference, state=state, x=x, h0=h0, c0=c0, wy=wy, ws=ws)
        assert ay.shape == want["y"].shape
        _close(ay, want["y"], "output")
        assert [s.shape for s in ast] == [s.shape for s in want["states"]]
        for a, t, what in zip(ast, want["states"], ("h_n", "c_n")):
            _close(a, t, what)
        aloss = (ay * ag.tensor(wy)).sum()
        for s, w in zip(ast, ws):
            aloss = aloss + (s * ag.tensor(w)).sum()
        await aloss.backward()
        _close(ax.grad, want["x_grad"], "input grad")
        agot = [a for a in (ah0, ac0) if a is not None]
        assert len(agot) == len(want["h0_grads"]) == (0 if not with_h0 else 2 if kind == "lstm" else 1)
        for a, t, what in zip(agot, want["h0_grads"], ("h0 grad", "c0 grad")):
            _close(a.grad, t, what)
        _assert_grads_equal(am, want["params"])


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
async def test_unbatched_input(rt, rng, torch_ref, kind) -> None:
    with trio.fail_after(30):
        x = rng.standard_normal((5, 3))
        h = rng.standard_normal((4, 4))
        c = rng.standard_normal((4, 4)) if kind == "lstm" else None

        def reference(torch):
            tm = _torch_module(torch, kind, 3, 4, 2, bidirectional=True)
            out = {"state": state_from_torch(tm)}
            tx, th, tc = (_tleaf(torch, a) for a in (x, h, c))
            out["y"], tst = tm(tx)
            if kind == "lstm":
                out["c_n"] = tst[1]
                ty2, _ = tm(tx, (th, tc))
            else:
                ty2, _ = tm(tx, th)
            out["y2"] = ty2
            ty2.sum().backward()
            out["h_grad"], out["params"] = th.grad, grads_of(tm)
            return out

        want = torch_ref("unbatched", reference, x=x, h=h, c=c)
        am = _ag_module(kind, want["state"], 3, 4, 2, bidirectional=True)
        ax = _leaf(x)
        ay, ast = am(ax)
        _close(ay, want["y"], "output")
        ah = _leaf(h)
        if kind == "lstm":
            assert ast[0].shape == (4, 4) and ast[1].shape == (4, 4)
            _close(ast[1], want["c_n"])
            ay2, _ = am(ax, (ah, _leaf(c)))
        else:
            assert ast.shape == (4, 4)
            ay2, _ = am(ax, ah)
        _close(ay2, want["y2"])
        await ay2.sum().backward()
        _close(ah.grad, want["h_grad"])
        _assert_grads_equal(am, want["params"])


async def test_state_dict_keys_and_shapes_are_torchs(rt, torch_ref) -> None:
    with trio.fail_after(30):
        states = torch_ref(
            "states",
            lambda torch: {kind: state_from_torch(_torch_module(torch, kind, 7, 3, 2, bidirectional=True))
                           for kind in KINDS},
        )
        assert list(states) == list(KINDS)
        for kind in KINDS:
            am = _ag_module(kind, states[kind], 7, 3, 2, bidirectional=True)
            assert [(k, v.shape) for k, v in am.state_dict().items()] == [
                (k, v.shape) for k, v in states[kind].items()
            ]
        lstm = nn.LSTM(4, 6)
        bound = 1 / np.sqrt(6)
        for p in lstm.parameters():
            v = p.numpy()
            assert np.all(np.abs(v) <= bound) and v.std() > 0
        assert len(lstm.all_weights) == 1 and len(lstm.all_weights[0]) == 4
    lstm.flatten_parameters()  # accepted, as programs written for cuDNN call it
    assert [id(p) for p in lstm._flat_weights] == [id(p) for p in lstm.parameters()]


async def test_dropout_between_layers(rt, rng, torch_ref) -> None:
    with trio.fail_after(30):
        x = rng.standard_normal((5, 2, 3))

        def reference(torch):
            tm = _torch_module(torch, "lstm", 3, 4, 2, dropout=0.5)
            state = state_from_torch(tm)
            tm.eval()
            return {"state": state, "eval_y": tm(_tleaf(torch, x))[0]}

        want = torch_ref("eval", reference, x=x)
        am = _ag_module("lstm", want["state"], 3, 4, 2, dropout=0.5)
        ax = _leaf(x)
        am.eval()
        _close(am(ax)[0], want["eval_y"], "eval: no dropout")
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
async def test_cells_match_torch(rt, rng, torch_ref, kind, batched) -> None:
    with trio.fail_after(30):
        name, extra = KINDS[kind]
        shp = (4,) if batched else ()
        x = rng.standard_normal((*shp, 3))
        h = rng.standard_normal((*shp, 5))
        c = rng.standard_normal((*shp, 5)) if kind == "lstm" else None

        def reference(torch):
            tm = getattr(torch.nn, name + "Cell")(3, 5, **extra).double()
            out = {"state": state_from_torch(tm)}
            tx, th, tc = (_tleaf(torch, a) for a in (x, h, c))
            if kind == "lstm":
                # two steps, so gradients flow through the states
                th1, tc1 = tm(tx, (th, tc))
                out["h2"], out["c2"] = th2, tc2 = tm(tx * 2, (th1, tc1))
                ((th2 * th2).sum() + tc2.sum()).backward()
                out["c_grad"] = tc.grad
                out["zero_state"] = tm(tx)[0]
            else:
                out["h2"] = th2 = tm(tx * 2, tm(tx, th))
                (th2 * th2).sum().backward()
                out["zero_state"] = tm(tx)
            out["x_grad"], out["h_grad"], out["params"] = tx.grad, th.grad, grads_of(tm)
            return out

        want = torch_ref("cell", reference, x=x, h=h, c=c)
        am = getattr(nn, name + "Cell")(3, 5, **extra, dtype=ag.float64)
        load_state(am, want["state"])
        ax, ah = _leaf(x), _leaf(h)
        if kind == "lstm":
            ac = _leaf(c)
            ah1, ac1 = am(ax, (ah, ac))
            ah2, ac2 = am(ax * 2, (ah1, ac1))
            _close(ah2, want["h2"])
            _close(ac2, want["c2"])
            await ((ah2 * ah2).sum() + ac2.sum()).backward()
            _close(ac.grad, want["c_grad"], "c grad")
            _close(am(ax)[0], want["zero_state"], "zero state")
        else:
            ah2 = am(ax * 2, am(ax, ah))
            _close(ah2, want["h2"])
            await (ah2 * ah2).sum().backward()
            _close(am(ax), want["zero_state"], "zero state")
        _close(ax.grad, want["x_grad"], "x grad")
        _close(ah.grad, want["h_grad"], "h grad")
        _assert_grads_equal(am, want["params"])


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
async def test_lanes_and_inline_give_the_same_values(rt, rng, torch_ref, monkeypatch, limit) -> None:
    """Every kernel queued on the lanes (pending inputs, views of a pending packed buffer) or every kernel
    inline: the same outputs and gradients as torch."""
    from tests._util import set_inline_limit

    set_inline_limit(monkeypatch, limit)
    cfg = {"bidirectional": True, "batch_first": True}
    with trio.fail_after(60):
        x = rng.standard_normal((2, 7, 3))

        def reference(torch):
            tm = _torch_module(torch, "lstm", 3, 4, 2, **cfg)
            state = state_from_torch(tm)
            tx = _tleaf(torch, x)
            ty, (th, tc) = tm(tx * 1.5)
            ((ty * ty).sum() + th.sum() + (tc * tc).sum()).backward()
            return {"state": state, "y": ty, "x_grad": tx.grad, "params": grads_of(tm)}

        want = torch_ref("lstm", reference, x=x)
        am = _ag_module("lstm", want["state"], 3, 4, 2, **cfg)
        ax = _leaf(x)
        ay, (ah, ac) = am(ax * 1.5)  # a pending input when queued
        await ((ay * ay).sum() + ah.sum() + (ac * ac).sum()).backward()
        _close(ay, want["y"])
        _close(ax.grad, want["x_grad"])
        _assert_grads_equal(am, want["params"])


async def test_float32_default_dtype(rt, rng, torch_ref) -> None:
    with trio.fail_after(30):
        x = rng.standard_normal((5, 2, 3)).astype(np.float32)

        def reference(torch):
            tm = torch.nn.GRU(3, 4, 2)
            ty, th = tm(torch.tensor(x))
            return {"state": state_from_torch(tm), "y": ty, "h": th}

        want = torch_ref("gru_float32", reference, x=x)
        am = nn.GRU(3, 4, 2)
        load_state(am, want["state"])
        ay, ah = am(ag.tensor(x))
        assert ay.dtype == np.float32 and ah.dtype == np.float32
        _close(ay, want["y"], rtol=1e-5, atol=1e-6)
        _close(ah, want["h"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bidir,batch_first,with_h0", [(False, False, True), (True, True, False)])
async def test_lstm_with_projection_matches_torch(rt, rng, torch_ref, bidir, batch_first, with_h0) -> None:
    cfg = {"bidirectional": bidir, "batch_first": batch_first, "proj_size": 2}
    with trio.fail_after(60):
        d = 2 if bidir else 1
        x = rng.standard_normal((4, 6, 3) if batch_first else (6, 4, 3))
        h0 = c0 = None
        if with_h0:
            h0 = rng.standard_normal((2 * d, 4, 2))
            c0 = rng.standard_normal((2 * d, 4, 5))

        def reference(torch):
            tm = _torch_module(torch, "lstm", 3, 5, 2, **cfg)
            out = {"state": state_from_torch(tm)}
            tx, th0, tc0 = (_tleaf(torch, a) for a in (x, h0, c0))
            ty, (thn, tcn) = tm(tx, None if th0 is None else (th0, tc0))
            out.update(y=ty, h_n=thn, c_n=tcn)
            ((ty * ty).sum() + thn.sum() + (tcn * tcn).sum()).backward()
            out["x_grad"], out["params"] = tx.grad, grads_of(tm)
            out["h0_grads"] = None if th0 is None else [th0.grad, tc0.grad]
            return out

        want = torch_ref("lstm_proj", reference, x=x, h0=h0, c0=c0)
        am = _ag_module("lstm", want["state"], 3, 5, 2, **cfg)
        assert "weight_hr_l1" in am.state_dict() and am.state_dict()["weight_hh_l0"].shape == (20, 2)
        ax, ah0, ac0 = _leaf(x), _leaf(h0), _leaf(c0)
        ay, (ahn, acn) = am(ax, None if ah0 is None else (ah0, ac0))
        assert ay.shape == want["y"].shape and ahn.shape == want["h_n"].shape and acn.shape == want["c_n"].shape
        _close(ay, want["y"])
        _close(ahn, want["h_n"])
        _close(acn, want["c_n"])
        await ((ay * ay).sum() + ahn.sum() + (acn * acn).sum()).backward()
        _close(ax.grad, want["x_grad"])
        if with_h0:
            _close(ah0.grad, want["h0_grads"][0])
            _close(ac0.grad, want["h0_grads"][1])
        _assert_grads_equal(am, want["params"])
    with pytest.raises(ValueError, match="proj_size has to be smaller than hidden_size"):
        nn.LSTM(3, 4, proj_size=4)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
async def test_gradient_penalty_through_recurrence_matches_torch(rt, rng, torch_ref, kind) -> None:
    """create_graph=True through a 2-layer bidirectional recurrence, then backward of the gradient's norm
    (WGAN-GP's penalty): the same values and parameter gradients as torch."""
    with trio.fail_after(60):
        x = rng.standard_normal((5, 2, 3))

        def reference(torch):
            tm = _torch_module(torch, kind, 3, 4, 2, bidirectional=True)
            state = state_from_torch(tm)
            tx = _tleaf(torch, x)
            ty, _ = tm(tx)
            (tgx,) = torch.autograd.grad((ty * ty).sum(), [tx], create_graph=True)
            ((tgx * tgx).sum()).backward()
            return {"state": state, "first_grad": tgx, "params": grads_of(tm), "x_grad": tx.grad}

        want = torch_ref("penalty", reference, x=x)
        am = _ag_module(kind, want["state"], 3, 4, 2, bidirectional=True)
        ax = _leaf(x)
        ay, _ = am(ax)
        (agx,) = await ag.grad((ay * ay).sum(), [ax], create_graph=True)
        _close(agx, want["first_grad"], "first gradient")
        await ((agx * agx).sum()).backward()
        _assert_grads_equal(am, want["params"], rtol=1e-9)
        _close(ax.grad, want["x_grad"], rtol=1e-9)
