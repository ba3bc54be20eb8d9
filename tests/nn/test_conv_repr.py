"""Convolution reprs (one helper, `_conv_extra_repr`, for Conv2d and the _ConvNd family) equal torch's."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import asyncgrad as ag

_CASES: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("Conv1d", (3, 6, 3), {}),
    ("Conv1d", (4, 8, 3), {"stride": 2, "padding": 1, "dilation": 2, "groups": 2, "bias": False}),
    ("Conv1d", (3, 6, 3), {"padding": "same"}),
    ("Conv1d", (3, 6, 3), {"padding": "valid"}),
    ("Conv2d", (3, 6, 3), {}),
    ("Conv2d", (4, 8, (3, 2)), {"stride": (2, 1), "padding": 1, "dilation": 2, "groups": 2, "bias": False}),
    ("Conv2d", (3, 6, 3), {"padding": "same"}),
    ("Conv2d", (3, 6, 3), {"padding": "valid"}),
    ("ConvTranspose1d", (3, 6, 3), {"stride": 2, "output_padding": 1}),
    ("ConvTranspose2d", (4, 8, 3), {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2, "bias": False}),
    ("ConvTranspose2d", (3, 6, 3), {}),
]


@pytest.mark.parametrize(("name", "args", "kw"), _CASES)
async def test_conv_repr_is_torchs(rt: Any, torch_ref: Any, name: str, args: tuple[Any, ...],
                                   kw: dict[str, Any]) -> None:
    with trio.fail_after(30):
        ours = repr(getattr(ag.nn, name)(*args, **kw))
    want = torch_ref("repr", lambda torch: repr(getattr(torch.nn, name)(*args, **kw)), name=name, args=args, kw=kw)
    assert ours == want
