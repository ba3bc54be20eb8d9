"""L-BFGS (``torch.optim.LBFGS``): the same iterations, line search and stopping rules, with an async step.

``step(closure)`` re-evaluates the model several times, and a closure's ``backward`` must be awaited, so
here ``step`` is a coroutine: ``loss = await opt.step(closure)``. The closure may be ``async def`` (the
usual form: ``opt.zero_grad(); loss = f(); await loss.backward(); return loss``) or a plain function.
The search directions and the history live in flat float arrays (the parameters' dtype), as PyTorch's
flat tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..runtime import Tensor, enable_grad, from_numpy, no_grad
from ._optimizer import Optimizer

__all__ = ["LBFGS"]


def _cubic_interpolate(
    x1: float, f1: float, g1: float, x2: float, f2: float, g2: float, bounds: tuple[float, float] | None = None
) -> float:
    # the minimiser of the cubic through two points with their derivatives (PyTorch's formula)
    if bounds is not None:
        xmin_bound, xmax_bound = bounds
    else:
        xmin_bound, xmax_bound = (x1, x2) if x1 <= x2 else (x2, x1)
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    d2_square = d1**2 - g1 * g2
    if d2_square >= 0:
        d2 = float(np.sqrt(d2_square))
        if x1 <= x2:
            min_pos = x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
        else:
            min_pos = x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2))
        return float(min(max(min_pos, xmin_bound), xmax_bound))
    return (xmin_bound + xmax_bound) / 2.0


async def _strong_wolfe(
    obj_func: Callable[[list[np.ndarray], float, np.ndarray], Any],
    x: list[np.ndarray], t: float, d: np.ndarray, f: float, g: np.ndarray, gtd: float,
    c1: float = 1e-4, c2: float = 0.9, tolerance_change: float = 1e-9, max_ls: int = 25,
) -> tuple[float, np.ndarray, float, int]:
    d_norm = float(np.abs(d).max())
    g = g.copy()
    f_new, g_new = await obj_func(x, t, d)
    ls_func_evals = 1
    gtd_new = float(g_new.dot(d))
    t_prev, f_prev, g_prev, gtd_prev = 0.0, f, g, gtd
    done = False
    ls_iter = 0
    bracket: list[float] = []
    bracket_f: list[float] = []
    bracket_g: list[np.ndarray] = []
    bracket_gtd: list[float] = []
    while ls_iter < max_ls:
        if f_new > (f + c1 * t * gtd) or (ls_iter > 1 and f_new >= f_prev):
            bracket, bracket_f = [t_prev, t], [f_prev, f_new]
            bracket_g, bracket_gtd = [g_prev, g_new.copy()], [gtd_prev, gtd_new]
            break
        if abs(gtd_new) <= -c2 * gtd:
            bracket, bracket_f, bracket_g = [t], [f_new], [g_new]
            done = True
            break
        if gtd_new >= 0:
            bracket, bracket_f = [t_prev, t], [f_prev, f_new]
            bracket_g, bracket_gtd = [g_prev, g_new.copy()], [gtd_prev, gtd_new]
            break
        min_step = t + 0.01 * (t - t_prev)
        max_step = t * 10
        tmp = t
        t = _cubic_interpolate(t_prev, f_prev, gtd_prev, t, f_new, gtd_new, bounds=(min_step, max_step))
        t_prev, f_prev, g_prev, gtd_prev = tmp, f_new, g_new.copy(), gtd_new
        f_new, g_new = await obj_func(x, t, d)
        ls_func_evals += 1
        gtd_new = float(g_new.dot(d))
        ls_iter += 1
    if ls_iter == max_ls:
        bracket, bracket_f, bracket_g, bracket_gtd = [0.0, t], [f, f_new], [g, g_new], [gtd, gtd_new]
    insuf_progress = False
    low_pos, high_pos = (0, 1) if bracket_f[0] <= bracket_f[-1] else (1, 0)
    while not done and ls_iter < max_ls:
        if abs(bracket[1] - bracket[0]) * d_norm < tolerance_change:
            break
        t = _cubic_interpolate(bracket[0], bracket_f[0], bracket_gtd[0], bracket[1], bracket_f[1], bracket_gtd[1])
        eps = 0.1 * (max(bracket) - min(bracket))
        if min(max(bracket) - t, t - min(bracket)) < eps:
            if insuf_progress or t >= max(bracket) or t <= min(bracket):
                t = max(bracket) - eps if abs(t - max(bracket)) < abs(t - min(bracket)) else min(bracket) + eps
                insuf_progress = False
            else:
                insuf_progress = True
        else:
            insuf_progress = False
        f_new, g_new = await obj_func(x, t, d)
        ls_func_evals += 1
        gtd_new = float(g_new.dot(d))
        ls_iter += 1
        if f_new > (f + c1 * t * gtd) or f_new >= bracket_f[low_pos]:
            bracket[high_pos], bracket_f[high_pos] = t, f_new
            bracket_g[high_pos], bracket_gtd[high_pos] = g_new.copy(), gtd_new
            low_pos, high_pos = (0, 1) if bracket_f[0] <= bracket_f[1] else (1, 0)
        else:
            if abs(gtd_new) <= -c2 * gtd:
                done = True
            elif gtd_new * (bracket[high_pos] - bracket[low_pos]) >= 0:
                bracket[high_pos], bracket_f[high_pos] = bracket[low_pos], bracket_f[low_pos]
                bracket_g[high_pos], bracket_gtd[high_pos] = bracket_g[low_pos], bracket_gtd[low_pos]
            bracket[low_pos], bracket_f[low_pos] = t, f_new
            bracket_g[low_pos], bracket_gtd[low_pos] = g_new.copy(), gtd_new
    return bracket_f[low_pos], bracket_g[low_pos], bracket[low_pos], ls_func_evals


class LBFGS(Optimizer):
    """L-BFGS with PyTorch's defaults, iterations, optional strong-Wolfe line search and stopping rules.

    ``loss = await opt.step(closure)``: the closure (``async def`` or plain) clears the gradients,
    computes the loss, awaits its backward and returns it; it is called up to ``max_eval`` times per step.

    Args:
        params: Parameters (one group only, as in PyTorch).
        lr: Step length scale (default 1).
        max_iter: Iterations per step (default 20).
        max_eval: Closure evaluations per step (default ``max_iter * 5 // 4``).
        tolerance_grad: Stop when the largest gradient entry is at most this.
        tolerance_change: Stop when the step or the loss changes less than this.
        history_size: Update history kept (default 100).
        line_search_fn: None or ``"strong_wolfe"``.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1, max_iter: int = 20, max_eval: int | None = None,
        tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9, history_size: int = 100,
        line_search_fn: str | None = None,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if max_eval is None:
            max_eval = max_iter * 5 // 4
        if line_search_fn not in (None, "strong_wolfe"):
            raise ValueError(f"LBFGS: line_search_fn must be None or 'strong_wolfe', got {line_search_fn!r}")
        super().__init__(params, {"lr": lr, "max_iter": max_iter, "max_eval": max_eval,
                                  "tolerance_grad": tolerance_grad, "tolerance_change": tolerance_change,
                                  "history_size": history_size, "line_search_fn": line_search_fn})
        if len(self.param_groups) != 1:
            raise ValueError("LBFGS doesn't support per-parameter options (parameter groups)")
        self._params: list[Tensor] = self.param_groups[0]["params"]

    def _numel(self) -> int:
        return sum(p.numel() for p in self._params)

    async def _flat_grad(self) -> np.ndarray:
        parts = []
        for p in self._params:
            g = p.grad
            if g is None:
                parts.append(np.zeros(p.numel(), dtype=p.dtype))
            else:
                await g.ready()
                parts.append(np.asarray(g).reshape(-1))
        return np.concatenate(parts)

    def _add_grad(self, step_size: float, update: np.ndarray) -> None:
        offset = 0
        with no_grad():
            for p in self._params:
                n = p.numel()
                # a copy: the in-place kernel may run after `update` is reused
                p.add_(from_numpy(np.array(update[offset : offset + n].reshape(p.shape))), alpha=step_size)
                offset += n
        if offset != self._numel():
            raise AssertionError("LBFGS: the flat update does not cover the parameters")

    def _clone_param(self) -> list[np.ndarray]:
        return [np.array(np.asarray(p), copy=True) for p in self._params]

    def _set_param(self, params_data: list[np.ndarray]) -> None:
        with no_grad():
            for p, pdata in zip(self._params, params_data):
                p.copy_(pdata)

    @staticmethod
    async def _call(closure: Callable[[], Any]) -> Any:
        with enable_grad():
            loss = closure()
            if inspect.isawaitable(loss):
                loss = await loss
        return loss

    async def _directional_evaluate(
        self, closure: Callable[[], Any], x: list[np.ndarray], t: float, d: np.ndarray
    ) -> tuple[float, np.ndarray]:
        self._add_grad(t, d)
        loss = float(await self._call(closure))
        flat_grad = await self._flat_grad()
        self._set_param(x)
        return loss, flat_grad

    async def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run up to ``max_iter`` L-BFGS iterations; returns the loss of the first closure call.

        Raises:
            RuntimeError: Without a closure (L-BFGS needs to re-evaluate the model).
        """
        if closure is None:
            raise RuntimeError("LBFGS.step() requires a closure that clears the gradients, computes the loss, "
                               "awaits its backward and returns it")
        group = self.param_groups[0]
        lr = group["lr"]
        max_iter, max_eval = group["max_iter"], group["max_eval"]
        tolerance_grad, tolerance_change = group["tolerance_grad"], group["tolerance_change"]
        line_search_fn, history_size = group["line_search_fn"], group["history_size"]
        state = self.state[self._params[0]]
        state.setdefault("func_evals", 0)
        state.setdefault("n_iter", 0)

        orig_loss = await self._call(closure)
        loss = float(orig_loss)
        current_evals = 1
        state["func_evals"] += 1
        flat_grad = await self._flat_grad()
        if np.abs(flat_grad).max() <= tolerance_grad:
            return orig_loss

        d: Any = state.get("d")
        t: Any = state.get("t")
        old_dirs: Any = state.get("old_dirs")
        old_stps: Any = state.get("old_stps")
        ro: Any = state.get("ro")
        h_diag: Any = state.get("H_diag")
        prev_flat_grad: Any = state.get("prev_flat_grad")
        prev_loss: Any = state.get("prev_loss")
        n_iter = 0
        while n_iter < max_iter:
            n_iter += 1
            state["n_iter"] += 1
            if state["n_iter"] == 1:
                d = -flat_grad
                old_dirs, old_stps, ro = [], [], []
                h_diag = 1.0
            else:
                y = flat_grad - prev_flat_grad
                s = d * t
                ys = float(y.dot(s))
                if ys > 1e-10:
                    if len(old_dirs) == history_size:
                        old_dirs.pop(0)
                        old_stps.pop(0)
                        ro.pop(0)
                    old_dirs.append(y)
                    old_stps.append(s)
                    ro.append(1.0 / ys)
                    h_diag = ys / float(y.dot(y))
                num_old = len(old_dirs)
                al: list[float] = state.setdefault("al", [0.0] * history_size)
                q = -flat_grad
                for i in range(num_old - 1, -1, -1):
                    al[i] = float(old_stps[i].dot(q)) * ro[i]
                    q += -al[i] * old_dirs[i]
                d = r = q * h_diag
                for i in range(num_old):
                    be_i = float(old_dirs[i].dot(r)) * ro[i]
                    r += (al[i] - be_i) * old_stps[i]
            prev_flat_grad = flat_grad.copy()
            prev_loss = loss
            t = min(1.0, 1.0 / float(np.abs(flat_grad).sum())) * lr if state["n_iter"] == 1 else lr
            gtd = float(flat_grad.dot(d))
            if gtd > -tolerance_change:
                break
            ls_func_evals = 0
            if line_search_fn is not None:
                x_init = self._clone_param()

                async def obj_func(x: list[np.ndarray], t: float, d: np.ndarray) -> tuple[float, np.ndarray]:
                    return await self._directional_evaluate(closure, x, t, d)

                loss, flat_grad, t, ls_func_evals = await _strong_wolfe(obj_func, x_init, t, d, loss, flat_grad, gtd)
                self._add_grad(t, d)
                opt_cond = np.abs(flat_grad).max() <= tolerance_grad
            else:
                self._add_grad(t, d)
                opt_cond = False
                if n_iter != max_iter:
                    loss = float(await self._call(closure))
                    flat_grad = await self._flat_grad()
                    opt_cond = np.abs(flat_grad).max() <= tolerance_grad
                    ls_func_evals = 1
            current_evals += ls_func_evals
            state["func_evals"] += ls_func_evals
            if n_iter == max_iter or current_evals >= max_eval or opt_cond:
                break
            if np.abs(d * t).max() <= tolerance_change:
                break
            if abs(loss - prev_loss) < tolerance_change:
                break
        state.update(d=d, t=t, old_dirs=old_dirs, old_stps=old_stps, ro=ro, H_diag=h_diag,
                     prev_flat_grad=prev_flat_grad, prev_loss=prev_loss)
        return orig_loss

    def state_dict(self) -> dict[str, Any]:
        """As `Optimizer.state_dict`; the L-BFGS history (flat arrays, lists of them) is copied as is."""
        import copy

        sd = super().state_dict()
        sd["state"] = copy.deepcopy(sd["state"])
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from `state_dict` (the history is copied, not checked against shapes)."""
        import copy

        saved = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for idx, st in saved.items():
            i = int(idx)
            if 0 <= i < len(self._params):
                self.state[self._params[i]] = copy.deepcopy(dict(st))
