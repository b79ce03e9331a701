"""Rank side of test_step_syncs.py: the small all-reduces and host reads gradstep itself
issues in one steady-state step, counted below the Python API.

All-reduces are counted as ``c10d.allreduce_`` and functional ``all_reduce`` (DTensor's)
dispatcher calls of at most ``SMALL`` elements (a ``TorchDispatchMode`` sees every
collective issued from Python); the backend's gradient buckets are larger. Host reads are
``aten._local_scalar_dense`` (``item()``, ``float()``, ``int()``, ``bool()`` of a tensor)
and ``Tensor.tolist()`` (which the dispatcher does not see), counted when the nearest
caller outside torch is gradstep's own code: the optimizer's and the backend's reads are
theirs, not the step's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.batches import make_windows
from tests.support.models import tiny_gpt
from tests.support.reference import lm_loss

SMALL = 64
"""Elements: the step's own all-reduces carry a few numbers, gradient buckets thousands."""


def _gradsteps_own() -> bool:
    """The nearest frame outside torch (and this module) is gradstep's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("sync_census.py"):
            return "/gradstep/" in name
        frame = frame.f_back
    return False


class _Census(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.all_reduces = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith(("c10d.allreduce_", "_c10d_functional.all_reduce")):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.all_reduces += sum(t.numel() for t in tensors) <= SMALL
        elif name.startswith("aten._local_scalar_dense") and _gradsteps_own():
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def census() -> Iterator[_Census]:
    counts = _Census()
    tolist = torch.Tensor.tolist

    def counted(t: torch.Tensor) -> Any:
        if _gradsteps_own():
            counts.host_reads += 1
        return tolist(t)

    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        with counts:
            yield counts
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]


def census_run(rank: int, world: int, strategy: str) -> dict[tuple, tuple[int, int]]:
    """(all-reduces, host reads) of the third step, per (count=fn?, norm in backward?)."""
    import gradstep
    import gradstep.parallel as gd

    data = make_windows(3, world, 3, seed=0)
    counts = {id(mb): int((mb["labels"] != -100).sum()) for w in data for mb in w[rank]}
    out = {}
    for with_count in (False, True):
        for in_backward in (False, True):
            torch.manual_seed(0)
            model = gd.prepare_model(tiny_gpt(), strategy)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)  # reads nothing on the host
            stepper = gradstep.Stepper(model, opt, norm_in_backward=in_backward)
            fn = (lambda mb: counts[id(mb)]) if with_count else None
            for step, window in enumerate(data):
                if step < len(data) - 1:
                    stepper.step(window[rank], lm_loss, count=fn)
                    continue
                with census() as c:
                    stepper.step(window[rank], lm_loss, count=fn)
            assert stepper.norm_in_backward is in_backward
            out[(with_count, in_backward)] = (c.all_reduces, c.host_reads)
    return out
