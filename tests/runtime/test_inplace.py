"""The in-place forms (``runtime/_inplace.py``): addcmul_/addcdiv_ against PyTorch.
"""

from __future__ import annotations

import numpy as np
import pytest

import asyncgrad as ag


async def test_inplace_addcmul_addcdiv(rt: ag.Runtime, torch_ref) -> None:
    rng = np.random.default_rng(4)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.uniform(1, 2, (3, 4))

    def reference(torch):
        tx, ty, tz = (torch.tensor(v, dtype=torch.float64) for v in (a, b, c))
        tx.addcmul_(ty, tz, value=0.3)
        tx.addcdiv_(ty, tz, value=-2)
        return tx

    x, y, z = (ag.tensor(v, dtype=ag.float64) for v in (a, b, c))
    assert x.addcmul_(y, z, value=0.3) is x
    x.addcdiv_(y, z, value=-2)
    np.testing.assert_allclose(x.numpy(), torch_ref("addcmul_addcdiv_", reference, a=a, b=b, c=c), rtol=1e-15)
    p = ag.tensor(a, requires_grad=True)
    with pytest.raises(RuntimeError, match="in-place addcmul_ on a tensor that requires grad"):
        p.addcmul_(y, z)
    with pytest.raises(RuntimeError, match="integer division with addcdiv is no longer supported"):
        ag.addcdiv(x, ag.ones(4, dtype=ag.int64), ag.ones(4, dtype=ag.int64))
