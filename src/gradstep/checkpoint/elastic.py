"""Elastic resumes: the global batch a checkpoint ran, kept on another number of ranks.

The global batch is ``accum_steps x data-parallel ranks x micro-batch``; the data-parallel
ranks are the ranks that read different data: the world size, except under tensor
parallel, whose peers read the same micro-batches (``dp_size`` in the manifest).
"""

from __future__ import annotations

from torch import nn

from .._validate import check_int
from .errors import CheckpointError

__all__ = ["data_parallel_size", "elastic_accum_steps"]


def elastic_accum_steps(accum_steps: int, saved_world_size: int, world_size: int) -> int:
    """Accumulation steps that keep the checkpoint's global batch on ``world_size`` ranks.

    The global batch is ``accum_steps * saved_world_size`` micro-batches per optimizer step;
    it must stay the same for the data stream and the LR schedule to mean the same thing.
    Both sizes count data-parallel ranks: the world sizes, except under tensor parallel
    (``CheckpointInfo.dp_size``).
    """
    for name, value in (
        ("accum_steps", accum_steps),
        ("saved_world_size", saved_world_size),
        ("world_size", world_size),
    ):
        check_int(name, value, 1, "elastic_accum_steps", CheckpointError)
    total = accum_steps * saved_world_size
    if total % world_size:
        raise CheckpointError(
            f"cannot keep the global batch: the checkpoint was saved with world_size="
            f"{saved_world_size} x accum_steps={accum_steps} = {total} micro-batches per step, "
            f"which world_size={world_size} does not divide; use a world size dividing {total}"
        )
    return total // world_size


def data_parallel_size(model: nn.Module | None, world: int) -> int:
    """Ranks that read different data: ``world``, except for a model whose layout has
    ranks that share data (tensor-parallel peers): its ``Layout.of(model).dp_size``."""
    if model is None or world == 1:
        return world
    from ..parallel.layout import Layout

    size = Layout.of(model, world).dp_size
    return size if world % size == 0 else world
