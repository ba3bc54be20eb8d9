"""Learning-rate schedulers with PyTorch's names, signatures and schedules (``torch.optim.lr_scheduler``).

Design. A scheduler is a function of the epoch: ``get_lr()`` returns the schedule's learning rates at
``last_epoch``, computed in closed form from ``base_lrs`` (the groups' ``initial_lr``; `MultiplicativeLR`,
whose factors are arbitrary functions, keeps a running product instead). ``step()``
advances the epoch and writes those values into the optimizer's groups. Closed forms do not drift over
long runs; they agree with PyTorch's recurrences (its ``step()``) to rounding, and exactly with PyTorch's
closed forms (its deprecated ``step(epoch)``).

Schedulers still compose, as PyTorch's do when several are stepped on one optimizer (or through
`ChainedScheduler`): each scheduler remembers its own value at the previous epoch. If the group's lr
still equals it, nothing else scaled the lr and the new closed-form value is written as is; otherwise
another scheduler (or the user) changed it, and this scheduler applies only its own relative change,
``lr * new / old`` (for `CosineAnnealingLR` with ``eta_min`` this scales the whole lr, where PyTorch's
recurrence scales its distance to ``eta_min``). Schedules that PyTorch defines as absolute
(`LambdaLR`, `OneCycleLR`, `CyclicLR`, `CosineAnnealingWarmRestarts`) always write their value.

`ReduceLROnPlateau` reacts to a metric instead of the epoch; `SequentialLR` and `ChainedScheduler`
drive other schedulers. ``state_dict()`` holds every attribute except the optimizer; functions given by
the user (lambdas, ``scale_fn``) are not saved, as in PyTorch: pass them again to the constructor.
"""

from __future__ import annotations

import math
import types
import warnings
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from ._optimizer import Optimizer

__all__ = [
    "ChainedScheduler",
    "ConstantLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "ExponentialLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "ReduceLROnPlateau",
    "SequentialLR",
    "StepLR",
]

_STEPPED = "_lr_scheduler_saw_step"  # set on an optimizer once its (wrapped) step() has run


def _watch_optimizer_steps(optimizer: Optimizer) -> None:
    """Wrap ``optimizer.step`` (on this instance only) so schedulers can tell whether it ever ran."""
    step = optimizer.step
    if getattr(step, "_lr_scheduler_watch", False):
        return
    func = getattr(step, "__func__", None)
    if func is None or getattr(step, "__self__", None) is not optimizer:
        return  # step() was replaced by something we cannot rebind: give up the check, not the schedule

    def watched(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        setattr(self, _STEPPED, True)
        return func(self, *args, **kwargs)

    watched._lr_scheduler_watch = True  # type: ignore[attr-defined]
    watched.__doc__ = func.__doc__
    # a bound method (not a closure over the optimizer) so copy.deepcopy rebinds it to the copy
    optimizer.step = types.MethodType(watched, optimizer)  # type: ignore[method-assign]


def _warn_if_optimizer_idle(sched: Any) -> None:
    """Warn once if the first ``scheduler.step()`` comes before any ``optimizer.step()``."""
    if sched._order_checked:
        return
    sched._order_checked = True
    if not getattr(sched.optimizer, _STEPPED, False) and getattr(sched.optimizer.step, "_lr_scheduler_watch", False):
        warnings.warn(
            "lr_scheduler.step() was called before `optimizer.step()`, so the first value of the schedule "
            "was skipped. In each iteration call optimizer.step() first, then scheduler.step().",
            UserWarning,
            stacklevel=3,
        )


def _warn_epoch_argument(cls_name: str) -> None:
    warnings.warn(
        f"Passing an epoch parameter to {cls_name}.step() is deprecated: it jumps to the closed-form value at "
        "that epoch and ignores other schedulers on the optimizer. Call step() without arguments once per "
        "epoch instead.",
        UserWarning,
        stacklevel=3,
    )


def _per_group(name: str, optimizer: Optimizer, value: Any) -> list[Any]:
    """``value`` for each param group: a list/tuple must have one entry per group, a scalar is repeated."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {n} param groups; give one per group"
            )
        return list(value)
    return [value] * n


def _momentum_uses_betas(optimizer: Optimizer, who: str) -> bool:
    """Whether momentum cycling drives Adam-style ``betas[0]`` (True) or SGD-style ``momentum`` (False)."""
    if "betas" in optimizer.defaults:
        return True
    if "momentum" in optimizer.defaults:
        return False
    raise ValueError(f"{who}: the optimizer has neither 'momentum' nor 'betas' to cycle; pass cycle_momentum=False")


def _set_momentum(group: dict[str, Any], value: float, betas: bool) -> None:
    if betas:
        group["betas"] = (value, *group["betas"][1:])
    else:
        group["momentum"] = value


class LRScheduler:
    """Base class of epoch-driven schedulers (``torch.optim.lr_scheduler.LRScheduler``).

    Subclasses implement `get_lr` as the schedule at ``self.last_epoch``. The constructor performs the
    first step, so ``last_epoch`` is 0 (or the resumed epoch + 1) and the groups hold the schedule's
    first value.

    Args:
        optimizer: The optimizer whose param groups' ``lr`` is scheduled.
        last_epoch: The index of the last epoch when resuming; -1 starts afresh. Resuming needs
            ``initial_lr`` in every param group (it is stored there on a fresh start).

    Attributes:
        optimizer: The scheduled optimizer.
        base_lrs: Each group's ``initial_lr``.
        last_epoch: The current epoch (number of ``step()`` calls since epoch 0).
    """

    # PyTorch's recurrent schedules compose with others on the same optimizer; absolute ones overwrite
    _relative: ClassVar[bool] = True
    # attributes left out of state_dict(): not data, or user functions that pickling cannot restore
    _unsaved: ClassVar[frozenset[str]] = frozenset({"optimizer"})

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__} needs an asyncgrad.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        groups = optimizer.param_groups
        if last_epoch == -1:
            for g in groups:
                g.setdefault("initial_lr", g["lr"])
        else:
            for i, g in enumerate(groups):
                if "initial_lr" not in g:
                    raise KeyError(
                        f"param_groups[{i}] has no 'initial_lr', which resuming with last_epoch={last_epoch} "
                        "needs: load the optimizer's state_dict from the earlier run first, or start with "
                        "last_epoch=-1"
                    )
        if not hasattr(self, "base_lrs"):
            self.base_lrs: list[float] = [g["initial_lr"] for g in groups]
        self.last_epoch = last_epoch
        self._order_checked = False
        # this schedule's values at last_epoch: the base lrs before epoch 0, the groups' lrs when resuming
        self._prev: list[float] = list(self.base_lrs) if last_epoch == -1 else [g["lr"] for g in groups]
        self._last_lr: list[float] = [g["lr"] for g in groups]
        _watch_optimizer_steps(optimizer)
        self._move_to(last_epoch + 1)

    def get_lr(self) -> list[float]:
        """The schedule's learning rates (one per group) at ``last_epoch``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The learning rates the last step wrote into the groups."""
        return list(self._last_lr)

    def step(self, epoch: float | None = None) -> None:
        """Advance one epoch and set the groups' learning rates.

        Args:
            epoch: Deprecated: jump to this epoch and write the closed-form value (warns).
        """
        _warn_if_optimizer_idle(self)
        if epoch is None:
            self._move_to(self.last_epoch + 1)
        else:
            _warn_epoch_argument(type(self).__name__)
            self._move_to(int(epoch), absolute=True)

    def _move_to(self, epoch: int, absolute: bool = False) -> None:
        """Set ``last_epoch`` and write the schedule's values (see the module docstring on composing)."""
        self.last_epoch = epoch
        new = self.get_lr()
        for g, old, lr in zip(self.optimizer.param_groups, self._prev, new):
            cur = g["lr"]
            if self._relative and not absolute and cur != old and old != 0:
                lr = cur * (lr / old)
            g["lr"] = lr
        self._prev = list(new)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        self._after_move()

    def _after_move(self) -> None:
        """Hook run after each step (momentum cycling)."""

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer (and user functions)."""
        return {k: v for k, v in vars(self).items() if k not in self._unsaved}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from `state_dict` (the optimizer's groups are not touched)."""
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in self._unsaved})


class _LambdaState:
    """state_dict support for schedulers holding one user function per group in ``lr_lambdas``.

    Plain functions are saved as None; callable objects save their ``__dict__`` (as PyTorch does).
    """

    lr_lambdas: list[Callable[[int], float]]
    _unsaved: ClassVar[frozenset[str]] = frozenset({"optimizer", "lr_lambdas"})

    def state_dict(self) -> dict[str, Any]:
        sd = LRScheduler.state_dict(self)  # type: ignore[arg-type]
        sd["lr_lambdas"] = [
            None if isinstance(f, types.FunctionType) else dict(vars(f)) if hasattr(f, "__dict__") else None
            for f in self.lr_lambdas
        ]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        LRScheduler.load_state_dict(self, state_dict)  # type: ignore[arg-type]
        for f, saved in zip(self.lr_lambdas, state_dict.get("lr_lambdas", ())):
            if saved is not None:
                vars(f).update(saved)


def _lambdas(optimizer: Optimizer, lr_lambda: Any) -> list[Callable[[int], float]]:
    fns = _per_group("lr_lambda", optimizer, lr_lambda)
    for f in fns:
        if not callable(f):
            raise TypeError(f"lr_lambda must be callable (or a list of callables), got {type(f).__name__}")
    return fns


class LambdaLR(_LambdaState, LRScheduler):
    """``lr = initial_lr * lr_lambda(epoch)`` (absolute: it overwrites other schedulers' changes).

    Args:
        optimizer: The optimizer.
        lr_lambda: A function of the epoch, or a list with one per param group.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    _relative = False

    def __init__(self, optimizer: Optimizer, lr_lambda: Any, last_epoch: int = -1) -> None:
        self.lr_lambdas = _lambdas(optimizer, lr_lambda)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [b * f(self.last_epoch) for b, f in zip(self.base_lrs, self.lr_lambdas)]


class MultiplicativeLR(_LambdaState, LRScheduler):
    """Each step multiplies the lr by ``lr_lambda(epoch)`` (no factor at epoch 0).

    Args:
        optimizer: The optimizer.
        lr_lambda: A function of the epoch giving the step's factor, or a list with one per param group.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(self, optimizer: Optimizer, lr_lambda: Any, last_epoch: int = -1) -> None:
        self.lr_lambdas = _lambdas(optimizer, lr_lambda)
        # no closed form (the factors are arbitrary): keep the running values and the epoch they are at
        self._values = [g.get("initial_lr", g["lr"]) if last_epoch == -1 else g["lr"] for g in optimizer.param_groups]
        self._values_epoch = last_epoch
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        e = self.last_epoch
        if e != self._values_epoch:
            if e > 0:
                self._values = [v * f(e) for v, f in zip(self._values, self.lr_lambdas)]
            self._values_epoch = e
        return list(self._values)


class _FactorLR(LRScheduler):
    """Schedules of the form ``lr = initial_lr * factor(epoch)``."""

    def _factor(self, epoch: int) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        f = self._factor(self.last_epoch)
        return [b * f for b in self.base_lrs]


class StepLR(_FactorLR):
    """``lr = initial_lr * gamma ** (epoch // step_size)``.

    Args:
        optimizer: The optimizer.
        step_size: Epochs between two decays.
        gamma: Multiplicative decay.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def _factor(self, epoch: int) -> float:
        return self.gamma ** (epoch // self.step_size)


class MultiStepLR(_FactorLR):
    """``lr = initial_lr * gamma ** (number of milestones <= epoch)``; a repeated milestone counts twice.

    Args:
        optimizer: The optimizer.
        milestones: Epochs at which to decay (any order).
        gamma: Multiplicative decay.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(
        self, optimizer: Optimizer, milestones: Iterable[int], gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        self.milestones = sorted(milestones)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def _factor(self, epoch: int) -> float:
        return self.gamma ** bisect_right(self.milestones, epoch)


class ConstantLR(_FactorLR):
    """``lr = initial_lr * factor`` until ``total_iters`` epochs have passed, then ``initial_lr``.

    Args:
        optimizer: The optimizer.
        factor: The scale while active, in [0, 1].
        total_iters: The number of epochs it is active.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(
        self, optimizer: Optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1
    ) -> None:
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"ConstantLR factor must lie in [0, 1] (it scales the lr down), got {factor}")
        self.factor = factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def _factor(self, epoch: int) -> float:
        return self.factor + (epoch >= self.total_iters) * (1.0 - self.factor)


class LinearLR(_FactorLR):
    """The factor goes linearly from ``start_factor`` to ``end_factor`` over ``total_iters`` epochs.

    Args:
        optimizer: The optimizer.
        start_factor: The factor at epoch 0, in (0, 1].
        end_factor: The factor from epoch ``total_iters`` on, in [0, 1].
        total_iters: The length of the ramp.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        total_iters: int = 5,
        last_epoch: int = -1,
    ) -> None:
        if not 0.0 < start_factor <= 1.0:
            raise ValueError(f"LinearLR start_factor must lie in (0, 1], got {start_factor}")
        if not 0.0 <= end_factor <= 1.0:
            raise ValueError(f"LinearLR end_factor must lie in [0, 1], got {end_factor}")
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def _factor(self, epoch: int) -> float:
        done = min(self.total_iters, epoch)
        return self.start_factor + (self.end_factor - self.start_factor) * done / self.total_iters


class ExponentialLR(_FactorLR):
    """``lr = initial_lr * gamma ** epoch``.

    Args:
        optimizer: The optimizer.
        gamma: Multiplicative decay per epoch.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def _factor(self, epoch: int) -> float:
        return self.gamma**epoch


class PolynomialLR(_FactorLR):
    """``lr = initial_lr * (1 - min(epoch, total_iters) / total_iters) ** power``.

    Args:
        optimizer: The optimizer.
        total_iters: Epochs until the lr reaches 0.
        power: The polynomial's power.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(self, optimizer: Optimizer, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1) -> None:
        self.total_iters = total_iters
        self.power = power
        super().__init__(optimizer, last_epoch)

    def _factor(self, epoch: int) -> float:
        return (1.0 - min(self.total_iters, epoch) / self.total_iters) ** self.power


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (initial_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2`` (periodic past T_max).

    Args:
        optimizer: The optimizer.
        T_max: Epochs from ``initial_lr`` down to ``eta_min`` (half a period).
        eta_min: The lowest lr.
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        c = 1 + math.cos(math.pi * self.last_epoch / self.T_max)
        return [self.eta_min + (b - self.eta_min) * c / 2 for b in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing from ``initial_lr`` to ``eta_min`` over ``T_i`` epochs, then a restart with
    ``T_i *= T_mult`` (SGDR). ``step(epoch)`` takes fractional epochs (e.g. ``epoch + i / iters``).

    Args:
        optimizer: The optimizer.
        T_0: Epochs until the first restart.
        T_mult: Growth of the period after each restart (an int >= 1).
        eta_min: The lowest lr.
        last_epoch: The last epoch when resuming (-1: start afresh).

    Attributes:
        T_cur: Epochs since the last restart (may be fractional).
        T_i: The current period.
    """

    _relative = False

    def __init__(
        self, optimizer: Optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1
    ) -> None:
        if not isinstance(T_0, int) or T_0 <= 0:
            raise ValueError(f"T_0 must be a positive int (epochs until the first restart), got {T_0!r}")
        if not isinstance(T_mult, int) or T_mult < 1:
            raise ValueError(f"T_mult must be an int >= 1 (period growth per restart), got {T_mult!r}")
        self.T_0 = T_0
        self.T_i = T_0
        self.T_mult = T_mult
        self.eta_min = eta_min
        self.T_cur: float = 0
        self._seek(last_epoch + 1)  # where the constructor's first step lands
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        c = 1 + math.cos(math.pi * self.T_cur / self.T_i)
        return [self.eta_min + (b - self.eta_min) * c / 2 for b in self.base_lrs]

    def step(self, epoch: float | None = None) -> None:
        """Advance one epoch, or go to a (possibly fractional) ``epoch``; no deprecation here."""
        if epoch is None:
            _warn_if_optimizer_idle(self)  # an explicit epoch says where we are: nothing is skipped
            self.T_cur += 1
            if self.T_cur >= self.T_i:
                self.T_cur -= self.T_i
                self.T_i *= self.T_mult
            self._move_to(self.last_epoch + 1)
            return
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self._seek(epoch)
        self._move_to(math.floor(epoch))

    def _seek(self, epoch: float) -> None:
        """Set ``T_cur`` and ``T_i`` for an absolute epoch."""
        if epoch < self.T_0:
            self.T_i, self.T_cur = self.T_0, epoch
        elif self.T_mult == 1:
            self.T_i, self.T_cur = self.T_0, epoch % self.T_0
        else:
            # restarts so far: the largest n with T_0 * (T_mult**n - 1) / (T_mult - 1) <= epoch
            n = int(math.log(epoch / self.T_0 * (self.T_mult - 1) + 1, self.T_mult))
            self.T_cur = epoch - self.T_0 * (self.T_mult**n - 1) / (self.T_mult - 1)
            self.T_i = self.T_0 * self.T_mult**n


class OneCycleLR(LRScheduler):
    """The 1cycle policy: lr from ``max_lr / div_factor`` up to ``max_lr``, then down to
    ``initial_lr / final_div_factor``, with momentum (or Adam's beta1) cycling the opposite way.
    Call ``step()`` after every batch, ``total_steps`` times at most.

    Args:
        optimizer: The optimizer.
        max_lr: The peak lr, or one per group.
        total_steps: The cycle's length; else ``epochs * steps_per_epoch``.
        epochs: Epochs to train (with ``steps_per_epoch``).
        steps_per_epoch: Batches per epoch.
        pct_start: The fraction of the cycle spent increasing the lr.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        cycle_momentum: Cycle momentum / beta1 between ``max_momentum`` and ``base_momentum``.
        base_momentum: The momentum at the lr's peak, or one per group.
        max_momentum: The momentum at the cycle's ends, or one per group.
        div_factor: ``initial_lr = max_lr / div_factor``.
        final_div_factor: ``min_lr = initial_lr / final_div_factor``.
        three_phase: Up, back down to ``initial_lr`` symmetrically, then down to ``min_lr``.
        last_epoch: The last step when resuming (-1: start afresh).
    """

    _relative = False

    def __init__(
        self,
        optimizer: Optimizer,
        max_lr: float | list[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | list[float] = 0.85,
        max_momentum: float | list[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
    ) -> None:
        if total_steps is None:
            if not (
                isinstance(epochs, int) and epochs > 0 and isinstance(steps_per_epoch, int) and steps_per_epoch > 0
            ):
                raise ValueError(
                    "OneCycleLR needs the cycle's length: total_steps, or both epochs and steps_per_epoch "
                    f"(positive ints); got epochs={epochs!r}, steps_per_epoch={steps_per_epoch!r}"
                )
            total_steps = epochs * steps_per_epoch
        elif not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
        if not 0.0 <= pct_start <= 1.0:
            raise ValueError(f"pct_start is a fraction of the cycle and must lie in [0, 1], got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.total_steps = total_steps
        self.anneal_strategy = anneal_strategy
        groups = optimizer.param_groups
        if last_epoch == -1:
            for g, top in zip(groups, _per_group("max_lr", optimizer, max_lr)):
                g["initial_lr"] = top / div_factor
                g["max_lr"] = top
                g["min_lr"] = g["initial_lr"] / final_div_factor
        # (last step of the phase, lr key at its start, at its end, momentum key at start, at end)
        up_end = float(pct_start * total_steps) - 1
        if three_phase:
            self._phases = [
                (up_end, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                (float(2 * pct_start * total_steps) - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"),
                (total_steps - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"),
            ]
        else:
            self._phases = [
                (up_end, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                (total_steps - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"),
            ]
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self.use_beta1 = _momentum_uses_betas(optimizer, "OneCycleLR")
            if last_epoch == -1:
                tops = _per_group("max_momentum", optimizer, max_momentum)
                bottoms = _per_group("base_momentum", optimizer, base_momentum)
                for g, top, bottom in zip(groups, tops, bottoms):
                    _set_momentum(g, top, self.use_beta1)
                    g["max_momentum"], g["base_momentum"] = top, bottom
        super().__init__(optimizer, last_epoch)

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _at(self, group: dict[str, Any]) -> tuple[float, float | None]:
        """The (lr, momentum) of ``group`` at ``last_epoch``."""
        t = self.last_epoch
        if t > self.total_steps:
            raise ValueError(
                f"OneCycleLR stepped {t} times but the cycle has total_steps={self.total_steps}; "
                "step once per batch, or make total_steps (or epochs * steps_per_epoch) cover the training"
            )
        begin = 0.0
        for i, (end, lr0, lr1, m0, m1) in enumerate(self._phases):
            if t <= end or i == len(self._phases) - 1:
                pct = (t - begin) / (end - begin)
                m = self._anneal(group[m0], group[m1], pct) if self.cycle_momentum else None
                return self._anneal(group[lr0], group[lr1], pct), m
            begin = end
        raise AssertionError("unreachable")

    def get_lr(self) -> list[float]:
        return [self._at(g)[0] for g in self.optimizer.param_groups]

    def _after_move(self) -> None:
        if self.cycle_momentum:
            for g in self.optimizer.param_groups:
                m = self._at(g)[1]
                assert m is not None
                _set_momentum(g, m, self.use_beta1)


class CyclicLR(LRScheduler):
    """Cyclical learning rate: a triangle between ``base_lr`` and ``max_lr`` (``step_size_up`` steps up,
    ``step_size_down`` down), its amplitude scaled by ``scale_fn``; momentum cycles the opposite way.
    Call ``step()`` after every batch.

    Args:
        optimizer: The optimizer.
        base_lr: The lower bound, or one per group.
        max_lr: The upper bound, or one per group.
        step_size_up: Steps in the rising half.
        step_size_down: Steps in the falling half (default ``step_size_up``).
        mode: ``"triangular"`` (constant amplitude), ``"triangular2"`` (halved each cycle) or
            ``"exp_range"`` (scaled by ``gamma ** step``); ignored when ``scale_fn`` is given.
        gamma: The base of ``exp_range``.
        scale_fn: A custom amplitude scale, a function of the cycle or the step (see ``scale_mode``);
            not saved by ``state_dict()``: the constructor's stays in use.
        scale_mode: ``"cycle"`` or ``"iterations"``: the argument of a custom ``scale_fn``.
        cycle_momentum: Cycle momentum / beta1 between ``base_momentum`` and ``max_momentum``.
        base_momentum: The momentum at the lr's peak, or one per group.
        max_momentum: The momentum at ``base_lr``, or one per group.
        last_epoch: The last step when resuming (-1: start afresh).
    """

    _relative = False
    _unsaved = frozenset({"optimizer", "_custom_scale_fn"})
    _MODES: ClassVar[dict[str, str]] = {"triangular": "cycle", "triangular2": "cycle", "exp_range": "iterations"}

    def __init__(
        self,
        optimizer: Optimizer,
        base_lr: float | list[float],
        max_lr: float | list[float],
        step_size_up: int = 2000,
        step_size_down: int | None = None,
        mode: str = "triangular",
        gamma: float = 1.0,
        scale_fn: Callable[[float], float] | None = None,
        scale_mode: str = "cycle",
        cycle_momentum: bool = True,
        base_momentum: float = 0.8,
        max_momentum: float = 0.9,
        last_epoch: int = -1,
    ) -> None:
        if scale_fn is None and mode not in self._MODES:
            raise ValueError(f"CyclicLR mode must be one of {sorted(self._MODES)}, or give a scale_fn; got {mode!r}")
        base_lrs = _per_group("base_lr", optimizer, base_lr)
        if last_epoch == -1:
            for g, lr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = lr
        self.max_lrs = _per_group("max_lr", optimizer, max_lr)
        up = float(step_size_up)
        down = float(step_size_down) if step_size_down is not None else up
        self.total_size = up + down
        self.step_ratio = up / self.total_size
        self.mode = mode
        self.gamma = gamma
        self._custom_scale_fn = scale_fn
        self.scale_mode = scale_mode if scale_fn is not None else self._MODES[mode]
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self.use_beta1 = _momentum_uses_betas(optimizer, "CyclicLR")
            self.base_momentums = _per_group("base_momentum", optimizer, base_momentum)
            self.max_momentums = _per_group("max_momentum", optimizer, max_momentum)
            if last_epoch == -1:
                for g, top, bottom in zip(optimizer.param_groups, self.max_momentums, self.base_momentums):
                    _set_momentum(g, top, self.use_beta1)
                    g["max_momentum"], g["base_momentum"] = top, bottom
        self.base_lrs = base_lrs  # the cycle's floor, not initial_lr
        super().__init__(optimizer, last_epoch)

    def scale_fn(self, x: float) -> float:
        """The amplitude's scale at ``x`` (the cycle number, or the step for ``exp_range``)."""
        if self._custom_scale_fn is not None:
            return self._custom_scale_fn(x)
        if self.mode == "triangular":
            return 1.0
        if self.mode == "triangular2":
            return 1 / (2.0 ** (x - 1))
        return self.gamma**x

    def _phase(self) -> tuple[float, float]:
        """(position in the triangle, 0 at the floor and 1 at the peak; the amplitude's scale)."""
        cycle = math.floor(1 + self.last_epoch / self.total_size)
        x = 1.0 + self.last_epoch / self.total_size - cycle
        height = x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)
        return height, self.scale_fn(cycle if self.scale_mode == "cycle" else self.last_epoch)

    def get_lr(self) -> list[float]:
        height, scale = self._phase()
        return [lo + (hi - lo) * height * scale for lo, hi in zip(self.base_lrs, self.max_lrs)]

    def _after_move(self) -> None:
        if self.cycle_momentum:
            height, scale = self._phase()
            for g, lo, hi in zip(self.optimizer.param_groups, self.base_momentums, self.max_momentums):
                _set_momentum(g, hi - (hi - lo) * height * scale, self.use_beta1)


class _Composite:
    """state_dict / load_state_dict for schedulers that drive child schedulers."""

    _schedulers: list[LRScheduler]

    def state_dict(self) -> dict[str, Any]:
        sd = {k: v for k, v in vars(self).items() if k not in ("optimizer", "_schedulers")}
        sd["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        children = state_dict.get("_schedulers", [])
        if len(children) != len(self._schedulers):
            raise ValueError(
                f"the state holds {len(children)} schedulers, this {type(self).__name__} has "
                f"{len(self._schedulers)}; build it with the same schedulers before loading"
            )
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "_schedulers"})
        for s, sd in zip(self._schedulers, children):
            s.load_state_dict(sd)


def _check_children(schedulers: Sequence[Any], optimizer: Optimizer, who: str) -> None:
    if len(schedulers) == 0:
        raise ValueError(f"{who} needs at least one scheduler")
    for i, s in enumerate(schedulers):
        if isinstance(s, ReduceLROnPlateau) or not isinstance(s, LRScheduler):
            raise TypeError(f"{who}: schedulers[{i}] must be an epoch-driven LRScheduler, got {type(s).__name__}")
        if s.optimizer is not optimizer:
            raise ValueError(f"{who}: schedulers[{i}] drives a different optimizer; all must share one")


class SequentialLR(_Composite, LRScheduler):
    """Runs ``schedulers[0]``, then from epoch ``milestones[0]`` on ``schedulers[1]`` (restarted at its
    epoch 0), and so on.

    Args:
        optimizer: The optimizer all the schedulers drive.
        schedulers: The schedules, in order.
        milestones: The epochs at which the next scheduler takes over (one fewer than schedulers).
        last_epoch: The last epoch when resuming (-1: start afresh).
    """

    def __init__(
        self, optimizer: Optimizer, schedulers: list[LRScheduler], milestones: list[int], last_epoch: int = -1
    ) -> None:
        _check_children(schedulers, optimizer, "SequentialLR")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(
                f"SequentialLR needs one milestone between each two schedulers: {len(schedulers)} schedulers, "
                f"so {len(schedulers) - 1} milestones, got {len(milestones)}"
            )
        self.optimizer = optimizer
        self._schedulers = list(schedulers)
        self._milestones = list(milestones)
        self.last_epoch = last_epoch + 1
        self._order_checked = False
        # every child took its first step on construction; only the first one's should count
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"]
        for s in self._schedulers:
            s.last_epoch -= 1
        first = self._schedulers[0]
        first._move_to(first.last_epoch + 1, absolute=True)
        self._last_lr = first.get_last_lr()

    def step(self) -> None:  # type: ignore[override]
        """Advance one epoch: step the active scheduler, or restart the next one at a milestone."""
        _warn_if_optimizer_idle(self)
        self.last_epoch += 1
        i = bisect_right(self._milestones, self.last_epoch)
        s = self._schedulers[i]
        if i > 0 and self._milestones[i - 1] == self.last_epoch:
            s._move_to(0, absolute=True)
        else:
            s._move_to(s.last_epoch + 1)
        self._last_lr = s.get_last_lr()


class ChainedScheduler(_Composite, LRScheduler):
    """Steps several schedulers together, each applying its change on top of the others' (their
    factors multiply).

    Args:
        schedulers: The schedulers, stepped in this order.
        optimizer: Their optimizer (default: the first scheduler's).
    """

    def __init__(self, schedulers: Sequence[LRScheduler], optimizer: Optimizer | None = None) -> None:
        if len(schedulers) == 0:
            raise ValueError("ChainedScheduler needs at least one scheduler")
        optimizer = optimizer if optimizer is not None else schedulers[0].optimizer
        _check_children(schedulers, optimizer, "ChainedScheduler")
        self.optimizer = optimizer
        self._schedulers = list(schedulers)
        self._order_checked = False
        self._last_lr = [g["lr"] for g in optimizer.param_groups]

    def step(self) -> None:  # type: ignore[override]
        """Step every scheduler once, in order."""
        _warn_if_optimizer_idle(self)
        for s in self._schedulers:
            s._move_to(s.last_epoch + 1)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]


class ReduceLROnPlateau(LRScheduler):
    """Multiplies the lr by ``factor`` when a metric has not improved for ``patience`` steps.

    Args:
        optimizer: The optimizer.
        mode: ``"min"`` (lower is better) or ``"max"``.
        factor: The reduction, in [0, 1).
        patience: Steps without improvement tolerated before reducing (the reduction comes on the next).
        threshold: The least change that counts as an improvement.
        threshold_mode: ``"rel"`` (``best * (1 -/+ threshold)``) or ``"abs"`` (``best -/+ threshold``).
        cooldown: Steps after a reduction during which bad steps are not counted.
        min_lr: The lowest lr, or one per group.
        eps: Reductions smaller than this are skipped.

    Attributes:
        best: The best metric so far.
        num_bad_epochs: Steps since the last improvement (reset by reductions and cooldown).
        cooldown_counter: Cooldown steps left.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_lr: list[float] | float = 0,
        eps: float = 1e-8,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"ReduceLROnPlateau needs an asyncgrad.optim.Optimizer, got {type(optimizer).__name__}")
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau factor must be < 1 (it reduces the lr), got {factor}")
        self._init_is_better(mode, threshold, threshold_mode)
        self.optimizer = optimizer
        self.min_lrs = [float(v) for v in _per_group("min_lr", optimizer, min_lr)]
        self.factor = factor
        self.patience = patience
        self.cooldown = cooldown
        self.eps = eps
        self.best = self.mode_worse
        self.num_bad_epochs = 0
        self.cooldown_counter = 0
        self.last_epoch = 0
        self._order_checked = True  # a metric-driven schedule has no first value to skip
        self._last_lr = [g["lr"] for g in optimizer.param_groups]

    @property
    def in_cooldown(self) -> bool:
        """Whether reductions are paused after the last one."""
        return self.cooldown_counter > 0

    def _init_is_better(self, mode: str, threshold: float, threshold_mode: str) -> None:
        """Check and keep what `_improves` compares by (PyTorch's method of the same name)."""
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
        self.mode = mode
        self.threshold = threshold
        self.threshold_mode = threshold_mode
        self.mode_worse = math.inf if mode == "min" else -math.inf

    def _improves(self, value: float) -> bool:
        t = self.threshold
        if self.mode == "min":
            return value < (self.best * (1.0 - t) if self.threshold_mode == "rel" else self.best - t)
        return value > (self.best * (1.0 + t) if self.threshold_mode == "rel" else self.best + t)

    def step(self, metrics: Any, epoch: int | None = None) -> None:  # type: ignore[override]
        """Record one value of the metric (a number or a one-element tensor) and reduce the lr if it
        has stalled.

        Args:
            metrics: The monitored quantity.
            epoch: Deprecated: the epoch number to record (warns).
        """
        value = float(metrics)
        if epoch is None:
            self.last_epoch += 1
        else:
            _warn_epoch_argument("ReduceLROnPlateau")
            self.last_epoch = epoch
        if self._improves(value):
            self.best = value
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.in_cooldown:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            for g, floor in zip(self.optimizer.param_groups, self.min_lrs):
                new = max(g["lr"] * self.factor, floor)
                if g["lr"] - new > self.eps:
                    g["lr"] = new
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]
