"""MultiheadAttention, scaled_dot_product_attention and the transformer layers against torch in float64."""

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
    assert_close,
    assert_grads_match,
    load_from_torch,
    pair,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")


def _modules(name: str, *args: object, **kw: object) -> tuple[object, object]:
    tm = getattr(torch.nn, name)(*args, **kw).double()
    am = getattr(nn, name)(*args, **kw, dtype=ag.float64)
    load_from_torch(am, tm)
    return am, tm


def _masks(rng, kind: str, n: int, h: int, lq: int, s: int):
    """(asyncgrad, torch) attn_mask of the given kind, never masking a whole row."""
    if kind == "none":
        return None, None
    if kind == "bool2d":
        m = rng.random((lq, s)) < 0.3
        m[:, 0] = False
    elif kind == "bool3d":
        m = rng.random((n * h, lq, s)) < 0.3
        m[..., 0] = False
    else:  # float2d
        m = rng.standard_normal((lq, s))
    return ag.tensor(m), torch.tensor(m)


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
async def test_multihead_attention_matches_torch(rt, rng, case) -> None:
    bf, kv, bias, bkv, zattn, need_w, avg, mkind, kpad, batched = case
    e, h, n, lq, s = 8, 2, 3, 4, 5
    kdim, vdim = kv if kv else (None, None)
    with trio.fail_after(60):
        am, tm = _modules(
            "MultiheadAttention", e, h, bias=bias, add_bias_kv=bkv, add_zero_attn=zattn, kdim=kdim, vdim=vdim,
            batch_first=bf,
        )

        def shape(length, feat):
            if not batched:
                return (length, feat)
            return (n, length, feat) if bf else (length, n, feat)

        aq, tq = pair(rng, shape(lq, e), torch)
        ak, tk = pair(rng, shape(s, kdim or e), torch)
        av, tv = pair(rng, shape(s, vdim or e), torch)
        amask, tmask = _masks(rng, mkind, n if batched else 1, h, lq, s)
        akp = tkp = None
        if kpad:
            kp = np.zeros((n, s) if batched else (s,), bool)
            kp[..., -2:] = True
            akp, tkp = ag.tensor(kp), torch.tensor(kp)
        ao, aw = am(aq, ak, av, key_padding_mask=akp, need_weights=need_w, attn_mask=amask, average_attn_weights=avg)
        to, tw = tm(tq, tk, tv, key_padding_mask=tkp, need_weights=need_w, attn_mask=tmask, average_attn_weights=avg)
        assert ao.shape == tuple(to.shape)
        assert_close(ao, to, "attn_output")
        w = rng.standard_normal(tuple(to.shape))
        aloss = (ao * ag.tensor(w)).sum()
        tloss = (to * torch.tensor(w)).sum()
        if need_w:
            assert aw.shape == tuple(tw.shape)
            assert_close(aw, tw, "attn_weights")
            ww = rng.standard_normal(tuple(tw.shape))
            aloss = aloss + (aw * ag.tensor(ww)).sum()
            tloss = tloss + (tw * torch.tensor(ww)).sum()
        else:
            assert aw is None and tw is None
        await aloss.backward()
        tloss.backward()
        for a, t, what in ((aq, tq, "query"), (ak, tk, "key"), (av, tv, "value")):
            assert_close(a.grad, t.grad, f"{what} grad")
        assert_grads_match(am, tm)


async def test_multihead_attention_state_dict_and_errors(rt) -> None:
    with trio.fail_after(30):
        for kw in ({}, {"kdim": 3, "vdim": 5}, {"bias": False, "add_bias_kv": True}):
            am, tm = _modules("MultiheadAttention", 8, 4, **kw)
            assert [(k, v.shape) for k, v in am.state_dict().items()] == [
                (k, tuple(v.shape)) for k, v in tm.state_dict().items()
            ]
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
async def test_sdpa_matches_torch(rt, rng, case) -> None:
    with trio.fail_after(30):
        kshape = (1, 3, 6, 5) if case == "broadcast" else (2, 1, 6, 5) if case == "gqa" else (2, 3, 6, 5)
        qshape = (2, 3, 4, 5)
        aq, tq = pair(rng, qshape, torch)
        ak, tk = pair(rng, kshape, torch)
        av, tv = pair(rng, (*kshape[:-1], 7), torch)
        kw: dict = {}
        akw: dict = {}
        if case == "causal":
            kw["is_causal"] = akw["is_causal"] = True
        if case in ("bool", "dead_row"):
            m = rng.random((4, 6)) < 0.6
            m[:, 0] = True
            if case == "dead_row":
                m[2] = False
            akw["attn_mask"], kw["attn_mask"] = ag.tensor(m), torch.tensor(m)
        if case == "float_grad":
            akw["attn_mask"], kw["attn_mask"] = pair(rng, (3, 4, 6), torch)
        if case == "scale":
            kw["scale"] = akw["scale"] = 0.37
        if case == "gqa":
            kw["enable_gqa"] = akw["enable_gqa"] = True
        ao = F.scaled_dot_product_attention(aq, ak, av, **akw)
        to = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **kw)
        assert_close(ao, to, "output")
        w = rng.standard_normal(tuple(to.shape))
        await (ao * ag.tensor(w)).sum().backward()
        (to * torch.tensor(w)).sum().backward()
        for a, t in ((aq, tq), (ak, tk), (av, tv)):
            assert_close(a.grad, t.grad)
        if case == "float_grad":
            assert_close(akw["attn_mask"].grad, kw["attn_mask"].grad, "mask grad")


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
async def test_encoder_decoder_layers_match_torch(rt, rng, norm_first, act, bf, masks) -> None:
    e, h, ff, n, s, t = 8, 2, 16, 2, 5, 4
    kw = {"dim_feedforward": ff, "dropout": 0.0, "activation": act, "batch_first": bf, "norm_first": norm_first}
    with trio.fail_after(60):
        aenc, tenc = _modules("TransformerEncoderLayer", e, h, **kw)
        adec, tdec = _modules("TransformerDecoderLayer", e, h, **kw)
        asrc, tsrc = pair(rng, (n, s, e) if bf else (s, n, e), torch)
        atgt, ttgt = pair(rng, (n, t, e) if bf else (t, n, e), torch)
        am = tmk = None
        akp = tkp = None
        if masks:
            cm = np.triu(np.full((t, t), -np.inf), 1)
            am, tmk = ag.tensor(cm), torch.tensor(cm)
            kp = np.zeros((n, s), bool)
            kp[0, -1] = True
            akp, tkp = ag.tensor(kp), torch.tensor(kp)
        amem = aenc(asrc, src_key_padding_mask=akp)
        tmem = tenc(tsrc, src_key_padding_mask=tkp)
        assert_close(amem, tmem, "encoder layer")
        aout = adec(atgt, amem, tgt_mask=am, memory_key_padding_mask=akp, tgt_is_causal=masks)
        tout = tdec(ttgt, tmem, tgt_mask=tmk, memory_key_padding_mask=tkp, tgt_is_causal=masks)
        assert_close(aout, tout, "decoder layer")
        w = rng.standard_normal(tuple(tout.shape))
        await (aout * ag.tensor(w)).sum().backward()
        (tout * torch.tensor(w)).sum().backward()
        assert_close(asrc.grad, tsrc.grad, "src grad")
        assert_close(atgt.grad, ttgt.grad, "tgt grad")
        assert_grads_match(aenc, tenc)
        assert_grads_match(adec, tdec)


async def test_transformer_matches_torch(rt, rng) -> None:
    e, h, n, s, t = 8, 2, 2, 5, 4
    with trio.fail_after(60):
        torch.manual_seed(0)
        tm = torch.nn.Transformer(e, h, 2, 2, 16, dropout=0.0, batch_first=True).double()
        am = nn.Transformer(e, h, 2, 2, 16, dropout=0.0, batch_first=True, dtype=ag.float64)
        assert [(k, v.shape) for k, v in am.state_dict().items()] == [
            (k, tuple(v.shape)) for k, v in tm.state_dict().items()
        ]
        load_from_torch(am, tm)
        asrc, tsrc = pair(rng, (n, s, e), torch)
        atgt, ttgt = pair(rng, (n, t, e), torch)
        amask = nn.Transformer.generate_square_subsequent_mask(t, dtype=ag.float64)
        tmask = torch.nn.Transformer.generate_square_subsequent_mask(t, dtype=torch.float64)
        assert_close(amask, tmask)
        ao = am(asrc, atgt, tgt_mask=amask, tgt_is_causal=True)
        to = tm(tsrc, ttgt, tgt_mask=tmask, tgt_is_causal=True)
        assert_close(ao, to, "transformer output")
        await (ao * ao).sum().backward()
        (to * to).sum().backward()
        assert_grads_match(am, tm)
        assert_close(asrc.grad, tsrc.grad)


async def test_encoder_stack_deep_copies_its_layer(rt, rng) -> None:
    with trio.fail_after(30):
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, dtype=ag.float64)
        enc = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(8, dtype=ag.float64))
        ws = [m.self_attn.in_proj_weight for m in enc.layers]
        assert len({id(w) for w in ws}) == 3 and all(w is not layer.self_attn.in_proj_weight for w in ws)
        assert all(np.array_equal(w.numpy(), layer.self_attn.in_proj_weight.numpy()) for w in ws)
        x = ag.tensor(rng.standard_normal((5, 2, 8)))
        await enc(x).sum().backward()
        assert layer.self_attn.in_proj_weight.grad is None
        assert all(w.grad is not None for w in ws)
        # torch's stack, with the same weights, gives the same values and gradients
        tenc = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0),
            3,
            torch.nn.LayerNorm(8),
            enable_nested_tensor=False,
        ).double()
        load_from_torch(enc, tenc)
        enc.zero_grad()
        tx = torch.tensor(x.numpy())
        ao, to = enc(x), tenc(tx)
        assert_close(ao, to)
        await ao.sum().backward()
        to.sum().backward()
        assert_grads_match(enc, tenc)
        # a deep copy of a tensor is a new leaf with its own value; copy.copy shares the value
        p = enc.layers[0].linear1.weight
        q = copy.deepcopy(p)
        assert q is not p and q.requires_grad and q.is_leaf and np.array_equal(q.numpy(), p.numpy())
        assert not np.shares_memory(q.numpy(), p.numpy())
        assert np.shares_memory(copy.copy(p).numpy(), p.numpy())
        with pytest.raises(RuntimeError, match="graph leaves"):
            copy.deepcopy(p * 2)


async def test_on_lanes_with_create_graph(rt, rng, monkeypatch) -> None:
    """Every kernel queued on the lanes: an encoder layer matches torch, and a gradient penalty through
    attention (create_graph=True, then backward of the gradient's norm) matches torch's too."""
    from tests._util import set_inline_limit

    set_inline_limit(monkeypatch, -1)
    with trio.fail_after(60):
        am, tm = _modules("TransformerEncoderLayer", 8, 2, 16, dropout=0.0, batch_first=True)
        ax, tx = pair(rng, (2, 5, 8), torch)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):  # torch's flash kernel on CPU has no double backward
            ay, ty = am(ax), tm(tx)
        assert_close(ay, ty)
        (ag_g,) = await ag.grad((ay * ay).sum(), [ax], create_graph=True)
        (t_g,) = torch.autograd.grad((ty * ty).sum(), [tx], create_graph=True)
        assert_close(ag_g, t_g, "first gradient")
        await (ag_g * ag_g).sum().backward()
        (t_g * t_g).sum().backward()
        assert_close(ax.grad, tx.grad, "gradient of the gradient penalty", rtol=1e-9)
        assert_grads_match(am, tm, rtol=1e-9)
