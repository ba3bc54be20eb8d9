"""Models and a bit-for-bit comparison shared by the capture tests and the capture benchmark."""

from __future__ import annotations

from typing import Any

import numpy as np

import asyncgrad as ag

nn = ag.nn
F = ag.nn.functional


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x: Any) -> Any:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    """The MNIST example's shape on 28x28 (conv2d + maxpool + linear), narrower."""

    def __init__(self, c1: int = 4, c2: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3, 1)
        self.conv2 = nn.Conv2d(c1, c2, 3, 1)
        self.fc1 = nn.Linear(c2 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: Any) -> Any:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = ag.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 20, emb: int = 16, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: Any) -> Any:
        h, _ = self.lstm(self.emb(x))
        return self.head(h)


def batches(kind: str, n: int, seed: int = 0) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if kind == "mlp":
            x = rng.standard_normal((16, 32)).astype(np.float32)
            y = rng.integers(0, 10, 16)
        elif kind == "cnn":
            x = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)
            y = rng.integers(0, 10, 4)
        else:
            x = rng.integers(0, 20, (4, 12))
            y = rng.integers(0, 20, (4, 12))
        out.append((ag.tensor(x), ag.tensor(y)))
    return out


def make(kind: str, opt: str, seed: int = 0) -> tuple[Any, Any]:
    ag.manual_seed(seed)
    model = {"mlp": MLP, "cnn": CNN, "lstm": LSTMLM}[kind]()
    return model, optimizer(model, opt)


def optimizer(model: Any, opt: str) -> Any:
    if opt == "sgd":
        return ag.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return ag.optim.Adam(model.parameters(), lr=1e-3)


def step_fn(kind: str, model: Any, opt: Any) -> Any:
    async def step(x: Any, y: Any) -> Any:
        opt.zero_grad()
        out = model(x)
        if kind == "cnn":
            loss = F.nll_loss(out, y)
        elif kind == "lstm":
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        else:
            loss = F.cross_entropy(out, y)
        await loss.backward()
        opt.step()
        return loss

    return step


def twin(kind: str, opt: str) -> tuple[Any, Any, Any, Any]:
    """Two identical (model, optimizer) pairs."""
    m1, o1 = make(kind, opt)
    m2, o2 = make(kind, opt)
    return m1, o1, m2, o2


def state_arrays(model: Any, opt: Any) -> list[tuple[str, Any]]:
    """Everything a step leaves: parameters, their .grad, versions, optimizer state (values and numbers)."""
    out: list[tuple[str, Any]] = []
    for name, p in model.named_parameters():
        out.append((name, p.numpy().copy()))
        out.append((name + ".grad", None if p.grad is None else p.grad.numpy().copy()))
        out.append((name + ".grad.strides", None if p.grad is None else p.grad.numpy().strides))
        out.append((name + "._version", p._version))
        # not .grad's version: eager's own steal (0) or copy (1) of a new .grad depends on whether the gradient's
        # kernel had run when the pass committed, so two eager runs can differ there
        for k, v in opt.state[p].items():
            out.append((f"{name}.state.{k}", v.numpy().copy() if isinstance(v, ag.Tensor) else v))
    return out


def assert_same(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> None:
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert x.tobytes() == y.tobytes(), f"{k} differs (max abs diff {np.max(np.abs(x - y))})"
        else:
            assert x == y, f"{k}: {x} != {y}"
