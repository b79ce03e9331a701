"""The window's accounting: loss sums, item counts and auxiliary terms of its micro-batches.

Per micro-batch only references are kept (no tensor arithmetic, no host sync); at the end
of the window they are stacked once and summed over the ranks in the step's single
collective, then read in its single host sync together with the gradient norm.

With ``count=fn`` the window's global item count is known before the first backward
(:func:`plan_counts`, one all-reduce): that is what weighting an auxiliary term by
micro-batch needs. Its gradient must end up as ``mean(aux)`` over the window's M
micro-batches on all ranks while the loss sum is divided by the N items afterwards, so each
micro-batch backpropagates ``total + (N / M) * aux``.

Every micro-batch of every rank must return the same aux names. A rank checks its own
micro-batches, the single collective carries a fingerprint of each rank's names, and
every decision is taken on the reduced values, so all ranks raise together rather than
one raising while the others wait in a collective. On several ranks the aux sums
themselves are reduced in a second collective, once the names (so the vector lengths) are
known to agree.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .loss import LossSum, check_count
from .parallel import window_length_error

__all__ = ["CountPlan", "Tally", "Window", "plan_counts"]


@dataclass(frozen=True)
class CountPlan:
    """What ``count=fn`` said of the window, before its first forward."""

    counts: list[int]
    """Items of each of this rank's micro-batches."""
    items: int
    """Items of the whole window, on every rank."""
    micro_batches: int
    """Micro-batches of the whole window, on every rank."""

    @property
    def aux_weight(self) -> float:
        return self.items / self.micro_batches


def plan_counts(micro_batches: Sequence[Any], fn: Callable[[Any], int], strategy: Any) -> CountPlan:
    """Count every micro-batch with ``fn`` and sum over the ranks (one collective)."""
    counts = []
    for i, mb in enumerate(micro_batches):
        c = fn(mb)
        if isinstance(c, torch.Tensor) and c.dim() == 0 and _is_integer(c.dtype):
            c = int(c)
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise ValueError(
                f"count: fn(micro_batch) must return an int >= 0; micro-batch {i} gave {c!r}"
            )
        counts.append(c)
    local = torch.tensor([float(sum(counts)), float(len(counts))], dtype=torch.float64)
    items, n = strategy.all_reduce_sum(local).tolist()
    return CountPlan(counts, int(items), int(n))


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

    def __init__(self, plan: CountPlan | None) -> None:
        self.plan = plan
        self.totals: list[torch.Tensor] = []
        self.counts: list[Any] = []
        self.aux: dict[str, list[torch.Tensor]] = {}
        self.mixed: str | None = None
        """Why this rank's micro-batches disagree on the aux names (raised in read)."""
        self._aux_local: torch.Tensor | None = None
        self._strategy: Any = None

    def add(self, loss: LossSum) -> torch.Tensor:
        """Record one micro-batch's loss; return what its backward propagates."""
        self.totals.append(loss.total.detach())
        self.counts.append(loss.count)
        if not loss.aux and not self.aux:
            return loss.total
        return loss.total + self._weighted_aux(loss)

    def _weighted_aux(self, loss: LossSum) -> torch.Tensor:
        if self.plan is None:
            raise ValueError(
                "LossSum.aux needs the window's item count before the first backward: pass "
                "stepper.step(window, loss_fn, count=fn), fn(micro_batch) -> its items"
            )
        names = sorted(loss.aux)
        index = len(self.totals) - 1
        if index and names != sorted(self.aux) and self.mixed is None:
            # Raised in read(), after the collective, so that every rank raises together
            # (raising here would leave the other ranks waiting in theirs).
            self.mixed = (
                f"LossSum.aux names must be the same in every micro-batch of a window: "
                f"{sorted(self.aux)} before, {names} in micro-batch {index}"
            )
        for name in names:
            self.aux.setdefault(name, []).append(loss.aux[name].detach())
        if not names:
            return torch.zeros((), dtype=loss.total.dtype, device=loss.total.device)
        return sum(loss.aux[n] for n in names) * self.plan.aux_weight

    def reduce(self, strategy: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the window's sums over every rank, this rank's item count): one collective.

        The vector is [loss sum, items, negative counts, count mismatches, n, n^2, mixed
        aux names, aux names' fingerprint (6), *aux sums], built with as few small ops as
        the counts allow (each costs microseconds on a CPU, a launch on a GPU). On several
        ranks the aux sums are reduced in :meth:`read`, once every rank is known to have
        the same aux names (so the same vector length).
        """
        dev, f64 = self.totals[0].device, torch.float64
        self._strategy = strategy
        if self.plan is not None and any(c is None for c in self.counts):
            # LossSum.count None: the count comes from count(micro_batch), taken up front.
            pairs = zip(self.counts, self.plan.counts, strict=True)
            self.counts = [planned if c is None else c for c, planned in pairs]
        for c in self.counts:  # once per window, not between forward and backward
            check_count(c)
        want = self.plan.counts if self.plan is not None else None
        loss = torch.stack(self.totals).sum(dtype=f64).reshape(1)
        aux = [torch.stack(self.aux[k]).sum(dtype=f64).reshape(1) for k in sorted(self.aux)]
        if aux and strategy.world_size > 1:
            self._aux_local, aux = torch.cat(aux), []
        names = _fingerprint(sorted(self.aux)) if self.aux else _NO_AUX
        tail = [float(n), float(n * n), float(self.mixed is not None), *names]
        if all(isinstance(c, int) for c in self.counts):  # counted on the host
            wrong = sum(c != w for c, w in zip(self.counts, want, strict=True)) if want else 0
            host = [float(sum(self.counts)), 0.0, float(wrong), *tail]
            local = torch.cat([loss, torch.tensor(host, dtype=f64, device=dev), *aux])
            mine = local[1:2].clone()  # before the all-reduce, which may work in place
            return strategy.all_reduce_sum(local), mine
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
        return strategy.all_reduce_sum(torch.cat([*parts, *aux])), items

    def read(
        self,
        reduced: torch.Tensor,
        local_items: torch.Tensor,
        raw_norm: torch.Tensor,
        n: int,
        world: int,
    ) -> Window:
        """The step's one host sync; raises on a window-length, count, sign or aux-name
        error (on every rank alike: each decision is taken on the reduced values)."""
        norm = raw_norm.reshape(1).to(reduced)
        values = torch.cat([reduced, norm, local_items.reshape(1)]).tolist()
        loss, count, neg, mismatch, n_sum, n2_sum, mixed = values[:7]
        aux_sums, (raw, mine) = values[_HEAD:-2], values[-2:]
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
        if self._aux_local is not None:  # several ranks, every one with these names
            aux_sums = self._strategy.all_reduce_sum(self._aux_local).tolist()
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
