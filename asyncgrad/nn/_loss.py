"""Loss modules (PyTorch's names, arguments and reductions)."""

from __future__ import annotations

from typing import Any

from ..runtime import Tensor
from . import functional as F
from ._module import Module

__all__ = ["BCEWithLogitsLoss", "CrossEntropyLoss", "MSELoss", "NLLLoss"]


class _Loss(Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"{reduction} is not a valid value for reduction (use 'mean', 'sum' or 'none')")
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
