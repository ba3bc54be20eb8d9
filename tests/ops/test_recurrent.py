"""The fused recurrence op: central-difference gradient checks in float64, for every mode and direction."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad.ops import recurrent_layer


@pytest.mark.parametrize("mode", ["rnn_tanh", "rnn_relu", "lstm", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
async def test_recurrent_layer_gradcheck(rt, rng, mode, reverse) -> None:
    g = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}[mode]
    t_len, b, i, h = 4, 2, 3, 3
    x = rng.standard_normal((t_len, b, i))
    h0 = rng.standard_normal((b, h)) * 0.5
    c0 = rng.standard_normal((b, h)) * 0.5
    w_ih = rng.standard_normal((g * h, i)) * 0.5
    w_hh = rng.standard_normal((g * h, h)) * 0.5
    b_ih = rng.standard_normal(g * h) * 0.3
    b_hh = rng.standard_normal(g * h) * 0.3
    lstm = mode == "lstm"

    def fn(x, h0, *rest):
        if lstm:
            c, wi, wh, bi, bh = rest
        else:
            (wi, wh, bi, bh), c = rest, None
        y, hn, cn = recurrent_layer(mode, x, h0, c, wi, wh, bi, bh, reverse=reverse)
        parts = [y.reshape(-1), hn.reshape(-1) * 2.0]
        if cn is not None:
            parts.append(cn.reshape(-1) * 3.0)
        return ag.cat(parts, 0)

    inputs = [x, h0, c0, w_ih, w_hh, b_ih, b_hh] if lstm else [x, h0, w_ih, w_hh, b_ih, b_hh]
    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(fn, inputs, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("reverse", [False, True])
async def test_projected_lstm_gradcheck(rt, rng, reverse) -> None:
    t_len, b, i, h, p = 3, 2, 2, 3, 2
    inputs = [
        rng.standard_normal((t_len, b, i)),
        rng.standard_normal((b, p)) * 0.5,
        rng.standard_normal((b, h)) * 0.5,
        rng.standard_normal((4 * h, i)) * 0.5,
        rng.standard_normal((4 * h, p)) * 0.5,
        rng.standard_normal(4 * h) * 0.3,
        rng.standard_normal(4 * h) * 0.3,
        rng.standard_normal((p, h)) * 0.5,
    ]

    def fn(x, h0, c0, wi, wh, bi, bh, wr):
        y, hn, cn = recurrent_layer("lstm", x, h0, c0, wi, wh, bi, bh, reverse=reverse, weight_hr=wr)
        return ag.cat([y.reshape(-1), hn.reshape(-1) * 2.0, cn.reshape(-1) * 3.0], 0)

    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(fn, inputs, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("mode", ["rnn_tanh", "lstm", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
async def test_recurrent_layer_with_lengths_gradcheck(rt, rng, mode, reverse) -> None:
    """Rows of a padded batch with their own lengths: states freeze past a row's end (backwards: start at it)."""
    g = {"rnn_tanh": 1, "lstm": 4, "gru": 3}[mode]
    t_len, b, i, h = 4, 3, 2, 3
    lstm = mode == "lstm"
    inputs = [
        rng.standard_normal((t_len, b, i)),
        rng.standard_normal((b, h)) * 0.5,
        rng.standard_normal((b, h)) * 0.5,
        rng.standard_normal((g * h, i)) * 0.5,
        rng.standard_normal((g * h, h)) * 0.5,
        rng.standard_normal(g * h) * 0.3,
    ]
    if not lstm:
        del inputs[2]

    def fn(x, h0, *rest):
        c, wi, wh, bi = rest if lstm else (None, *rest)
        y, hn, cn = recurrent_layer(mode, x, h0, c, wi, wh, bi, None, reverse=reverse, lengths=[4, 1, 2])
        parts = [y.reshape(-1), hn.reshape(-1) * 2.0] + ([cn.reshape(-1) * 3.0] if cn is not None else [])
        return ag.cat(parts, 0)

    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(fn, inputs, atol=1e-7, rtol=1e-6)
    t = [ag.tensor(a) for a in inputs]
    x, h0, c0 = t[0], t[1], (t[2] if lstm else None)
    wi, wh, bi = t[-3:]
    with pytest.raises(ag.OpError, match=r"lengths of 3 sequences, each in \[1, 4\]"):
        recurrent_layer(mode, x, h0, c0, wi, wh, bi, lengths=[4, 0, 2])


async def test_recurrent_layer_without_bias_and_errors(rt, rng) -> None:
    x = rng.standard_normal((3, 2, 2))
    h0 = rng.standard_normal((2, 2))
    w_ih = rng.standard_normal((6, 2)) * 0.5
    w_hh = rng.standard_normal((6, 2)) * 0.5
    with trio.fail_after(60):
        assert await ag.autograd.gradcheck(
            lambda *a: recurrent_layer("gru", *a[:2], None, *a[2:])[0], [x, h0, w_ih, w_hh]
        )
    t = ag.tensor
    with pytest.raises(ag.OpError, match=r"weight_ih of shape \(6, 2\) does not fit an input of shape \(3, 2, 5\)"):
        recurrent_layer("gru", t(np.zeros((3, 2, 5))), t(h0), None, t(w_ih), t(w_hh))
    with pytest.raises(ag.OpError, match="cell state c0"):
        recurrent_layer("lstm", t(x), t(h0), None, t(np.zeros((8, 2))), t(np.zeros((8, 2))))
    with pytest.raises(ag.OpError, match=r"expected hx of shape \(2, 2\), got \(2, 3\)"):
        recurrent_layer("gru", t(x), t(np.zeros((2, 3))), None, t(w_ih), t(w_hh))
    with pytest.raises(ag.OpError, match="unknown mode"):
        recurrent_layer("elman", t(x), t(h0), None, t(w_ih), t(w_hh))
    with pytest.raises(ag.OpError, match="at least one step"):
        recurrent_layer("gru", t(np.zeros((0, 2, 2))), t(h0), None, t(w_ih), t(w_hh))


@pytest.mark.parametrize(
    "mode,reverse,proj,lengths",
    [
        ("rnn_tanh", False, False, None),
        ("rnn_relu", True, False, [3, 1]),
        ("lstm", False, False, None),
        ("lstm", True, True, [2, 3]),
        ("gru", False, False, [3, 2]),
        ("gru", True, False, None),
    ],
)
async def test_recurrent_layer_second_derivatives(rt, rng, mode, reverse, proj, lengths) -> None:
    """create_graph=True: the backward runs as recorded ops (same first gradients, 1e-12), and its own
    gradient matches central differences of the first gradients."""
    g = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}[mode]
    t_len, b, i, h, p = 3, 2, 2, 3, 2
    hs = p if proj else h
    lstm = mode == "lstm"
    inputs = [rng.standard_normal((t_len, b, i)), rng.standard_normal((b, hs)) * 0.5]
    if lstm:
        inputs.append(rng.standard_normal((b, h)) * 0.5)
    inputs += [
        rng.standard_normal((g * h, i)) * 0.5,
        rng.standard_normal((g * h, hs)) * 0.5,
        rng.standard_normal(g * h) * 0.3,
        rng.standard_normal(g * h) * 0.3,
    ]
    if proj:
        inputs.append(rng.standard_normal((p, h)) * 0.5)

    def fn(x, h0, *rest):
        rest = list(rest)
        c0 = rest.pop(0) if lstm else None
        wr = rest.pop() if proj else None
        y, hn, cn = recurrent_layer(mode, x, h0, c0, *rest, reverse=reverse, weight_hr=wr, lengths=lengths)
        parts = [y.reshape(-1), hn.reshape(-1) * 2.0] + ([cn.reshape(-1) * 3.0] if cn is not None else [])
        return ag.cat(parts, 0)

    with trio.fail_after(120):
        assert await ag.autograd.gradgradcheck(fn, inputs, atol=1e-6, rtol=1e-5)
