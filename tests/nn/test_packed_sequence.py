"""nn.utils.rnn (PackedSequence, pack/pad helpers) and recurrent layers over packed batches, against torch."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn.utils import rnn as R
from tests._util import (
    assert_close,
    assert_grads_match,
    load_from_torch,
    pair,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)

torch = pytest.importorskip("torch")
TR = torch.nn.utils.rnn


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("sorted_", [True, False])
async def test_recurrent_layers_on_packed_batches(rt, rng, kind, sorted_) -> None:
    lengths = [7, 5, 4, 2] if sorted_ else [4, 7, 2, 5]
    with trio.fail_after(60):
        tm = getattr(torch.nn, kind)(3, 4, 2, bidirectional=True, batch_first=True).double()
        am = getattr(nn, kind)(3, 4, 2, bidirectional=True, batch_first=True, dtype=ag.float64)
        load_from_torch(am, tm)
        ax, tx = pair(rng, (4, 7, 3), torch)
        ah, th = pair(rng, (4, 4, 4), torch)
        ac, tc = pair(rng, (4, 4, 4), torch)
        ahx, thx = ((ah, ac), (th, tc)) if kind == "LSTM" else (ah, th)
        ap = R.pack_padded_sequence(ax, lengths, batch_first=True, enforce_sorted=sorted_)
        tp = TR.pack_padded_sequence(tx, lengths, batch_first=True, enforce_sorted=sorted_)
        assert_close(ap.data, tp.data, "packed input")
        assert ap.batch_sizes.numpy().tolist() == tp.batch_sizes.tolist()
        aout, ast = am(ap, ahx)
        tout, tst = tm(tp, thx)
        assert isinstance(aout, R.PackedSequence)
        assert_close(aout.data, tout.data, "packed output")
        apad, alen = R.pad_packed_sequence(aout, batch_first=True)
        tpad, tlen = TR.pad_packed_sequence(tout, batch_first=True)
        assert_close(apad, tpad, "padded output")
        assert alen.numpy().tolist() == tlen.tolist() == lengths
        ah_n = ast[0] if kind == "LSTM" else ast
        th_n = tst[0] if kind == "LSTM" else tst
        assert_close(ah_n, th_n, "h_n")
        w = rng.standard_normal(tuple(tpad.shape))
        wh = rng.standard_normal(tuple(th_n.shape))
        aloss = (apad * ag.tensor(w)).sum() + (ah_n * ag.tensor(wh)).sum()
        tloss = (tpad * torch.tensor(w)).sum() + (th_n * torch.tensor(wh)).sum()
        if kind == "LSTM":
            assert_close(ast[1], tst[1], "c_n")
            aloss = aloss + (ast[1] * ast[1]).sum()
            tloss = tloss + (tst[1] * tst[1]).sum()
        await aloss.backward()
        tloss.backward()
        assert_close(ax.grad, tx.grad, "input grad")
        assert_close(ah.grad, th.grad, "h0 grad")
        if kind == "LSTM":
            assert_close(ac.grad, tc.grad, "c0 grad")
        assert_grads_match(am, tm)


async def test_pack_pad_helpers_match_torch(rt, rng) -> None:
    with trio.fail_after(30):
        seqs = [rng.standard_normal((n, 2)) for n in (3, 5, 1)]
        aseqs = [ag.tensor(s, requires_grad=True) for s in seqs]
        tseqs = [torch.tensor(s, requires_grad=True) for s in seqs]
        for bf in (False, True):
            for side in ("right", "left"):
                assert_close(
                    R.pad_sequence(aseqs, batch_first=bf, padding_value=-1.0, padding_side=side),
                    TR.pad_sequence(tseqs, batch_first=bf, padding_value=-1.0, padding_side=side),
                )
        ap = R.pack_sequence(aseqs, enforce_sorted=False)
        tp = TR.pack_sequence(tseqs, enforce_sorted=False)
        assert_close(ap.data, tp.data)
        assert ap.sorted_indices.numpy().tolist() == tp.sorted_indices.tolist()
        assert ap.unsorted_indices.numpy().tolist() == tp.unsorted_indices.tolist()
        apad, _ = R.pad_packed_sequence(ap, padding_value=9.0, total_length=6)
        tpad, _ = TR.pad_packed_sequence(tp, padding_value=9.0, total_length=6)
        assert_close(apad, tpad)
        for a, t in zip(R.unpack_sequence(ap), TR.unpack_sequence(tp)):
            assert_close(a, t)
        w = rng.standard_normal(tuple(tpad.shape))
        await (apad * ag.tensor(w)).sum().backward()
        (tpad * torch.tensor(w)).sum().backward()
        for a, t in zip(aseqs, tseqs):
            assert_close(a.grad, t.grad)
        with pytest.raises(RuntimeError, match="sorted in decreasing order"):
            R.pack_sequence(aseqs)
        with pytest.raises(RuntimeError, match="greater than 0"):
            R.pack_padded_sequence(ag.zeros((3, 2, 1)), [3, 0])
        with pytest.raises(ValueError, match="total_length to be at least"):
            R.pad_packed_sequence(ap, total_length=2)


async def test_packed_lstm_language_model_step(rt, rng) -> None:
    """The usual classifier's shape: embed padded token ids, pack, LSTM, classify from h_n; a few SGD steps."""
    with trio.fail_after(60):
        torch.manual_seed(0)
        temb, tl, tfc = torch.nn.Embedding(10, 4).double(), torch.nn.LSTM(4, 5).double(), torch.nn.Linear(5, 2).double()
        f64 = {"dtype": ag.float64}
        aemb, al, afc = nn.Embedding(10, 4, **f64), nn.LSTM(4, 5, **f64), nn.Linear(5, 2, **f64)
        for a, t in ((aemb, temb), (al, tl), (afc, tfc)):
            load_from_torch(a, t)
        toks = rng.integers(1, 10, (6, 3))
        lengths = [6, 2, 4]
        y = np.array([0, 1, 1])
        tparams = [*temb.parameters(), *tl.parameters(), *tfc.parameters()]
        aparams = [*aemb.parameters(), *al.parameters(), *afc.parameters()]
        topt, aopt = torch.optim.SGD(tparams, lr=0.5), ag.optim.SGD(aparams, lr=0.5)
        for _ in range(5):
            tp = TR.pack_padded_sequence(temb(torch.tensor(toks)), lengths, enforce_sorted=False)
            ap = R.pack_padded_sequence(aemb(ag.tensor(toks)), lengths, enforce_sorted=False)
            tloss = torch.nn.functional.cross_entropy(tfc(tl(tp)[1][0][-1]), torch.tensor(y))
            aloss = nn.functional.cross_entropy(afc(al(ap)[1][0][-1]), ag.tensor(y))
            assert abs(aloss.item() - tloss.item()) <= 1e-12 * abs(tloss.item())
            topt.zero_grad()
            aopt.zero_grad()
            tloss.backward()
            await aloss.backward()
            topt.step()
            aopt.step()
