"""Comparisons: relative errors in float64, state snapshots, recursive bitwise equality,
and a hash of a folder tree (to assert a run folder was left untouched).

``flat`` / ``rel_err`` take tensors in order (a list, or one tensor); ``flat_named`` /
``rel_err_named`` take ``{name: tensor}`` dicts, as the distributed runs return them.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

Tensors = torch.Tensor | Iterable[torch.Tensor]


def flat(tensors: Tensors) -> torch.Tensor:
    """One vector of every element, in order."""
    if isinstance(tensors, torch.Tensor):
        return tensors.reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def rel_err(a: Tensors, b: Tensors) -> float:
    """||a - b|| / ||b|| over all elements at once, in float64."""
    a, b = flat(a).detach().double(), flat(b).detach().double()
    return float((a - b).norm() / b.norm())


def flat_named(
    tensors: dict[str, torch.Tensor], minus: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """All tensors as one float64 vector (optionally minus another set, e.g. the init)."""
    parts = [t.to(torch.float64).flatten() for t in tensors.values()]
    if minus is not None:
        parts = [
            p - minus[n].to(torch.float64).flatten() for p, n in zip(parts, tensors, strict=True)
        ]
    return torch.cat(parts)


def rel_err_named(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor relative error ||got - want|| / ||want||, in float64."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    errs = []
    for name, w in want.items():
        g = got[name].to(torch.float64)
        w = w.to(torch.float64)
        errs.append(float((g - w).norm() / w.norm().clamp_min(1e-30)))
    return max(errs)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Copies of the model's and the optimizer's state dicts, for bitwise comparisons."""
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = copy.deepcopy(optimizer.state_dict())
    return params, opt


def assert_bitwise_equal(a: Any, b: Any) -> None:
    """Recursive bitwise equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), "tensors differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise_equal(x, y)
    else:
        assert a == b


def tree_hash(folder: Path) -> str:
    """Every folder and file under ``folder`` (a lock file too), with its bytes."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest() if path.is_file() else b"/")
    return digest.hexdigest()
