"""Measure instead of estimate: peak memory of real micro-batches, fitted as fixed + per item.

``probe_memory(run, sizes)`` calls ``run(b)`` (one forward + backward, or one whole
``Stepper.step``, of a micro-batch of ``b`` items: the caller builds it) for a few growing
``b`` and reads the peak after each: on CUDA the caching allocator's
``max_memory_allocated`` (reset with ``reset_peak_memory_stats``), on CPU the process's peak
RSS, ``VmHWM``, which Linux resets to the current RSS when ``5`` is written to
``/proc/self/clear_refs``. Each size runs once unmeasured first (one-time costs), then
measured. A least-squares line through ``(b, peak)`` on CPU, or through
``(b, peak - bytes allocated before)`` on CUDA (see ``_fit_mode``), gives the cost per item
and the fixed cost (runtime, model, optimizer state).

A budget is a promise for the whole process, the probe included: before each size the
probe predicts that size's peak from what it has measured so far and stops instead of
running a size that would not fit.

CPU caveat: glibc's malloc raises its mmap threshold after large frees (up to 32 MiB), so
later tensors come from heap arenas that are not given back, and the peak RSS then depends
on the allocation history as much as on the live tensors (+40% after a few steps of the
demo model). :func:`pin_mmap_threshold` fixes the threshold: tensors above it are mapped
and unmapped, and RSS follows the live bytes. oneDNN (bf16 on CPU) also keeps compiled
kernels per input shape: :func:`bound_kernel_caches` bounds them, and the probe's shape
sweep measures what they hold when full.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .fit import _fit_bytes, _fit_mode, _fit_seconds, _predict_next
from .probe_result import ProbeResult
from .process import (
    KERNEL_CACHE_CAPACITY,
    _device,
    _is_cuda,
    bound_kernel_caches,
    current_bytes,
    peak_bytes,
    pin_mmap_threshold,
    reset_peak,
    runtime_bytes,
)
from .units import format_bytes

__all__ = [
    "KERNEL_CACHE_CAPACITY",
    "SHAPE_GUESS_BYTES",
    "ProbeResult",
    "bound_kernel_caches",
    "current_bytes",
    "peak_bytes",
    "pin_mmap_threshold",
    "probe_memory",
    "reset_peak",
    "runtime_bytes",
]

SHAPE_GUESS_BYTES = 16 * 2**20
"""CPU: what a new input shape's kernels may leave resident before any was measured (~12
MiB while oneDNN's bounded caches fill, bf16 demo GPT, torch 2.13; fp32 less). The shape
sweep's first shape, and a size after a one-size probe, leave room for it."""

SHAPE_SETTLED_BYTES = 2 * 2**20
"""A new input shape that leaves less than this resident does not grow the kernel caches
any more (two in a row end the probe's shape sweep). Calibrated on CPU, torch 2.13, the
demo GPT, where a new shape adds ~12 MiB while oneDNN's kernel caches fill
(docs/library/memory.md)."""


def _timed_peak(
    run: Callable[[int], None], b: int, dev: torch.device
) -> tuple[tuple[int, int, float], int]:
    """``((b, peak, seconds), bytes in use just before)`` of one call of ``run(b)``.

    Seconds are wall time on CUDA (synchronized), and this process's CPU time on CPU: the
    probe only compares sizes with each other, and CPU time does not count the time other
    processes on a shared machine take the cores away (wall times of the same run varied
    6x on the 2-core test machine).
    """
    cuda = _is_cuda(dev)
    clock = time.perf_counter if cuda else time.process_time
    reset_peak(dev)
    before = current_bytes(dev)
    t0 = clock()
    run(b)
    if cuda:
        torch.cuda.synchronize(dev)
    return (b, peak_bytes(dev), clock() - t0), before


def _budget_error(
    budget: int | None, baseline: int, first: int, estimate: Callable[[int], int] | None
) -> str | None:
    """Why probing must not start under ``budget`` (None: it may)."""
    if budget is None:
        return None
    if baseline > budget:
        return (
            f"memory budget {format_bytes(budget)} is already exceeded before probing: "
            f"this process uses {format_bytes(baseline)} (interpreter, torch, data) before "
            "building the model; the budget must hold that plus the training step"
        )
    if estimate is not None and estimate(first) > budget:
        return (
            f"memory budget {format_bytes(budget)}: even the smallest probe size "
            f"b={first} is estimated at {format_bytes(estimate(first))}; not probing; "
            f"a budget of at least {format_bytes(estimate(first))} is needed"
        )
    return None


def _check_budget_before(
    budget: int | None,
    baseline: int,
    first: int,
    estimate: Callable[[int], int] | None,
    agree: Callable[[bool], bool] | None,
) -> None:
    """Raise on every rank together (``agree``) when probing must not start on some rank."""
    if budget is None:
        return  # the same on every rank: nothing to agree on
    error = _budget_error(budget, baseline, first, estimate)
    ok = error is None if agree is None else agree(error is None)
    if not ok:
        raise ValueError(error or "memory budget: another rank cannot start probing within it")


@dataclass
class _Sizes:
    """What running the probe sizes measured."""

    warmups: list[tuple[int, int, float]] = field(default_factory=list)
    points: list[tuple[int, int, float]] = field(default_factory=list)
    befores: list[int] = field(default_factory=list)
    warm_befores: list[int | None] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


def _run_sizes(
    run: Callable[[int], None],
    order: list[int],
    dev: torch.device,
    mode: str,
    baseline: int,
    budget: int | None,
    agree: Callable[[bool], bool] | None,
    per_item: float | None = None,
) -> _Sizes:
    """Each size (ascending): warm-up (per ``mode``), then the measured run; stop before a
    size predicted to exceed ``budget`` (every rank the same, through ``agree``)."""
    out = _Sizes()
    shape = 0 if _is_cuda(dev) else SHAPE_GUESS_BYTES
    for i, b in enumerate(order):
        known = [*out.warmups, *out.points]  # every peak seen so far is evidence
        fits = (
            budget is None
            or not known
            or _predict_next(b, baseline, known, per_item, shape) <= budget
        )
        if agree is not None:
            fits = agree(fits)
        if not fits:
            out.skipped = order[i:]
            break
        warm_before = None
        if mode == "each" or (mode == "first" and i == 0):
            warm, warm_before = _timed_peak(run, b, dev)
            out.warmups.append(warm)
        out.warm_befores.append(warm_before)
        point, before = _timed_peak(run, b, dev)
        out.points.append(point)
        out.befores.append(before)
    return out


def _sweep_shapes(
    shapes: Callable[[int], None],
    max_shapes: int,
    dev: torch.device,
    first: tuple[int, int, float],
    first_before: int,
    budget: int | None,
    agree: Callable[[bool], bool] | None,
) -> tuple[int, int, bool]:
    """(bytes in use after, shapes run, settled) of up to ``max_shapes`` calls
    ``shapes(i)``; stops after two shapes in a row that left less than
    :data:`SHAPE_SETTLED_BYTES` (the caches are full) or before one that could exceed
    ``budget`` (a shape's step costs the smallest size's increment plus its growth). On
    several ranks (``agree``) every rank runs the same shapes: all go on while one still
    grows and all fit."""
    every = agree if agree is not None else (lambda flag: flag)
    step_cost = max(first[1] - first_before, 0)
    in_use = current_bytes(dev)
    growths: list[int] = []
    for i in range(max_shapes):
        settled = every(len(growths) >= 2 and max(growths[-2:]) < SHAPE_SETTLED_BYTES)
        # Before any shape ran, its kernels are guessed (a shorter row needs no more than
        # the step already measured); after, the largest growth seen.
        worst = in_use + step_cost + max(growths, default=min(step_cost, SHAPE_GUESS_BYTES))
        if settled or not every(budget is None or worst <= budget):
            return in_use, len(growths), settled
        shapes(i)
        now = current_bytes(dev)
        growths.append(now - in_use)
        in_use = now
    settled = len(growths) >= 2 and max(growths[-2:]) < SHAPE_SETTLED_BYTES
    return in_use, len(growths), every(settled)


def _shape_bytes(final: int, befores: list[int], per_shape: float) -> int:
    """What the caches hold when full beyond the fit's fixed cost (which holds one shape).

    Point ``k`` ran with ``k`` shapes more than the first resident, which the fit took out
    (``k * per_shape``); the lowest such resident level is what the fixed cost stands on.
    Taking the lowest is the safe side: when the caches are too small for the probe's own
    sizes (they evict), a line through the peaks bends, and only the resident levels the
    sizes really ran on bound what a full cache adds.
    """
    base = min(before - k * round(per_shape) for k, before in enumerate(befores))
    return max(final - base, 0)


def probe_memory(
    run: Callable[[int], None],
    sizes: Sequence[int] = (1, 2, 4),
    *,
    device: torch.device | str | None,
    budget_bytes: int | None = None,
    warmup: str | bool = "each",
    estimate: Callable[[int], int] | None = None,
    agree: Callable[[bool], bool] | None = None,
    fit: str | None = None,
    shapes: Callable[[int], None] | None = None,
    max_shapes: int = 8,
    per_item_bytes: float | None = None,
) -> ProbeResult:
    """Run ``run(b)`` for each of ``sizes`` (ascending), measure its peak, fit the line.

    ``warmup``: ``"each"`` (default) runs every size once unmeasured before measuring it, so
    one-time costs (optimizer state, kernel caches and per-shape compiled kernels, thread
    pools) stay out of the fit, at twice the runs; ``"first"`` (or True) only the smallest
    size; ``"none"`` (or False) none. ``estimate`` (e.g. the analytic model, ``b -> bytes``)
    is the only prediction before the first run, so probing is refused (ValueError) when it
    says the smallest size does not fit. ``budget_bytes``: stop before a size predicted to
    exceed it. ``agree``: on several ranks (each running its collectives inside ``run``),
    called with this rank's "the next size fits", must return every rank's verdict (e.g. an
    all-reduce MIN), so that all ranks run the same sizes instead of deadlocking. ``fit``:
    see :func:`_fit_mode` (None chooses). ``shapes(i)``: one step (like ``run(1)``) whose
    input has the ``i``-th of up to ``max_shapes`` further distinct shapes, e.g. the
    sequence lengths the data will produce; run after the sizes until the memory new
    shapes leave behind stops growing (``ProbeResult.shape_bytes``). ``per_item_bytes``:
    the analytic model's cost of one more item (e.g. ``estimate_step_memory``'s
    ``activations_per_item``): after one measured size the next is predicted from it (not
    from the upper bound that charges everything above the baseline to the items, which
    stopped tight budgets at one size), and when the budget lets only one size run it is
    the fit's slope through that size's peak (``ProbeResult.per_item_source``).
    """
    dev = _device(device)
    mode, order = _mode_and_order(warmup, sizes)
    fit_mode = _fit_mode(fit, dev)
    source = reset_peak(dev)
    baseline = current_bytes(dev)
    _check_budget_before(budget_bytes, baseline, order[0], estimate, agree)
    start = time.perf_counter()
    ran = _run_sizes(run, order, dev, mode, baseline, budget_bytes, agree, per_item_bytes)
    if not ran.points:
        raise ValueError(f"no probe size ran: another rank refused b={order[0]} (agree)")
    # Every size skipped is impossible (the first size always runs: nothing predicts it).
    fixed, slope, per_shape = _fit_bytes(
        ran.points, ran.befores, ran.warm_befores, baseline, fit_mode, per_item_bytes
    )
    swept = _Swept()
    if shapes is not None and max_shapes > 0:
        swept = _sweep(shapes, max_shapes, dev, ran, baseline, budget_bytes, per_shape, agree)
    one = len({p[0] for p in ran.points}) < 2
    how = "measured" if not one else "analytic" if per_item_bytes is not None else "upper bound"
    fitted = _Fitted(fixed, slope, per_shape, fit_mode, source, baseline, how)
    return _result(ran, fitted, swept, mode, budget_bytes, time.perf_counter() - start, dev)


@dataclass
class _Fitted:
    """The byte fit of the sizes, and what it was measured against."""

    fixed: float
    slope: float
    per_shape: float
    fit: str
    source: str
    baseline: int
    per_item_source: str = "measured"


def _result(
    ran: _Sizes,
    fitted: _Fitted,
    swept: _Swept,
    mode: str,
    budget: int | None,
    seconds: float,
    dev: torch.device,
) -> ProbeResult:
    # The high-water mark was last reset before the last size: it now also covers the sweep.
    highest = max([peak for _, peak, _ in [*ran.warmups, *ran.points]] + [peak_bytes(dev)])
    t_fixed, t_item = _fit_seconds(ran.points, ran.warmups if mode == "each" else [])
    return ProbeResult(
        fixed_bytes=round(fitted.fixed),
        per_item_bytes=round(max(fitted.slope, 0.0)),
        points=ran.points,
        seconds_total=seconds,
        source=fitted.source,
        seconds_per_micro_batch=t_fixed,
        seconds_per_item=t_item,
        baseline_bytes=fitted.baseline,
        warmup=ran.warmups[0] if ran.warmups else None,
        skipped=ran.skipped,
        budget_bytes=budget,
        fit=fitted.fit,
        per_shape_bytes=round(fitted.per_shape),
        shape_bytes=swept.shape_bytes,
        shapes_run=swept.shapes_run,
        shapes_settled=swept.settled,
        shapes_unmeasured=swept.unmeasured,
        highest_bytes=highest,
        per_item_source=fitted.per_item_source,
    )


def _mode_and_order(warmup: str | bool, sizes: Sequence[int]) -> tuple[str, list[int]]:
    """The warm-up mode (``"each"``, ``"first"``, ``"none"``) and the sizes, ascending."""
    mode = {True: "each", False: "none"}.get(warmup, warmup)  # type: ignore[call-overload]
    if mode not in ("each", "first", "none"):
        raise ValueError(f"warmup must be 'each', 'first' or 'none', got {warmup!r}")
    order = sorted({int(b) for b in sizes})
    if not order or order[0] < 1:
        raise ValueError(f"probe sizes must be integers >= 1, got {list(sizes)}")
    return mode, order


@dataclass
class _Swept:
    """What the shape sweep found (the defaults: no sweep)."""

    shape_bytes: int = 0
    shapes_run: int = 0
    settled: bool = True
    unmeasured: bool = False


def _sweep(
    shapes: Callable[[int], None],
    max_shapes: int,
    dev: torch.device,
    ran: _Sizes,
    baseline: int,
    budget: int | None,
    per_shape: float,
    agree: Callable[[bool], bool] | None,
) -> _Swept:
    """The shape sweep after the sizes, and what the full caches hold beyond the fit."""
    final, shapes_run, settled = _sweep_shapes(
        shapes, max_shapes, dev, ran.points[0], ran.befores[0], budget, agree
    )
    shape_bytes = _shape_bytes(final, ran.befores, per_shape)
    unmeasured = shapes_run == 0 and not settled  # the budget stopped the sweep at once
    if unmeasured:
        shape_bytes = max(ran.points[0][1] - baseline, 0)
    return _Swept(shape_bytes, shapes_run, settled, unmeasured)
