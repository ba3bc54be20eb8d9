"""The PyTorch MNIST example (its CNN, DataLoader, Adadelta, StepLR, nll_loss), ported to asyncgrad with the
smallest changes, on synthetic 28x28 data: 30 steps from torch's initial weights, float64, losses against
torch's (max relative difference <= 1e-6).

Changes from the example: channel widths are smaller (8/16 and 32 hidden, for CI), dropout p=0 (the two
libraries draw different masks), the data is random, and torch is fed the very batches asyncgrad's
shuffling DataLoader produced (so the order is the same).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import asyncgrad as ag
from asyncgrad import nn
from asyncgrad.nn import functional as F
from asyncgrad.optim.lr_scheduler import StepLR
from asyncgrad.utils.data import DataLoader, TensorDataset
from tests._util import load_state, state_from_torch

from ._parity import float64_everywhere, max_rel_diff

C1, C2, HID = 4, 8, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, C1, 3, 1)
        self.conv2 = nn.Conv2d(C1, C2, 3, 1)
        self.dropout1 = nn.Dropout(0.0)
        self.dropout2 = nn.Dropout(0.0)
        self.fc1 = nn.Linear(12 * 12 * C2, HID)
        self.fc2 = nn.Linear(HID, 10)

    def forward(self, x):  # type: ignore[no-untyped-def]
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = ag.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def _tnet(torch: Any) -> Any:
    """The torch net (built inside the reference function: torch is a parameter, not a module global)."""
    tnn, TF = torch.nn, torch.nn.functional

    class TNet(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = tnn.Conv2d(1, C1, 3, 1)
            self.conv2 = tnn.Conv2d(C1, C2, 3, 1)
            self.dropout1 = tnn.Dropout(0.0)
            self.dropout2 = tnn.Dropout(0.0)
            self.fc1 = tnn.Linear(12 * 12 * C2, HID)
            self.fc2 = tnn.Linear(HID, 10)

        def forward(self, x):  # type: ignore[no-untyped-def]
            x = TF.relu(self.conv1(x))
            x = TF.relu(self.conv2(x))
            x = TF.max_pool2d(x, 2)
            x = torch.flatten(self.dropout1(x), 1)
            x = self.dropout2(TF.relu(self.fc1(x)))
            return TF.log_softmax(self.fc2(x), dim=1)

    return TNet()


def _loader(images: np.ndarray, labels: np.ndarray, batch: int) -> DataLoader:
    return DataLoader(
        TensorDataset(ag.tensor(images), ag.tensor(labels)), batch_size=batch, shuffle=True,
        generator=np.random.default_rng(42),
    )


async def test_mnist_example_matches_torch(rt: ag.Runtime, torch_ref) -> None:
    rng = np.random.default_rng(0)
    n, batch, epochs = 100, 10, 3  # 10 steps per epoch, 30 steps
    images = rng.standard_normal((n, 1, 28, 28)) * 0.3 + 0.1307
    labels = rng.integers(0, 10, n)
    with float64_everywhere():
        # the batches the training loop's shuffling DataLoader produces (a twin: the same generator seed), in
        # order: torch is fed these, and the loop checks it gets the very same
        twin = _loader(images, labels, batch)
        batches = [(d.numpy().copy(), t.numpy().copy()) for _epoch in range(epochs) async for d, t in twin]

    def reference(torch):
        with float64_everywhere(torch):
            TF = torch.nn.functional
            torch.manual_seed(1)
            tmodel = _tnet(torch)
            state = state_from_torch(tmodel)
            toptimizer = torch.optim.Adadelta(tmodel.parameters(), lr=1.0, foreach=False)
            tscheduler = torch.optim.lr_scheduler.StepLR(toptimizer, step_size=1, gamma=0.7)
            tlosses = []
            steps = iter(batches)
            for _epoch in range(epochs):
                tmodel.train()
                for _ in range(n // batch):
                    td, tt = (torch.from_numpy(a) for a in next(steps))
                    toptimizer.zero_grad()
                    tloss = TF.nll_loss(tmodel(td), tt)
                    tloss.backward()
                    toptimizer.step()
                    tlosses.append(tloss.item())
                tscheduler.step()
            return {"state": state, "losses": tlosses, "lr": float(toptimizer.param_groups[0]["lr"])}

    want = torch_ref("mnist", reference, batches=batches, epochs=epochs)
    tlosses = want["losses"]
    with float64_everywhere():
        model = Net()
        load_state(model, want["state"])  # torch's initial weights, as a (recorded) torch state dict
        device = ag.device("cuda" if ag.cuda.is_available() else "cpu")
        model.to(device)
        loader = _loader(images, labels, batch)
        optimizer = ag.optim.Adadelta(model.parameters(), lr=1.0)
        scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
        losses = []
        with trio.fail_after(120):
            for _epoch in range(epochs):
                model.train()
                async for data, target in loader:
                    data, target = data.to(device), target.to(device)
                    optimizer.zero_grad()
                    output = model(data)
                    loss = F.nll_loss(output, target)
                    await loss.backward()
                    optimizer.step()
                    losses.append(loss.item())

                    # torch was fed this very batch
                    fed = batches[len(losses) - 1]
                    np.testing.assert_array_equal(data.numpy(), fed[0])
                    np.testing.assert_array_equal(target.numpy(), fed[1])
                scheduler.step()
        assert len(losses) == 30
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want["lr"], rel=1e-15)
        diff = max_rel_diff(losses, tlosses)
        print(f"MNIST CNN + DataLoader + Adadelta + StepLR, 30 steps: max relative loss difference {diff:.3g}")
        assert diff <= 1e-6, diff
        # it trains: the loss goes down on this (memorisable) data
        assert np.mean(losses[-10:]) < np.mean(losses[:10])
