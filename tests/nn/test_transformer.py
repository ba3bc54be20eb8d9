"""MultiheadAttention, scaled_dot_product_attention and the transformer layers against torch in float64.

The torch side runs in ``torch_ref`` functions (live where torch is installed, recorded otherwise): torch
builds each module, its initial weights come back as a state dict that the asyncgrad module loads.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F
from tests._util import (
    ATOL,
    RTOL,
    grads_of,
    load_state,
    state_from_torch,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)

warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")


def _torch_module(torch, name: str, *args: object, state=None, **kw: object):
    """torch's ``torch.nn.<name>`` in float64, with ``state`` loaded when given (else torch's own init)."""
    tm = getattr(torch.nn, name)(*args, **kw).double()
    if state is not None:
        tm.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    return tm


def _ag_module(name: str, state, *args: object, **kw: object):
    """asyncgrad's ``nn.<name>`` in float64 with torch's (recorded) ``state`` loaded strictly."""
    am = getattr(nn, name)(*args, **kw, dtype=ag.float64)
    load_state(am, state)
    return am


def _tleaf(torch, a):
    """A float64 torch leaf of ``a`` that requires grad."""
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def _leaf(a):
    """A float64 asyncgrad leaf of ``a`` that requires grad."""
    return ag.tensor(a, dtype=ag.float64, requires_grad=True)


def _opt(lib_tensor, a):
    """``lib_tensor(a)``, or None for None."""
    return None if a is None else lib_tensor(a)


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


def _mask(rng, kind: str, n: int, h: int, lq: int, s: int):
    """An attn_mask (numpy) of the given kind, never masking a whole row; None for "none"."""
    if kind == "none":
        return None
    if kind == "bool2d":
        m = rng.random((lq, s)) < 0.3
        m[:, 0] = False
    elif kind == "bool3d":
        m = rng.random((n * h, lq, s)) < 0.3
        m[..., 0] = False
    else:  # float2d
        m = rng.standard_normal((lq, s))
    return m


MHA = "MultiheadAttention"
CASES = [
    # batch_first, kdim/vdim, bias, add_bias_kv, add_zero_attn, need_weights, average, mask, key padding, batched
    (False, None, True, False, False, True, True, "none", False, True),
    (True, None, True, False, False, False, True, "bool2d", True, True),
    (False, (3, 6), True, False, False, True, False, "float2d", True, True),
    (True, (5, 4), False, False, False, False, True, "bool3d", False, True),
    (False, None, True, True, False, True, True, "bool2d", True, True),
    (False, None, True, False, True, False, True, "float2d", True, True),
    (False, None, True, True, True, True, False, "bool3d", False, True),
    (False, None, True, False, False, True, True, "bool2d", False, False),
    (True, None, True, False, False, False, True, "none", True, False),
]


@pytest.mark.parametrize("case", CASES)
async def test_multihead_attention_matches_torch(rt, rng, torch_ref, case) -> None:
    bf, kv, bias, bkv, zattn, need_w, avg, mkind, kpad, batched = case
    e, h, n, lq, s = 8, 2, 3, 4, 5
    kdim, vdim = kv if kv else (None, None)
    args = (e, h)
    cfg = {"bias": bias, "add_bias_kv": bkv, "add_zero_attn": zattn, "kdim": kdim, "vdim": vdim, "batch_first": bf}
    with trio.fail_after(60):
        state = torch_ref("init", lambda torch: state_from_torch(_torch_module(torch, MHA, *args, **cfg)))
        am = _ag_module(MHA, state, *args, **cfg)

        def shape(length, feat):
            if not batched:
                return (length, feat)
            return (n, length, feat) if bf else (length, n, feat)

        q = rng.standard_normal(shape(lq, e))
        k = rng.standard_normal(shape(s, kdim or e))
        v = rng.standard_normal(shape(s, vdim or e))
        mask = _mask(rng, mkind, n if batched else 1, h, lq, s)
        kp = None
        if kpad:
            kp = np.zeros((n, s) if batched else (s,), bool)
            kp[..., -2:] = True
        aq, ak, av = _leaf(q), _leaf(k), _leaf(v)
        call = {"need_weights": need_w, "average_attn_weights": avg}
        ao, aw = am(aq, ak, av, key_padding_mask=_opt(ag.tensor, kp), attn_mask=_opt(ag.tensor, mask), **call)
        # the output weightings, drawn for asyncgrad's shapes (which must be torch's: checked below)
        w = rng.standard_normal(ao.shape)
        ww = rng.standard_normal(aw.shape) if need_w else None

        def reference(torch):
            tm = _torch_module(torch, MHA, *args, state=state, **cfg)
            tq, tk, tv = _tleaf(torch, q), _tleaf(torch, k), _tleaf(torch, v)
            to, tw = tm(tq, tk, tv, key_padding_mask=_opt(torch.tensor, kp), attn_mask=_opt(torch.tensor, mask),
                        **call)
            tloss = (to * torch.tensor(w)).sum()
            if tw is not None:
                tloss = tloss + (tw * torch.tensor(ww)).sum()
            tloss.backward()
            return {"out": to, "weights": tw, "grads": [tq.grad, tk.grad, tv.grad], "params": grads_of(tm)}

        want = torch_ref("attention", reference, state=state, q=q, k=k, v=v, mask=mask, kp=kp, w=w, ww=ww)
        assert ao.shape == want["out"].shape
        _close(ao, want["out"], "attn_output")
        aloss = (ao * ag.tensor(w)).sum()
        if need_w:
            assert want["weights"] is not None and aw.shape == want["weights"].shape
            _close(aw, want["weights"], "attn_weights")
            aloss = aloss + (aw * ag.tensor(ww)).sum()
        else:
            assert aw is None and want["weights"] is None
        await aloss.backward()
        for a, t, what in zip((aq, ak, av), want["grads"], ("query", "key", "value"), strict=True):
            _close(a.grad, t, f"{what} grad")
        _assert_grads_equal(am, want["params"])


async def test_multihead_attention_state_dict_and_errors(rt, torch_ref) -> None:
    kws = ({}, {"kdim": 3, "vdim": 5}, {"bias": False, "add_bias_kv": True})
    with trio.fail_after(30):
        states = torch_ref(
            "states", lambda torch: [state_from_torch(_torch_module(torch, "MultiheadAttention", 8, 4, **kw))
                                     for kw in kws]
        )
        assert len(states) == len(kws)
        for kw, state in zip(kws, states):
            am = _ag_module("MultiheadAttention", state, 8, 4, **kw)
            assert [(k, v.shape) for k, v in am.state_dict().items()] == [(k, v.shape) for k, v in state.items()]
        m = nn.MultiheadAttention(8, 2)
        assert np.all(m.in_proj_bias.numpy() == 0) and np.all(m.out_proj.bias.numpy() == 0)
        with pytest.raises(ValueError, match="divisible by num_heads"):
            nn.MultiheadAttention(6, 4)
        x = ag.zeros((4, 2, 8))
        with pytest.raises(ValueError, match="embedding dimension of 8, but got 6"):
            m(ag.zeros((4, 2, 6)), x, x)
        with pytest.raises(RuntimeError, match=r"2D attn_mask is \(3, 3\), but should be \(4, 4\)"):
            m(x, x, x, attn_mask=ag.zeros((3, 3), dtype=ag.bool))
        with pytest.raises(RuntimeError, match="Need attn_mask"):
            m(x, x, x, is_causal=True)
        with pytest.raises(ValueError, match=r"key_padding_mask of shape \(2, 4\)"):
            m(x, x, x, key_padding_mask=ag.zeros((2, 3), dtype=ag.bool))


SDPA_CASES = ["plain", "causal", "bool", "float_grad", "scale", "broadcast", "gqa", "dead_row"]


@pytest.mark.parametrize("case", SDPA_CASES)
async def test_sdpa_matches_torch(rt, rng, torch_ref, case) -> None:
    with trio.fail_after(30):
        kshape = (1, 3, 6, 5) if case == "broadcast" else (2, 1, 6, 5) if case == "gqa" else (2, 3, 6, 5)
        qshape = (2, 3, 4, 5)
        q, k, v = rng.standard_normal(qshape), rng.standard_normal(kshape), rng.standard_normal((*kshape[:-1], 7))
        kw: dict = {}
        mask = None
        if case == "causal":
            kw["is_causal"] = True
        if case in ("bool", "dead_row"):
            mask = rng.random((4, 6)) < 0.6
            mask[:, 0] = True
            if case == "dead_row":
                mask[2] = False
        if case == "float_grad":
            mask = rng.standard_normal((3, 4, 6))
        if case == "scale":
            kw["scale"] = 0.37
        if case == "gqa":
            kw["enable_gqa"] = True
        aq, ak, av = _leaf(q), _leaf(k), _leaf(v)
        amask = None if mask is None else _leaf(mask) if case == "float_grad" else ag.tensor(mask)
        ao = F.scaled_dot_product_attention(aq, ak, av, attn_mask=amask, **kw)
        w = rng.standard_normal(ao.shape)  # asyncgrad's shape, which must be torch's: checked below

        def reference(torch):
            tq, tk, tv = _tleaf(torch, q), _tleaf(torch, k), _tleaf(torch, v)
            tmask = None if mask is None else _tleaf(torch, mask) if case == "float_grad" else torch.tensor(mask)
            to = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, **kw)
            (to * torch.tensor(w)).sum().backward()
            mask_grad = tmask.grad if case == "float_grad" else None
            return {"out": to, "grads": [tq.grad, tk.grad, tv.grad], "mask_grad": mask_grad}

        want = torch_ref("sdpa", reference, q=q, k=k, v=v, mask=mask, w=w)
        _close(ao, want["out"], "output")
        await (ao * ag.tensor(w)).sum().backward()
        for a, t in zip((aq, ak, av), want["grads"], strict=True):
            _close(a.grad, t)
        if case == "float_grad":
            _close(amask.grad, want["mask_grad"], "mask grad")


async def test_sdpa_dropout_is_consistent_and_errors(rt, rng) -> None:
    with trio.fail_after(30):
        q = ag.tensor(rng.standard_normal((2, 4, 3)), requires_grad=True)
        ag.manual_seed(5)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).numpy()
        ag.manual_seed(5)
        b = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).numpy()
        c = F.scaled_dot_product_attention(q, q, q).numpy()
        assert np.array_equal(a, b) and not np.allclose(a, c)
        with pytest.raises(ag.OpError, match="should not be set when is_causal"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=ag.ones((4, 4), dtype=ag.bool), is_causal=True)
        with pytest.raises(ag.OpError, match=r"attn_mask of shape \(3, 3\) does not broadcast"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=ag.ones((3, 3), dtype=ag.bool))
        with pytest.raises(ag.OpError, match=r"query .* key .* value"):
            F.scaled_dot_product_attention(q, q, ag.zeros((2, 5, 3), dtype=ag.float64))
        with pytest.raises(ag.OpError, match="one floating point dtype"):
            F.scaled_dot_product_attention(q, q, ag.zeros((2, 4, 3), dtype=ag.float32))


LAYER_CASES = [
    # norm_first, activation, batch_first, masks
    (False, "relu", False, False),
    (True, "gelu", True, True),
    (False, "gelu", True, True),
]


@pytest.mark.parametrize("norm_first,act,bf,masks", LAYER_CASES)
async def test_encoder_decoder_layers_match_torch(rt, rng, torch_ref, norm_first, act, bf, masks) -> None:
    e, h, ff, n, s, t = 8, 2, 16, 2, 5, 4
    kw = {"dim_feedforward": ff, "dropout": 0.0, "activation": act, "batch_first": bf, "norm_first": norm_first}
    names = ("TransformerEncoderLayer", "TransformerDecoderLayer")
    with trio.fail_after(60):
        states = torch_ref(
            "init", lambda torch: [state_from_torch(_torch_module(torch, nm, e, h, **kw)) for nm in names]
        )
        aenc, adec = (_ag_module(nm, sd, e, h, **kw) for nm, sd in zip(names, states, strict=True))
        src = rng.standard_normal((n, s, e) if bf else (s, n, e))
        tgt = rng.standard_normal((n, t, e) if bf else (t, n, e))
        cm = kp = None
        if masks:
            cm = np.triu(np.full((t, t), -np.inf), 1)
            kp = np.zeros((n, s), bool)
            kp[0, -1] = True
        asrc, atgt = _leaf(src), _leaf(tgt)
        amem = aenc(asrc, src_key_padding_mask=_opt(ag.tensor, kp))
        aout = adec(atgt, amem, tgt_mask=_opt(ag.tensor, cm), memory_key_padding_mask=_opt(ag.tensor, kp),
                    tgt_is_causal=masks)
        w = rng.standard_normal(aout.shape)  # asyncgrad's shape, which must be torch's: checked below

        def reference(torch):
            tenc, tdec = (_torch_module(torch, nm, e, h, state=sd, **kw) for nm, sd in zip(names, states))
            tsrc, ttgt = _tleaf(torch, src), _tleaf(torch, tgt)
            tkp = _opt(torch.tensor, kp)
            tmem = tenc(tsrc, src_key_padding_mask=tkp)
            tout = tdec(ttgt, tmem, tgt_mask=_opt(torch.tensor, cm), memory_key_padding_mask=tkp, tgt_is_causal=masks)
            (tout * torch.tensor(w)).sum().backward()
            return {"memory": tmem, "out": tout, "src_grad": tsrc.grad, "tgt_grad": ttgt.grad,
                    "enc_params": grads_of(tenc), "dec_params": grads_of(tdec)}

        want = torch_ref("layers", reference, states=states, src=src, tgt=tgt, cm=cm, kp=kp, w=w)
        _close(amem, want["memory"], "encoder layer")
        _close(aout, want["out"], "decoder layer")
        await (aout * ag.tensor(w)).sum().backward()
        _close(asrc.grad, want["src_grad"], "src grad")
        _close(atgt.grad, want["tgt_grad"], "tgt grad")
        _assert_grads_equal(aenc, want["enc_params"])
        _assert_grads_equal(adec, want["dec_params"])


async def test_transformer_matches_torch(rt, rng, torch_ref) -> None:
    e, h, n, s, t = 8, 2, 2, 5, 4
    with trio.fail_after(60):
        src, tgt = rng.standard_normal((n, s, e)), rng.standard_normal((n, t, e))

        def reference(torch):
            torch.manual_seed(0)
            tm = torch.nn.Transformer(e, h, 2, 2, 16, dropout=0.0, batch_first=True).double()
            state = state_from_torch(tm)
            tsrc, ttgt = _tleaf(torch, src), _tleaf(torch, tgt)
            tmask = torch.nn.Transformer.generate_square_subsequent_mask(t, dtype=torch.float64)
            to = tm(tsrc, ttgt, tgt_mask=tmask, tgt_is_causal=True)
            (to * to).sum().backward()
            return {"state": state, "mask": tmask, "out": to, "params": grads_of(tm), "src_grad": tsrc.grad}

        want = torch_ref("transformer", reference, src=src, tgt=tgt)
        am = nn.Transformer(e, h, 2, 2, 16, dropout=0.0, batch_first=True, dtype=ag.float64)
        assert [(k, v.shape) for k, v in am.state_dict().items()] == [(k, v.shape) for k, v in want["state"].items()]
        load_state(am, want["state"])
        asrc, atgt = _leaf(src), _leaf(tgt)
        amask = nn.Transformer.generate_square_subsequent_mask(t, dtype=ag.float64)
        _close(amask, want["mask"])
        ao = am(asrc, atgt, tgt_mask=amask, tgt_is_causal=True)
        _close(ao, want["out"], "transformer output")
        await (ao * ao).sum().backward()
        _assert_grads_equal(am, want["params"])
        _close(asrc.grad, want["src_grad"])


async def test_encoder_stack_deep_copies_its_layer(rt, rng, torch_ref) -> None:
    with trio.fail_after(30):
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, dtype=ag.float64)
        enc = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(8, dtype=ag.float64))
        ws = [m.self_attn.in_proj_weight for m in enc.layers]
        assert len({id(w) for w in ws}) == 3 and all(w is not layer.self_attn.in_proj_weight for w in ws)
        assert all(np.array_equal(w.numpy(), layer.self_attn.in_proj_weight.numpy()) for w in ws)
        xv = rng.standard_normal((5, 2, 8))
        x = ag.tensor(xv)
        await enc(x).sum().backward()
        assert layer.self_attn.in_proj_weight.grad is None
        assert all(w.grad is not None for w in ws)

        # torch's stack, with the same weights, gives the same values and gradients
        def reference(torch):
            tenc = torch.nn.TransformerEncoder(
                torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0),
                3,
                torch.nn.LayerNorm(8),
                enable_nested_tensor=False,
            ).double()
            state = state_from_torch(tenc)
            to = tenc(torch.tensor(xv))
            to.sum().backward()
            return {"state": state, "out": to, "params": grads_of(tenc)}

        want = torch_ref("encoder_stack", reference, x=xv)
        load_state(enc, want["state"])
        enc.zero_grad()
        ao = enc(x)
        _close(ao, want["out"])
        await ao.sum().backward()
        _assert_grads_equal(enc, want["params"])
        # a deep copy of a tensor is a new leaf with its own value; copy.copy shares the value
        p = enc.layers[0].linear1.weight
        q = copy.deepcopy(p)
        assert q is not p and q.requires_grad and q.is_leaf and np.array_equal(q.numpy(), p.numpy())
        assert not np.shares_memory(q.numpy(), p.numpy())
        assert np.shares_memory(copy.copy(p).numpy(), p.numpy())
        with pytest.raises(RuntimeError, match="graph leaves"):
            copy.deepcopy(p * 2)


async def test_on_lanes_with_create_graph(rt, rng, torch_ref, monkeypatch) -> None:
    """Every kernel queued on the lanes: an encoder layer matches torch, and a gradient penalty through
    attention (create_graph=True, then backward of the gradient's norm) matches torch's too."""
    from tests._util import set_inline_limit

    set_inline_limit(monkeypatch, -1)
    name, args, kw = "TransformerEncoderLayer", (8, 2, 16), {"dropout": 0.0, "batch_first": True}
    with trio.fail_after(60):
        x = rng.standard_normal((2, 5, 8))

        def reference(torch):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            tm = _torch_module(torch, name, *args, **kw)
            state = state_from_torch(tm)
            tx = _tleaf(torch, x)
            with sdpa_kernel(SDPBackend.MATH):  # torch's flash kernel on CPU has no double backward
                ty = tm(tx)
            (t_g,) = torch.autograd.grad((ty * ty).sum(), [tx], create_graph=True)
            (t_g * t_g).sum().backward()
            return {"state": state, "y": ty, "first_grad": t_g, "x_grad": tx.grad, "params": grads_of(tm)}

        want = torch_ref("penalty", reference, x=x)
        am = _ag_module(name, want["state"], *args, **kw)
        ax = _leaf(x)
        ay = am(ax)
        _close(ay, want["y"])
        (ag_g,) = await ag.grad((ay * ay).sum(), [ax], create_graph=True)
        _close(ag_g, want["first_grad"], "first gradient")
        await (ag_g * ag_g).sum().backward()
        _close(ax.grad, want["x_grad"], "gradient of the gradient penalty", rtol=1e-9)
        _assert_grads_equal(am, want["params"], rtol=1e-9)
