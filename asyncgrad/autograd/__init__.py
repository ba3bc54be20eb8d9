"""Reverse-mode autodiff: backward passes as tasks, the engine, leaf owners, hooks, Function, checkpoint.

A backward pass, in the order its files run::

    _api.py          backward() / grad(): check the arguments, build the pass (a GraphTask) to await
    _engine.py       GraphTask.run: count dependencies (_deps.py), then run ready nodes latest-first, giving
                     the loop back on a time budget; stage the leaves' gradients
      _run_node.py     one node: a built-in op's rule as one kernel (or recorded ops under create_graph),
                       or a Function's backward
      _hooks.py        tensor hooks, node pre/post hooks around each node
      _trampoline.py   an ``async def`` backward that awaits another pass: nested on the task's trampoline
    _unawaited.py    a pass never awaited: reported at the next backward() or scheduling point
    _leaf_owner.py   the pass succeeded: each leaf's owner actor runs its hooks and commits (all or none)
      _accumulate.py   fold a gradient into .grad under the layout contract (steal or copy)

Around it: ``_function.py`` (custom `Function`), ``_checkpoint.py`` (recompute in backward),
``_tensor_hooks.py`` (registering hooks), ``_gradcheck.py`` (finite-difference checks).
"""

from ..runtime import enable_grad, inference_mode, no_grad, set_grad_enabled
from ._api import backward, grad
from ._checkpoint import checkpoint
from ._commit_now import commit_gradients as commit_gradients
from ._compile import CaptureFallback, CompiledStep, CompileStatistics
from ._compile import compile as compile  # not in __all__: a star import must not shadow the builtin
from ._function import Function, FunctionCtx, once_differentiable
from ._gradcheck import GradcheckError, gradcheck, gradgradcheck
from ._leaf_owner import queue_callback
from ._run_node import BackwardError
from ._unawaited import ForgottenAwaitWarning

__all__ = [
    "BackwardError",
    "CaptureFallback",
    "CompileStatistics",
    "CompiledStep",
    "ForgottenAwaitWarning",
    "Function",
    "FunctionCtx",
    "GradcheckError",
    "backward",
    "checkpoint",
    "enable_grad",
    "grad",
    "gradcheck",
    "gradgradcheck",
    "inference_mode",
    "no_grad",
    "once_differentiable",
    "queue_callback",
    "set_grad_enabled",
]
