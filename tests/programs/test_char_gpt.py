"""A small character GPT (nanoGPT's shape: causal self-attention through scaled_dot_product_attention with
is_causal, GELU MLP, pre-norm blocks, lm_head tied to the token embedding), trained 30 steps with AdamW in
float64 from torch's initial weights: asyncgrad's losses follow torch's to within 1e-6 relative."""

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

TEXT = (
    "it was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of light"
)


def gpt(L: Lib, vocab: int, block: int, n_embd: int = 16, n_head: int = 2, n_layer: int = 2):
    nn, F = L.nn, L.F

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd)
            self.c_proj = nn.Linear(n_embd, n_embd)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(n_embd, dim=2)
            q = q.reshape(b, t, n_head, c // n_head).transpose(1, 2)
            k = k.reshape(b, t, n_head, c // n_head).transpose(1, 2)
            v = v.reshape(b, t, n_head, c // n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
            y = y.transpose(1, 2).reshape(b, t, c)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(n_embd, 4 * n_embd)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * n_embd, n_embd)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(n_embd)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(n_embd)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(
                {
                    "wte": nn.Embedding(vocab, n_embd),
                    "wpe": nn.Embedding(block, n_embd),
                    "h": nn.ModuleList([Block() for _ in range(n_layer)]),
                    "ln_f": nn.LayerNorm(n_embd),
                }
            )
            self.lm_head = nn.Linear(n_embd, vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        def forward(self, idx, targets):
            _, t = idx.shape
            pos = L.arange(0, t)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for blk in self.transformer.h:
                x = blk(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


async def _train(L: Lib, m, data: np.ndarray, block: int, starts: list[np.ndarray]) -> list[float]:
    """The training loop, one source for both libraries (torch's runs through ``run_sync``)."""
    losses = []
    opt = L.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    for s in starts:
        x = np.stack([data[i : i + block] for i in s])
        y = np.stack([data[i + 1 : i + 1 + block] for i in s])
        loss = m(L.tensor(x), L.tensor(y))
        opt.zero_grad()
        await L.backward(loss)
        opt.step()
        losses.append(float(loss.item()))
    return losses


async def test_char_gpt_matches_torch(rt, torch_ref) -> None:
    chars = sorted(set(TEXT))
    data = np.array([chars.index(c) for c in TEXT], dtype=np.int64)
    vocab, block, batch, steps = len(chars), 16, 4, 30
    rng = np.random.default_rng(0)
    starts = [rng.integers(0, len(data) - block - 1, batch) for _ in range(steps)]

    def reference(torch):
        T = Lib("torch")
        torch.manual_seed(0)
        tm = gpt(T, vocab, block).double()
        state = state_from_torch(tm)
        return {"state": state, "losses": run_sync(_train(T, tm, data, block, starts))}

    want = torch_ref("char_gpt", reference, data=data, block=block, starts=starts)
    A = Lib("asyncgrad")
    am = gpt(A, vocab, block)
    am.double()
    load_state(am, want["state"])
    assert am.lm_head.weight is am.transformer.wte.weight
    losses: dict[str, list[float]] = {"torch": want["losses"], "asyncgrad": []}
    with trio.fail_after(120):
        losses["asyncgrad"] = await _train(A, am, data, block, starts)
    diff = max_rel_diff(losses["asyncgrad"], losses["torch"])
    first, last = losses["torch"][0], losses["torch"][-1]
    print(f"\nchar GPT: {steps} steps, loss {first:.4f} -> {last:.4f}, max rel diff {diff:.3e}")
    assert losses["torch"][-1] < losses["torch"][0]  # it learns
    assert diff <= 1e-6
