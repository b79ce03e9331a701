"""The window's accounting: loss sums, item counts and auxiliary terms of its micro-batches.

Per micro-batch only references are kept (no tensor arithmetic, no host sync); at the end
of the window they are stacked once and summed over the ranks in the step's single
collective, then read in its single host sync together with the gradient norm.

With ``count=fn`` the window's global item count is known before the first backward
(:func:`plan_counts`, one all-reduce): that is what weighting an auxiliary term by
micro-batch needs. Its gradient must end up as ``mean(aux)`` over the window's M
micro-batches on all ranks while the loss sum is divided by the N items afterwards, so each
micro-batch backpropagates ``total + (N / M) * aux``.
"""

from __future__ import annotations

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
        if isinstance(c, torch.Tensor) and c.dim() == 0 and not c.is_floating_point():
            c = int(c)
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise ValueError(
                f"count: fn(micro_batch) must return an int >= 0; micro-batch {i} gave {c!r}"
            )
        counts.append(c)
    local = torch.tensor([float(sum(counts)), float(len(counts))], dtype=torch.float64)
    items, n = strategy.all_reduce_sum(local).tolist()
    return CountPlan(counts, int(items), int(n))


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


class Tally:
    """Collects one window's micro-batch losses; see the module docs."""

    def __init__(self, plan: CountPlan | None) -> None:
        self.plan = plan
        self.totals: list[torch.Tensor] = []
        self.counts: list[Any] = []
        self.aux: dict[str, list[torch.Tensor]] = {}

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
        if self.totals[1:] and names != sorted(self.aux):
            raise ValueError(
                f"LossSum.aux names must be the same in every micro-batch of a window: "
                f"{sorted(self.aux)} before, {names} in micro-batch {len(self.totals) - 1}"
            )
        for name in names:
            self.aux.setdefault(name, []).append(loss.aux[name].detach())
        return sum(loss.aux[n] for n in names) * self.plan.aux_weight

    def reduce(self, strategy: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the window's sums over every rank, this rank's item count): one collective.

        The vector is [loss sum, items, negative counts, n, n^2, count mismatches, *aux
        sums], built with as few small ops as the counts allow (each costs microseconds
        on a CPU, a launch on a GPU).
        """
        dev, f64 = self.totals[0].device, torch.float64
        if self.plan is not None and any(c is None for c in self.counts):
            # LossSum.count None: the count comes from count(micro_batch), taken up front.
            pairs = zip(self.counts, self.plan.counts, strict=True)
            self.counts = [planned if c is None else c for c, planned in pairs]
        for c in self.counts:  # once per window, not between forward and backward
            check_count(c)
        want = self.plan.counts if self.plan is not None else None
        loss = torch.stack(self.totals).sum(dtype=f64).reshape(1)
        aux = [torch.stack(self.aux[k]).sum(dtype=f64).reshape(1) for k in sorted(self.aux)]
        if all(isinstance(c, int) for c in self.counts):  # counted on the host
            wrong = sum(c != w for c, w in zip(self.counts, want, strict=True)) if want else 0
            host = [float(sum(self.counts)), 0.0, float(n), float(n * n), float(wrong)]
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
            wrong = (counts != torch.tensor(want, device=dev)).sum(dtype=f64).reshape(1)
            parts += [torch.tensor([float(n), float(n * n)], dtype=f64, device=dev), wrong]
        else:
            parts.append(torch.tensor([float(n), float(n * n), 0.0], dtype=f64, device=dev))
        return strategy.all_reduce_sum(torch.cat([*parts, *aux])), items

    def read(
        self,
        reduced: torch.Tensor,
        local_items: torch.Tensor,
        raw_norm: torch.Tensor,
        n: int,
        world: int,
    ) -> Window:
        """The step's one host sync; raises on a window-length, count or sign error."""
        norm = raw_norm.reshape(1).to(reduced)
        values = torch.cat([reduced, norm, local_items.reshape(1)]).tolist()
        loss, count, neg, n_sum, n2_sum, mismatch = values[:6]
        aux_sums, (raw, mine) = values[6:-2], values[-2:]
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
        aux = {name: s / n_sum for name, s in zip(sorted(self.aux), aux_sums, strict=True)}
        return Window(loss, int(count), n, raw, aux, int(mine))
