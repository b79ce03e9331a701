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
and unmapped, and RSS follows the live bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import math
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .units import format_bytes

__all__ = [
    "ProbeResult",
    "current_bytes",
    "peak_bytes",
    "pin_mmap_threshold",
    "probe_memory",
    "reset_peak",
    "runtime_bytes",
]

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number

CPU_KERNEL_RUNTIME_BYTES = 30 * 2**20
"""RSS a CPU process gains from its first training steps beyond the tensors and imports:
code pages of libtorch/oneDNN paged in as kernels first run, thread pools, kernel caches.
Calibrated with torch 2.13 (CPU, x86-64, demo GPT, 1-2 threads): 24 MiB fp32, 35 MiB bf16,
independent of the batch. The probe measures it; this is only for the analytic estimate."""

CPU_DYNAMO_IMPORT_BYTES = 69 * 2**20
"""RSS of ``import torch._dynamo`` (with sympy, mpmath, ...: about 800 modules), which the
first ``optimizer.step()`` triggers when nothing imported it before (torch 2.13)."""


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def _is_cuda(dev: torch.device) -> bool:
    return dev.type == "cuda" and torch.cuda.is_available()


def _status_bytes(key: str) -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _ru_maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def reset_peak(device: torch.device | str | None = None) -> str:
    """Start a new peak measurement; returns where :func:`peak_bytes` will read it from.

    ``"cuda_max_allocated"``; ``"vmhwm"`` (reset worked); or ``"ru_maxrss (no reset)"``
    where ``/proc/self/clear_refs`` cannot be written (not Linux, or a locked-down
    container): the peak is then the process's peak since it started, so only sizes that
    go up can be told apart.
    """
    dev = _device(device)
    if _is_cuda(dev):
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        return "cuda_max_allocated"
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return "ru_maxrss (no reset)"
    return "vmhwm" if _status_bytes("VmHWM:") is not None else "ru_maxrss (no reset)"


def peak_bytes(device: torch.device | str | None = None) -> int:
    """Peak bytes since the last :func:`reset_peak`: CUDA allocator peak, or CPU VmHWM."""
    dev = _device(device)
    if _is_cuda(dev):
        return int(torch.cuda.max_memory_allocated(dev))
    hwm = _status_bytes("VmHWM:")
    return hwm if hwm is not None else _ru_maxrss_bytes()


def current_bytes(device: torch.device | str | None = None) -> int:
    """Bytes in use now: CUDA ``memory_allocated``, or the process's RSS on CPU."""
    dev = _device(device)
    if _is_cuda(dev):
        return int(torch.cuda.memory_allocated(dev))
    rss = _status_bytes("VmRSS:")
    return rss if rss is not None else _ru_maxrss_bytes()


def runtime_bytes(device: torch.device | str | None = None) -> int:
    """The fixed cost for the analytic estimate, read *before* building the model.

    CPU: the process's RSS now (interpreter, torch, imported modules) plus what the first
    steps add whatever the batch: :data:`CPU_DYNAMO_IMPORT_BYTES` unless ``torch._dynamo``
    is already imported, and :data:`CPU_KERNEL_RUNTIME_BYTES`. CUDA: ``memory_allocated``
    now (the CUDA context and kernel images are outside ``max_memory_allocated``; cuBLAS
    workspaces are inside it; not calibrated on a GPU here).
    """
    dev = _device(device)
    if _is_cuda(dev):
        return current_bytes(dev)
    lazy = CPU_KERNEL_RUNTIME_BYTES
    if "torch._dynamo" not in sys.modules:
        lazy += CPU_DYNAMO_IMPORT_BYTES
    return current_bytes(dev) + lazy


def pin_mmap_threshold(threshold_bytes: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold so freed tensors go back to the OS (CPU RSS = live bytes).

    Without it, glibc adapts the threshold upward after every large free and serves later
    tensors from arenas it keeps, so a CPU process's peak RSS grows with the allocation
    history, not with what is alive. Affects only allocations made afterwards. Costs page
    faults on every large allocation. Returns False where unavailable (not glibc).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys on xs; the slope is 0 for a single x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - slope * mx, slope


@dataclass
class ProbeResult:
    """Measured peaks and the fit ``peak = fixed_bytes + per_item_bytes * b``."""

    fixed_bytes: int
    per_item_bytes: int
    points: list[tuple[int, int, float]]
    """``(b, peak bytes, seconds)`` per measured size, in the order run (seconds: see
    ``_timed_peak``, CPU time on CPU)."""
    seconds_total: float
    """Wall time of the whole probe, warm-up included: what probing cost."""
    source: str
    """Where peaks came from: ``cuda_max_allocated``, ``vmhwm``, ``ru_maxrss (no reset)``."""
    seconds_per_micro_batch: float = 0.0
    """Fitted time of one ``run(b)`` = this + ``seconds_per_item * b``."""
    seconds_per_item: float = 0.0
    baseline_bytes: int = 0
    """Memory in use before the probe (RSS, or CUDA memory_allocated)."""
    warmup: tuple[int, int, float] | None = None
    """The first unmeasured call ``(b, peak, seconds)``: it pays one-time costs (optimizer
    state, kernel caches, thread pools) that would otherwise bend the line."""
    skipped: list[int] = field(default_factory=list)
    """Sizes not run because their predicted peak exceeded the budget."""
    budget_bytes: int | None = None
    fit: str = "peaks"
    """``increments`` (peak minus bytes in use before each run) or ``peaks``: see _fit_mode."""
    per_shape_bytes: int = 0
    """CPU: what each further distinct micro-batch shape (a short last micro-batch) adds for
    good (compiled kernels); ``fixed_bytes`` already includes one shape. See _per_shape."""

    def predict(self, b: int) -> int:
        """Predicted peak bytes of ``run(b)``."""
        return round(self.fixed_bytes + self.per_item_bytes * b)

    def predict_seconds(self, b: int) -> float:
        return self.seconds_per_micro_batch + self.seconds_per_item * b

    def describe(self) -> str:
        sizes = ", ".join(f"b={b}: {format_bytes(p)} in {s:.2f}s" for b, p, s in self.points)
        note = f"; skipped (over budget) {self.skipped}" if self.skipped else ""
        return (
            f"probe ({self.source}): fixed {format_bytes(self.fixed_bytes)} + "
            f"{format_bytes(self.per_item_bytes)}/item [{sizes}]{note}; "
            f"took {self.seconds_total:.1f}s"
        )


def _predict_next(b: int, baseline: int, points: list[tuple[int, int, float]]) -> int:
    """The peak of size ``b`` expected from the sizes measured so far.

    From one point, memory above the baseline is assumed proportional to ``b`` (an upper
    bound, since part of it is fixed); from two or more, the least-squares line, never
    below the last measured peak.
    """
    if len(points) == 1 or len({p[0] for p in points}) == 1:
        b0, p0, _ = points[-1]
        return baseline + math.ceil(max(p0 - baseline, 0) * b / b0)
    fixed, slope = _line([p[0] for p in points], [p[1] for p in points])
    return max(round(fixed + max(slope, 0.0) * b), points[-1][1])


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
) -> tuple[float, float, float]:
    """(fixed, per item, per shape) from the measured points (sizes ascending, distinct).

    ``peaks``: the line through ``peak_k - k * per_shape`` (``k`` = shapes run before size
    ``k``; see :func:`_per_shape`); the fixed cost includes one shape, as a training run
    with one micro-batch shape pays. ``increments``: the line through ``peak - in use
    before``, fixed = in use before the first + the intercept.
    """
    xs = [p[0] for p in points]
    if len(set(xs)) < 2:
        # One size only: charge everything above the baseline to the items (upper bound).
        b0, p0, _ = points[-1]
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


def _check_budget_before(
    budget: int | None, baseline: int, first: int, estimate: Callable[[int], int] | None
) -> None:
    if budget is None:
        return
    if baseline > budget:
        raise ValueError(
            f"memory budget {format_bytes(budget)} is already exceeded before probing "
            f"({format_bytes(baseline)} in use)"
        )
    if estimate is not None and estimate(first) > budget:
        raise ValueError(
            f"memory budget {format_bytes(budget)}: even the smallest probe size "
            f"b={first} is estimated at {format_bytes(estimate(first))}; not probing"
        )


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
    see :func:`_fit_mode` (None chooses).
    """
    dev = _device(device)
    mode = {True: "each", False: "none"}.get(warmup, warmup)  # type: ignore[call-overload]
    if mode not in ("each", "first", "none"):
        raise ValueError(f"warmup must be 'each', 'first' or 'none', got {warmup!r}")
    order = sorted({int(b) for b in sizes})
    if not order or order[0] < 1:
        raise ValueError(f"probe sizes must be integers >= 1, got {list(sizes)}")
    fit_mode = _fit_mode(fit, dev)
    source = reset_peak(dev)
    baseline = current_bytes(dev)
    _check_budget_before(budget_bytes, baseline, order[0], estimate)
    start = time.perf_counter()
    warmups: list[tuple[int, int, float]] = []
    points: list[tuple[int, int, float]] = []
    befores: list[int] = []
    warm_befores: list[int | None] = []
    skipped: list[int] = []
    for i, b in enumerate(order):
        known = [*warmups, *points]  # every peak seen so far is evidence for the next size
        fits = (
            budget_bytes is None or not known or _predict_next(b, baseline, known) <= budget_bytes
        )
        if agree is not None:
            fits = agree(fits)
        if not fits:
            skipped = order[i:]
            break
        warm_before = None
        if mode == "each" or (mode == "first" and i == 0):
            warm, warm_before = _timed_peak(run, b, dev)
            warmups.append(warm)
        warm_befores.append(warm_before)
        point, before = _timed_peak(run, b, dev)
        points.append(point)
        befores.append(before)
    total = time.perf_counter() - start
    # Every size skipped is impossible (the first size always runs: nothing predicts it).
    fixed, slope, per_shape = _fit_bytes(points, befores, warm_befores, baseline, fit_mode)
    t_fixed, t_item = _fit_seconds(points, warmups if mode == "each" else [])
    return ProbeResult(
        fixed_bytes=round(fixed),
        per_item_bytes=round(max(slope, 0.0)),
        points=points,
        seconds_total=total,
        source=source,
        seconds_per_micro_batch=t_fixed,
        seconds_per_item=t_item,
        baseline_bytes=baseline,
        warmup=warmups[0] if warmups else None,
        skipped=skipped,
        budget_bytes=budget_bytes,
        fit=fit_mode,
        per_shape_bytes=round(per_shape),
    )
