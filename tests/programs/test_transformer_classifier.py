"""A Transformer encoder sequence classifier: token embedding plus a sinusoidal positional-encoding buffer,
a 2-layer nn.TransformerEncoder (batch_first, GELU, key padding masks for variable-length sequences), masked
mean pooling and a linear head, trained 30 steps with Adam and a StepLR schedule in float64 from torch's
initial weights: asyncgrad's losses follow torch's to within 1e-6 relative."""

from __future__ import annotations

import math

import numpy as np
import trio

from tests._util import (
    Lib,
    load_state,
    max_rel_diff,
    state_from_torch,
    torch_one_thread,  # noqa: F401  (autouse: torch on one thread)
)

from ._parity import run_sync


def classifier(L: Lib, vocab: int, d_model: int, nhead: int, n_classes: int, max_len: int):
    nn = L.nn

    class PositionalEncoding(nn.Module):
        def __init__(self):
            super().__init__()
            pe = np.zeros((max_len, d_model))
            pos = np.arange(max_len)[:, None]
            div = np.exp(np.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
            pe[:, 0::2] = np.sin(pos * div)
            pe[:, 1::2] = np.cos(pos * div)
            self.register_buffer("pe", L.tensor(pe[None]))

        def forward(self, x):
            return x + self.pe[:, : x.shape[1]]

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model, padding_idx=0)
            self.pos = PositionalEncoding()
            layer = nn.TransformerEncoderLayer(
                d_model, nhead, dim_feedforward=32, dropout=0.0, activation="gelu", batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, n_classes)

        def forward(self, tokens, pad_mask, keep):
            x = self.pos(self.embed(tokens) * math.sqrt(d_model))
            x = self.encoder(x, src_key_padding_mask=pad_mask)
            pooled = (x * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True)
            return self.head(pooled)

    return Classifier()


async def _train(L: Lib, m, batches: list[tuple[np.ndarray, ...]]) -> list[float]:
    """The training loop, one source for both libraries (torch's runs through ``run_sync``)."""
    losses = []
    opt = L.optim.Adam(m.parameters(), lr=3e-3)
    sched = L.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    for toks, pad, keep, labels in batches:
        logits = m(L.tensor(toks), L.tensor(pad), L.tensor(keep))
        loss = L.F.cross_entropy(logits, L.tensor(labels))
        opt.zero_grad()
        await L.backward(loss)
        opt.step()
        sched.step()
        losses.append(float(loss.item()))
    return losses


async def test_transformer_classifier_matches_torch(rt, torch_ref) -> None:
    vocab, d_model, nhead, n_classes, max_len, batch, steps = 20, 16, 4, 3, 12, 8, 30
    rng = np.random.default_rng(2)
    batches = []
    for _ in range(steps):
        lengths = rng.integers(4, max_len + 1, batch)
        labels = rng.integers(0, n_classes, batch)
        toks = np.zeros((batch, max_len), np.int64)
        for i, n in enumerate(lengths):
            # class c mostly uses tokens 1 + 6c .. 6 + 6c: learnable, not trivially
            own = rng.integers(1 + 6 * labels[i], 7 + 6 * labels[i], n)
            toks[i, :n] = np.where(rng.random(n) < 0.7, own, rng.integers(1, vocab, n))
        pad = toks == 0
        batches.append((toks, pad, (~pad).astype(np.float64), labels))
    sizes = (vocab, d_model, nhead, n_classes, max_len)

    def reference(torch):
        T = Lib("torch")
        torch.manual_seed(0)
        tm = classifier(T, *sizes).double()
        state = state_from_torch(tm)
        return {"state": state, "losses": run_sync(_train(T, tm, batches))}

    want = torch_ref("transformer_classifier", reference, sizes=sizes, batches=batches)
    A = Lib("asyncgrad")
    am = classifier(A, *sizes)
    am.double()
    load_state(am, want["state"])
    losses: dict[str, list[float]] = {"torch": want["losses"], "asyncgrad": []}
    with trio.fail_after(120):
        losses["asyncgrad"] = await _train(A, am, batches)
    diff = max_rel_diff(losses["asyncgrad"], losses["torch"])
    print(
        f"\nTransformer classifier: {steps} steps, loss {losses['torch'][0]:.4f} -> {losses['torch'][-1]:.4f}, "
        f"max rel diff {diff:.3e}"
    )
    assert np.mean(losses["torch"][-5:]) < losses["torch"][0] - 0.3  # it learns
    assert diff <= 1e-6
