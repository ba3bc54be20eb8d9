"""Optimizers with PyTorch's names and exact update formulas: `SGD`, `Adam`, `AdamW`, `RMSprop`,
`Adagrad`, `Adadelta`, `Adamax`, `NAdam`, `RAdam`, `ASGD`, `Rprop`, `LBFGS` (``await opt.step(closure)``);
learning-rate schedulers in `asyncgrad.optim.lr_scheduler`.

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
from ._adadelta import Adadelta
from ._adagrad import Adagrad
from ._adam import Adam, AdamW
from ._adamax import Adamax
from ._asgd import ASGD
from ._lbfgs import LBFGS
from ._nadam import NAdam
from ._optimizer import Optimizer
from ._radam import RAdam
from ._rmsprop import RMSprop
from ._rprop import Rprop
from ._sgd import SGD

__all__ = [
    "ASGD",
    "LBFGS",
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "Optimizer",
    "RAdam",
    "RMSprop",
    "Rprop",
    "lr_scheduler",
]
