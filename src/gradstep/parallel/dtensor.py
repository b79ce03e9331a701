"""DTensor facts in one place: a shard's local view and norms of local tensors.

FSDP2 (and tensor parallelism) hand out gradients as DTensors. Everything in gradstep
that measures them locally asks here, so "what is this rank's part" and "in which dtype
is a norm taken" each have one answer.
"""

from __future__ import annotations

import torch

__all__ = ["norm32", "to_local"]


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself when it is a plain one)."""
    local = getattr(t, "to_local", None)
    return local() if local is not None else t


def norm32(t: torch.Tensor, norm_type: float = 2.0, dim: int | None = None) -> torch.Tensor:
    """``vector_norm`` in at least float32 (torch's own norm of a bf16/fp16 tensor rounds in
    that dtype); an empty tensor's norm is 0 (the inf-norm of an empty shard raises)."""
    wide = torch.promote_types(t.dtype, torch.float32)
    if t.numel() == 0 and dim is None:
        return torch.zeros((), dtype=wide, device=t.device)
    return torch.linalg.vector_norm(t, norm_type, dim=dim, dtype=wide)
