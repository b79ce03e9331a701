"""What :func:`gradstep.memory.probe_memory` measured: the peaks of real micro-batches and
the line ``fixed + per_item * b`` fitted through them (:class:`ProbeResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .units import format_bytes

__all__ = ["ProbeResult"]


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
    shape_bytes: int = 0
    """What any number of further input shapes keeps resident beyond ``fixed_bytes``'s one
    (measured by the shape sweep: the kernel caches filled to their bound), 0 without one."""
    shapes_run: int = 0
    """Input shapes the sweep ran (0: no sweep)."""
    shapes_settled: bool = True
    """False when the last shapes of the sweep still grew the process: the caches are not
    bounded (see :func:`bound_kernel_caches`) and ``shape_bytes`` covers only
    ``shapes_run`` shapes."""
    shapes_unmeasured: bool = False
    """The budget left no room to run a single further shape: ``shape_bytes`` is then not
    measured but charged what the smallest size's step added above the probe's baseline
    (model state, activations and the first shape's kernels: more than the kernels of other
    shapes hold), so that a tight budget is refused, with the budget it needs, rather than
    overrun by caches nobody measured."""
    highest_bytes: int = 0
    """The highest peak the probe itself reached (warm-ups, sizes, shape sweep): a process
    that probes before it trains (``--micro-batch-size auto``) peaks at least there."""
    per_item_source: str = "measured"
    """Where ``per_item_bytes`` comes from: ``measured`` (a line through two or more sizes),
    ``analytic`` (one size ran: the analytic model's cost per item through its peak) or
    ``upper bound`` (one size, no analytic model: everything above the baseline charged
    to the items)."""

    @property
    def one_size(self) -> bool:
        """Only one size was measured (a tight budget): the per-item cost is not measured
        (:attr:`per_item_source`) and there is no time per item."""
        return len({p[0] for p in self.points}) < 2

    def predict(self, b: int) -> int:
        """Predicted peak bytes of ``run(b)``."""
        return round(self.fixed_bytes + self.per_item_bytes * b)

    def predict_seconds(self, b: int) -> float:
        return self.seconds_per_micro_batch + self.seconds_per_item * b

    def describe(self) -> str:
        sizes = ", ".join(f"b={b}: {format_bytes(p)} in {s:.2f}s" for b, p, s in self.points)
        note = f"; skipped (over budget) {self.skipped}" if self.skipped else ""
        if self.one_size and self.per_item_source == "analytic":
            note += "; one size only: the per-item cost is the analytic model's"
        elif self.one_size:
            note += "; one size only: the per-item cost is an upper bound"
        if self.shapes_run:
            note += (
                f"; {self.shapes_run} more input shapes keep "
                f"{format_bytes(self.shape_bytes)} resident"
            )
            if not self.shapes_settled:
                note += " and still grew (kernel caches not bounded)"
        if self.shapes_unmeasured:
            note += (
                "; no room in the budget to run the data's other input shapes: charged "
                f"{format_bytes(self.shape_bytes)} (the smallest step above the baseline) for them"
            )
        return (
            f"probe ({self.source}): fixed {format_bytes(self.fixed_bytes)} + "
            f"{format_bytes(self.per_item_bytes)}/item [{sizes}]{note}; "
            f"took {self.seconds_total:.1f}s"
        )
