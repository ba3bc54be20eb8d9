"""Variable-length sequences for the recurrent layers, with ``torch.nn.utils.rnn``'s names and semantics.

A `PackedSequence` holds the time steps of a batch of sequences sorted by decreasing length, step by step
(``data``: ``(sum(lengths), *)``; ``batch_sizes[t]``: how many sequences have a step ``t``). The recurrent
layers take one directly: they run the padded batch through the fused recurrence with each sequence's
length, so every sequence stops at its own end (and, backwards, starts from it), and return a
`PackedSequence` with ``h_n`` holding each sequence's last states. Packing and unpacking are
``index_select`` gathers, so gradients flow through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ...ops import cat, index_select, stack
from ...runtime import Tensor, full, tensor

__all__ = [
    "PackedSequence",
    "pack_padded_sequence",
    "pack_sequence",
    "pad_packed_sequence",
    "pad_sequence",
    "unpack_sequence",
    "unpad_sequence",
]


class PackedSequence(NamedTuple):
    """A packed batch of variable-length sequences (PyTorch's ``PackedSequence``).

    Attributes:
        data: ``(sum(lengths), *)``: step 0 of every sequence, then step 1 of those that have one, ...
        batch_sizes: int64 tensor: how many sequences have each step.
        sorted_indices: The batch order used for packing (None: the batch was sorted already).
        unsorted_indices: Its inverse (None with sorted_indices None).
    """

    data: Tensor
    batch_sizes: Tensor
    sorted_indices: Tensor | None = None
    unsorted_indices: Tensor | None = None

    def to(self, *args: Any, **kwargs: Any) -> PackedSequence:
        """The same packing with ``data.to(...)``."""
        return self._replace(data=self.data.to(*args, **kwargs))

    def double(self) -> PackedSequence:
        return self.to(dtype=np.float64)

    def float(self) -> PackedSequence:
        return self.to(dtype=np.float32)

    @property
    def is_cuda(self) -> bool:
        return str(self.data.device).startswith("cuda")


def _as_lengths(lengths: Any) -> np.ndarray:
    arr = lengths.numpy() if isinstance(lengths, Tensor) else np.asarray(lengths)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be a 1-d sequence of ints, got {lengths!r}")
    return arr.astype(np.int64)


def _pack_index(batch_sizes: np.ndarray, b: int) -> np.ndarray:
    """Rows of a flattened ``(T * B, *)`` time-major batch that make up the packed data, in order."""
    return np.concatenate([t * b + np.arange(n) for t, n in enumerate(batch_sizes)]).astype(np.int64)


def _batch_sizes(sorted_lengths: np.ndarray) -> np.ndarray:
    t_max = int(sorted_lengths[0])
    return np.array([(sorted_lengths > t).sum() for t in range(t_max)], dtype=np.int64)


def pack_padded_sequence(
    input: Tensor, lengths: Any, batch_first: bool = False, enforce_sorted: bool = True
) -> PackedSequence:
    """Pack a padded batch ``(T, B, *)`` (``(B, T, *)`` with batch_first) of sequences of ``lengths``.

    Args:
        input: The padded batch.
        lengths: Each sequence's length (a list, array or int64 tensor), each at least 1.
        batch_first: ``input`` is ``(B, T, *)``.
        enforce_sorted: Require ``lengths`` sorted in decreasing order; False sorts them (and records how).
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"pack_padded_sequence: input must be a Tensor, got {type(input).__name__}")
    lens = _as_lengths(lengths)
    if input.ndim < 2:
        raise ValueError(f"pack_padded_sequence: expected an input of at least 2 dims, got shape {input.shape}")
    if batch_first:
        input = input.transpose(0, 1)
    t_len, b = input.shape[0], input.shape[1]
    if len(lens) != b:
        raise ValueError(f"pack_padded_sequence: expected {b} lengths (the batch size), got {len(lens)}")
    if lens.min() < 1:
        raise RuntimeError("pack_padded_sequence: length of all samples has to be greater than 0")
    if lens.max() > t_len:
        raise RuntimeError(
            f"pack_padded_sequence: a length of {int(lens.max())} does not fit a padded length of {t_len}"
        )
    sorted_idx = unsorted_idx = None
    if enforce_sorted:
        if np.any(np.diff(lens) > 0):
            raise RuntimeError(
                "`lengths` array must be sorted in decreasing order when `enforce_sorted` is True. You can pass "
                "`enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to sidestep this requirement "
                "if you do not need ONNX exportability."
            )
    else:
        order = np.argsort(-lens, kind="stable")
        lens = lens[order]
        input = index_select(input, 1, order)
        sorted_idx = tensor(order.astype(np.int64), device=input.device)
        unsorted_idx = tensor(np.argsort(order).astype(np.int64), device=input.device)
    bs = _batch_sizes(lens)
    flat = input.reshape(t_len * b, *input.shape[2:])
    data = index_select(flat, 0, _pack_index(bs, b))
    return PackedSequence(data, tensor(bs), sorted_idx, unsorted_idx)


def _padded_sorted(seq: PackedSequence, padding_value: float, total_length: int | None) -> tuple[Tensor, np.ndarray]:
    """The packed data as a padded ``(T, B, *)`` batch in the packing (sorted) order, and its lengths."""
    bs = seq.batch_sizes.numpy()
    t_len = len(bs) if total_length is None else int(total_length)
    if t_len < len(bs):
        raise ValueError(
            f"Expected total_length to be at least the length of the longest sequence in input, but got "
            f"total_length={total_length} and max sequence length being {len(bs)}"
        )
    b = int(bs[0])
    data = seq.data
    n = data.shape[0]
    # the position in data of every (t, b), or n: a padding row appended to data
    where_ = np.full(t_len * b, n, dtype=np.int64)
    where_[_pack_index(bs, b)] = np.arange(n)
    pad_row = full((1, *data.shape[1:]), padding_value, dtype=data.dtype, device=data.device)
    padded = index_select(cat([data, pad_row], 0), 0, where_).reshape(t_len, b, *data.shape[1:])
    lens = np.array([(bs > i).sum() for i in range(b)], dtype=np.int64)
    return padded, lens


def pad_packed_sequence(
    sequence: PackedSequence, batch_first: bool = False, padding_value: float = 0.0, total_length: int | None = None
) -> tuple[Tensor, Tensor]:
    """Unpack to ``(padded, lengths)``: padded ``(T, B, *)`` (``(B, T, *)`` with batch_first) in the
    original batch order, ``lengths`` an int64 tensor."""
    if not isinstance(sequence, PackedSequence):
        raise TypeError(f"pad_packed_sequence: expected a PackedSequence, got {type(sequence).__name__}")
    padded, lens = _padded_sorted(sequence, padding_value, total_length)
    if sequence.unsorted_indices is not None:
        un = sequence.unsorted_indices.numpy()
        padded = index_select(padded, 1, un)
        lens = lens[un]
    if batch_first:
        padded = padded.transpose(0, 1)
    return padded, tensor(lens)


def pad_sequence(
    sequences: Sequence[Tensor], batch_first: bool = False, padding_value: float = 0.0, padding_side: str = "right"
) -> Tensor:
    """Stack tensors of shapes ``(L_i, *)`` into ``(L_max, B, *)`` (``(B, L_max, *)`` with batch_first)."""
    seqs = list(sequences)
    if not seqs:
        raise ValueError("pad_sequence: received an empty list of sequences")
    if padding_side not in ("left", "right"):
        raise ValueError(f"pad_sequence: padding_side must be 'left' or 'right', got {padding_side!r}")
    rest = tuple(seqs[0].shape[1:])
    for s in seqs:
        if tuple(s.shape[1:]) != rest:
            raise ValueError(f"pad_sequence: sequences must share their trailing dims, got {rest} and {s.shape[1:]}")
    t_max = max(s.shape[0] for s in seqs)
    out = []
    for s in seqs:
        k = t_max - s.shape[0]
        if k:
            pad = full((k, *rest), padding_value, dtype=s.dtype, device=s.device)
            s = cat([s, pad] if padding_side == "right" else [pad, s], 0)
        out.append(s)
    return stack(out, 0 if batch_first else 1)  # type: ignore[no-any-return]


def pack_sequence(sequences: Sequence[Tensor], enforce_sorted: bool = True) -> PackedSequence:
    """Pack a list of tensors ``(L_i, *)`` (sorted by decreasing length unless ``enforce_sorted=False``)."""
    lens = [s.shape[0] for s in sequences]
    return pack_padded_sequence(pad_sequence(sequences), lens, enforce_sorted=enforce_sorted)


def unpad_sequence(padded_sequences: Tensor, lengths: Any, batch_first: bool = False) -> list[Tensor]:
    """The inverse of `pad_sequence`: the list of unpadded sequences."""
    lens = _as_lengths(lengths)
    if not batch_first:
        padded_sequences = padded_sequences.transpose(0, 1)
    return [padded_sequences[i, : int(n)] for i, n in enumerate(lens)]


def unpack_sequence(packed_sequences: PackedSequence) -> list[Tensor]:
    """The inverse of `pack_sequence`: the list of sequences, in the original order."""
    padded, lens = pad_packed_sequence(packed_sequences, batch_first=True)
    return unpad_sequence(padded, lens, batch_first=True)
