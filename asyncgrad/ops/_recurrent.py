"""Fused recurrences: one op per layer and direction runs a whole sequence of an RNN, LSTM or GRU.

The forward kernel multiplies every time step's input by ``W_ih`` in one GEMM, then loops over the time
steps in numpy (one ``(B, H) @ (H, G*H)`` product and a few elementwise ops per step) inside ONE kernel on
a lane. Its backward rule is one kernel too: it walks the steps in reverse for the hidden-state gradients
only, then computes ``dW_ih``, ``dW_hh``, the biases and ``dx`` with one GEMM each over all steps.

The op has one output, a flat buffer packing ``y`` (the hidden state of every step, ``(T, B, H)``), then
what the backward needs (the gate activations and, for an LSTM, every cell state). `recurrent_layer`
returns views of it: ``y``, ``h_n`` (a step of ``y``) and ``c_n`` (a step of the cell states), so the
gradients of all three reach the one rule through the buffer.

Gate layouts are PyTorch's: LSTM ``i, f, g, o``; GRU ``r, z, n`` with ``n = tanh(W_in x + b_in + r * (W_hn h +
b_hn))``; RNN ``tanh`` or ``relu``. An LSTM may project its hidden state (``proj_size``: ``h = W_hr (o *
tanh(c))``). Per-row ``lengths`` run a padded batch of variable-length sequences (PackedSequence): a row's
states stay as they are outside its own steps.

Under ``create_graph=True`` the rule instead recomputes the sequence with recorded ops and runs the same
backward equations as ops (a Python loop of small ops), so second derivatives are exact too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..runtime._dispatch import apply
from ..runtime._factories import tensor, zeros
from ..runtime._op import OpError, defop
from ..runtime._tensor import Tensor
from ._elementwise import relu, sigmoid, tanh
from ._linalg import matmul
from ._shape import cat, stack

__all__ = ["RECURRENT_MODES", "recurrent_layer"]

# mode -> gates per hidden unit
RECURRENT_MODES: dict[str, int] = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form: no overflow warning for large |x| (1 / (1 + exp(-x)) overflows exp)
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # type: ignore[no-any-return]


def _ws_size(mode: str, t: int, b: int, h: int) -> int:
    """Elements after ``y`` in the packed buffer (``h``: the cell size, the gates' hidden size): LSTM gates
    (4H) and cells (H), GRU r z n and W_hn h + b_hn."""
    if mode == "lstm":
        return t * b * 5 * h
    if mode == "gru":
        return t * b * 4 * h
    return 0


def _order(t: int, reverse: bool) -> range:
    return range(t - 1, -1, -1) if reverse else range(t)


# ---- forward ----------------------------------------------------------------------------------------


def _recurrent_kernel(
    x: np.ndarray,
    h0: np.ndarray,
    c0: np.ndarray | None,
    w_ih: np.ndarray,
    w_hh: np.ndarray,
    b_ih: np.ndarray | None,
    b_hh: np.ndarray | None,
    w_hr: np.ndarray | None,
    mode: str,
    reverse: bool,
    lengths: tuple[int, ...] | None = None,
) -> np.ndarray:
    t_len, b, _ = x.shape
    lens = None if lengths is None else np.asarray(lengths)
    hs = h0.shape[1]  # the state size: hidden_size, or proj_size for a projected LSTM
    h = w_ih.shape[0] // RECURRENT_MODES[mode]  # hidden_size (the gates', the cells')
    dt = x.dtype
    n_y = t_len * b * hs
    n_c = t_len * b * h
    buf = np.empty(n_y + _ws_size(mode, t_len, b, h), dt)
    y = buf[:n_y].reshape(t_len, b, hs)
    # every step's input projection in one GEMM
    xw = (x.reshape(t_len * b, -1) @ w_ih.T).reshape(t_len, b, -1)
    if b_ih is not None:
        xw += b_ih
    w_hh_t = np.ascontiguousarray(w_hh.T)  # a plain (H, G*H) operand: W9 LSTM h @ W_hh^T 5.8 -> 3.2 ms per layer
    hp = h0
    if mode == "lstm":
        if b_hh is not None:
            xw += b_hh
        gates = buf[n_y : n_y + 4 * n_c].reshape(t_len, b, 4 * h)
        cells = buf[n_y + 4 * n_c :].reshape(t_len, b, h)
        cp: Any = c0
        hw = np.empty((b, 4 * h), dt)
        tmp = np.empty((b, h), dt)
        # all four gates in three passes over the full width: sigmoid(x) = 0.5 + 0.5 tanh(0.5 x) on i, f, o
        # and tanh on g, as tanh(scale * x) * scale + shift with per-column scale (0.5 or 1) and shift
        scale = np.full(4 * h, 0.5, dt)
        scale[2 * h : 3 * h] = 1.0
        shift = np.full(4 * h, 0.5, dt)
        shift[2 * h : 3 * h] = 0.0
        for s in _order(t_len, reverse):
            pre = xw[s]  # scratch: each step's projection is read once, so the gates build up in place
            np.matmul(hp, w_hh_t, out=hw)
            pre += hw
            gs = gates[s]
            np.multiply(pre, scale, out=gs)
            np.tanh(gs, out=gs)
            gs *= scale
            gs += shift
            i, f, g, o = gs[:, :h], gs[:, h : 2 * h], gs[:, 2 * h : 3 * h], gs[:, 3 * h :]
            c = cells[s]
            np.multiply(f, cp, out=c)
            np.multiply(i, g, out=tmp)
            c += tmp
            if w_hr is None:
                np.tanh(c, out=tmp)
                np.multiply(o, tmp, out=y[s])
            else:  # the projection: h = W_hr (o * tanh(c))
                np.matmul(o * np.tanh(c), w_hr.T, out=y[s])
            if lens is not None:  # finished (or, backwards, not yet started) rows keep their states
                done = s >= lens
                if done.any():
                    y[s][done] = hp[done]
                    c[done] = cp[done]
            hp, cp = y[s], c
    elif mode == "gru":
        ws = buf[n_y:].reshape(t_len, b, 4 * h)  # r, z, n, W_hn h + b_hn
        for s in _order(t_len, reverse):
            gh = hp @ w_hh_t
            if b_hh is not None:
                gh += b_hh
            gi = xw[s]
            w = ws[s]
            w[:, : 2 * h] = _sigmoid(gi[:, : 2 * h] + gh[:, : 2 * h])
            r, z = w[:, :h], w[:, h : 2 * h]
            w[:, 3 * h :] = gh[:, 2 * h :]
            w[:, 2 * h : 3 * h] = np.tanh(gi[:, 2 * h :] + r * gh[:, 2 * h :])
            n = w[:, 2 * h : 3 * h]
            # h' = (1 - z) * n + z * h = n + z * (h - n)
            np.add(n, z * (hp - n), out=y[s])
            if lens is not None:
                done = s >= lens
                if done.any():
                    y[s][done] = hp[done]
            hp = y[s]
    else:
        if b_hh is not None:
            xw += b_hh
        relu = mode == "rnn_relu"
        for s in _order(t_len, reverse):
            pre = xw[s] + hp @ w_hh_t
            if relu:
                np.maximum(pre, 0, out=y[s])
            else:
                np.tanh(pre, out=y[s])
            if lens is not None:
                done = s >= lens
                if done.any():
                    y[s][done] = hp[done]
            hp = y[s]
    return buf


# ---- backward ---------------------------------------------------------------------------------------


def _prev_hidden(y: np.ndarray, h0: np.ndarray, reverse: bool) -> np.ndarray:
    """The hidden state each step started from, ``(T, B, H)``."""
    hprev = np.empty_like(y)
    if reverse:
        hprev[-1] = h0
        hprev[:-1] = y[1:]
    else:
        hprev[0] = h0
        hprev[1:] = y[:-1]
    return hprev


def _recurrent_grads(
    g: np.ndarray, args: list[Any], out: np.ndarray, kw: dict[str, Any], needs: Any
) -> tuple[Any, ...]:
    x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr = args
    mode, reverse = kw["mode"], kw["reverse"]
    t_len, b, n_in = x.shape
    hs = h0.shape[1]
    h = w_ih.shape[0] // RECURRENT_MODES[mode]
    n_y = t_len * b * hs
    n_c = t_len * b * h
    y = out[:n_y].reshape(t_len, b, hs)
    dy = g[:n_y].reshape(t_len, b, hs)
    dh = np.zeros((b, hs), g.dtype)
    steps = list(reversed(_order(t_len, reverse)))
    dc0 = dw_hr = None
    lengths = kw.get("lengths")
    # per step, a (B, 1) 1/0 column: which rows took the step (None: all of them, every step)
    lens = None if lengths is None else np.asarray(lengths).reshape(-1, 1)
    if mode == "lstm":
        gates = out[n_y : n_y + 4 * n_c].reshape(t_len, b, 4 * h)
        cells = out[n_y + 4 * n_c :].reshape(t_len, b, h)
        dcells = g[n_y + 4 * n_c :].reshape(t_len, b, h)  # c_n's gradient (and any other step's)
        dgi = np.empty((t_len, b, 4 * h), g.dtype)
        dc = np.zeros((b, h), g.dtype)
        dhs = np.empty((t_len, b, hs), g.dtype) if w_hr is not None else None
        act = np.empty((b, 4 * h), g.dtype)  # scratch: the gates' activation derivatives
        for k, s in enumerate(steps):
            gs = gates[s]
            i, f, gg, o = gs[:, :h], gs[:, h : 2 * h], gs[:, 2 * h : 3 * h], gs[:, 3 * h :]
            if k + 1 < len(steps):
                cp = cells[steps[k + 1]]
            else:
                cp = c0
            dst = dy[s] + dh  # the gradient of the state after step s
            a = None if lens is None else (s < lens).astype(g.dtype)
            dht = dst if a is None else dst * a
            if dhs is not None:  # through the projection: the gradient of o * tanh(c)
                dhs[s] = dht
                dht = dht @ w_hr
            tc = np.tanh(cells[s])
            dct = dc + dcells[s] + dht * o * (1.0 - tc * tc)
            d = dgi[s]
            dcg = dct if a is None else dct * a
            # each gate's output gradient, then times its activation's derivative over the full width
            # (sigmoid's s (1 - s) on i, f, o; tanh's 1 - g^2 on g)
            np.multiply(dcg, gg, out=d[:, :h])
            np.multiply(dcg, cp, out=d[:, h : 2 * h])
            np.multiply(dcg, i, out=d[:, 2 * h : 3 * h])
            np.multiply(dht, tc, out=d[:, 3 * h :])
            np.subtract(1.0, gs, out=act)
            act *= gs
            np.multiply(gg, gg, out=act[:, 2 * h : 3 * h])
            np.subtract(1.0, act[:, 2 * h : 3 * h], out=act[:, 2 * h : 3 * h])
            d *= act
            if a is None:
                dc = dct * f
                dh = d @ w_hh
            else:  # a row that skipped the step passes its state's gradients straight through
                dc = dct * (a * f + (1.0 - a))
                dh = d @ w_hh + dst * (1.0 - a)
        dc0 = dc
        dgh = dgi
        if dhs is not None and needs[7]:
            m = gates[:, :, 3 * h :] * np.tanh(cells)  # o * tanh(c) at every step
            dw_hr = dhs.reshape(t_len * b, hs).T @ m.reshape(t_len * b, h)
    elif mode == "gru":
        ws = out[n_y:].reshape(t_len, b, 4 * h)
        dgi = np.empty((t_len, b, 3 * h), g.dtype)
        dgh = np.empty((t_len, b, 3 * h), g.dtype)
        for k, s in enumerate(steps):
            w = ws[s]
            r, z, n, ghn = w[:, :h], w[:, h : 2 * h], w[:, 2 * h : 3 * h], w[:, 3 * h :]
            hp = y[steps[k + 1]] if k + 1 < len(steps) else h0
            dst = dy[s] + dh
            a = None if lens is None else (s < lens).astype(g.dtype)
            dht = dst if a is None else dst * a
            dn = dht * (1.0 - z) * (1.0 - n * n)
            dz = dht * (hp - n) * z * (1.0 - z)
            dr = dn * ghn * r * (1.0 - r)
            di, dhh = dgi[s], dgh[s]
            di[:, :h] = dr
            di[:, h : 2 * h] = dz
            di[:, 2 * h :] = dn
            dhh[:, : 2 * h] = di[:, : 2 * h]
            dhh[:, 2 * h :] = dn * r
            dh = dht * z + dhh @ w_hh
            if a is not None:
                dh += dst * (1.0 - a)
    else:
        dgi = np.empty((t_len, b, h), g.dtype)
        relu = mode == "rnn_relu"
        for s in steps:
            dst = dy[s] + dh
            a = None if lens is None else (s < lens).astype(g.dtype)
            dht = dst if a is None else dst * a
            ys = y[s]
            np.multiply(dht, (ys > 0) if relu else (1.0 - ys * ys), out=dgi[s])
            dh = dgi[s] @ w_hh
            if a is not None:
                dh += dst * (1.0 - a)
        dgh = dgi
    dgi2 = dgi.reshape(t_len * b, -1)
    dgh2 = dgh.reshape(t_len * b, -1)
    dx = (dgi2 @ w_ih).reshape(x.shape) if needs[0] else None
    dw_ih = dgi2.T @ x.reshape(t_len * b, n_in) if needs[3] else None
    dw_hh = dgh2.T @ _prev_hidden(y, h0, reverse).reshape(t_len * b, hs) if needs[4] else None
    db_ih = dgi2.sum(0) if b_ih is not None and needs[5] else None
    db_hh = dgh2.sum(0) if b_hh is not None and needs[6] else None
    return (dx, dh, dc0 if c0 is not None else None, dw_ih, dw_hh, db_ih, db_hh, dw_hr)


def _recurrent_rule(xp: Any, g: Any, args: Any, out: Any, kw: Any, needs: Any) -> tuple[Any, ...]:
    if not isinstance(g, np.ndarray):
        return _recurrent_grads_recorded(g, args, kw, needs)
    return _recurrent_grads(g, args, out, kw, needs)


def _recurrent_grads_recorded(g: Tensor, args: Any, kw: dict[str, Any], needs: Any) -> tuple[Any, ...]:
    """The backward as recorded ops (``create_graph=True``), so that it can be differentiated again.

    The forward is recomputed step by step with ops (the fused op's saved gates are not differentiable
    functions of the inputs), then the same equations as `_recurrent_grads` run as ops: a Python loop of
    small ops, taken only by passes that build a graph of the backward.
    """
    x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr = args
    mode, reverse = kw["mode"], kw["reverse"]
    lengths = kw.get("lengths")
    t_len, b, n_in = x.shape
    hs = h0.shape[1]
    h = w_ih.shape[0] // RECURRENT_MODES[mode]
    n_y = t_len * b * hs
    order = list(_order(t_len, reverse))
    masks: dict[int, Any] = {}
    if lengths is not None:
        lens = np.asarray(lengths).reshape(-1, 1)
        for s in order:
            masks[s] = tensor((s < lens).astype(x.dtype), device=x.device)

    def keep(s: int, new: Any, old: Any) -> Any:  # rows past their length keep their state
        a = masks.get(s)
        return new if a is None else new * a + old * (1.0 - a)

    # forward, recorded
    xw = matmul(x.reshape(t_len * b, n_in), w_ih.transpose(0, 1)).reshape(t_len, b, -1)
    if b_ih is not None:
        xw = xw + b_ih
    if b_hh is not None and mode != "gru":
        xw = xw + b_hh
    w_hh_t = w_hh.transpose(0, 1)
    saved: dict[int, tuple[Any, ...]] = {}
    hp, cp = h0, c0
    for s in order:
        if mode == "lstm":
            pre = xw[s] + matmul(hp, w_hh_t)
            i, f = sigmoid(pre[:, :h]), sigmoid(pre[:, h : 2 * h])
            gg, o = tanh(pre[:, 2 * h : 3 * h]), sigmoid(pre[:, 3 * h :])
            c = keep(s, f * cp + i * gg, cp)
            m = o * tanh(c)
            hn = keep(s, m if w_hr is None else matmul(m, w_hr.transpose(0, 1)), hp)
            saved[s] = (hp, cp, i, f, gg, o, c, m)
            hp, cp = hn, c
        elif mode == "gru":
            gh = matmul(hp, w_hh_t)
            if b_hh is not None:
                gh = gh + b_hh
            gi = xw[s]
            r = sigmoid(gi[:, :h] + gh[:, :h])
            z = sigmoid(gi[:, h : 2 * h] + gh[:, h : 2 * h])
            ghn = gh[:, 2 * h :]
            n = tanh(gi[:, 2 * h :] + r * ghn)
            saved[s] = (hp, r, z, n, ghn)
            hp = keep(s, n + z * (hp - n), hp)
        else:
            pre = xw[s] + matmul(hp, w_hh_t)
            hn = relu(pre) if mode == "rnn_relu" else tanh(pre)
            saved[s] = (hp, hn)
            hp = keep(s, hn, hp)

    # backward, recorded
    dy = g[:n_y].reshape(t_len, b, hs)
    dcells = g[n_y + 4 * t_len * b * h :].reshape(t_len, b, h) if mode == "lstm" else None
    dh: Any = zeros((b, hs), dtype=g.dtype, device=g.device)
    dc: Any = zeros((b, h), dtype=g.dtype, device=g.device) if mode == "lstm" else None
    dgi: dict[int, Any] = {}
    dgh: dict[int, Any] = {}
    dhs: dict[int, Any] = {}
    for s in reversed(order):
        a = masks.get(s)
        dst = dy[s] + dh
        dht = dst if a is None else dst * a
        if mode == "lstm":
            hp_s, cp_s, i, f, gg, o, c, m = saved[s]
            if w_hr is not None:
                dhs[s] = dht
                dht = matmul(dht, w_hr)
            tc = tanh(c)
            assert dcells is not None
            dct = dc + dcells[s] + dht * o * (1.0 - tc * tc)
            dcg = dct if a is None else dct * a
            d = cat([dcg * gg * i * (1.0 - i), dcg * cp_s * f * (1.0 - f), dcg * i * (1.0 - gg * gg),
                     dht * tc * o * (1.0 - o)], 1)
            dgi[s] = dgh[s] = d
            dc = dct * f if a is None else dct * (a * f + (1.0 - a))
            dh = matmul(d, w_hh)
        elif mode == "gru":
            hp_s, r, z, n, ghn = saved[s]
            dn = dht * (1.0 - z) * (1.0 - n * n)
            dz = dht * (hp_s - n) * z * (1.0 - z)
            dr = dn * ghn * r * (1.0 - r)
            dgi[s] = cat([dr, dz, dn], 1)
            dgh[s] = cat([dr, dz, dn * r], 1)
            dh = dht * z + matmul(dgh[s], w_hh)
        else:
            hp_s, hn = saved[s]
            dpre = dht * (hn > 0).to(dtype=hn.dtype) if mode == "rnn_relu" else dht * (1.0 - hn * hn)
            dgi[s] = dgh[s] = dpre
            dh = matmul(dpre, w_hh)
        if a is not None:
            dh = dh + dst * (1.0 - a)
    dgi2 = stack([dgi[s] for s in range(t_len)], 0).reshape(t_len * b, -1)
    dgh2 = stack([dgh[s] for s in range(t_len)], 0).reshape(t_len * b, -1)
    hprev = stack([saved[s][0] for s in range(t_len)], 0).reshape(t_len * b, hs)
    dx = matmul(dgi2, w_ih).reshape(t_len, b, n_in) if needs[0] else None
    dw_ih = matmul(dgi2.transpose(0, 1), x.reshape(t_len * b, n_in)) if needs[3] else None
    dw_hh = matmul(dgh2.transpose(0, 1), hprev) if needs[4] else None
    db_ih = dgi2.sum(0) if b_ih is not None and needs[5] else None
    db_hh = dgh2.sum(0) if b_hh is not None and needs[6] else None
    dw_hr = None
    if w_hr is not None and needs[7]:
        dhs2 = stack([dhs[s] for s in range(t_len)], 0).reshape(t_len * b, hs)
        m2 = stack([saved[s][7] for s in range(t_len)], 0).reshape(t_len * b, h)
        dw_hr = matmul(dhs2.transpose(0, 1), m2)
    return (dx, dh, dc if c0 is not None else None, dw_ih, dw_hh, db_ih, db_hh, dw_hr)


def _recurrent_meta(
    x: Any,
    h0: Any,
    c0: Any,
    w_ih: Any,
    w_hh: Any,
    b_ih: Any,
    b_hh: Any,
    w_hr: Any,
    mode: str,
    reverse: bool,
    lengths: tuple[int, ...] | None = None,
) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if mode not in RECURRENT_MODES:
        raise OpError(f"recurrent_layer: unknown mode {mode!r}; expected one of {sorted(RECURRENT_MODES)}")
    gates = RECURRENT_MODES[mode]
    if x.ndim != 3:
        raise OpError(f"{mode}: expected an input of shape (seq_len, batch, input_size), got {tuple(x.shape)}")
    t_len, b, n_in = x.shape
    if w_ih.ndim != 2 or w_ih.shape[1] != n_in or w_ih.shape[0] % gates:
        raise OpError(
            f"{mode}: weight_ih of shape {tuple(w_ih.shape)} does not fit an input of shape {tuple(x.shape)}: "
            f"expected ({gates} * hidden_size, {n_in})"
        )
    h = w_ih.shape[0] // gates
    if w_hr is not None and mode != "lstm":
        raise OpError(f"{mode}: only an LSTM has a projection (weight_hr)")
    if w_hr is not None and (w_hr.ndim != 2 or w_hr.shape[1] != h or not 0 < w_hr.shape[0] < h):
        raise OpError(
            f"lstm: expected weight_hr of shape (proj_size, {h}) with 0 < proj_size < hidden_size, got "
            f"{tuple(w_hr.shape)}"
        )
    hs = h if w_hr is None else w_hr.shape[0]  # the state size
    if lengths is not None and (len(lengths) != b or any(not 1 <= n <= t_len for n in lengths)):
        raise OpError(
            f"{mode}: expected lengths of {b} sequences, each in [1, {t_len}] (the padded length), got {list(lengths)}"
        )
    want = {
        "hx": (h0, (b, hs)),
        "weight_hh": (w_hh, (gates * h, hs)),
        "bias_ih": (b_ih, (gates * h,)),
        "bias_hh": (b_hh, (gates * h,)),
        "cx": (c0, (b, h)),
    }
    if mode == "lstm" and c0 is None:
        raise OpError("lstm: expected an initial cell state c0 of shape (batch, hidden_size), got None")
    if mode != "lstm" and c0 is not None:
        raise OpError(f"{mode}: only an LSTM takes a cell state, got c0")
    for name, (t, shape) in want.items():
        if t is not None and tuple(t.shape) != shape:
            raise OpError(f"{mode}: expected {name} of shape {shape}, got {tuple(t.shape)}")
    dts = {str(t.dtype) for t in (x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr) if t is not None}
    if len(dts) != 1 or x.dtype.kind != "f":
        raise OpError(
            f"{mode}: expected input, states and weights of one floating point dtype, got {sorted(dts)}; "
            "convert them with .to(dtype) (or the module with .double() / .float())"
        )
    return (t_len * b * hs + _ws_size(mode, t_len, b, h),), x.dtype


OP_RECURRENT = defop("recurrent_layer", _recurrent_kernel, _recurrent_meta, _recurrent_rule, save_out=True)


def recurrent_layer(
    mode: str,
    input: Tensor,
    hx: Tensor,
    cx: Tensor | None,
    weight_ih: Tensor,
    weight_hh: Tensor,
    bias_ih: Tensor | None = None,
    bias_hh: Tensor | None = None,
    reverse: bool = False,
    weight_hr: Tensor | None = None,
    lengths: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Run one layer and direction of an RNN, LSTM or GRU over a whole sequence, as one op.

    Args:
        mode: ``"rnn_tanh"``, ``"rnn_relu"``, ``"lstm"`` or ``"gru"``.
        input: ``(seq_len, batch, input_size)``.
        hx: Initial hidden state ``(batch, hidden_size)`` (``(batch, proj_size)`` with a projection).
        cx: Initial cell state ``(batch, hidden_size)`` for an LSTM, else None.
        weight_ih: ``(gates * hidden_size, input_size)``, PyTorch's gate order.
        weight_hh: ``(gates * hidden_size, hidden_size)`` (``(4 * hidden_size, proj_size)`` with a projection).
        bias_ih: ``(gates * hidden_size,)`` or None.
        bias_hh: ``(gates * hidden_size,)`` or None.
        reverse: Walk the sequence from its last step to its first (the backward direction of a
            bidirectional layer); ``output[t]`` is still the state at step ``t``.
        weight_hr: An LSTM's projection ``(proj_size, hidden_size)``: ``h = W_hr (o * tanh(c))``, or None.
        lengths: Per batch row, how many steps it has (a padded batch of sequences, PackedSequence's
            case): a row takes steps ``0 .. length - 1`` only (backwards: from its own last step), its
            states staying as they are elsewhere, so ``h_n`` / ``c_n`` are each row's states after its own
            sequence. ``output`` then holds those frozen states past a row's end: mask it (the caller's
            job, `asyncgrad.nn.utils.rnn` does).

    Returns:
        ``(output, h_n, c_n)``: output ``(seq_len, batch, H_out)``, the final states ``(batch, H_out)``
        (``H_out``: proj_size or hidden_size) and ``(batch, hidden_size)``; ``c_n`` is None except for an LSTM.
    """
    if input.ndim == 3 and input.shape[0] == 0:
        raise OpError(f"{mode}: expected a sequence of at least one step, got input of shape {input.shape}")
    args = (input, hx, cx, weight_ih, weight_hh, bias_ih, bias_hh, weight_hr)
    kw: dict[str, Any] = {"mode": mode, "reverse": bool(reverse)}
    if lengths is not None:
        kw["lengths"] = tuple(int(n) for n in lengths)
    packed = apply(OP_RECURRENT, args, kw)
    t_len, b = input.shape[0], input.shape[1]
    hs = hx.shape[1]
    n_y = t_len * b * hs
    y = packed[:n_y].reshape(t_len, b, hs)
    last = 0 if reverse else t_len - 1
    h_n = y[last]
    c_n = None
    if mode == "lstm":
        h = weight_ih.shape[0] // 4
        start = n_y + 4 * t_len * b * h + last * b * h
        c_n = packed[start : start + b * h].reshape(b, h)
    return y, h_n, c_n
