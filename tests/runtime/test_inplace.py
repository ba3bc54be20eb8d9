"""The in-place forms (``runtime/_inplace.py``): addcmul_/addcdiv_ against PyTorch.
"""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag
from tests._util import torch_pair

torch = pytest.importorskip("torch")


async def test_inplace_addcmul_addcdiv(rt: ag.Runtime) -> None:
    rng = np.random.default_rng(4)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.uniform(1, 2, (3, 4))
    (x, tx), (y, ty), (z, tz) = torch_pair(a), torch_pair(b), torch_pair(c)
    assert x.addcmul_(y, z, value=0.3) is x
    tx.addcmul_(ty, tz, value=0.3)
    x.addcdiv_(y, z, value=-2)
    tx.addcdiv_(ty, tz, value=-2)
    np.testing.assert_allclose(x.numpy(), tx.numpy(), rtol=1e-15)
    p = ag.tensor(a, requires_grad=True)
    with pytest.raises(RuntimeError, match="in-place addcmul_ on a tensor that requires grad"):
        p.addcmul_(y, z)
    with pytest.raises(RuntimeError, match="integer division with addcdiv is no longer supported"):
        ag.addcdiv(x, ag.ones(4, dtype=ag.int64), ag.ones(4, dtype=ag.int64))
