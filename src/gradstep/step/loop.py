"""Windows of micro-batches and their accounting: loss sums, item counts, auxiliary terms.

One window is one optimizer step. Per micro-batch the :class:`Tally` keeps only references
(no tensor arithmetic, no host sync); at the end of the window they are stacked once and
summed over the data-parallel ranks in the step's single collective, which also carries
the gradient norm's part where the strategy lets it (FSDP2: each rank's ``norm**p``), and
read in the step's single host sync.

With ``count=fn`` the window's global item count is known before the first backward
(:func:`plan_counts`, one collective; it also carries the window-length agreement that
FSDP2 needs before its first forward, and is read on the host only then). An auxiliary
term's gradient must end up as ``mean(aux)`` over the window's M micro-batches on all
ranks while the loss sum is divided by the N items afterwards, so each micro-batch
backpropagates ``total + (N / M) * aux``; ``N / M`` stays a device tensor.

Every micro-batch of every rank must return the same aux names. A rank checks its own
micro-batches, the collective carries a fingerprint of each rank's names, and every
decision is taken on the reduced values, so all ranks raise together rather than one
raising while the others wait in a collective. On several ranks the aux sums themselves
are reduced in a second collective, once the names (so the vector lengths) agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from ..parallel import Strategy, window_length_error
from .loss import LossSum, check_count, check_loss_sum

__all__ = [
    "NULL",
    "CountPlan",
    "Loop",
    "Tally",
    "Window",
    "check_micro_batches",
    "mark_last",
    "plan_counts",
    "windows",
]

NULL = contextlib.nullcontext()
"""The context of a feature that is off: one shared no-op."""

T = TypeVar("T")


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


def check_micro_batches(micro_batches: Any) -> None:
    """Refuse what is one batch, not a window of them. A tuple too: (inputs, targets) is
    the usual shape of ONE batch, and iterating it would run the inputs and the targets
    as two micro-batches."""
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


def _none(*_: Any) -> contextlib.AbstractContextManager[None]:
    return NULL


@dataclass
class Loop:
    """The micro-batch loop of one window, and what it enters, resolved once per window: a
    feature that is off costs the shared :data:`NULL` (each real context costs
    microseconds per micro-batch, which is what a small model's step is made of)."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], LossSum]
    precision: Any
    """The Stepper's :class:`gradstep.step.precision.Precision` (autocast, backward, buffers)."""
    mean_over_ranks: Callable[[Any], float]
    sync: Callable[[bool], Any] = _none
    """``sync(enabled)``, around a micro-batch's forward and backward (DDP ``no_sync``)."""
    sync_each: bool = False
    guard: Callable[[Any], Any] = _none
    """``guard(micro_batch)``, around its forward and, again, its backward (out-of-memory)."""
    autocast: Callable[[], Any] = _none
    observe: Callable[[int], Any] = _none
    """``observe(index)``, around a backward (hooks that see each micro-batch's gradient)."""
    final: Any = NULL
    """Around the last backward: the hooks that take the norm there."""
    around: Any = NULL
    """Around the whole window (out-of-memory agreement before communicating forwards)."""
    on_end: Sequence[Callable[[int, bool, LossSum], None]] = ()

    def run(self, micro_batches: Iterable[Any], tally: Tally) -> None:
        """Forward and backward every micro-batch; sync gradients only on the last."""
        n, model, precision = 0, self.model, self.precision
        with precision.accumulating(), self.around:
            for n, (is_last, mb) in enumerate(mark_last(micro_batches), start=1):  # noqa: B007
                with self.sync(is_last or self.sync_each):
                    with self.guard(mb), self.autocast():
                        loss = check_loss_sum(self.loss_fn(model, mb), count=False)
                    backprop, items = tally.add(loss)  # the loss sum (+ weighted aux terms)
                    if loss.count is None:  # hooks see the count step(count=fn) gave it
                        loss = LossSum(loss.total, items, loss.aux)
                    with self.guard(mb), self.observe(n - 1), self.final if is_last else NULL:
                        precision.backward(backprop, items, self.mean_over_ranks)
                for call in self.on_end:
                    call(n - 1, is_last, loss)
        if n == 0:
            raise ValueError("micro_batches is empty: a window needs at least one micro-batch")


@dataclass(frozen=True)
class CountPlan:
    """What ``count=fn`` said of the window, before its first forward."""

    counts: list[int]
    """Items of each of this rank's micro-batches."""
    items_per_micro_batch: torch.Tensor
    """Items / micro-batches of the whole window on every rank (0-dim float64, not read on
    the host until an auxiliary term needs it as its weight)."""


def plan_counts(
    micro_batches: Sequence[Any], fn: Callable[[Any], int], strategy: Strategy, agree: bool
) -> CountPlan:
    """Count every micro-batch with ``fn`` and sum over the ranks (one collective). With
    ``agree`` the collective also compares the ranks' window lengths, read on the host
    (raised on every rank before any forward); without, nothing is read."""
    counts = [_count(fn(mb), i) for i, mb in enumerate(micro_batches)]
    n = len(counts)
    local = torch.tensor([float(sum(counts)), float(n), float(n * n)], dtype=torch.float64)
    reduced = strategy.all_reduce_sum(local)
    if agree:
        error = window_length_error(n, *reduced[1:].tolist(), strategy.world_size)
        if error is not None:
            raise error
    return CountPlan(counts, reduced[0] / reduced[1])


def _count(c: Any, index: int) -> int:
    if isinstance(c, torch.Tensor) and c.dim() == 0 and _is_integer(c.dtype):
        c = int(c)
    if not isinstance(c, int) or isinstance(c, bool) or c < 0:
        raise ValueError(
            f"count: fn(micro_batch) must return an int >= 0; micro-batch {index} gave {c!r}"
        )
    return c


def _is_integer(dtype: torch.dtype) -> bool:
    """An integer dtype: not floating, complex or bool (a mask's ``any()`` is no count)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


@dataclass
class Window:
    """The window's totals over every rank, read in the step's one host sync."""

    loss_sum: float
    items: int
    micro_batches: int
    raw_norm: float
    """Global norm of the summed (not yet normalised) gradient."""
    aux: dict[str, float] = field(default_factory=dict)
    """Each auxiliary term's mean over the window's micro-batches on every rank."""
    local_items: int = 0
    """Items of this rank's micro-batches."""

    @property
    def loss(self) -> float:
        return self.loss_sum / self.items if self.items else math.nan

    def traps(self, world: int) -> list[tuple[str, str]]:
        """Silent traps that do not stop the step: (key, message) to warn about once."""
        out = []
        if not math.isfinite(self.loss) and self.items and math.isfinite(self.raw_norm):
            out.append((
                "loss",
                f"Stepper.step: the window's loss is {self.loss} but its gradient is finite: "
                "the loss sum includes a non-finite term that carries no gradient (e.g. a "
                "masked position's logit); the step is taken",
            ))  # fmt: skip
        if world > 1 and self.local_items == 0 and self.items > 0:
            out.append((
                "count",
                "Stepper.step: every micro-batch of this rank had LossSum.count 0 (every "
                "label ignored?): this rank contributed nothing to the step",
            ))  # fmt: skip
        return out


_HEAD = 13
"""Entries of the reduced vector before the aux sums: loss sum, items, negative counts,
count mismatches, n, n^2, windows with mixed aux names, and the aux names' fingerprint."""


def _fingerprint(names: Sequence[str]) -> list[float]:
    """Three 12-bit hashes of the aux names, each with its square: the ranks' names agree
    iff ``world * sum(f^2) == sum(f)^2`` for each (Cauchy-Schwarz), exact in float64 up
    to ~20000 ranks; different names pass all three by chance once in 2^36."""
    digest = hashlib.blake2b("\0".join(names).encode(), digest_size=6).digest()
    parts = [int.from_bytes(digest[2 * i : 2 * i + 2], "big") >> 4 for i in range(3)]
    return [v for f in parts for v in (float(f), float(f * f))]


_NO_AUX = _fingerprint(())


class Tally:
    """Collects one window's micro-batch losses; see the module docs."""

    def __init__(self, strategy: Strategy, plan: CountPlan | None = None) -> None:
        self.strategy = strategy
        self.plan = plan
        self.totals: list[torch.Tensor] = []
        self.counts: list[Any] = []
        self.aux: dict[str, list[torch.Tensor]] = {}
        self.mixed: str | None = None
        """Why this rank's micro-batches disagree on the aux names (raised in finish)."""
        self._aux_weight: float | None = None

    def add(self, loss: LossSum) -> tuple[torch.Tensor, Any]:
        """Record one micro-batch's loss; return what its backward propagates, and its
        count (``count(micro_batch)``'s when the loss left it to that)."""
        count = loss.count
        if count is None and self.plan is not None:
            count = self.plan.counts[len(self.totals)]
        self.totals.append(loss.total.detach())
        self.counts.append(count)
        if not loss.aux and not self.aux:
            return loss.total, count
        return loss.total + self._weighted_aux(loss), count

    def _weighted_aux(self, loss: LossSum) -> torch.Tensor:
        if self.plan is None:
            raise ValueError(
                "LossSum.aux needs the window's item count before the first backward: pass "
                "stepper.step(window, loss_fn, count=fn), fn(micro_batch) -> its items"
            )
        names = sorted(loss.aux)
        index = len(self.totals) - 1
        if index and names != sorted(self.aux) and self.mixed is None:
            # Raised in finish(), after the collective, so that every rank raises together
            # (raising here would leave the other ranks waiting in theirs).
            self.mixed = (
                f"LossSum.aux names must be the same in every micro-batch of a window: "
                f"{sorted(self.aux)} before, {names} in micro-batch {index}"
            )
        for name in names:
            self.aux.setdefault(name, []).append(loss.aux[name].detach())
        if not names:
            return torch.zeros((), dtype=loss.total.dtype, device=loss.total.device)
        if self._aux_weight is None:  # a Python float: the terms keep their dtype
            self._aux_weight = float(self.plan.items_per_micro_batch)
        return sum(loss.aux[n] for n in names) * self._aux_weight

    def finish(self, norm: torch.Tensor, norm_type: float, summed: bool) -> Window:
        """The window's totals over every rank: one collective, one host read. ``norm`` is
        this rank's gradient norm; ``summed``: its ``norm_type``-th power is to be summed
        over the ranks (a sharded gradient), else it is already the global norm. Raises
        on a window-length, count, sign or aux-name error, on every rank alike."""
        for c in self.counts:  # once per window; a sign on every rank, after the collective
            check_count(c, sign=False)
        local, mine = self._local_vector()
        if summed:
            local = torch.cat([local, norm.reshape(1).to(local) ** norm_type])
        reduced = self.strategy.all_reduce_sum(local)
        read = [reduced, mine] if summed else [reduced, norm.reshape(1).to(reduced), mine]
        values = torch.cat(read).tolist()
        if summed:
            values[-2] = values[-2] ** (1.0 / norm_type)
        return self._window(values[:-2], raw=values[-2], mine=values[-1])

    def _local_vector(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[loss sum, items, negative counts, count mismatches, n, n^2, mixed aux names,
        aux names' fingerprint (6), *aux sums on one process] and this rank's items, built
        with as few small ops as the counts allow (each costs microseconds on a CPU, a
        launch on a GPU)."""
        dev, f64, n = self.totals[0].device, torch.float64, len(self.totals)
        want = self.plan.counts if self.plan is not None else None
        loss = torch.stack(self.totals).sum(dtype=f64).reshape(1)
        # On several ranks the aux sums go in a second collective, once the names agree.
        aux = [self._aux_sums()] if self.aux and self.strategy.world_size == 1 else []
        names = _fingerprint(sorted(self.aux)) if self.aux else _NO_AUX
        tail = [float(n), float(n * n), float(self.mixed is not None), *names]
        if all(isinstance(c, int) for c in self.counts):  # counted on the host
            wrong = sum(c != w for c, w in zip(self.counts, want, strict=True)) if want else 0
            negative = sum(c < 0 for c in self.counts)
            host = [float(sum(self.counts)), float(negative), float(wrong), *tail]
            local = torch.cat([loss, torch.tensor(host, dtype=f64, device=dev), *aux])
            return local, local[1:2].clone()  # before the all-reduce, which may be in place
        if all(isinstance(c, torch.Tensor) for c in self.counts):
            counts = torch.stack(self.counts).to(dev)
        else:  # some ints, some tensors
            counts = torch.stack([torch.as_tensor(c, device=dev) for c in self.counts])
        items = counts.sum(dtype=f64).reshape(1)
        parts = [loss, items, (counts < 0).sum(dtype=f64).reshape(1)]
        if want is not None:
            parts.append((counts != torch.tensor(want, device=dev)).sum(dtype=f64).reshape(1))
        else:
            tail = [0.0, *tail]
        parts.append(torch.tensor(tail, dtype=f64, device=dev))
        return torch.cat([*parts, *aux]), items

    def _aux_sums(self) -> torch.Tensor:
        sums = [torch.stack(self.aux[k]).sum(dtype=torch.float64) for k in sorted(self.aux)]
        return torch.stack(sums)

    def _window(self, values: list[float], raw: float, mine: float) -> Window:
        loss, count, neg, mismatch, n_sum, n2_sum, mixed = values[:7]
        n, world = len(self.totals), self.strategy.world_size
        error = window_length_error(n, n_sum, n2_sum, world)
        if error is not None:
            raise error
        if neg > 0:
            raise ValueError("LossSum.count must be >= 0; loss_fn returned a negative count")
        if mismatch > 0:
            raise ValueError(
                f"LossSum.count differs from count(micro_batch) on {int(mismatch)} micro-batch(es) "
                "of this window: the two must agree (the auxiliary terms were weighted by "
                "count's total)"
            )
        self._check_aux_names(mixed, values[7:_HEAD], world)
        aux_sums = values[_HEAD:]
        if self.aux and world > 1:  # several ranks, every one with these names
            aux_sums = self.strategy.all_reduce_sum(self._aux_sums()).tolist()
        aux = {name: s / n_sum for name, s in zip(sorted(self.aux), aux_sums, strict=True)}
        return Window(loss, int(count), n, raw, aux, int(mine))

    def _check_aux_names(self, mixed: float, fingerprint: list[float], world: int) -> None:
        """Every micro-batch of every rank must return the same aux names: a term missing
        somewhere would make its mean one over fewer micro-batches than it says."""
        if self.mixed is not None:
            raise ValueError(self.mixed)
        mine = sorted(self.aux)
        if mixed > 0:
            raise ValueError(
                "LossSum.aux names must be the same in every micro-batch of a window: they "
                f"differ between the micro-batches of another rank (this rank's: {mine})"
            )
        pairs = zip(fingerprint[::2], fingerprint[1::2], strict=True)
        if any(world * squares != total * total for total, squares in pairs):
            raise ValueError(
                "LossSum.aux names must be the same on every rank: this rank's micro-batches "
                f"return {mine}, another rank's others; return every aux term from every "
                "micro-batch (a zero term where it does not apply)"
            )
