"""Optimizers with PyTorch's names and exact update formulas: `SGD`, `Adam`, `AdamW`, `RMSprop`,
`Adagrad`; learning-rate schedulers in `asyncgrad.optim.lr_scheduler`.

``step()`` queues one fused in-place kernel per parameter on the calling task's stream, after the
backward that produced the gradients; parameters keep their memory layout.

Example::

    opt = ag.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = loss_fn(model(x), y)
    await loss.backward()
    opt.step()
    opt.zero_grad()
"""

from . import lr_scheduler
from ._adagrad import Adagrad
from ._adam import Adam, AdamW
from ._optimizer import Optimizer
from ._rmsprop import RMSprop
from ._sgd import SGD

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Optimizer", "RMSprop", "lr_scheduler"]
