"""How much each step trains on, and at what learning rate: the LR schedule, the batch ramp.

The schedule's clock is the number of sequences the taken steps trained on, counted in
full-batch steps (``--accum-steps`` micro-batches on every rank), not the number of
optimizer steps: a batch ramp makes the early steps smaller, and a step-keyed warm-up or
decay would then end too early (Megatron's and OLMo-core's ramps key on consumed samples or
tokens for the same reason). Without a ramp every step is a full one and the clock is the
step count, exactly.

With a ramp, ``--max-steps`` is the run's length in full-batch steps: the run trains on
that many sequences, in more (smaller) optimizer steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gradstep import scale_lr
from gradstep_cli.data.sources import Batch

__all__ = [
    "GNS_PATIENCE",
    "BatchRamp",
    "LRSchedule",
    "WarmupCosine",
    "parse_ramp",
    "ramp_windows",
]

GNS_PATIENCE = 10
"""--batch-ramp gns: windows measured before the first growth, and between two growths
(the noise scale is a smoothed, lagging estimate)."""


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier at clock ``t`` (full-batch steps): linear warm-up, then cosine decay.

    A pure function (and a picklable object, not a lambda). Warm-up starts at ``1 / warmup``
    rather than 0 so the first step is not wasted. Never above 1, also at a fractional clock
    (a batch ramp's) between ``warmup - 1`` and ``warmup``, where the ramp is complete.
    From ``max_steps`` on (the steps of an extended run) it stays at ``min_ratio``.
    """

    warmup: int
    max_steps: int
    min_ratio: float

    def __call__(self, step: float) -> float:
        if step < self.warmup:
            return min(1.0, (step + 1) / self.warmup)
        if step >= self.max_steps:  # an extended run's later steps (also when warmup=max_steps)
            return self.min_ratio
        progress = min(1.0, (step - self.warmup) / max(1, self.max_steps - self.warmup))
        half_cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        # min(): min_ratio + (1 - min_ratio) may round one ulp above 1.
        return min(1.0, self.min_ratio + (1.0 - self.min_ratio) * half_cos)


@dataclass
class LRSchedule:
    """Sets the learning rate of every step from the sequences trained on so far.

    ``lr`` is the peak, tuned for ``base_micro_batches`` per rank per step; ``scaling``
    (``none``/``linear``/``sqrt``, :func:`gradstep.scale_lr`) rescales it to the batch a
    step actually uses. Saved in checkpoints (``state_dict``) so a resume continues it: the
    clock, and the horizon (``shape.max_steps``), which a resume with a larger
    ``--max-steps`` keeps (the later steps run at the cosine's end, ``min_ratio``).
    """

    shape: WarmupCosine
    lr: float
    base_micro_batches: int
    scaling: str = "none"
    world: int = 1
    trained: int = 0
    """Micro-batches, over all ranks, of the steps taken so far: the clock. Counted over
    all ranks so that a resume on another world size (same global batch) keeps it."""

    @property
    def full_step(self) -> int:
        """Micro-batches over all ranks of one full-batch step: the clock's unit."""
        return self.base_micro_batches * self.world

    @property
    def clock(self) -> float:
        """Full-batch steps' worth of micro-batches the taken steps trained on."""
        return self.trained / self.full_step

    def lr_for(self, micro_batches: int) -> float:
        """The LR of a step of ``micro_batches`` per rank."""
        clock = self.clock
        peak = scale_lr(self.lr, micro_batches, self.base_micro_batches, self.scaling)
        return peak * self.shape(clock)

    def apply(self, optimizer: Any, micro_batches: int) -> None:
        """Set the LR of the coming step, of ``micro_batches`` per rank."""
        lr = self.lr_for(micro_batches)
        for group in optimizer.param_groups:
            group["lr"] = lr

    def advance(self, micro_batches: int, taken: bool) -> None:
        """After a step: a skipped step trained on nothing and does not move the clock."""
        if taken:
            self.trained += micro_batches * self.world

    def state_dict(self) -> dict[str, Any]:
        return {"trained": self.trained, "full_step": self.full_step, "max_steps": self.horizon}

    @property
    def horizon(self) -> int:
        """The step (in full-batch steps) where the cosine reaches ``min_ratio``."""
        return self.shape.max_steps

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved clock and horizon. The clock is rescaled to this run's unit: an
        exact global batch may be split into other micro-batches (another world size or
        --micro-batch-size), a full step is still a full step. Checkpoints from before the
        horizon was saved keep the one this schedule was built with."""
        if "trained" not in state:
            raise ValueError(
                "scheduler state: this checkpoint holds a step-keyed LambdaLR state from an "
                "older gradstep; resume it with that version, or start a new run"
            )
        saved_unit = int(state.get("full_step", self.full_step))
        trained, rest = divmod(int(state["trained"]) * self.full_step, saved_unit)
        if rest:
            raise ValueError(
                f"scheduler state: {state['trained']} micro-batches of full steps of "
                f"{saved_unit} are no whole number of this run's full steps of "
                f"{self.full_step}; resume with the checkpoint's batch layout"
            )
        self.trained = trained
        if "max_steps" in state:
            self.shape = dataclasses.replace(self.shape, max_steps=int(state["max_steps"]))


def parse_ramp(spec: str) -> tuple[str, int, int]:
    """``START:STEPS`` -> ("linear", START, STEPS); ``gns`` -> ("gns", 0, 0)."""
    text = "".join(spec.split()).lower()  # any case, spaces ignored, as --clip
    if text == "gns":
        return "gns", 0, 0
    start, colon, steps = text.partition(":")
    if not (colon and start.isdigit() and steps.isdigit() and int(start) >= 1 and int(steps) >= 1):
        raise ValueError(
            f"--batch-ramp must be START:STEPS (whole numbers >= 1: micro-batches per rank to "
            f"start with, optimizer steps to reach --accum-steps) or gns, got {spec!r}"
        )
    return "linear", int(start), int(steps)


@dataclass
class BatchRamp:
    """Micro-batches per rank for each step, growing to ``full`` (``--accum-steps``).

    ``linear``: from ``start`` to ``full`` over ``steps`` optimizer steps, a pure function
    of the step index. ``gns``: starts at the smallest batch that can measure the noise
    scale (two micro-batches over all ranks) and doubles, up to ``full`` and never down,
    whenever the measured B_simple exceeds the batch in use (in items, as B_simple is).
    """

    kind: str
    full: int
    start: int = 1
    steps: int = 1
    current: int = 0
    last_growth: int = 0
    """Step index of the latest growth (gns)."""

    @classmethod
    def from_spec(cls, spec: str, full: int, world: int) -> BatchRamp:
        kind, start, steps = parse_ramp(spec)
        if kind == "gns":
            start = min(full, 2 if world == 1 else 1)
        if start > full:
            raise ValueError(
                f"--batch-ramp START ({start}) must be <= --accum-steps ({full}): the ramp "
                "grows to --accum-steps"
            )
        return cls(kind, full, start, steps, current=start)

    def micro_batches(self, step: int) -> int:
        """Micro-batches per rank of step ``step`` (0-based index of the run's steps)."""
        if self.kind == "linear":
            if step >= self.steps:
                return self.full
            return self.start + (self.full - self.start) * step // self.steps
        return self.current

    def observe(self, step: int, b_simple: float | None, batch_items: int, measured: int) -> bool:
        """After step ``step`` (gns): grow when the noise scale exceeds the batch. True if
        it grew."""
        if self.kind != "gns" or self.current >= self.full or b_simple is None:
            return False
        if measured < GNS_PATIENCE or step - self.last_growth < GNS_PATIENCE:
            return False
        if b_simple <= batch_items:
            return False
        self.current, self.last_growth = min(self.full, 2 * self.current), step
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "current": self.current, "last_growth": self.last_growth}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["kind"] != self.kind:
            raise ValueError(f"batch ramp: saved {state['kind']!r}, this run {self.kind!r}")
        self.current, self.last_growth = int(state["current"]), int(state["last_growth"])


def ramp_windows(
    stream: Iterator[Batch], ramp: BatchRamp, first_step: int, left: Callable[[], int]
) -> Iterator[list[Batch]]:
    """The windows of a ramped run from step ``first_step`` on, until ``left()`` (the
    micro-batches per rank still to train on) is 0; the last window takes only what is
    left. Asked lazily: a gns ramp sizes the next window after the previous step."""
    step = first_step
    while (remaining := left()) > 0:
        yield [next(stream) for _ in range(min(remaining, ramp.micro_batches(step)))]
        step += 1
