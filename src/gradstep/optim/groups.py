"""Parameter groups for layer-adaptive optimizers: which tensors decay and adapt."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from .._validate import check_number

__all__ = ["param_groups"]


def param_groups(
    model: nn.Module, *, weight_decay: float, no_decay: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """Two parameter groups: weights with ``weight_decay``, the rest without.

    Biases, normalisation gains and scalars (every parameter with <= 1 dimension) and
    the parameters named in ``no_decay`` (names of ``model.named_parameters()``, e.g. a
    position embedding; any of a tied parameter's names) go in a group with
    ``weight_decay=0`` and ``always_adapt=False``: no decay and no layer adaptation, the
    convention of the LARS and LAMB papers (and BERT, SimCLR). The decay group has only
    ``weight_decay`` set, so the optimizer's own ``always_adapt`` applies to it. Frozen
    parameters are left out; an empty group is dropped. torch's own optimizers ignore the
    extra ``always_adapt`` key.

    Under FSDP2 call it on the sharded model: ``ndim`` of a DTensor is the whole
    parameter's, so the split is the same on every rank and as on one process.
    """
    wd = check_number("weight_decay", weight_decay, "param_groups")
    names = [no_decay] if isinstance(no_decay, str) else list(no_decay)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"param_groups: no_decay must be parameter names (str), got {names!r}")
    # Every name of a tied (shared) parameter counts: no_decay=["head.weight"] reaches the
    # output layer tied to the embedding, which named_parameters() lists once, as the
    # embedding.
    every = {n: p for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise ValueError(
            f"param_groups: no_decay names {unknown} are not trainable parameters of the "
            "model; use names from model.named_parameters()"
        )
    excluded = {id(every[n]) for n in names}
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim > 1 and id(p) not in excluded]
    rest = [p for p in trainable if p.ndim <= 1 or id(p) in excluded]
    groups = [
        {"params": decay, "weight_decay": wd},
        {"params": rest, "weight_decay": 0.0, "always_adapt": False},
    ]
    return [g for g in groups if g["params"]]
