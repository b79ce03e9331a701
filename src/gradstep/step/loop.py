"""Windows of micro-batches, and the one loop that runs a window's forwards and backwards.

:class:`Loop` is built once per Stepper, with a context for each place a feature acts,
named for where it acts (around the window, the micro-batch, the forward, the backward,
and calls after each micro-batch). A feature that is off costs the shared :data:`NULL`
(each real context costs microseconds per micro-batch, which is what a small model's step
is made of). A strategy that runs the window itself (a pipeline schedule:
:class:`gradstep.parallel.RunsWindow`) is handed the loop and runs :meth:`Loop.one` for
each micro-batch in its own order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from .loss import LossSum, check_loss_sum
from .tally import Tally

__all__ = [
    "NULL",
    "Loop",
    "check_micro_batches",
    "compose",
    "mark_last",
    "off",
    "plain_backward",
    "windows",
]

NULL = contextlib.nullcontext()
"""The context of a feature that is off: one shared no-op."""

T = TypeVar("T")
Context = Callable[..., contextlib.AbstractContextManager[Any]]


def windows(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    """Group a stream of micro-batches into windows of ``size`` (the last may be shorter)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"windows: size must be an int >= 1, got {size!r}")
    return _windows(iter(iterable), size)


def _windows(it: Iterator[T], size: int) -> Iterator[list[T]]:
    while True:
        window = []
        for item in it:
            window.append(item)
            if len(window) == size:
                break
        if not window:
            return
        yield window
        if len(window) < size:
            return


def check_micro_batches(micro_batches: Any, count: Any = None) -> None:
    """Refuse what is one batch, not a window of them. A tuple too: (inputs, targets) is
    the usual shape of ONE batch, and iterating it would run the inputs and the targets
    as two micro-batches. ``count``: None or ``step(..., count=fn)``'s callable."""
    if count is not None and not callable(count):
        raise TypeError(f"count must be None or a callable, got {type(count).__name__}")
    if isinstance(micro_batches, (dict, torch.Tensor, tuple, str, bytes)) or not isinstance(
        micro_batches, Iterable
    ):
        raise TypeError(
            "micro_batches must be an iterable of micro-batches forming one window (a list "
            f"or a generator; not a tuple or a string), got a {type(micro_batches).__name__}; "
            "wrap a single batch in a list: stepper.step([batch], loss_fn)"
        )


def mark_last(iterable: Iterable[T]) -> Iterator[tuple[bool, T]]:
    """Yield (is_last, item), looking one ahead so the last is known before its forward."""
    it = iter(iterable)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield False, prev
        prev = item
    yield True, prev


def off(*_: Any) -> contextlib.AbstractContextManager[None]:
    """A context that is off, whatever it is called with."""
    return NULL


def compose(*contexts: Context | None) -> Context:
    """One context that enters each of ``contexts`` (None: a feature that is off), in
    order, with the same arguments: :func:`off` when all are off, the one that is on alone."""
    live = [c for c in contexts if c is not None]
    if not live:
        return off
    if len(live) == 1:
        return live[0]

    @contextlib.contextmanager
    def all_of(*args: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for context in live:
                stack.enter_context(context(*args))
            yield

    return all_of


def plain_backward(total: torch.Tensor, count: Any) -> None:
    """Backpropagate a loss sum as it is (no fp16 loss scale, no pre-scale)."""
    total.backward()


@dataclass(frozen=True)
class Loop:
    """The micro-batch loop of a Stepper, and the contexts each micro-batch enters."""

    model: nn.Module
    around_window: Callable[[], contextlib.AbstractContextManager[Any]]
    """Around the whole window: float32 accumulation buffers, out-of-memory agreement
    before each communicating forward."""
    around_micro_batch: Callable[[Any, bool], contextlib.AbstractContextManager[Any]]
    """``(micro_batch, is_last)``, around its forward and backward: the strategy's gradient
    sync (on the last only); yields the micro-batch to run."""
    around_forward: Context
    """``(micro_batch)``: out-of-memory guard, autocast."""
    around_backward: Context
    """``(micro_batch, index)``: out-of-memory guard, hooks lent each gradient."""
    backward: Callable[[torch.Tensor, Any], None]
    """``(loss sum, its count)``: the backward itself (fp16: pre-scaled and scaled)."""
    after_micro_batch: Sequence[Callable[[int, bool, LossSum], None]] = ()
    """Hooks' ``on_micro_batch_end``."""
    sync_each: bool = False
    """Reduce after every micro-batch, not only the last (``sync_each_micro_batch``)."""
    run_window: Callable[..., None] | None = None
    """A strategy's own schedule for the window (``RunsWindow.run_window``)."""

    def run(
        self, micro_batches: Iterable[Any], loss_fn: Callable, tally: Tally, final: Any
    ) -> None:
        """Forward and backward every micro-batch; sync gradients only on the last.
        ``final``: the context around the last backward (the norm taken there)."""
        with self.around_window():
            if self.run_window is not None:
                self.run_window(self, micro_batches, tally, loss_fn, final)
            else:
                for n, (is_last, mb) in enumerate(mark_last(micro_batches)):  # noqa: B007
                    self.one(n, mb, is_last, loss_fn, tally, final if is_last else NULL)
        if not tally.totals:
            raise ValueError("micro_batches is empty: a window needs at least one micro-batch")

    def one(
        self, index: int, mb: Any, is_last: bool, loss_fn: Callable, tally: Tally, final: Any
    ) -> LossSum:
        """One micro-batch: forward, its loss into the tally, backward."""
        with self.around_micro_batch(mb, is_last or self.sync_each) as mb:
            with self.around_forward(mb):
                loss = check_loss_sum(loss_fn(self.model, mb), tally.plan is None, sign=False)
            backprop, items = tally.add(loss)  # the loss sum (+ weighted aux terms)
            if loss.count is None:  # hooks see the count step(count=fn) gave it
                loss = LossSum(loss.total, items, loss.aux)
            with self.around_backward(mb, index), final:
                self.backward(backprop, items)
        for call in self.after_micro_batch:
            call(index, is_last, loss)
        return loss
