"""Attention and transformer layers with PyTorch's names, arguments, defaults and state-dict keys.

`MultiheadAttention` follows ``torch.nn.functional.multi_head_attention_forward``: packed ``in_proj_weight``
(or ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` when ``kdim`` / ``vdim`` differ), ``out_proj``,
bool masks meaning "do not attend" (True: masked), float masks added to the scores. Without
``need_weights`` the heads go through the fused `asyncgrad.ops.scaled_dot_product_attention` op; with it,
the weights are computed with ops and returned (averaged over heads by default), as PyTorch does.

The encoder and decoder stacks deep-copy the layer they are given ``num_layers`` times (``copy.deepcopy``),
so ``layers.0.self_attn.in_proj_weight`` and friends match PyTorch's keys.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import ops as _ops
from .. import runtime as _runtime
from ..ops import scaled_dot_product_attention
from ..runtime import Tensor, get_default_dtype
from . import functional as F
from . import init
from ._layers import Dropout, LayerNorm, Linear, ModuleList, _new_param
from ._module import Module

__all__ = [
    "MultiheadAttention",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]


def _float_mask(mask: Tensor | None, name: str, dtype: Any) -> Tensor | None:
    """PyTorch's canonical mask: a bool mask becomes 0 / -inf (True: masked), a float mask stays."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"MultiheadAttention: {name} must be a Tensor or None, got {type(mask).__name__}")
    if mask.dtype == np.bool_:
        z = _runtime.zeros((), dtype=dtype, device=mask.device)
        return _ops.where(mask, z - np.inf, z)  # type: ignore[no-any-return]
    if mask.dtype.kind != "f":
        raise TypeError(f"MultiheadAttention: only bool and floating types of {name} are supported, got {mask.dtype}")
    return mask.to(dtype=dtype) if mask.dtype != dtype else mask


class MultiheadAttention(Module):
    """Multi-head attention, PyTorch's ``nn.MultiheadAttention``.

    Args:
        embed_dim: Model dimension E (split over the heads).
        num_heads: Parallel heads (E must be divisible by it).
        dropout: Dropout on the attention weights in training (default 0).
        bias: Biases on the input and output projections (default True).
        add_bias_kv: Learned ``bias_k`` / ``bias_v`` appended to the keys and values (default False).
        add_zero_attn: Append a zero key and value (default False).
        kdim: Key features (default E).
        vdim: Value features (default E).
        batch_first: Inputs and output are ``(N, L, E)`` instead of ``(L, N, E)`` (default False).
        device: Device of the parameters.
        dtype: Parameter dtype.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"MultiheadAttention: embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} "
                f"and num_heads={num_heads} instead"
            )
        if embed_dim % num_heads:
            raise ValueError(
                f"MultiheadAttention: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"MultiheadAttention: dropout must be in [0, 1], got {dropout}")
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = float(dropout)
        self.batch_first = bool(batch_first)
        self.head_dim = embed_dim // num_heads
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = _new_param((embed_dim, embed_dim), dtype, device)
            self.k_proj_weight = _new_param((embed_dim, self.kdim), dtype, device)
            self.v_proj_weight = _new_param((embed_dim, self.vdim), dtype, device)
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = _new_param((3 * embed_dim, embed_dim), dtype, device)
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = _new_param((3 * embed_dim,), dtype, device)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        if add_bias_kv:
            self.bias_k = _new_param((1, 1, embed_dim), dtype, device)
            self.bias_v = _new_param((1, 1, embed_dim), dtype, device)
        else:
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)
        self.add_zero_attn = bool(add_zero_attn)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            init.xavier_uniform_(self.q_proj_weight)
            init.xavier_uniform_(self.k_proj_weight)
            init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
            init.xavier_normal_(self.bias_v)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key`` / ``value``: returns ``(attn_output, attn_weights or None)``.

        Args:
            query: ``(L, N, E)`` (``(N, L, E)`` with batch_first; unbatched ``(L, E)``).
            key: ``(S, N, kdim)``.
            value: ``(S, N, vdim)``.
            key_padding_mask: ``(N, S)``: True (or a float added to the scores) where a key is padding.
            need_weights: Also return the attention weights (default True).
            attn_mask: ``(L, S)`` or ``(N * num_heads, L, S)``: True where attending is not allowed, or a
                float mask added to the scores.
            average_attn_weights: Average the returned weights over the heads (default True).
            is_causal: A hint that ``attn_mask`` is the causal mask (it must then be given).
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"MultiheadAttention: {name} must be a Tensor, got {type(t).__name__}")
        batched = query.ndim == 3
        if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(
                "MultiheadAttention: query, key and value must all be 3-D (batched) or all 2-D (unbatched), got "
                f"shapes {query.shape}, {key.shape}, {value.shape}"
            )
        if self.batch_first and batched:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        if not batched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, e = query.shape
        src_len = key.shape[0]
        if e != self.embed_dim:
            raise ValueError(f"MultiheadAttention: was expecting embedding dimension of {self.embed_dim}, but got {e}")
        if key.shape[:2] != value.shape[:2] or key.shape[1] != bsz:
            raise ValueError(
                f"MultiheadAttention: key {key.shape} and value {value.shape} must have the same sequence length "
                f"and the batch size of query {query.shape}"
            )
        if key.shape[2] != self.kdim or value.shape[2] != self.vdim:
            raise ValueError(
                f"MultiheadAttention: expected key features {self.kdim} and value features {self.vdim}, got "
                f"{key.shape[2]} and {value.shape[2]}"
            )
        dt = query.dtype
        kpm = _float_mask(key_padding_mask, "key_padding_mask", dt)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "MultiheadAttention: Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                "module method `generate_square_subsequent_mask` to create this mask."
            )
        use_causal = bool(is_causal) and kpm is None and not need_weights
        mask = None if use_causal else _float_mask(attn_mask, "attn_mask", dt)

        # input projections
        b = self.in_proj_bias
        eq = self.embed_dim
        bq, bk, bv = (None, None, None) if b is None else (b[:eq], b[eq : 2 * eq], b[2 * eq :])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            wq, wk, wv = w[:eq], w[eq : 2 * eq], w[2 * eq :]
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        q = F.linear(query, wq, bq)
        k = F.linear(key, wk, bk)
        v = F.linear(value, wv, bv)

        if mask is not None:
            if mask.ndim == 2:
                if tuple(mask.shape) != (tgt_len, src_len):
                    raise RuntimeError(
                        f"MultiheadAttention: The shape of the 2D attn_mask is {mask.shape}, but should be "
                        f"{(tgt_len, src_len)}."
                    )
                mask = mask.unsqueeze(0)
            elif mask.ndim == 3:
                if tuple(mask.shape) != (bsz * self.num_heads, tgt_len, src_len):
                    raise RuntimeError(
                        f"MultiheadAttention: The shape of the 3D attn_mask is {mask.shape}, but should be "
                        f"{(bsz * self.num_heads, tgt_len, src_len)}."
                    )
            else:
                raise RuntimeError(f"MultiheadAttention: attn_mask's dimension {mask.ndim} is not supported")
        if self.bias_k is not None and self.bias_v is not None:
            k = _ops.cat([k, self.bias_k.repeat(1, bsz, 1)], 0)
            v = _ops.cat([v, self.bias_v.repeat(1, bsz, 1)], 0)
            mask = F.pad(mask, (0, 1)) if mask is not None else None
            kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
        h, hd = self.num_heads, self.head_dim
        q = q.reshape(tgt_len, bsz * h, hd).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * h, hd).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * h, hd).transpose(0, 1)
        if self.add_zero_attn:
            z = _runtime.zeros((bsz * h, 1, hd), dtype=dt, device=q.device)
            k = _ops.cat([k, z], 1)
            v = _ops.cat([v, z], 1)
            mask = F.pad(mask, (0, 1)) if mask is not None else None
            kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
        src_len = k.shape[1]
        if kpm is not None:
            if tuple(kpm.shape) != (bsz, src_len):
                raise ValueError(
                    f"MultiheadAttention: expected key_padding_mask of shape {(bsz, src_len)}, got {kpm.shape}"
                )
            kpm = kpm.reshape(bsz, 1, 1, src_len).expand(bsz, h, 1, src_len).reshape(bsz * h, 1, src_len)
            mask = kpm if mask is None else mask + kpm
        p = self.dropout if self.training else 0.0

        weights = None
        if need_weights:
            s = _ops.matmul(q * math.sqrt(1.0 / hd), k.transpose(1, 2))
            if mask is not None:
                s = s + mask
            att = F.softmax(s, dim=-1)
            if p > 0.0:
                att = F.dropout(att, p=p)
            out = _ops.bmm(att, v)
            out = out.transpose(0, 1).reshape(tgt_len * bsz, e)
            weights = att.reshape(bsz, h, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        else:
            if mask is not None:
                if mask.shape[0] == 1 and mask.ndim == 3:
                    mask = mask.unsqueeze(0)
                else:
                    mask = mask.reshape(bsz, h, -1, src_len)
            q4 = q.reshape(bsz, h, tgt_len, hd)
            k4 = k.reshape(bsz, h, src_len, hd)
            v4 = v.reshape(bsz, h, src_len, hd)
            o = scaled_dot_product_attention(q4, k4, v4, mask, p, use_causal)
            out = o.permute(2, 0, 1, 3).reshape(bsz * tgt_len, e)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias).reshape(tgt_len, bsz, e)
        if not batched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"


def _activation(activation: str | Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    if callable(activation):
        return activation
    raise RuntimeError(f"activation should be relu/gelu, not {activation}")


class _TransformerLayer(Module):
    """What the encoder and decoder layers share: the constructor (PyTorch's sub-modules, in its order; a
    decoder layer adds attention over the encoder's memory, its norm and its dropout) and the self-attention
    block. Arguments: see `TransformerEncoderLayer`."""

    _decoder = False

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **fk)
        if self._decoder:
            self.multihead_attn = MultiheadAttention(
                d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **fk
            )
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **fk)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **fk)
        self.norm_first = bool(norm_first)
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
        if self._decoder:
            self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        if self._decoder:
            self.dropout3 = Dropout(dropout)
        else:
            self.activation_relu_or_gelu = 1 if activation == "relu" else 2 if activation == "gelu" else 0
        self.activation = _activation(activation)
        self.batch_first = bool(batch_first)

    def _sa_block(self, x: Tensor, attn_mask: Any, key_padding_mask: Any, is_causal: bool) -> Tensor:
        y = self.self_attn(
            x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False, is_causal=is_causal
        )[0]
        return self.dropout1(y)  # type: ignore[no-any-return]


class TransformerEncoderLayer(_TransformerLayer):
    """Self-attention and a feed-forward block, PyTorch's ``nn.TransformerEncoderLayer``.

    Args:
        d_model: Model dimension.
        nhead: Attention heads.
        dim_feedforward: Hidden width of the feed-forward block (default 2048).
        dropout: Dropout (default 0.1).
        activation: ``"relu"`` (default), ``"gelu"`` or a callable.
        layer_norm_eps: LayerNorm eps (default 1e-5).
        batch_first: ``(N, S, E)`` inputs (default False: ``(S, N, E)``).
        norm_first: Pre-norm (LayerNorm before attention and feed-forward) instead of post-norm.
        bias: Biases in the linear layers and layer norms (default True).
        device: Device of the parameters.
        dtype: Parameter dtype.
    """

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Run the layer on ``src``; masks as in `MultiheadAttention` (``src_mask`` its ``attn_mask``)."""
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))  # type: ignore[no-any-return]


class TransformerDecoderLayer(_TransformerLayer):
    """Self-attention, attention over the encoder's memory and a feed-forward block (``nn.TransformerDecoderLayer``).

    Args: as `TransformerEncoderLayer`.
    """

    _decoder = True

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Run the layer on ``tgt`` attending to ``memory``."""
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _mha_block(self, x: Tensor, mem: Tensor, attn_mask: Any, key_padding_mask: Any, is_causal: bool) -> Tensor:
        y = self.multihead_attn(
            x, mem, mem, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
            need_weights=False,
        )[0]
        return self.dropout2(y)  # type: ignore[no-any-return]

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))  # type: ignore[no-any-return]


class _LayerStack(Module):
    """What the encoder and decoder stacks share: ``num_layers`` deep copies of a layer, an optional final norm."""

    def __init__(self, layer: Module, num_layers: int, norm: Module | None) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"{type(self).__name__}: num_layers must be at least 1, got {num_layers}")
        self.layers = ModuleList([copy.deepcopy(layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def _final_norm(self, out: Tensor) -> Tensor:
        return out if self.norm is None else self.norm(out)  # type: ignore[no-any-return]


class TransformerEncoder(_LayerStack):
    """A stack of ``num_layers`` deep copies of ``encoder_layer`` (PyTorch's ``nn.TransformerEncoder``).

    Args:
        encoder_layer: The layer to copy (a `TransformerEncoderLayer`).
        num_layers: How many copies.
        norm: An optional final layer norm.
        enable_nested_tensor: Accepted for compatibility (no nested tensors here).
        mask_check: Accepted for compatibility.
    """

    def __init__(
        self,
        encoder_layer: Module,
        num_layers: int,
        norm: Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        super().__init__(encoder_layer, num_layers, norm)
        self.enable_nested_tensor = enable_nested_tensor
        self.mask_check = mask_check

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        """Run every layer in turn (``mask``: each layer's ``src_mask``)."""
        out = src
        causal = bool(is_causal) and mask is not None
        for mod in self.layers:
            out = mod(out, src_mask=mask, is_causal=causal, src_key_padding_mask=src_key_padding_mask)
        return self._final_norm(out)


class TransformerDecoder(_LayerStack):
    """A stack of ``num_layers`` deep copies of ``decoder_layer`` (PyTorch's ``nn.TransformerDecoder``)."""

    def __init__(self, decoder_layer: Module, num_layers: int, norm: Module | None = None) -> None:
        super().__init__(decoder_layer, num_layers, norm)

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Run every layer in turn over ``tgt`` and ``memory``."""
        out = tgt
        causal = bool(tgt_is_causal) and tgt_mask is not None
        for mod in self.layers:
            out = mod(
                out,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                tgt_is_causal=causal,
                memory_is_causal=memory_is_causal,
            )
        return self._final_norm(out)


class Transformer(Module):
    """An encoder-decoder transformer, PyTorch's ``nn.Transformer`` (parameters with dim > 1 xavier-uniform).

    Args:
        d_model: Model dimension (default 512).
        nhead: Heads (default 8).
        num_encoder_layers: Encoder layers (default 6).
        num_decoder_layers: Decoder layers (default 6).
        dim_feedforward: Feed-forward width (default 2048).
        dropout: Dropout (default 0.1).
        activation: ``"relu"``, ``"gelu"`` or a callable.
        custom_encoder: Use this encoder instead.
        custom_decoder: Use this decoder instead.
        layer_norm_eps: LayerNorm eps (default 1e-5).
        batch_first: ``(N, S, E)`` inputs (default False).
        norm_first: Pre-norm layers (default False).
        bias: Biases in linear layers and layer norms (default True).
        device: Device of the parameters.
        dtype: Parameter dtype.
    """

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        custom_encoder: Module | None = None,
        custom_decoder: Module | None = None,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        lk = {
            "dim_feedforward": dim_feedforward,
            "dropout": dropout,
            "activation": activation,
            "layer_norm_eps": layer_norm_eps,
            "batch_first": batch_first,
            "norm_first": norm_first,
            "bias": bias,
            **fk,
        }
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            layer = TransformerEncoderLayer(d_model, nhead, **lk)
            self.encoder = TransformerEncoder(
                layer, num_encoder_layers, LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
            )
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            dlayer = TransformerDecoderLayer(d_model, nhead, **lk)
            self.decoder = TransformerDecoder(
                dlayer, num_decoder_layers, LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
            )
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)
        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Encode ``src``, then decode ``tgt`` attending to the encoding."""
        batched = src.ndim == 3
        if batched and src.shape[0 if self.batch_first else 1] != tgt.shape[0 if self.batch_first else 1]:
            raise RuntimeError("Transformer: the batch number of src and tgt must be equal")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise RuntimeError("Transformer: the feature number of src and tgt must be equal to d_model")
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal)
        return self.decoder(  # type: ignore[no-any-return]
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            memory_is_causal=memory_is_causal,
        )

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device: Any = None, dtype: Any = None) -> Tensor:
        """A float ``(sz, sz)`` causal mask: -inf above the diagonal, 0 elsewhere."""
        dt = get_default_dtype() if dtype is None else np.dtype(dtype)
        m = np.triu(np.full((sz, sz), -np.inf, dtype=dt), k=1)
        return _runtime.tensor(m, dtype=dt, device="cpu" if device is None else device)
