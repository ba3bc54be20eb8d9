"""The word language model (PyTorch's examples/word_language_model, RNNModel) with an LSTM and with a GRU:
embedding, a 2-layer recurrence, a tied decoder, truncated BPTT with the hidden state carried (detached)
from batch to batch, clip_grad_norm_ and plain SGD, 25 steps in float64 from torch's initial weights:
asyncgrad's losses follow torch's to within 1e-6 relative."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from tests._util import (
    Lib,
    load_state,
    max_rel_diff,
    state_from_torch,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)

from ._parity import run_sync


def rnn_model(L: Lib, rnn_type: str, ntoken: int, ninp: int, nhid: int, nlayers: int, tie: bool):
    nn = L.nn

    class RNNModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.ntoken = ntoken
            self.drop = nn.Dropout(0.0)
            self.encoder = nn.Embedding(ntoken, ninp)
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=0.0)
            self.decoder = nn.Linear(nhid, ntoken)
            if tie:
                self.decoder.weight = self.encoder.weight
            self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers
            initrange = 0.1
            nn.init.uniform_(self.encoder.weight, -initrange, initrange)
            nn.init.zeros_(self.decoder.bias)
            nn.init.uniform_(self.decoder.weight, -initrange, initrange)

        def forward(self, input, hidden):
            emb = self.drop(self.encoder(input))
            output, hidden = self.rnn(emb, hidden)
            output = self.drop(output)
            decoded = self.decoder(output).reshape(-1, self.ntoken)
            return L.F.log_softmax(decoded, dim=1), hidden

    return RNNModel()


def repackage_hidden(h):
    """Detach hidden states from their history (the example's helper, unchanged)."""
    if isinstance(h, tuple):
        return tuple(repackage_hidden(v) for v in h)
    return h.detach()


async def _train(L: Lib, m, rnn_type: str, corpus: np.ndarray, nlayers: int, bsz: int, nhid: int, bptt: int,
                 steps: int) -> list[float]:
    """The training loop, one source for both libraries (torch's runs through ``run_sync``)."""
    losses = []
    m.train()
    z = L.zeros(nlayers, bsz, nhid)
    hidden = (z, z) if rnn_type == "LSTM" else z
    opt = L.optim.SGD(m.parameters(), lr=5.0)
    for i in range(0, steps * bptt, bptt):
        data = L.tensor(corpus[i : i + bptt])
        targets = L.tensor(corpus[i + 1 : i + 1 + bptt].reshape(-1))
        m.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = m(data, hidden)
        loss = L.F.nll_loss(output, targets)
        await L.backward(loss)
        L.clip_grad_norm_(m.parameters(), 0.25)
        opt.step()
        losses.append(float(loss.item()))
    return losses


@pytest.mark.parametrize("rnn_type", ["LSTM", "GRU"])
async def test_rnn_language_model_matches_torch(rt, torch_ref, rnn_type) -> None:
    ntoken, emsize, nhid, nlayers, bsz, bptt, steps = 30, 16, 16, 2, 4, 8, 25
    # a learnable stream: mostly t -> (3t + 1) mod ntoken, with some noise
    rng = np.random.default_rng(1)
    n = bsz * (bptt * steps + 1)
    seq = np.empty(n, np.int64)
    seq[0] = 0
    for i in range(1, n):
        seq[i] = (3 * seq[i - 1] + 1) % ntoken if rng.random() < 0.9 else rng.integers(ntoken)
    corpus = seq.reshape(bsz, -1).T.copy()  # (len, bsz), as the example's batchify
    train_args = (rnn_type, corpus, nlayers, bsz, nhid, bptt, steps)

    def reference(torch):
        T = Lib("torch")
        torch.manual_seed(0)
        tm = rnn_model(T, rnn_type, ntoken, emsize, nhid, nlayers, tie=True).double()
        state = state_from_torch(tm)
        return {"state": state, "losses": run_sync(_train(T, tm, *train_args))}

    want = torch_ref("rnn_lm", reference, rnn_type=rnn_type, corpus=corpus, sizes=[ntoken, emsize, nhid, nlayers],
                     bsz=bsz, bptt=bptt, steps=steps)
    A = Lib("asyncgrad")
    am = rnn_model(A, rnn_type, ntoken, emsize, nhid, nlayers, tie=True)
    am.double()
    load_state(am, want["state"])
    losses: dict[str, list[float]] = {"torch": want["losses"], "asyncgrad": []}
    with trio.fail_after(120):
        losses["asyncgrad"] = await _train(A, am, *train_args)
    diff = max_rel_diff(losses["asyncgrad"], losses["torch"])
    print(
        f"\n{rnn_type} LM: {steps} steps, loss {losses['torch'][0]:.4f} -> {losses['torch'][-1]:.4f}, "
        f"max rel diff {diff:.3e}"
    )
    assert np.mean(losses["torch"][-5:]) < losses["torch"][0] - 0.3  # it learns
    assert diff <= 1e-6
