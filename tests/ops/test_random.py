"""The random ops (``ops/_random.py``): multinomial's semantics and errors, as PyTorch's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncgrad as ag

# ---- multinomial ---------------------------------------------------------------------------------------------


async def test_multinomial_semantics(rt: ag.Runtime, torch_ref: Any) -> None:
    w = ag.tensor([0.0, 1.0, 3.0, 0.0, 6.0], dtype=ag.float64)
    g = np.random.default_rng(0)
    s = ag.multinomial(w, 20000, replacement=True, generator=g)
    assert s.dtype == np.int64 and s.shape == (20000,)
    counts = np.bincount(s.numpy(), minlength=5) / 20000
    assert counts[0] == 0 and counts[3] == 0  # zero weight: never drawn (as in torch)
    np.testing.assert_allclose(counts, [0, 0.1, 0.3, 0, 0.6], atol=0.015)
    probs = [0.0, 1.0, 3.0, 0.0, 6.0]
    torch_shape = torch_ref(
        "multinomial_shape",
        lambda torch: torch.multinomial(torch.tensor(probs, dtype=torch.float64), 3).shape,
        probs=probs,
    )
    assert torch_shape == ag.multinomial(w, 3, generator=g).shape
    rows = ag.tensor(np.random.default_rng(1).uniform(0.1, 1, (4, 6)))
    no_rep = rows.multinomial(6, generator=g)
    assert no_rep.shape == (4, 6)
    assert all(sorted(r) == list(range(6)) for r in no_rep.numpy().tolist())  # a permutation per row
    a1 = ag.multinomial(rows, 3, generator=np.random.default_rng(7)).numpy()
    a2 = ag.multinomial(rows, 3, generator=np.random.default_rng(7)).numpy()
    np.testing.assert_array_equal(a1, a2)  # a seeded generator reproduces
    # without replacement, first draws follow the weights too: P(first = 2) = 3/10
    firsts = [int(ag.multinomial(w, 2, generator=g)[0].item()) for _ in range(3000)]
    assert abs(firsts.count(2) / 3000 - 0.3) < 0.04


async def test_multinomial_errors_as_torch(rt: ag.Runtime) -> None:
    for bad, msg in [
        (ag.tensor([1.0, -1.0]), "element < 0"),
        (ag.tensor([1.0, float("nan")]), "`inf`, `nan` or element < 0"),
        (ag.tensor([0.0, 0.0]), "sum of probabilities <= 0"),
        (ag.zeros(2, 2, 2) + 1, "prob_dist must be 1 or 2 dim"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            ag.multinomial(bad, 1)
    with pytest.raises(RuntimeError, match=r"cannot sample n_sample > prob_dist\.size"):
        ag.multinomial(ag.ones(3), 4)
    with pytest.raises(RuntimeError, match="not enough non-negative category"):
        ag.multinomial(ag.tensor([1.0, 0.0, 0.0]), 2)
    with pytest.raises(RuntimeError, match="only supports floating-point dtypes"):
        ag.multinomial(ag.tensor([1, 2]), 1)
    with pytest.raises(RuntimeError, match="n_sample <= 0"):
        ag.multinomial(ag.ones(3), 0)
