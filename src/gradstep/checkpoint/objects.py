"""The keyword objects of ``save`` and ``load``: which is the model, which the optimizer.

:func:`classify` splits them into one ``nn.Module``, at most one optimizer and the other
objects (each needing ``state_dict``/``load_state_dict``), refusing anything else, the same
way for a save and a load; :func:`kind` is the ``kind`` a manifest records for each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError

__all__ = ["NamedObject", "classify", "kind"]


@dataclass(frozen=True)
class NamedObject:
    """One keyword argument of ``save``/``load``: the name it is stored under, and the object."""

    name: str
    obj: Any


def classify(
    stateful: dict[str, Any],
) -> tuple[NamedObject | None, NamedObject | None, dict[str, Any]]:
    """Split the keyword objects into (model), (optimizer) and the rest, checking each."""
    modules = [NamedObject(n, o) for n, o in stateful.items() if isinstance(o, nn.Module)]
    optims = [
        NamedObject(n, o) for n, o in stateful.items() if isinstance(o, torch.optim.Optimizer)
    ]
    if len(modules) > 1 or len(optims) > 1:
        raise CheckpointError(
            "a checkpoint holds at most one nn.Module and one Optimizer; got modules "
            f"{[m.name for m in modules]} and optimizers {[o.name for o in optims]}"
        )
    if optims and not modules:
        raise CheckpointError("an optimizer needs its model in the same call (parameter names)")
    special = {named.name for named in modules + optims}
    others = {n: o for n, o in stateful.items() if n not in special}
    for name, obj in others.items():
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise CheckpointError(
                f"{name}={type(obj).__name__}: checkpointed objects must be an nn.Module, an "
                "Optimizer, or have state_dict() and load_state_dict()"
            )
    return (modules[0] if modules else None), (optims[0] if optims else None), others


def kind(obj: Any) -> str:
    """The ``kind`` a manifest entry records for ``obj``."""
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    return "object"
