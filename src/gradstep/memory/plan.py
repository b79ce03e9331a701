"""Choose micro-batch size, accumulation steps, activation checkpointing (and, when asked,
the loss's chunking) for a budget.

The global batch is fixed (it is part of the optimisation: changing it changes the
trajectory); only how each rank splits its share into micro-batches is chosen. Every
``(micro-batch size, checkpointing[, loss chunk])`` becomes a :class:`Candidate` with a
predicted peak per device and a predicted throughput; the plan is the fastest candidate
whose peak leaves ``margin`` of the budget free, near-ties decided by a fixed rule
(:data:`TIE`). The throughput comes from ``step_time``: for the command line a count of the
step's work (:mod:`gradstep.memory.speed`), never a timing, so that the same flags give the
same plan in every process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict

from .candidates import Candidate, Plan, loss_words
from .fit import _line
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
"""Step time with checkpointing / without in :func:`default_step_time`, for a caller with
no shapes to count (the command line counts them: :data:`gradstep.memory.speed.RECOMPUTE`,
1.45-1.6x measured on CPU): backward costs about two forwards, so one recomputed forward
adds a third."""

TIE = 0.03
"""Candidates within this fraction of the fastest predicted throughput are ties, decided by
a fixed rule: no checkpointing, then the first of ``loss_chunks`` (the run's own setting),
then the larger micro-batch. The prediction is a count of work, not a timing, so the rule
is not there to absorb noise (the same flags give the same numbers in every process) but
the model's own resolution: differences of a few percent are within its error, and the
rule then prefers what needs no recomputation and launches fewer micro-batches."""


class BudgetTooSmall(ValueError):
    """No candidate fits the budget; ``needed_bytes`` is the budget the message quotes:
    :func:`plan_step`'s ``budget_for`` of the candidate needing least (default: its
    predicted peak with the margin)."""

    def __init__(self, message: str, needed_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


def default_step_time(
    overhead_items: float = 1.0, checkpoint_factor: float = CHECKPOINT_FACTOR
) -> Callable[[int, bool], float]:
    """Time of one micro-batch without measurements: a fixed overhead worth
    ``overhead_items`` items (launches, Python, reading the weights) plus one unit per item;
    checkpointing multiplies both (the recomputed forward repeats launches and math)."""

    def step_time(mbs: int, checkpointing: bool, loss_chunk_tokens: int = 0) -> float:
        # The loss's chunking is not modelled: every candidate's loss costs the same.
        return (overhead_items + mbs) * (checkpoint_factor if checkpointing else 1.0)

    return step_time


def probe_step_time(
    probe: ProbeResult,
    checkpoint_factor: float = CHECKPOINT_FACTOR,
    probe_checkpointing: bool = False,
) -> Callable[[int, bool], float]:
    """Micro-batch time from a probe's time fit; the other checkpointing setting scaled."""

    def step_time(mbs: int, checkpointing: bool, loss_chunk_tokens: int = 0) -> float:
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
) -> Callable[..., int]:
    """``predict(mbs, checkpointing, loss_chunk_tokens=None)`` for :func:`plan_step`, from
    both sources (``loss_chunk_tokens``: a candidate's; None: ``estimate_kwargs``' setting,
    the one the probe ran).

    Without a probe: the analytic total (pass ``fixed_bytes`` for the runtime). With one:
    the probe's measured line, bent as the analytic model bends away from a line through
    the probe's sizes (:func:`_bend`), plus the analytic difference between the candidate
    and what the probe ran (checkpointing ``probe_checkpointing``; ``probe_accum_steps``
    micro-batches per step: 1 when ``run`` is one ``Stepper.step`` of one micro-batch, None
    when it is a bare forward/backward whose gradients stay allocated), so that one probe
    serves every candidate; plus ``extra_bytes`` for what ``run`` did not allocate
    (optimizer state when it did not step). ``per_rank_batch`` gives each candidate its
    accumulation steps.
    """

    ran = estimate_kwargs.get("loss_chunk_tokens", 0)

    def estimate(mbs: int, checkpointing: bool, steps: int | None, chunk: object) -> int:
        kwargs = {**estimate_kwargs, "loss_chunk_tokens": chunk}
        est = estimate_step_memory(
            shape,
            mbs,
            activation_checkpointing=checkpointing,
            accum_steps=steps,
            **kwargs,  # type: ignore[arg-type]
        )
        return est.total

    bend = None
    if probe is not None:
        bend = _bend(probe, lambda b: estimate(b, probe_checkpointing, probe_accum_steps, ran))

    def predict(mbs: int, checkpointing: bool, loss_chunk_tokens: int | None = None) -> int:
        steps = math.ceil(per_rank_batch / mbs) if per_rank_batch else None
        chunk = ran if loss_chunk_tokens is None else loss_chunk_tokens
        if probe is None or bend is None:
            return estimate(mbs, checkpointing, steps, chunk) + extra_bytes
        ran_here = estimate(mbs, probe_checkpointing, probe_accum_steps, ran)
        delta = estimate(mbs, checkpointing, steps, chunk) - ran_here
        measured = probe.predict(mbs) + bend(mbs, ran_here)
        return round(measured + delta + _shape_bytes(probe, mbs, per_rank_batch) + extra_bytes)

    return predict


def _bend(probe: ProbeResult, ran: Callable[[int], int]) -> Callable[[int, int], float]:
    """``(mbs, ran(mbs)) -> bytes``: how far the analytic model of what the probe ran lies
    from its own line through the probe's sizes (the same least squares as the probe's, or
    through its one size at the probe's cost per item). A line through 1-4 rows carries
    on what stops growing: a 1024-token loss chunk fills at 4 rows of 256, so a chunked
    loss's measured line over-predicted micro-batch 8 by 500 MiB at a 128k vocabulary;
    and an optimizer step that peaks above small micro-batches' backward hides their
    growth. Zero where the model is a line through those sizes."""
    sizes = sorted({b for b, _, _ in probe.points})
    if not sizes:  # a line given, not measured
        return lambda mbs, here: 0.0
    if len(sizes) == 1:
        b0 = sizes[0]
        at = ran(b0)
        return lambda mbs, here: here - at - probe.per_item_bytes * (mbs - b0)
    fixed, slope = _line(sizes, [ran(b) for b in sizes])
    return lambda mbs, here: here - (fixed + slope * mbs)


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


def _keys(
    per_rank: int,
    sizes: Sequence[int] | None,
    checkpointing: Sequence[bool],
    loss_chunks: Sequence[int] | None,
) -> tuple[list[tuple], list[tuple]]:
    """(every candidate's (mbs, checkpointing[, chunk]), the chunk settings as tuples)."""
    chunks = [()] if loss_chunks is None else [(c,) for c in dict.fromkeys(loss_chunks)]
    keys = [
        (mbs, ckpt, *chunk)
        for ckpt in dict.fromkeys(checkpointing)
        for chunk in chunks
        for mbs in _sizes(per_rank, sizes)
    ]
    return keys, chunks


def _sizes(per_rank: int, asked: Sequence[int] | None) -> list[int]:
    """The micro-batch sizes to weigh: ``asked`` (default: :func:`_default_sizes`) up to
    ``per_rank``."""
    asked = _default_sizes(per_rank) if asked is None else asked
    sizes = sorted({int(s) for s in asked if 1 <= s <= per_rank})
    if not sizes:
        raise ValueError(f"no micro-batch size in 1..{per_rank} (the per-rank batch) to plan")
    return sizes


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
    key: tuple,
    per_rank: int,
    predict: Callable[..., int],
    step_time: Callable[..., float],
    usable: float,
) -> tuple[Candidate, float]:
    """``key``: (mbs, checkpointing), with the loss chunk when it is planned."""
    mbs, rest = key[0], key[1:]
    steps = math.ceil(per_rank / mbs)
    last = per_rank - (steps - 1) * mbs
    peak = int(predict(mbs, *rest))
    seconds = (steps - 1) * step_time(mbs, *rest) + step_time(last, *rest)
    if last != mbs:
        peak = max(peak, int(predict(last, *rest)))
    chunk = rest[1] if len(rest) > 1 else None
    cand = Candidate(mbs, steps, rest[0], peak, 0.0, peak <= usable, last, seconds, chunk)
    return cand, per_rank / seconds


def _too_small(
    candidates: list[Candidate], budget: int, margin: float, budget_for: Callable[[Candidate], int]
) -> BudgetTooSmall:
    """The error when no candidate fits: the candidate the smallest budget holds, and that
    budget (``budget_for``)."""
    need, smallest = min((budget_for(c), c.key) for c in candidates)
    (cand,) = [c for c in candidates if c.key == smallest]
    return BudgetTooSmall(
        f"memory budget {format_bytes(budget)} is too small: with a {margin:.0%} safety "
        f"margin {format_bytes(budget * (1 - margin))} is usable, and the smallest candidate "
        f"(micro-batch {cand.micro_batch_size}, activation checkpointing "
        f"{'on' if cand.activation_checkpointing else 'off'}"
        f"{loss_words(cand.loss_chunk_tokens)}) needs "
        f"{format_bytes(cand.predicted_peak_bytes)} per device: a budget of at "
        f"least {budget_text(need)} fits it; or shorten the sequences, shrink the model",
        need,
    )


def plan_step(
    budget_bytes: int | str,
    global_batch: int,
    *,
    world_size: int = 1,
    predict: Callable[..., int],
    step_time: Callable[..., float] | None = None,
    margin: float = 0.1,
    micro_batch_sizes: Sequence[int] | None = None,
    checkpointing: Sequence[bool] = (False, True),
    loss_chunks: Sequence[int] | None = None,
    budget_for: Callable[[Candidate], int] | None = None,
) -> Plan:
    """The fastest split of the global batch whose predicted peak fits the budget.

    Each rank gets ``ceil(global_batch / world_size)`` items (the heaviest rank: FSDP2's
    collectives need every rank to run as many micro-batches), in ``ceil(per_rank / mbs)``
    micro-batches, the last possibly shorter: the global batch stays exact. A candidate
    fits when its predicted peak is at most ``budget * (1 - margin)``. ``loss_chunks``: also
    choose among these ``--loss-chunk-tokens`` (a third argument of ``predict`` and
    ``step_time``). Near-ties: :data:`TIE`. Nothing fits: :class:`BudgetTooSmall`, naming
    the budget that would (``budget_for`` of the candidate needing least; default: its
    predicted peak with the margin).
    """
    budget = parse_size(budget_bytes)
    _check(budget, global_batch, world_size, margin)
    per_rank = math.ceil(global_batch / world_size)
    timer = step_time if step_time is not None else default_step_time()
    keys, chunks = _keys(per_rank, micro_batch_sizes, checkpointing, loss_chunks)
    usable = budget * (1 - margin)
    scored = [_candidate(key, per_rank, predict, timer, usable) for key in keys]
    fitting = [(c, tp) for c, tp in scored if c.fits]
    if not fitting:
        need = budget_for or (lambda c: needed_budget(c.predicted_peak_bytes, margin))
        raise _too_small([c for c, _ in scored], budget, margin, need)
    chosen = _tie_rule(fitting, chunks)
    best_tp = max(tp for _, tp in fitting)
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
        timed=step_time is not None,
        loss_chunk_tokens=chosen.loss_chunk_tokens,
    )


def _tie_rule(fitting: list[tuple[Candidate, float]], chunks: list[tuple]) -> Candidate:
    """The fastest candidate that fits; among those within :data:`TIE` of it: no
    checkpointing, then the first loss setting of ``chunks``, then the larger micro-batch."""
    best_tp = max(tp for _, tp in fitting)
    near = [c for c, tp in fitting if tp >= best_tp * (1 - TIE)]
    order = {chunk[0] if chunk else None: i for i, chunk in enumerate(chunks)}
    return min(
        near,
        key=lambda c: (
            c.activation_checkpointing,
            order[c.loss_chunk_tokens],
            -c.micro_batch_size,
        ),
    )
