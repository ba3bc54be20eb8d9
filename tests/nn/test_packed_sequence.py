"""nn.utils.rnn (PackedSequence, pack/pad helpers) and recurrent layers over packed batches, against torch.

The torch side runs in ``torch_ref`` functions (live where torch is installed, recorded otherwise): torch
builds each module, its initial weights come back as a state dict that the asyncgrad module loads.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn.utils import rnn as R
from tests._util import (
    ATOL,
    RTOL,
    grads_of,
    load_state,
    state_from_torch,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)


def _tleaf(torch, a):
    """A float64 torch leaf of ``a`` that requires grad."""
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def _leaf(a):
    """A float64 asyncgrad leaf of ``a`` that requires grad."""
    return ag.tensor(a, dtype=ag.float64, requires_grad=True)


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


def _load_torch(torch, tm, state):
    tm.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    return tm


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("sorted_", [True, False])
async def test_recurrent_layers_on_packed_batches(rt, rng, torch_ref, kind, sorted_) -> None:
    lengths = [7, 5, 4, 2] if sorted_ else [4, 7, 2, 5]
    cfg = {"bidirectional": True, "batch_first": True}
    with trio.fail_after(60):
        state = torch_ref("init", lambda torch: state_from_torch(getattr(torch.nn, kind)(3, 4, 2, **cfg).double()))
        am = getattr(nn, kind)(3, 4, 2, **cfg, dtype=ag.float64)
        load_state(am, state)
        x, h, c = rng.standard_normal((4, 7, 3)), rng.standard_normal((4, 4, 4)), rng.standard_normal((4, 4, 4))
        ax, ah, ac = _leaf(x), _leaf(h), _leaf(c)
        ahx = (ah, ac) if kind == "LSTM" else ah
        ap = R.pack_padded_sequence(ax, lengths, batch_first=True, enforce_sorted=sorted_)
        aout, ast = am(ap, ahx)
        assert isinstance(aout, R.PackedSequence)
        apad, alen = R.pad_packed_sequence(aout, batch_first=True)
        ah_n = ast[0] if kind == "LSTM" else ast
        # the output weightings, drawn for asyncgrad's shapes (which must be torch's: checked below)
        w = rng.standard_normal(apad.shape)
        wh = rng.standard_normal(ah_n.shape)

        def reference(torch):
            TR = torch.nn.utils.rnn
            tm = _load_torch(torch, getattr(torch.nn, kind)(3, 4, 2, **cfg).double(), state)
            tx, th, tc = _tleaf(torch, x), _tleaf(torch, h), _tleaf(torch, c)
            thx = (th, tc) if kind == "LSTM" else th
            tp = TR.pack_padded_sequence(tx, lengths, batch_first=True, enforce_sorted=sorted_)
            tout, tst = tm(tp, thx)
            tpad, tlen = TR.pad_packed_sequence(tout, batch_first=True)
            th_n = tst[0] if kind == "LSTM" else tst
            out = {"packed_input": tp.data, "batch_sizes": tp.batch_sizes, "packed_output": tout.data,
                   "padded": tpad, "lengths": tlen, "h_n": th_n}
            tloss = (tpad * torch.tensor(w)).sum() + (th_n * torch.tensor(wh)).sum()
            if kind == "LSTM":
                out["c_n"] = tst[1]
                tloss = tloss + (tst[1] * tst[1]).sum()
            tloss.backward()
            out["x_grad"], out["h0_grad"], out["c0_grad"] = tx.grad, th.grad, tc.grad
            out["params"] = grads_of(tm)
            return out

        want = torch_ref("packed", reference, state=state, x=x, h=h, c=c, lengths=lengths, w=w, wh=wh)
        _close(ap.data, want["packed_input"], "packed input")
        assert ap.batch_sizes.numpy().tolist() == want["batch_sizes"].tolist()
        _close(aout.data, want["packed_output"], "packed output")
        assert apad.shape == want["padded"].shape
        _close(apad, want["padded"], "padded output")
        assert alen.numpy().tolist() == want["lengths"].tolist() == lengths
        assert ah_n.shape == want["h_n"].shape
        _close(ah_n, want["h_n"], "h_n")
        aloss = (apad * ag.tensor(w)).sum() + (ah_n * ag.tensor(wh)).sum()
        if kind == "LSTM":
            _close(ast[1], want["c_n"], "c_n")
            aloss = aloss + (ast[1] * ast[1]).sum()
        await aloss.backward()
        _close(ax.grad, want["x_grad"], "input grad")
        _close(ah.grad, want["h0_grad"], "h0 grad")
        if kind == "LSTM":
            _close(ac.grad, want["c0_grad"], "c0 grad")
        _assert_grads_equal(am, want["params"])


async def test_pack_pad_helpers_match_torch(rt, rng, torch_ref) -> None:
    with trio.fail_after(30):
        seqs = [rng.standard_normal((n, 2)) for n in (3, 5, 1)]
        aseqs = [ag.tensor(s, requires_grad=True) for s in seqs]
        pads = [(bf, side) for bf in (False, True) for side in ("right", "left")]
        ap = R.pack_sequence(aseqs, enforce_sorted=False)
        apad, _ = R.pad_packed_sequence(ap, padding_value=9.0, total_length=6)
        w = rng.standard_normal(apad.shape)  # asyncgrad's shape, which must be torch's: checked below

        def reference(torch):
            TR = torch.nn.utils.rnn
            tseqs = [torch.tensor(s, requires_grad=True) for s in seqs]
            out = {"pad_sequence": [
                TR.pad_sequence(tseqs, batch_first=bf, padding_value=-1.0, padding_side=side) for bf, side in pads
            ]}
            tp = TR.pack_sequence(tseqs, enforce_sorted=False)
            out.update(data=tp.data, sorted_indices=tp.sorted_indices, unsorted_indices=tp.unsorted_indices)
            tpad, _ = TR.pad_packed_sequence(tp, padding_value=9.0, total_length=6)
            out["padded"], out["unpacked"] = tpad, TR.unpack_sequence(tp)
            (tpad * torch.tensor(w)).sum().backward()
            out["grads"] = [t.grad for t in tseqs]
            return out

        want = torch_ref("helpers", reference, seqs=seqs, w=w)
        assert len(want["pad_sequence"]) == len(pads)
        for (bf, side), t in zip(pads, want["pad_sequence"]):
            _close(R.pad_sequence(aseqs, batch_first=bf, padding_value=-1.0, padding_side=side), t)
        _close(ap.data, want["data"])
        assert ap.sorted_indices.numpy().tolist() == want["sorted_indices"].tolist()
        assert ap.unsorted_indices.numpy().tolist() == want["unsorted_indices"].tolist()
        assert apad.shape == want["padded"].shape
        _close(apad, want["padded"])
        for a, t in zip(R.unpack_sequence(ap), want["unpacked"], strict=True):
            _close(a, t)
        await (apad * ag.tensor(w)).sum().backward()
        for a, t in zip(aseqs, want["grads"], strict=True):
            _close(a.grad, t)
        with pytest.raises(RuntimeError, match="sorted in decreasing order"):
            R.pack_sequence(aseqs)
        with pytest.raises(RuntimeError, match="greater than 0"):
            R.pack_padded_sequence(ag.zeros((3, 2, 1)), [3, 0])
        with pytest.raises(ValueError, match="total_length to be at least"):
            R.pad_packed_sequence(ap, total_length=2)


async def test_packed_lstm_language_model_step(rt, rng, torch_ref) -> None:
    """The usual classifier's shape: embed padded token ids, pack, LSTM, classify from h_n; a few SGD steps."""
    with trio.fail_after(60):
        toks = rng.integers(1, 10, (6, 3))
        lengths = [6, 2, 4]
        y = np.array([0, 1, 1])

        def reference(torch):
            TR = torch.nn.utils.rnn
            torch.manual_seed(0)
            temb, tl = torch.nn.Embedding(10, 4).double(), torch.nn.LSTM(4, 5).double()
            tfc = torch.nn.Linear(5, 2).double()
            states = [state_from_torch(t) for t in (temb, tl, tfc)]
            tparams = [*temb.parameters(), *tl.parameters(), *tfc.parameters()]
            topt = torch.optim.SGD(tparams, lr=0.5)
            losses = []
            for _ in range(5):
                tp = TR.pack_padded_sequence(temb(torch.tensor(toks)), lengths, enforce_sorted=False)
                tloss = torch.nn.functional.cross_entropy(tfc(tl(tp)[1][0][-1]), torch.tensor(y))
                losses.append(tloss.item())
                topt.zero_grad()
                tloss.backward()
                topt.step()
            return {"states": states, "losses": losses}

        want = torch_ref("sgd_steps", reference, toks=toks, lengths=lengths, y=y)
        f64 = {"dtype": ag.float64}
        aemb, al, afc = nn.Embedding(10, 4, **f64), nn.LSTM(4, 5, **f64), nn.Linear(5, 2, **f64)
        for a, sd in zip((aemb, al, afc), want["states"], strict=True):
            load_state(a, sd)
        aparams = [*aemb.parameters(), *al.parameters(), *afc.parameters()]
        aopt = ag.optim.SGD(aparams, lr=0.5)
        assert len(want["losses"]) == 5
        for tloss in want["losses"]:
            ap = R.pack_padded_sequence(aemb(ag.tensor(toks)), lengths, enforce_sorted=False)
            aloss = nn.functional.cross_entropy(afc(al(ap)[1][0][-1]), ag.tensor(y))
            assert abs(aloss.item() - tloss) <= 1e-12 * abs(tloss)
            aopt.zero_grad()
            await aloss.backward()
            aopt.step()
