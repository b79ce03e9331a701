"""Recovering from out-of-memory by halving micro-batches (``Stepper(on_oom="split")``).

Normalisation is by the global item count, so cutting a micro-batch in two changes nothing
in the update (to float rounding): the split window's step equals the unsplit one's.
:class:`OOMSplitter` is the whole feature as the Stepper sees it: the halvings, the retry,
the guards around each micro-batch's forward and backward. :class:`OOMAgreement` turns an
out-of-memory on any rank into one decision every rank takes together (the Stepper's
windows and the demo's evaluation use it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._handles import removing
from ..errors import MicroBatchTooLarge

__all__ = [
    "MAX_HALVINGS",
    "ON_OOM",
    "OOMAgreement",
    "OOMSplitter",
    "SplitFn",
    "WindowOOM",
    "batch_size",
    "halve",
    "is_out_of_memory",
    "rows",
    "split_in_half",
    "too_large",
    "too_large_error",
]

ON_OOM = ("raise", "split")
"""What ``Stepper(on_oom=...)`` accepts."""

MAX_HALVINGS = 16
"""Halvings after which a window that still runs out of memory is given up (a custom
``split_fn`` whose micro-batches never shrink would otherwise double the window forever)."""

OOM_MESSAGES = (
    "can't allocate memory",  # torch's CPU allocator: RuntimeError ... DefaultCPUAllocator
    "could not create a primitive",  # oneDNN: no memory for a kernel (its JIT code)
    "CUDA out of memory",  # older torch, and RuntimeErrors re-raised from CUDA code
    "CUDA error: out of memory",
    "std::bad_alloc",  # a C++ allocation failing inside an operator
)
"""How the allocators really report running out (torch 2.13, CPU under an address-space
limit, and CUDA): CUDA's is also a ``torch.OutOfMemoryError``, the others plain
``RuntimeError``s identified by these texts."""


class WindowOOM(Exception):
    """Some rank ran out of memory in this window: every rank drops it and splits."""


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
    """CUDA's ``OutOfMemoryError``, Python's ``MemoryError``, and the ``RuntimeError``s of
    :data:`OOM_MESSAGES` (the CPU allocator's, oneDNN's kernel creation)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)


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


def too_large_error(halvings: int, last_error: str | None = None) -> MicroBatchTooLarge:
    said = f" (the last error: {last_error})" if last_error else ""
    stuck = ""
    if last_error and "could not create a primitive" in last_error:
        # oneDNN (torch 2.13) cannot compile any new kernel on a thread where one compile
        # ran out of memory: smaller shapes fail too, so the halvings prove nothing.
        stuck = (
            "; oneDNN failed to compile a kernel, and after that it cannot compile one for "
            "any new shape in this thread, so the halvings said nothing of the memory: "
            "restart the process with more memory"
        )
    return MicroBatchTooLarge(
        f"on_oom='split': after {halvings} halvings, micro-batches of one item still do not "
        f"fit in the memory this process has{said}{stuck}; shorten the sequences, shrink the "
        "model, checkpoint activations, or allow more memory"
    )


class OOMAgreement:
    """Out-of-memory turned into one decision that every rank takes together.

    Every agreement point is the same one-number all-reduce (``all_reduce_sum``): after each
    guarded forward and backward (:meth:`guard`), and, where forwards communicate (FSDP2's
    all-gathers), before each communicating module's forward (:meth:`before_forwards`). A
    rank that fails early therefore meets its peers at their next agreement point, never
    inside an all-gather or a gradient reduction. Every rank must pass the same number of
    points: the same number of micro-batches per window.
    """

    def __init__(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], world: int):
        self._sum, self.world_size = all_reduce_sum, world
        self.reset()

    def reset(self) -> None:
        """Forget this rank's failure (at the start of every attempt)."""
        self.failed_rows: int | None = None
        """Items of the micro-batch that ran out of memory here (None: none did, or unknown)."""
        self.failed = False
        self.last_error: str | None = None
        """The failure's text: only text, so that no frame (and tensor) outlives it."""

    @contextlib.contextmanager
    def guard(self, micro_batch: Any = None) -> Iterator[None]:
        """Run the body; out-of-memory in it (here or on any rank) raises :class:`WindowOOM`
        on every rank at the end of the body, any other error propagates."""
        failed = False
        try:
            yield
        except WindowOOM:
            raise
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            failed = True
            self.failed, self.failed_rows = True, rows(micro_batch)
            first_line = (str(exc).splitlines() or [""])[0][:200]
            self.last_error = f"{type(exc).__name__}: {first_line}"
        self.agree(failed)

    def agree(self, failed: bool) -> None:
        """Raise :class:`WindowOOM` on every rank when any rank says it ran out."""
        if self.world_size > 1:
            flag = torch.tensor([float(failed)], dtype=torch.float64)
            failed = bool(self._sum(flag).item() > 0)
        if failed:
            raise WindowOOM

    def before_forwards(self, modules: Sequence[nn.Module]) -> contextlib.AbstractContextManager:
        """An agreement point before the forward of each of ``modules``."""
        hook = lambda module, args: self.agree(False)  # noqa: E731
        return removing(m.register_forward_pre_hook(hook, prepend=True) for m in modules)

    def stuck(self) -> bool:
        """Every rank's verdict (a collective): some rank ran out of memory in a micro-batch
        of at most one item, which no split can shrink."""
        here = self.failed and self.failed_rows is not None and self.failed_rows <= 1
        if self.world_size == 1:
            return here
        flag = torch.tensor([float(here)], dtype=torch.float64)
        return bool(self._sum(flag).item() > 0)


class OOMSplitter:
    """``on_oom="split"``: every window starts halved ``halvings`` times; a window that runs
    out of memory (on any rank) is dropped, halved once more and run again.

    The Stepper asks three things of it: :meth:`prepare` (the window, halved as far as
    earlier windows needed), :meth:`run` (the retry around one attempt at the step), and
    :meth:`guard` / :meth:`window` (the agreement points inside the micro-batch loop).
    """

    def __init__(self, caps: Any, split_fn: SplitFn | None = None) -> None:
        """``caps``: the strategy's :class:`gradstep.parallel.Capabilities` (who agrees,
        and which modules' forwards communicate)."""
        self.split_fn = split_fn or split_in_half
        self.halvings = 0
        """How many times every micro-batch is halved before it runs (grows on OOM)."""
        self._caps = caps
        self._agreement = OOMAgreement(caps.agree_sum, caps.agree_ranks)

    def prepare(self, micro_batches: Any) -> list[Any]:
        return halve(list(micro_batches), self.split_fn, self.halvings)

    def run(
        self,
        micro_batches: list[Any],
        attempt: Callable[[list[Any]], Any],
        drop: Callable[[], None],
    ) -> Any:
        """``attempt(micro_batches)``, again on halved micro-batches after out-of-memory
        (``drop()`` first forgets the failed attempt); its result gets ``oom_splits``."""
        splits = 0
        while True:
            self._agreement.reset()
            try:
                stats = attempt(micro_batches)
                break
            except WindowOOM:
                drop()
                # Raised on every rank together, and decided together: give up when a rank
                # ran out in a one-item micro-batch (no split can help it); else every rank
                # halves, so that all windows keep the same length.
                if self._agreement.stuck() or self.halvings >= MAX_HALVINGS:
                    raise too_large_error(self.halvings, self._agreement.last_error) from None
                self.halvings += 1
                micro_batches = halve(micro_batches, self.split_fn, 1)
                splits += 1
        stats.oom_splits = splits
        return stats

    def guard(self, micro_batch: Any) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward, and its backward: see :class:`OOMAgreement`."""
        return self._agreement.guard(micro_batch)

    def window(self) -> contextlib.AbstractContextManager[None]:
        """Around the window's micro-batches: on several ranks, an agreement point before
        every forward that communicates (FSDP2's units, DDP broadcasting buffers)."""
        if self._caps.agree_ranks == 1:
            return contextlib.nullcontext()
        return self._agreement.before_forwards(self._caps.communicating_modules())
