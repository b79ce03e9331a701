"""Halving micro-batches, for recovering from out-of-memory (``Stepper(on_oom="split")``).

Normalisation is by the global item count, so cutting a micro-batch in two changes nothing
in the update (to float rounding): the split window's step equals the unsplit one's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import MicroBatchTooLarge

__all__ = [
    "SplitFn",
    "batch_size",
    "halve",
    "is_out_of_memory",
    "rows",
    "split_in_half",
    "too_large",
    "too_large_error",
]

SplitFn = Callable[[Any], "tuple[Any, Any]"]
"""Cut one micro-batch into two along its batch dimension. A one-item micro-batch becomes
itself and an empty one: every rank's window must keep the same number of micro-batches
(their forwards and backwards pair collectives), and an empty micro-batch adds nothing."""


def _tensors(mb: Any) -> list[torch.Tensor]:
    if isinstance(mb, torch.Tensor):
        return [mb]
    if isinstance(mb, Mapping):
        return [t for v in mb.values() for t in _tensors(v)]
    if isinstance(mb, (list, tuple)):
        return [t for v in mb for t in _tensors(v)]
    return []


def batch_size(mb: Any) -> int:
    """Rows along dim 0, shared by every tensor of the micro-batch."""
    sizes = {t.shape[0] for t in _tensors(mb) if t.dim() > 0}
    if len(sizes) != 1:
        raise TypeError(
            "on_oom='split' splits micro-batches along dim 0 of their tensors: the default "
            "splitter needs a tensor, or a dict / list / tuple of tensors with one batch "
            f"size; found sizes {sorted(sizes)} in a {type(mb).__name__}. Pass split_fn="
        )
    return sizes.pop()


def _take(mb: Any, rows: slice) -> Any:
    if isinstance(mb, torch.Tensor):
        return mb[rows] if mb.dim() > 0 else mb
    if isinstance(mb, Mapping):
        return type(mb)({k: _take(v, rows) for k, v in mb.items()})  # type: ignore[call-arg]
    if isinstance(mb, (list, tuple)):
        return type(mb)(_take(v, rows) for v in mb)
    return mb  # not batched (a flag, a string): shared by both halves


def split_in_half(mb: Any) -> tuple[Any, Any]:
    """The default splitter: the first ceil(n/2) rows and the rest (empty for one row), for
    a tensor or a dict / list / tuple of tensors (nested)."""
    n = batch_size(mb)
    half = (n + 1) // 2
    return _take(mb, slice(0, half)), _take(mb, slice(half, n))


def rows(mb: Any) -> int | None:
    """Items in a micro-batch, or None when the default splitter cannot tell."""
    try:
        return batch_size(mb)
    except TypeError:
        return None


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, and the CPU allocator's failure (a plain RuntimeError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def halve(micro_batches: list[Any], split_fn: SplitFn, times: int) -> list[Any]:
    """Every micro-batch cut in two, ``times`` times over."""
    for _ in range(times):
        out: list[Any] = []
        for mb in micro_batches:
            parts = split_fn(mb)
            if not (isinstance(parts, tuple) and len(parts) == 2):
                raise TypeError(
                    "split_fn must return a tuple of two micro-batches (the second may be "
                    f"empty), got {type(parts).__name__}"
                )
            out.extend(parts)
        micro_batches = out
    return micro_batches


def too_large(micro_batches: list[Any]) -> bool:
    """True when no micro-batch can shrink any more (every one holds at most one item)."""
    sizes = [rows(mb) for mb in micro_batches]
    return all(n is not None and n <= 1 for n in sizes)


def too_large_error(halvings: int) -> MicroBatchTooLarge:
    return MicroBatchTooLarge(
        f"on_oom='split': after {halvings} halvings, micro-batches of one item still do not "
        "fit in the memory this process has; shorten the sequences, shrink the model, "
        "checkpoint activations, or allow more memory"
    )
