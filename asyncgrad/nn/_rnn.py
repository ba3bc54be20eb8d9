"""Recurrent layers with PyTorch's names, arguments, parameter names and shapes: RNN, LSTM, GRU and cells.

Each layer and direction of a sequence runs as ONE fused op (`asyncgrad.ops.recurrent_layer`: the time
loop runs inside the kernel, and one backward kernel gives every gradient), not as a Python loop of
small ops. A cell is the same op over a sequence of one step.

Parameters: ``weight_ih_l{k}{_reverse}`` ``(gates * hidden_size, input_size)`` (layer 0) or
``(gates * hidden_size, D * hidden_size)``, ``weight_hh_l{k}{_reverse}``, ``bias_ih_l{k}{_reverse}``,
``bias_hh_l{k}{_reverse}``; all initialised ``U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))``, as PyTorch.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

from .. import ops as _ops
from .. import runtime as _runtime
from ..ops import RECURRENT_MODES, recurrent_layer
from ..runtime import Tensor
from . import functional as F
from . import init
from ._layers import _new_param
from ._module import Module
from .utils.rnn import PackedSequence, _pack_index, _padded_sorted

__all__ = ["GRU", "LSTM", "RNN", "GRUCell", "LSTMCell", "RNNBase", "RNNCell", "RNNCellBase"]


def _check_sizes(cls: str, **sizes: Any) -> None:
    for name, v in sizes.items():
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{cls}: {name} must be a positive int, got {v!r}")


def _check_input(
    cls: str, input: Any, what: str, ndims: tuple[int, ...], input_size: int, ndim_msg: str, size_msg: str
) -> None:
    """PyTorch's checks of a recurrent module's input: a Tensor (else ``TypeError``, naming ``what`` it
    must be), with ``ndims`` dimensions and ``input_size`` features (else ``ValueError``: ``ndim_msg`` /
    ``size_msg``, formatted with the input's ``ndim``, ``shape``, its ``size`` and the ``expected`` one)."""
    if not isinstance(input, Tensor):
        raise TypeError(f"{cls}: input must be {what}, got {type(input).__name__}")
    facts = {"ndim": input.ndim, "shape": input.shape, "size": input.shape[-1] if input.ndim else None,
             "expected": input_size}
    if input.ndim not in ndims:
        raise ValueError(f"{cls}: " + ndim_msg.format(**facts))
    if input.shape[-1] != input_size:
        raise ValueError(f"{cls}: " + size_msg.format(**facts))


class RNNBase(Module):
    """The multi-layer, optionally bidirectional recurrence behind `RNN`, `LSTM` and `GRU`."""

    mode: str
    input_size: int
    hidden_size: int
    num_layers: int
    bias: bool
    batch_first: bool
    dropout: float
    bidirectional: bool
    proj_size: int

    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        _check_sizes(cls, input_size=input_size, hidden_size=hidden_size, num_layers=num_layers)
        if mode not in RECURRENT_MODES:
            raise ValueError(f"{cls}: unknown mode {mode!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Number) or not 0 <= dropout <= 1:
            raise ValueError(
                f"{cls}: dropout should be a number in range [0, 1] representing the probability of an "
                f"element being zeroed, got {dropout!r}"
            )
        if isinstance(proj_size, bool) or not isinstance(proj_size, numbers.Integral) or proj_size < 0:
            raise ValueError(f"{cls}: proj_size should be a positive integer or zero to disable projections")
        if proj_size >= hidden_size:
            raise ValueError(f"{cls}: proj_size has to be smaller than hidden_size (got {proj_size} >= {hidden_size})")
        if proj_size and mode != "lstm":
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        if dropout > 0 and num_layers == 1:
            warnings.warn(
                "dropout option adds dropout after all but last recurrent layer, so non-zero dropout expects "
                f"num_layers greater than 1, but got dropout={dropout} and num_layers={num_layers}",
                stacklevel=3,
            )
        self.mode = mode
        self.input_size = int(input_size)
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.dropout = float(dropout)
        self.bidirectional = bool(bidirectional)
        self.proj_size = int(proj_size)
        gates = RECURRENT_MODES[mode]
        d = 2 if bidirectional else 1
        out = self.proj_size or self.hidden_size  # the state size
        self._flat_weights_names: list[str] = []
        for layer in range(self.num_layers):
            n_in = self.input_size if layer == 0 else out * d
            for direction in range(d):
                sfx = f"_l{layer}" + ("_reverse" if direction else "")
                names = [f"weight_ih{sfx}", f"weight_hh{sfx}"]
                shapes: list[tuple[int, ...]] = [(gates * hidden_size, n_in), (gates * hidden_size, out)]
                if bias:
                    names += [f"bias_ih{sfx}", f"bias_hh{sfx}"]
                    shapes += [(gates * hidden_size,), (gates * hidden_size,)]
                if self.proj_size:
                    names.append(f"weight_hr{sfx}")
                    shapes.append((self.proj_size, hidden_size))
                for name, shape in zip(names, shapes):
                    setattr(self, name, _new_param(shape, dtype, device))
                self._flat_weights_names.extend(names)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's initialisation: every weight and bias ``U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))``."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0.0
        for p in self.parameters():
            init.uniform_(p, -stdv, stdv)

    def flatten_parameters(self) -> None:
        """Accepted for PyTorch compatibility (cuDNN's contiguous weight buffer): a no-op here, where the
        fused recurrence reads each weight where it is."""

    @property
    def _flat_weights(self) -> list[Tensor]:
        return [getattr(self, n) for n in self._flat_weights_names]

    @property
    def all_weights(self) -> list[list[Tensor]]:
        """Per layer and direction, its ``[weight_ih, weight_hh, bias_ih, bias_hh]`` (PyTorch's ``all_weights``)."""
        per = (4 if self.bias else 2) + (1 if self.proj_size else 0)
        names = self._flat_weights_names
        return [[getattr(self, n) for n in names[i : i + per]] for i in range(0, len(names), per)]

    def _layer_weights(self, layer: int, direction: int) -> tuple[Any, Any, Any, Any, Any]:
        sfx = f"_l{layer}" + ("_reverse" if direction else "")
        w_hr = getattr(self, f"weight_hr{sfx}") if self.proj_size else None
        if self.bias:
            return (
                getattr(self, f"weight_ih{sfx}"),
                getattr(self, f"weight_hh{sfx}"),
                getattr(self, f"bias_ih{sfx}"),
                getattr(self, f"bias_hh{sfx}"),
                w_hr,
            )
        return getattr(self, f"weight_ih{sfx}"), getattr(self, f"weight_hh{sfx}"), None, None, w_hr

    def _check_state(self, name: str, t: Any, shape: tuple[int, ...]) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"{type(self).__name__}: {name} must be a Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{type(self).__name__}: expected {name} of size {shape}, got {tuple(t.shape)}")

    def _initial_states(self, hx: Any, n: int, ref: Tensor, batched: bool = True) -> tuple[Tensor, Tensor | None]:
        """``(h_0, c_0)`` (``c_0`` None but for LSTM) for a batch of ``n``: zeros like ``ref`` without ``hx``,
        else ``hx`` checked against PyTorch's shapes (without the batch dim for an unbatched input)."""
        cls = type(self).__name__
        layers = self.num_layers * (2 if self.bidirectional else 1)
        hs = self.proj_size or self.hidden_size
        lstm = self.mode == "lstm"
        if hx is None:
            h0 = _runtime.zeros((layers, n, hs), dtype=ref.dtype, device=ref.device)
            c0 = _runtime.zeros((layers, n, self.hidden_size), dtype=ref.dtype, device=ref.device) if lstm else None
            return h0, c0
        lead = (layers, n) if batched else (layers,)
        if lstm:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"{cls}: hx must be a tuple (h_0, c_0) of tensors, got {type(hx).__name__}")
            h0, c0 = hx
            self._check_state("h_0", h0, (*lead, hs))
            self._check_state("c_0", c0, (*lead, self.hidden_size))
        else:
            if isinstance(hx, (tuple, list)):
                raise TypeError(f"{cls}: hx must be a Tensor, got a {type(hx).__name__}")
            h0, c0 = hx, None
            self._check_state("hx", h0, (*lead, hs))
        return h0, c0

    def forward(self, input: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        """Run the sequence: returns ``(output, h_n)`` (LSTM: ``(output, (h_n, c_n))``).

        Args:
            input: ``(L, N, H_in)``, ``(N, L, H_in)`` with ``batch_first``, unbatched ``(L, H_in)``, or a
                `asyncgrad.nn.utils.rnn.PackedSequence` (then ``output`` is one too, and ``h_n`` holds each
                sequence's states after its own last step).
            hx: Initial state(s) ``(D * num_layers, N, H_out)`` (unbatched: without N); zeros when None.
                For an LSTM, a tuple ``(h_0, c_0)``.
        """
        cls = type(self).__name__
        if isinstance(input, PackedSequence):
            return self._forward_packed(input, hx)
        _check_input(
            cls, input, "a Tensor or a PackedSequence", (2, 3), self.input_size,
            "Expected input to be 2D or 3D, got {ndim}D tensor of shape {shape}",
            "input.size(-1) must be equal to input_size. Expected {expected}, got {size} (input of shape {shape})",
        )
        lstm = self.mode == "lstm"
        batched = input.ndim == 3
        if not batched:
            input = input.unsqueeze(1)
        elif self.batch_first:
            input = input.transpose(0, 1)
        h0, c0 = self._initial_states(hx, input.shape[1], input, batched)
        if hx is not None and not batched:
            h0 = h0.unsqueeze(1)
            c0 = c0.unsqueeze(1) if c0 is not None else None
        output, hn, cn = self._run(input, h0, c0, None)
        if not batched:
            output = output.squeeze(1)
            hn = hn.squeeze(1)
            cn = cn.squeeze(1) if cn is not None else None
        elif self.batch_first:
            output = output.transpose(0, 1)
        if lstm:
            return output, (hn, cn)
        return output, hn

    def _forward_packed(self, seq: PackedSequence, hx: Any) -> tuple[PackedSequence, Any]:
        """A `PackedSequence` in, one out: the padded batch runs with each sequence's length."""
        cls = type(self).__name__
        data = seq.data
        if data.ndim != 2 or data.shape[1] != self.input_size:
            raise ValueError(
                f"{cls}: input.size(-1) must be equal to input_size. Expected {self.input_size}, got packed data of "
                f"shape {data.shape}"
            )
        padded, lens = _padded_sorted(seq, 0.0, None)
        t_len, n = padded.shape[0], padded.shape[1]
        lstm = self.mode == "lstm"
        h0, c0 = self._initial_states(hx, n, data)
        if hx is not None and seq.sorted_indices is not None:  # the states are given in the original batch order
            order = seq.sorted_indices.numpy()
            h0 = _ops.index_select(h0, 1, order)
            c0 = _ops.index_select(c0, 1, order) if c0 is not None else None
        out, hn, cn = self._run(padded, h0, c0, tuple(int(v) for v in lens))
        flat = out.reshape(t_len * n, out.shape[2])
        packed = PackedSequence(
            _ops.index_select(flat, 0, _pack_index(seq.batch_sizes.numpy(), n)),
            seq.batch_sizes,
            seq.sorted_indices,
            seq.unsorted_indices,
        )
        if seq.unsorted_indices is not None:
            un = seq.unsorted_indices.numpy()
            hn = _ops.index_select(hn, 1, un)
            cn = _ops.index_select(cn, 1, un) if cn is not None else None
        if lstm:
            return packed, (hn, cn)
        return packed, hn

    def _run(
        self, input: Tensor, h0: Tensor, c0: Tensor | None, lengths: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Every layer and direction over ``(T, N, H_in)``: the output and the stacked final states."""
        d = 2 if self.bidirectional else 1
        lstm = self.mode == "lstm"
        layer_in = input
        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        for layer in range(self.num_layers):
            outs = []
            for direction in range(d):
                k = layer * d + direction
                w_ih, w_hh, b_ih, b_hh, w_hr = self._layer_weights(layer, direction)
                y, hk, ck = recurrent_layer(
                    self.mode,
                    layer_in,
                    h0[k],
                    c0[k] if c0 is not None else None,
                    w_ih,
                    w_hh,
                    b_ih,
                    b_hh,
                    reverse=bool(direction),
                    weight_hr=w_hr,
                    lengths=lengths,
                )
                outs.append(y)
                h_n.append(hk)
                if ck is not None:
                    c_n.append(ck)
            layer_in = outs[0] if d == 1 else _ops.cat(outs, 2)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, True)
        return layer_in, _ops.stack(h_n, 0), _ops.stack(c_n, 0) if lstm else None

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if self.mode == "rnn_relu":
            s += ", nonlinearity='relu'"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        if self.proj_size:
            s += f", proj_size={self.proj_size}"
        return s


class RNN(RNNBase):
    """Elman RNN, ``h_t = tanh(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh)`` (or relu), PyTorch's ``nn.RNN``.

    Args:
        input_size: Features of the input.
        hidden_size: Features of the hidden state.
        num_layers: Stacked layers (default 1).
        nonlinearity: ``"tanh"`` (default) or ``"relu"``.
        bias: Learn ``b_ih`` and ``b_hh`` (default True).
        batch_first: Input and output are ``(N, L, H)`` instead of ``(L, N, H)`` (default False).
        dropout: Dropout on the outputs of each layer but the last, in training (default 0).
        bidirectional: Run a second direction and concatenate its outputs (default False).
        device: Device of the parameters.
        dtype: Parameter dtype (default: `asyncgrad.get_default_dtype()`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        if len(args) > 3:  # RNN(input_size, hidden_size, num_layers, nonlinearity, bias, ...)
            kwargs["nonlinearity"] = args[3]
            args = args[:3] + args[4:]
        nl = kwargs.pop("nonlinearity", "tanh")
        if nl not in ("tanh", "relu"):
            raise ValueError(f"RNN: unknown nonlinearity {nl!r}; select from 'tanh' or 'relu'")
        super().__init__("rnn_tanh" if nl == "tanh" else "rnn_relu", *args, **kwargs)
        self.nonlinearity = nl


class LSTM(RNNBase):
    """Long short-term memory, PyTorch's ``nn.LSTM`` (gates i, f, g, o); returns ``(output, (h_n, c_n))``.

    Args: as `RNN` without ``nonlinearity``, plus ``proj_size`` (default 0): project each hidden state to
    this size, ``h_t = W_hr (o_t * tanh(c_t))`` with ``weight_hr_l{k}`` of shape ``(proj_size, hidden_size)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__("lstm", *args, **kwargs)


class GRU(RNNBase):
    """Gated recurrent unit, PyTorch's ``nn.GRU`` (gates r, z, n; ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``).

    Args: as `RNN` without ``nonlinearity``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        super().__init__("gru", *args, **kwargs)


# ---- cells ------------------------------------------------------------------------------------------


class RNNCellBase(Module):
    """One step of a recurrence: parameters ``weight_ih``, ``weight_hh``, ``bias_ih``, ``bias_hh``."""

    def __init__(
        self, mode: str, input_size: int, hidden_size: int, bias: bool = True, device: Any = None, dtype: Any = None
    ) -> None:
        super().__init__()
        _check_sizes(type(self).__name__, input_size=input_size, hidden_size=hidden_size)
        self.mode = mode
        self.input_size = int(input_size)
        self.hidden_size = int(hidden_size)
        self.bias = bool(bias)
        gates = RECURRENT_MODES[mode]
        self.weight_ih = _new_param((gates * hidden_size, input_size), dtype, device)
        self.weight_hh = _new_param((gates * hidden_size, hidden_size), dtype, device)
        if bias:
            self.bias_ih = _new_param((gates * hidden_size,), dtype, device)
            self.bias_hh = _new_param((gates * hidden_size,), dtype, device)
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's initialisation: ``U(-1/sqrt(hidden_size), 1/sqrt(hidden_size))``."""
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            init.uniform_(p, -stdv, stdv)

    def _step(self, input: Tensor, hx: Any) -> tuple[Tensor, Tensor | None, bool]:
        cls = type(self).__name__
        _check_input(
            cls, input, "a Tensor", (1, 2), self.input_size, "Expected input to be 1D or 2D, got {ndim}D instead",
            "input has inconsistent input_size: got {size} expected {expected}",
        )
        batched = input.ndim == 2
        x = input if batched else input.unsqueeze(0)
        n = x.shape[0]
        lstm = self.mode == "lstm"
        if hx is None:
            h0 = _runtime.zeros((n, self.hidden_size), dtype=x.dtype, device=x.device)
            c0 = h0 if lstm else None
        else:
            if lstm:
                if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                    raise TypeError(f"{cls}: hx must be a tuple (h_0, c_0), got {type(hx).__name__}")
                h0, c0 = hx
            else:
                h0, c0 = hx, None
            want = (n, self.hidden_size) if batched else (self.hidden_size,)
            for name, t in (("hx", h0), ("cx", c0)):
                if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != want):
                    got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                    raise ValueError(f"{cls}: expected {name} of size {want}, got {got}")
            if not batched:
                h0 = h0.unsqueeze(0)
                c0 = c0.unsqueeze(0) if c0 is not None else None
        _, h1, c1 = recurrent_layer(
            self.mode, x.unsqueeze(0), h0, c0, self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh
        )
        if not batched:
            h1 = h1.squeeze(0)
            c1 = c1.squeeze(0) if c1 is not None else None
        return h1, c1, batched

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if not self.bias:
            s += ", bias=False"
        if self.mode == "rnn_relu":
            s += ", nonlinearity='relu'"
        return s


class RNNCell(RNNCellBase):
    """One Elman RNN step, PyTorch's ``nn.RNNCell(input_size, hidden_size, bias=True, nonlinearity="tanh")``."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        nonlinearity: str = "tanh",
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNNCell: unknown nonlinearity {nonlinearity!r}; select from 'tanh' or 'relu'")
        super().__init__("rnn_" + nonlinearity, input_size, hidden_size, bias, device, dtype)
        self.nonlinearity = nonlinearity

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """``h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh)``; input ``(N, H_in)`` or ``(H_in,)``."""
        return self._step(input, hx)[0]


class LSTMCell(RNNCellBase):
    """One LSTM step, PyTorch's ``nn.LSTMCell``: returns ``(h', c')``."""

    def __init__(
        self, input_size: int, hidden_size: int, bias: bool = True, device: Any = None, dtype: Any = None
    ) -> None:
        super().__init__("lstm", input_size, hidden_size, bias, device, dtype)

    def forward(self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """One step from ``hx = (h, c)`` (zeros when None)."""
        h1, c1, _ = self._step(input, hx)
        assert c1 is not None
        return h1, c1


class GRUCell(RNNCellBase):
    """One GRU step, PyTorch's ``nn.GRUCell``."""

    def __init__(
        self, input_size: int, hidden_size: int, bias: bool = True, device: Any = None, dtype: Any = None
    ) -> None:
        super().__init__("gru", input_size, hidden_size, bias, device, dtype)

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """One step from ``hx`` (zeros when None)."""
        return self._step(input, hx)[0]
