"""Choose micro-batch size, accumulation steps and activation checkpointing for a budget.

The global batch is fixed (it is part of the optimisation: changing it changes the
trajectory); only how each rank splits its share into micro-batches is chosen. Every
``(micro-batch size, checkpointing)`` pair becomes a :class:`Candidate` with a predicted
peak per device and a predicted throughput; the plan is the fastest candidate whose peak
leaves ``margin`` of the budget free. Checkpointing costs about one extra forward per
micro-batch, so it is chosen only when no candidate without it fits or it is faster
(a larger micro-batch it enables can amortise a big per-micro-batch overhead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from .model import Shape, estimate_step_memory
from .probe import ProbeResult
from .units import format_bytes, parse_size

__all__ = [
    "BudgetTooSmall",
    "Candidate",
    "Plan",
    "budget_text",
    "needed_budget",
    "default_step_time",
    "plan_step",
    "probe_step_time",
    "step_predictor",
    "sweep_widths",
]

CHECKPOINT_FACTOR = 4 / 3
"""Step time with checkpointing / without when nothing is measured: backward costs about
two forwards, so one recomputed forward adds a third. An upper estimate; calibrated on CPU,
torch 2.13, the demo GPT, which measured 1.15 (bench/memory.py), its backward costing more
than two forwards."""

TIE = 0.1
"""Candidates within this fraction of the fastest predicted throughput are ties, decided by
a fixed rule (no checkpointing, then the larger micro-batch), not by the timings: on a
shared CPU the probe's timings move by more than that from run to run, and ``gradstep
plan`` and ``train --micro-batch-size auto`` must choose the same plan for the same flags."""


class BudgetTooSmall(ValueError):
    """No candidate fits the budget; ``needed_bytes`` is the smallest budget that would
    hold the smallest candidate with the margin."""

    def __init__(self, message: str, needed_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


@dataclass(frozen=True)
class Candidate:
    micro_batch_size: int
    accum_steps: int
    activation_checkpointing: bool
    predicted_peak_bytes: int
    relative_throughput: float
    """Items per second relative to the fastest candidate that fits (1.0 = the best; above
    1 for faster candidates that do not fit: what the budget costs)."""
    fits: bool
    last_micro_batch_size: int
    """The last micro-batch of a rank's window: shorter when ``mbs`` does not divide it."""
    step_seconds: float
    """Predicted time of one optimizer step (in the units of ``step_time``)."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    micro_batch_size: int
    accum_steps: int
    activation_checkpointing: bool
    predicted_peak_bytes: int
    budget_bytes: int
    global_batch: int
    candidates: list[Candidate] = field(default_factory=list)
    world_size: int = 1
    margin: float = 0.1
    per_rank_batch: int = 0
    last_micro_batch_size: int = 0
    timed: bool = True
    """False when the step times are not measured (a one-size probe, or none): the speed
    column then only reflects the default step-time model, and the table leaves it out."""
    tp: int = 1
    """Tensor-parallel ranks per data-parallel rank: ``world_size`` counts the data-parallel
    ranks the global batch is split over, each of them ``tp`` devices."""
    probe_peak_bytes: int = 0
    """The highest peak the probe reached in this process (0: no probe). A run that plans
    itself (``--micro-batch-size auto``) probes first, so its process peaks at
    :attr:`process_peak_bytes`; a run given the choice by hand at the prediction."""

    @property
    def process_peak_bytes(self) -> int:
        """The peak of a process that probes, then trains at this plan."""
        return max(self.predicted_peak_bytes, self.probe_peak_bytes)

    def to_json(self) -> dict:
        """Plain JSON types; ``candidates`` as dicts."""
        out = asdict(self)
        out["candidates"] = [c.to_json() for c in self.candidates]
        out["process_peak_bytes"] = self.process_peak_bytes
        return out

    def _row(self, c: Candidate) -> tuple[str, ...]:
        chosen = (c.micro_batch_size, c.activation_checkpointing) == (
            self.micro_batch_size,
            self.activation_checkpointing,
        )
        return (
            "*" if chosen else "",
            str(c.micro_batch_size),
            str(c.accum_steps),
            str(c.last_micro_batch_size),
            "on" if c.activation_checkpointing else "off",
            format_bytes(c.predicted_peak_bytes),
            f"{c.predicted_peak_bytes / self.budget_bytes:.0%}",
            f"{c.relative_throughput:.2f}" if self.timed else "-",
            "yes" if c.fits else "no",
        )

    def table(self) -> str:
        """The candidates as an aligned text table, the chosen row marked ``*``."""
        usable = self.budget_bytes * (1 - self.margin)
        ranks = "rank(s)" if self.tp == 1 else f"data-parallel rank(s) x {self.tp} tensor-parallel"
        head = (
            f"budget {format_bytes(self.budget_bytes)} per device, margin {self.margin:.0%} "
            f"-> {format_bytes(usable)} usable; global batch {self.global_batch} over "
            f"{self.world_size} {ranks} = {self.per_rank_batch} per rank"
        )
        cols = ("", "mbs", "accum", "last", "ckpt", "peak/device", "of budget", "speed", "fits")
        order = sorted(
            self.candidates, key=lambda c: (c.activation_checkpointing, c.micro_batch_size)
        )
        rows = [self._row(c) for c in order]
        widths = [max(len(r[i]) for r in (cols, *rows)) for i in range(len(cols))]
        lines = [head, "  ".join(h.rjust(w) for h, w in zip(cols, widths, strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
        if not self.timed:
            lines.append(
                "speed: not measured (one probe size, or no probe); among the candidates "
                "that fit, the largest micro-batch without checkpointing is chosen"
            )
        lines.append(
            f"chosen: micro-batch {self.micro_batch_size} x {self.accum_steps} accumulation "
            f"steps (last {self.last_micro_batch_size}), activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}, predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)}"
        )
        if self.probe_peak_bytes > self.predicted_peak_bytes:
            lines.append(
                f"the probe itself peaked at {format_bytes(self.probe_peak_bytes)}: a run that "
                "plans itself (--micro-batch-size auto) peaks there"
            )
        return "\n".join(lines)


def default_step_time(
    overhead_items: float = 1.0, checkpoint_factor: float = CHECKPOINT_FACTOR
) -> Callable[[int, bool], float]:
    """Time of one micro-batch without measurements: a fixed overhead worth
    ``overhead_items`` items (launches, Python, reading the weights) plus one unit per item;
    checkpointing multiplies both (the recomputed forward repeats launches and math)."""

    def step_time(mbs: int, checkpointing: bool) -> float:
        return (overhead_items + mbs) * (checkpoint_factor if checkpointing else 1.0)

    return step_time


def probe_step_time(
    probe: ProbeResult,
    checkpoint_factor: float = CHECKPOINT_FACTOR,
    probe_checkpointing: bool = False,
) -> Callable[[int, bool], float]:
    """Micro-batch time from a probe's time fit; the other checkpointing setting scaled."""

    def step_time(mbs: int, checkpointing: bool) -> float:
        t = probe.predict_seconds(mbs)
        if checkpointing == probe_checkpointing:
            return t
        return t * checkpoint_factor if checkpointing else t / checkpoint_factor

    return step_time


def step_predictor(
    shape: Shape,
    *,
    probe: ProbeResult | None = None,
    probe_checkpointing: bool = False,
    probe_accum_steps: int | None = 1,
    per_rank_batch: int | None = None,
    extra_bytes: int = 0,
    **estimate_kwargs: object,
) -> Callable[[int, bool], int]:
    """``predict(mbs, checkpointing)`` for :func:`plan_step`, from both sources.

    Without a probe: the analytic total (pass ``fixed_bytes`` for the runtime). With one:
    the probe's measured line, plus the analytic difference between the candidate and what
    the probe ran (checkpointing ``probe_checkpointing``; ``probe_accum_steps`` micro-batches
    per step: 1 when ``run`` is one ``Stepper.step`` of one micro-batch, None when it is a
    bare forward/backward whose gradients stay allocated), so that one probe serves every
    candidate; plus ``extra_bytes`` for what ``run`` did not allocate (optimizer state when
    it did not step). ``per_rank_batch`` gives each candidate its accumulation steps.
    """

    def estimate(mbs: int, checkpointing: bool, steps: int | None) -> int:
        est = estimate_step_memory(
            shape,
            mbs,
            activation_checkpointing=checkpointing,
            accum_steps=steps,
            **estimate_kwargs,  # type: ignore[arg-type]
        )
        return est.total

    def predict(mbs: int, checkpointing: bool) -> int:
        steps = math.ceil(per_rank_batch / mbs) if per_rank_batch else None
        if probe is None:
            return estimate(mbs, checkpointing, steps) + extra_bytes
        delta = estimate(mbs, checkpointing, steps) - estimate(
            mbs, probe_checkpointing, probe_accum_steps
        )
        return probe.predict(mbs) + delta + _shape_bytes(probe, mbs, per_rank_batch) + extra_bytes

    return predict


def _shape_bytes(probe: ProbeResult, mbs: int, per_rank_batch: int | None) -> int:
    """What input shapes beyond the probe's one keep resident (CPU kernel caches).

    With a shape sweep: its measurement (any number of shapes, the caches bounded), or its
    charge when the budget stopped it before the first shape. Without: a short last
    micro-batch is one more shape.
    """
    if probe.shapes_run or probe.shapes_unmeasured:
        return probe.shape_bytes
    return probe.per_shape_bytes if per_rank_batch and per_rank_batch % mbs else 0


def sweep_widths(seq_len: int, n: int, lengths: Sequence[int] | None = None) -> list[int]:
    """``n`` distinct row lengths below the longest for a probe's shape sweep, spread over
    what the data yields: ``lengths`` (the rows of one epoch), else any length from 1 to
    ``seq_len``."""
    if lengths:
        longest = max(lengths)
        shorter = sorted(set(lengths) - {longest})
        if len(shorter) <= n:
            return shorter or [longest]
        return sorted({shorter[(len(shorter) - 1) * k // (n - 1)] for k in range(n)})
    widths = sorted({max(1, seq_len * (k + 1) // (n + 1)) for k in range(n)} - {seq_len})
    return widths or [seq_len]


def needed_budget(peak_bytes: float, margin: float) -> int:
    """The smallest budget whose usable part (``1 - margin`` of it) holds ``peak_bytes``."""
    return math.ceil(peak_bytes / (1 - margin))


def budget_text(n_bytes: float) -> str:
    """``n_bytes`` rounded UP to 0.1 MiB, as ``--memory-budget`` accepts it (``"386.5MiB"``):
    a budget read off a message must hold what the message said."""
    return f"{math.ceil(n_bytes * 10 / 2**20) / 10:.1f}MiB"


def _default_sizes(per_rank: int) -> list[int]:
    """Powers of two up to ``per_rank`` and every exact divisor of it."""
    sizes = {1 << k for k in range(per_rank.bit_length()) if 1 << k <= per_rank}
    for d in range(1, math.isqrt(per_rank) + 1):
        if per_rank % d == 0:
            sizes |= {d, per_rank // d}
    return sorted(sizes)


def _check(budget: int, global_batch: int, world_size: int, margin: float) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be an int >= 1, got {global_batch!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size > global_batch:
        raise ValueError(
            f"global_batch {global_batch} is smaller than world_size {world_size}: "
            "every rank needs at least one item"
        )
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")


def _candidate(
    mbs: int,
    checkpointing: bool,
    per_rank: int,
    predict: Callable[[int, bool], int],
    step_time: Callable[[int, bool], float],
    usable: float,
) -> tuple[Candidate, float]:
    steps = math.ceil(per_rank / mbs)
    last = per_rank - (steps - 1) * mbs
    peak = int(predict(mbs, checkpointing))
    seconds = (steps - 1) * step_time(mbs, checkpointing) + step_time(last, checkpointing)
    if last != mbs:
        peak = max(peak, int(predict(last, checkpointing)))
    cand = Candidate(mbs, steps, checkpointing, peak, 0.0, peak <= usable, last, seconds)
    return cand, per_rank / seconds


def _too_small(candidates: list[Candidate], budget: int, margin: float) -> BudgetTooSmall:
    """The error when no candidate fits: the smallest one, and the budget that holds it."""
    smallest = min(candidates, key=lambda c: c.predicted_peak_bytes)
    need = needed_budget(smallest.predicted_peak_bytes, margin)
    return BudgetTooSmall(
        f"memory budget {format_bytes(budget)} is too small: with a {margin:.0%} safety "
        f"margin {format_bytes(budget * (1 - margin))} is usable, and the smallest candidate "
        f"(micro-batch {smallest.micro_batch_size}, activation checkpointing "
        f"{'on' if smallest.activation_checkpointing else 'off'}) needs "
        f"{format_bytes(smallest.predicted_peak_bytes)} per device: a budget of at "
        f"least {budget_text(need)} fits it (that peak with the {margin:.0%} margin); "
        "or shorten the sequences, shrink the model",
        need,
    )


def plan_step(
    budget_bytes: int | str,
    global_batch: int,
    *,
    world_size: int = 1,
    predict: Callable[[int, bool], int],
    step_time: Callable[[int, bool], float] | None = None,
    margin: float = 0.1,
    micro_batch_sizes: Sequence[int] | None = None,
    checkpointing: Sequence[bool] = (False, True),
) -> Plan:
    """The fastest split of the global batch whose predicted peak fits the budget.

    Each rank gets ``ceil(global_batch / world_size)`` items (the heaviest rank; all ranks
    run the same number of micro-batches, as FSDP2's per-forward collectives need), split
    into ``accum_steps = ceil(per_rank / mbs)`` micro-batches, the last possibly shorter,
    so the global batch stays exact. A candidate fits when its predicted peak is at most
    ``budget * (1 - margin)``. Ties in throughput go to no checkpointing, then to the
    larger micro-batch, and so do candidates within :data:`TIE` of the fastest. Raises
    ValueError naming the memory budget, and the budget that would fit, when nothing fits.
    """
    budget = parse_size(budget_bytes)
    _check(budget, global_batch, world_size, margin)
    per_rank = math.ceil(global_batch / world_size)
    asked = _default_sizes(per_rank) if micro_batch_sizes is None else micro_batch_sizes
    sizes = sorted({int(s) for s in asked if 1 <= s <= per_rank})
    if not sizes:
        raise ValueError(f"no micro-batch size in 1..{per_rank} (the per-rank batch) to plan")
    timer = step_time if step_time is not None else default_step_time()
    usable = budget * (1 - margin)
    scored = [
        _candidate(mbs, ckpt, per_rank, predict, timer, usable)
        for ckpt in dict.fromkeys(checkpointing)
        for mbs in sizes
    ]
    fitting = [(c, tp) for c, tp in scored if c.fits]
    if not fitting:
        raise _too_small([c for c, _ in scored], budget, margin)
    best_tp = max(tp for _, tp in fitting)
    near = [c for c, tp in fitting if tp >= best_tp * (1 - TIE)]
    chosen = min(near, key=lambda c: (c.activation_checkpointing, -c.micro_batch_size))
    candidates = [
        Candidate(**{**asdict(c), "relative_throughput": tp / best_tp}) for c, tp in scored
    ]
    return Plan(
        micro_batch_size=chosen.micro_batch_size,
        accum_steps=chosen.accum_steps,
        activation_checkpointing=chosen.activation_checkpointing,
        predicted_peak_bytes=chosen.predicted_peak_bytes,
        budget_bytes=budget,
        global_batch=global_batch,
        candidates=candidates,
        world_size=world_size,
        margin=margin,
        per_rank_batch=per_rank,
        last_micro_batch_size=chosen.last_micro_batch_size,
    )
