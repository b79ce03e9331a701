"""The window's accounting: loss sums, item counts, auxiliary terms, in one collective.

One window is one optimizer step. Per micro-batch the :class:`Tally` keeps only references
(no tensor arithmetic, no host sync); at the end of the window they are stacked once into
one vector of named slots (:class:`Slots`), summed over the data-parallel ranks in the
step's single collective, which also carries this rank's part of the gradient norm where
the layout sums it (FSDP2: ``norm**p``), and read in the step's single host sync.

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

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..parallel import Strategy, window_length_error
from .loss import LossSum

__all__ = ["CountPlan", "Slots", "Tally", "Window", "plan_counts"]


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
    loss: float = math.nan
    """The window's mean loss: ``loss_sum / items``."""
    traps: list[tuple[str, str]] = field(default_factory=list)
    """Silent traps that do not stop the step: (key, message) to warn about once."""


def _traps(window: Window, world: int) -> list[tuple[str, str]]:
    out = []
    if not math.isfinite(window.loss) and window.items and math.isfinite(window.raw_norm):
        out.append((
            "loss",
            f"Stepper.step: the window's loss is {window.loss} but its gradient is finite: "
            "the loss sum includes a non-finite term that carries no gradient (e.g. a "
            "masked position's logit); the step is taken",
        ))  # fmt: skip
    if world > 1 and window.local_items == 0 and window.items > 0:
        out.append((
            "count",
            "Stepper.step: every micro-batch of this rank had LossSum.count 0 (every "
            "label ignored?): this rank contributed nothing to the step",
        ))  # fmt: skip
    return out


@dataclass(frozen=True)
class Slots:
    """Named places in the window's reduced vector, in order: name -> (offset, length)."""

    at: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, parts: dict[str, torch.Tensor]) -> Slots:
        at, offset = {}, 0
        for name, part in parts.items():
            at[name] = (offset, part.numel())
            offset += part.numel()
        return cls(at)

    def read(self, values: list[float]) -> dict[str, Any]:
        """Each slot's values: a float for a one-entry slot, else a list."""
        return {
            name: values[o] if n == 1 else values[o : o + n] for name, (o, n) in self.at.items()
        }


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
        world = self.strategy.world_size
        parts = self._local_parts()
        mine = parts.pop("mine")
        norm64 = norm.reshape(1).to(parts["loss"])
        if summed:
            parts["norm"] = norm64**norm_type
        local = torch.cat(list(parts.values()))
        reduced = self.strategy.all_reduce_sum(local) if world > 1 else local
        if not summed:  # already the global norm: read in the same host read, unreduced
            parts["norm"] = norm64
            reduced = torch.cat([reduced, norm64])
        parts["mine"] = mine
        got = Slots.of(parts).read(torch.cat([reduced, mine]).tolist())
        if summed:
            got["norm"] = got["norm"] ** (1.0 / norm_type)
        return self._window(got)

    def _local_parts(self) -> dict[str, torch.Tensor]:
        """This rank's slots (and ``mine``, its own items, which is not reduced), built with
        as few small ops as the counts allow (each costs microseconds on a CPU, a launch on
        a GPU)."""
        dev, f64, n = self.totals[0].device, torch.float64, len(self.totals)
        want = self.plan.counts if self.plan is not None else None
        parts = {"loss": torch.stack(self.totals).sum(dtype=f64).reshape(1)}
        names = _fingerprint(sorted(self.aux)) if self.aux else _NO_AUX
        tail = [float(n), float(n * n), float(self.mixed is not None), *names]
        if all(isinstance(c, int) for c in self.counts):  # counted on the host
            wrong = sum(c != w for c, w in zip(self.counts, want, strict=True)) if want else 0
            negative = sum(c < 0 for c in self.counts)
            host = [float(sum(self.counts)), float(negative), float(wrong), *tail]
            parts["counts"] = torch.tensor(host, dtype=f64, device=dev)
            mine = parts["counts"][:1]  # the collective runs on a concatenated copy
        else:
            counts = torch.stack([torch.as_tensor(c, device=dev) for c in self.counts])
            items = counts.sum(dtype=f64).reshape(1)
            wrong = (
                (counts != torch.tensor(want, device=dev)).sum(dtype=f64).reshape(1)
                if want is not None
                else torch.zeros(1, dtype=f64, device=dev)
            )
            head = [items, (counts < 0).sum(dtype=f64).reshape(1), wrong]
            parts["counts"] = torch.cat([*head, torch.tensor(tail, dtype=f64, device=dev)])
            mine = items
        if self.aux and self.strategy.world_size == 1:  # several ranks: a second collective
            parts["aux"] = self._aux_sums()
        parts["mine"] = mine
        return parts

    def _aux_sums(self) -> torch.Tensor:
        sums = [torch.stack(self.aux[k]).sum(dtype=torch.float64) for k in sorted(self.aux)]
        return torch.stack(sums)

    def _window(self, got: dict[str, Any]) -> Window:
        count, neg, mismatch, n_sum, n2_sum, mixed, *names = got["counts"]
        n, world = len(self.totals), self.strategy.world_size
        error = window_length_error(n, n_sum, n2_sum, world) if world > 1 else None
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
        self._check_aux_names(mixed, names, world)  # also on a rank without aux terms
        aux: dict[str, float] = {}
        if self.aux:
            sums = got["aux"] if world == 1 else self.strategy.all_reduce_sum(self._aux_sums())
            sums = [sums] if isinstance(sums, float) else sums
            aux = {k: float(s) / n_sum for k, s in zip(sorted(self.aux), sums, strict=True)}
        loss = got["loss"] / count if count else math.nan
        window = Window(got["loss"], int(count), n, got["norm"], aux, int(got["mine"]), loss)
        window.traps = _traps(window, world)
        return window

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
