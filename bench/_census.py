"""Every collective one training step issues, with its issuer, kind, group and bytes.

The approaches of the test suite's ``tests/parallel/sync_census.py`` and
``tests/parallel/distributed_ranks.py``'s ``CollectiveSpy``, combined:

- a ``TorchDispatchMode`` sees each ``c10d`` and functional collective dispatched from
  Python, whoever calls it, below the ``torch.distributed`` API;
- a collective DTensor issues *inside* an op's dispatch (a redistribution its sharding
  propagation asks for, e.g. in ``get_total_norm``'s ``vector_norm`` of the stacked
  per-tensor norms) runs with the mode popped: a spy on
  ``torch.distributed._functional_collectives`` counts those, and only those, so no call
  is counted twice.

Each call is recorded as ``(issuer, kind, group size, bytes, elements, hidden)``:

- issuer: ``fsdp2`` (an FSDP2 frame on the stack: its parameter all-gathers, gradient
  reduce-scatters and HSDP's all-reduce), ``tp`` (tensor parallel: a DTensor collective in
  the model's forward or in the backward), or the label of the step's own code (the first
  frame outside torch, matched against ``Census(own=...)``; ``tp`` when none matches);
- kind: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast``, ...;
- bytes and elements: the full buffer (an all-gather's output, a reduce-scatter's input,
  an all-reduce's tensor);
- hidden: seen by the spy, inside a DTensor op's dispatch.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

SMALL = 64
"""Elements: a step's own all-reduces carry a few numbers, gradient buckets thousands."""

_KINDS = (  # substring of the op name -> kind; reduce_scatter before scatter
    ("reduce_scatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("alltoall", "all_to_all"),
    ("all_to_all", "all_to_all"),
)
# The functional collectives DTensor calls (spied on for the hidden calls), with the
# position of their ``group`` argument (read from the arguments, not the signature: another
# wrapper may sit in between).
_FUNCOL = {
    "all_reduce": 2, "all_gather_single": 2, "all_gather_tensor": 2,
    "reduce_scatter_single": 3, "reduce_scatter_tensor": 3, "all_reduce_coalesced": 2,
    "broadcast": 2, "all_to_all_single": 3,
}  # fmt: skip
# This module's frames, skipped when looking for the issuer.
_OWN_FRAMES = {"_issuer", "_record", "__torch_dispatch__", "spy"}
_TORCH = os.path.dirname(torch.__file__) + os.sep
_FSDP = os.path.join(_TORCH, "distributed", "fsdp") + os.sep


def _kind(op: str) -> str | None:
    """The collective kind of a dispatcher op name, None for a non-collective (``wait``s
    and the functional collectives' autograd wrapper are not collectives)."""
    if not op.startswith(("c10d.", "_c10d_functional.")) or "wait" in op or "wrap" in op:
        return None
    name = op.split(".")[1]
    return next((kind for key, kind in _KINDS if key in name), name)


def _tensors(arg: Any) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


def _group_size(args: tuple) -> int:
    """Ranks in the call's process group: a c10d op's boxed ProcessGroup or a functional
    op's group name (the other strings and script objects are reduce ops)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in reversed(args):  # the group comes after the reduce op
        try:
            if isinstance(a, str):
                return _resolve_process_group(a).size()
            if isinstance(a, torch.ScriptObject):
                return dist.ProcessGroup.unbox(a).size()
        except (RuntimeError, ValueError, TypeError):
            continue
    return 0


def _issuer(own: dict[str, str]) -> str:
    """``fsdp2``, ``tp`` or ``own``'s label for the first frame outside torch (see above)."""
    files = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not (code.co_filename == __file__ and code.co_name in _OWN_FRAMES):
            files.append(code.co_filename)
        frame = frame.f_back
    if any(f.startswith(_FSDP) for f in files):
        return "fsdp2"
    if torch._C._current_autograd_node() is not None:
        return "tp"  # a DTensor redistribution's backward (FSDP2's are caught above)
    outside = next((f for f in files if not f.startswith(_TORCH)), "")
    return next((label for key, label in own.items() if outside.startswith(key)), "tp")


class Census(TorchDispatchMode):
    """Records every collective while active in ``calls`` (see the module docs).

    ``own``: ``{path prefix: label}`` for the step's own code (a package's folder with its
    trailing separator, or one file), e.g. ``{os.path.dirname(gradstep.__file__) + os.sep:
    "gradstep", __file__: "hand loop"}``.
    """

    def __init__(self, own: dict[str, str]) -> None:
        super().__init__()
        self.own = own
        self.calls: list[tuple[str, str, int, int, int, bool]] = []
        self._saved: list[tuple[str, Any]] = []
        self._depth = 0

    def __enter__(self) -> Census:
        import torch.distributed._functional_collectives as funcol

        for name in _FUNCOL:
            fn = getattr(funcol, name)
            self._saved.append((name, fn))
            setattr(funcol, name, self._spy(name, fn))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        import torch.distributed._functional_collectives as funcol

        super().__exit__(*exc)
        for name, fn in self._saved:
            setattr(funcol, name, fn)
        self._saved.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = _kind(str(func))
        if kind is not None:
            numel = max((sum(t.numel() for t in _tensors(a)) for a in args[:2]), default=0)
            group = _group_size(tuple(args) + tuple((kwargs or {}).values()))
            if str(func).startswith("_c10d_functional.all_gather"):
                numel *= group  # the functional form gets the input alone
            self._record(kind, group, numel, _tensors(args[:2]), hidden=False)
        return func(*args, **(kwargs or {}))

    def _record(
        self, kind: str, group: int, numel: int, tensors: list[torch.Tensor], hidden: bool
    ) -> None:
        item = max((t.element_size() for t in tensors), default=0)
        self.calls.append((_issuer(self.own), kind, group, numel * item, numel, hidden))

    def _spy(self, name: str, fn: Any) -> Any:
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.distributed_c10d import _resolve_process_group
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        at = _FUNCOL[name]

        def spy(*args: Any, **kwargs: Any) -> Any:
            if self._depth or self in _get_current_dispatch_mode_stack():
                return fn(*args, **kwargs)  # the mode sees it, or an outer spy counted it
            self._depth += 1
            try:
                group_arg = kwargs["group"] if "group" in kwargs else args[at]
                size = _resolve_process_group(funcol._resolve_group_name(group_arg)).size()
                tensors = _tensors(args[0])
                numel = sum(t.numel() for t in tensors) * (size if "gather" in name else 1)
                self._record(_kind(f"c10d.{name}") or name, size, numel, tensors, hidden=True)
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return spy


def census_rows(calls: list[tuple]) -> list[dict]:
    """Calls grouped by (issuer, kind, group size, small or not, hidden): count and bytes."""
    rows: dict[tuple, list[int]] = {}
    for issuer, kind, group, nbytes, numel, hidden in calls:
        row = rows.setdefault((issuer, kind, group, numel <= SMALL, hidden), [0, 0])
        row[0] += 1
        row[1] += nbytes
    keys = ("issuer", "kind", "group", "small", "hidden")
    return [
        {**dict(zip(keys, key, strict=True)), "calls": calls, "bytes": nbytes}
        for key, (calls, nbytes) in rows.items()
    ]


class DTensorWarnings(logging.Handler):
    """DTensor's "N sequential <collective> operations" warnings (logged once per mesh and
    dims by ``torch.distributed.tensor._redistribute``), with the side that triggered them."""

    LOGGER = "torch.distributed.tensor._redistribute"

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.side = "-"
        self.seen: list[tuple[str, str]] = []
        logging.getLogger(self.LOGGER).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((self.side, record.getMessage().split(". This is")[0]))
