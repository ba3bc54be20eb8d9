"""Loss modules (PyTorch's names, arguments and reductions)."""

from __future__ import annotations

from typing import Any

from ..runtime import Tensor
from . import functional as F
from ._module import Module

__all__ = [
    "BCELoss",
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "HuberLoss",
    "KLDivLoss",
    "L1Loss",
    "MSELoss",
    "NLLLoss",
    "SmoothL1Loss",
]


class _Loss(Module):
    _reductions: tuple[str, ...] = ("mean", "sum", "none")

    def __init__(self, reduction: str = "mean", size_average: Any = None, reduce: Any = None) -> None:
        super().__init__()
        if size_average is not None or reduce is not None:  # PyTorch's legacy arguments
            sa = True if size_average is None else size_average
            rd = True if reduce is None else reduce
            reduction = ("mean" if sa else "sum") if rd else "none"
        if reduction not in self._reductions:
            allowed = ", ".join(repr(r) for r in self._reductions)
            raise ValueError(f"{reduction} is not a valid value for reduction (use one of {allowed})")
        self.reduction = reduction

    def extra_repr(self) -> str:
        return "" if self.reduction == "mean" else f"reduction={self.reduction!r}"


class CrossEntropyLoss(_Loss):
    """Cross entropy between logits ``(N, C, ...)`` and class indices ``(N, ...)`` or class probabilities.

    Args:
        weight: Per-class weights ``(C,)``.
        ignore_index: Target value that contributes nothing (index targets only).
        reduction: ``"mean"`` (weighted mean over non-ignored targets), ``"sum"`` or ``"none"``.
        label_smoothing: Mix the targets with the uniform distribution by this amount.
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.cross_entropy(
            input,
            target,
            weight=self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


class NLLLoss(_Loss):
    """Negative log likelihood of log-probabilities ``(N, C, ...)`` at class indices ``(N, ...)``."""

    def __init__(
        self, weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean"
    ) -> None:
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.nll_loss(
            input, target, weight=self.weight, ignore_index=self.ignore_index, reduction=self.reduction
        )


class MSELoss(_Loss):
    """Mean squared error ``(input - target)^2`` with the chosen reduction."""

    def forward(self, input: Tensor, target: Any) -> Tensor:
        if self.reduction != "mean":
            return F.mse_loss(input, target, reduction=self.reduction)
        return F.mse_loss(input, target)


class BCEWithLogitsLoss(_Loss):
    """Binary cross entropy on logits (numerically stable), with optional ``weight`` and ``pos_weight``."""

    def __init__(
        self, weight: Tensor | None = None, reduction: str = "mean", pos_weight: Tensor | None = None
    ) -> None:
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.binary_cross_entropy_with_logits(
            input, target, weight=self.weight, pos_weight=self.pos_weight, reduction=self.reduction
        )


class L1Loss(_Loss):
    """Mean absolute error ``|input - target|`` with the chosen reduction."""

    def __init__(self, size_average: Any = None, reduce: Any = None, reduction: str = "mean") -> None:
        super().__init__(reduction, size_average, reduce)

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.l1_loss(input, target, reduction=self.reduction)


class SmoothL1Loss(_Loss):
    """``0.5 d^2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 beta``."""

    def __init__(
        self, size_average: Any = None, reduce: Any = None, reduction: str = "mean", beta: float = 1.0
    ) -> None:
        super().__init__(reduction, size_average, reduce)
        self.beta = beta

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class HuberLoss(_Loss):
    """``0.5 d^2`` where ``|d| < delta``, else ``delta (|d| - 0.5 delta)``."""

    def __init__(self, reduction: str = "mean", delta: float = 1.0) -> None:
        super().__init__(reduction)
        self.delta = delta

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class BCELoss(_Loss):
    """Binary cross entropy of probabilities (logs clamped at -100), with an optional ``weight``."""

    def __init__(
        self, weight: Tensor | None = None, size_average: Any = None, reduce: Any = None, reduction: str = "mean"
    ) -> None:
        super().__init__(reduction, size_average, reduce)
        self.register_buffer("weight", weight)

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.binary_cross_entropy(input, target, weight=self.weight, reduction=self.reduction)


class KLDivLoss(_Loss):
    """KL divergence of log-probabilities ``input`` from ``target`` (reduction may be ``"batchmean"``)."""

    _reductions = ("mean", "sum", "none", "batchmean")

    def __init__(
        self, size_average: Any = None, reduce: Any = None, reduction: str = "mean", log_target: bool = False
    ) -> None:
        super().__init__(reduction, size_average, reduce)
        self.log_target = log_target

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)
