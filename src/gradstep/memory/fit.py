"""Fitting a probe's measurements: the line through the peaks, per-shape memory, step times.

Split out of :mod:`gradstep.memory.probe` (which runs the sizes and measures).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from .process import _is_cuda

__all__: list[str] = []


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys on xs; the slope is 0 for a single x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - slope * mx, slope


NEXT_SIZE_SAFETY = 1.5
"""From one measured size, the next size's peak is that size's plus this many times the
analytic model's cost of the extra items (and a new shape's kernels): the analytic
per-item cost is within 7% of the measured one (tests/memory), so 1.5 leaves room."""


def _predict_next(
    b: int,
    baseline: int,
    points: list[tuple[int, int, float]],
    per_item: float | None = None,
    new_shape: int = 0,
) -> int:
    """The peak of size ``b`` expected from the sizes measured so far.

    From one point, memory above the baseline is assumed proportional to ``b`` (an upper
    bound, since part of it is fixed), or, given the analytic model's ``per_item`` bytes,
    the point plus :data:`NEXT_SIZE_SAFETY` times their cost and ``new_shape`` (what a new
    input shape's kernels may add), whichever is lower; from two or more, the
    least-squares line, never below the last measured peak.
    """
    if len(points) == 1 or len({p[0] for p in points}) == 1:
        b0, p0, _ = points[-1]
        upper = baseline + math.ceil(max(p0 - baseline, 0) * b / b0)
        if per_item is None:
            return upper
        return min(upper, p0 + math.ceil(NEXT_SIZE_SAFETY * per_item * (b - b0)) + new_shape)
    fixed, slope = _line([p[0] for p in points], [p[1] for p in points])
    return max(round(fixed + max(slope, 0.0) * b), points[-1][1])


def _fit_mode(fit: str | None, dev: torch.device) -> str:
    """``increments`` on CUDA, ``peaks`` on CPU, unless ``fit`` says otherwise.

    The CUDA allocator's counters are live bytes, so ``peak - allocated before`` is the
    run's own cost, free of whatever earlier sizes left behind. CPU RSS is not: tensors
    below the mmap threshold come from heap arenas that keep freed memory, so a run reuses
    pages already counted before it and its increment under-counts (the unsafe side: the
    demo's bf16 probe saw half the per-item cost). Absolute peaks over-count instead (the
    safe side): oneDNN compiles and caches kernels per shape (~7 MiB per new shape in bf16),
    so each larger size also pays for the shapes before it.
    """
    if fit is not None:
        if fit not in ("increments", "peaks"):
            raise ValueError(f"fit must be None, 'increments' or 'peaks', got {fit!r}")
        return fit
    return "increments" if _is_cuda(dev) else "peaks"


def _per_shape(befores: list[int], warm_befores: list[int | None]) -> float:
    """Memory each new shape leaves behind for good, measured, or 0.

    On CPU the first run of a shape compiles and caches kernels (oneDNN with bf16: 7-11 MiB
    per shape on the test machine; ~0 with fp32), so every larger size also carries the
    shapes before it, which a line through the peaks would charge to the items (x3 the
    demo's bf16 per-item cost). The warm-up of a size is that first run: in-use bytes after
    it minus before it. The first size is left out (it also pays one-time costs). Growth
    that rises with the size is not a per-shape constant but heap arenas keeping freed
    memory (glibc's default malloc: +21, +41 MiB for the fp32 demo), and is not corrected;
    otherwise the smallest growth is used (the smaller correction, the safer prediction).
    """
    growth = [
        after - before
        for after, before in list(zip(befores, warm_befores, strict=True))[1:]
        if before is not None
    ]
    if len(growth) < 2 or min(growth) <= 0:
        return 0.0
    if any(later > 1.1 * earlier for earlier, later in itertools.pairwise(growth)):
        return 0.0
    return float(min(growth))


def _fit_bytes(
    points: list[tuple[int, int, float]],
    befores: list[int],
    warm_befores: list[int | None],
    baseline: int,
    mode: str,
    per_item: float | None = None,
) -> tuple[float, float, float]:
    """(fixed, per item, per shape) from the measured points (sizes ascending, distinct).

    One size only: the analytic model's ``per_item`` bytes through the measured point, or
    without it everything above the baseline charged to the items (an upper bound, which
    made every larger size look as if it would not fit).

    ``peaks``: the line through ``peak_k - k * per_shape`` (``k`` = shapes run before size
    ``k``; see :func:`_per_shape`); the fixed cost includes one shape, as a training run
    with one micro-batch shape pays. ``increments``: the line through ``peak - in use
    before``, fixed = in use before the first + the intercept.
    """
    xs = [p[0] for p in points]
    if len(set(xs)) < 2:
        b0, p0, _ = points[-1]
        if per_item is not None:
            return p0 - per_item * b0, per_item, 0.0
        return baseline, max(p0 - baseline, 0) / b0, 0.0
    if mode == "increments":
        fixed, slope = _line(xs, [p[1] - before for p, before in zip(points, befores, strict=True)])
        return befores[0] + fixed, slope, 0.0
    per_shape = _per_shape(befores, warm_befores)
    fixed, slope = _line(xs, [p[1] - k * per_shape for k, p in enumerate(points)])
    return fixed, slope, per_shape


def _fit_seconds(
    points: list[tuple[int, int, float]], warmups: list[tuple[int, int, float]]
) -> tuple[float, float]:
    """(seconds per micro-batch, seconds per item), both >= 0, from the fastest run of
    each size (a warm-up of the same size counts: contention only ever adds time).

    Small probe sizes are dominated by fixed costs and noise; a negative intercept or
    slope is replaced by the least-squares fit of the other term alone.
    """
    best: dict[int, float] = {}
    for b, _, seconds in [*points, *warmups]:
        best[b] = min(best.get(b, math.inf), seconds)
    xs, ts = list(best), list(best.values())
    fixed, slope = _line(xs, ts)
    if len(xs) < 2 or slope < 0:
        return sum(ts) / len(ts), 0.0
    if fixed < 0:
        return 0.0, sum(t * x for t, x in zip(ts, xs, strict=True)) / sum(x * x for x in xs)
    return fixed, slope
