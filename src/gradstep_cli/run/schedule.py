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
from gradstep_cli.config.recipe import SCHEDULES
from gradstep_cli.data.sources import Batch

__all__ = [
    "GNS_PATIENCE",
    "BatchRamp",
    "LRSchedule",
    "LRShape",
    "SCHEDULES",
    "WarmupCosine",
    "shape_of",
    "warmup_steps",
    "parse_ramp",
    "ramp_windows",
]

GNS_PATIENCE = 10
"""--batch-ramp gns: windows measured before the first growth, and between two growths
(the noise scale is a smoothed, lagging estimate)."""


@dataclass(frozen=True)
class LRShape:
    """LR multiplier at clock ``t`` (full-batch steps): warm-up, then ``kind``.

    transformers' conventions, so the same numbers give the same curve: the warm-up rises
    linearly from 0 (step ``t`` of ``warmup`` runs at ``t / warmup``: the first step at
    0), ``wsd``'s from ``min_ratio``; then cosine or linear decay to ``min_ratio`` at
    ``max_steps``, or constant, or stable until the last ``decay`` steps of ``wsd``'s
    cosine decay. A pure function of the clock (a batch ramp's is fractional). From
    ``max_steps`` on (an extended run's later steps) it stays at ``min_ratio``.
    ``legacy_warmup``: checkpoints from before the schedule kinds warmed up from
    ``1 / warmup`` (step ``t`` at ``(t + 1) / warmup``); they resume on their own curve.
    """

    kind: str
    warmup: int
    max_steps: int
    min_ratio: float
    decay: int = 0
    """wsd: steps of its decay, at the end of the horizon."""
    legacy_warmup: bool = False

    def __call__(self, step: float) -> float:
        if step < self.warmup:
            if self.legacy_warmup:
                return min(1.0, (step + 1) / self.warmup)
            rise = step / self.warmup
            return self.min_ratio + (1 - self.min_ratio) * rise if self.kind == "wsd" else rise
        if step >= self.max_steps:  # an extended run's later steps (also when warmup=max_steps)
            return self.min_ratio
        if self.kind == "constant":
            return 1.0
        start = self.max_steps - self.decay if self.kind == "wsd" else self.warmup
        if step < start:
            return 1.0
        progress = (step - start) / max(1, self.max_steps - start)
        if self.kind == "linear":
            left = 1.0 - progress
        else:
            left = 0.5 * (1.0 + math.cos(math.pi * progress))
        # min(): min_ratio + (1 - min_ratio) may round one ulp above 1.
        return min(1.0, self.min_ratio + (1.0 - self.min_ratio) * left)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def WarmupCosine(warmup: int, max_steps: int, min_ratio: float) -> LRShape:  # noqa: N802
    """A warm-up then a cosine to ``min_ratio`` (``--lr-schedule cosine``)."""
    return LRShape("cosine", warmup, max_steps, min_ratio)


def warmup_steps(warmup: int | float, horizon: int) -> int:
    """``--warmup`` in steps: a whole number is steps, a value in (0, 1) a share of the
    horizon, rounded up (transformers' ``get_warmup_steps``)."""
    if isinstance(warmup, float) and 0 < warmup < 1:
        return math.ceil(horizon * warmup)
    return int(warmup)


def decay_steps(ratio: float, horizon: int) -> int:
    """``--decay-ratio`` in steps, rounded up (a ratio typed as steps / horizon gives those
    steps back, whatever the float rounding)."""
    return math.ceil(round(ratio * horizon, 9))


def shape_of(cfg: Any, horizon: int) -> LRShape:
    """The LR shape ``cfg`` asks for over ``horizon`` full-batch steps; ValueError when its
    warm-up and decay do not fit in it."""
    warm = warmup_steps(cfg.warmup, horizon)
    if warm > horizon:
        raise ValueError(
            f"--warmup must be <= --max-steps ({horizon}), got {warm}: the learning rate "
            "would never reach --lr (the schedule's length is --max-steps, wherever "
            "--stop-after stops); pass a smaller --warmup, a share of the run (e.g. 0.1), or "
            "leave it out"
        )
    decay = 0
    if cfg.lr_schedule == "wsd":
        decay = decay_steps(cfg.decay_ratio, horizon)
        if warm + decay > horizon:
            raise ValueError(
                f"--lr-schedule wsd: the warm-up ({warm} steps) and the decay ({decay} "
                f"steps, --decay-ratio {cfg.decay_ratio:g}) do not fit in the schedule's "
                f"{horizon} steps; shorten one"
            )
    return LRShape(cfg.lr_schedule, warm, horizon, cfg.min_lr / cfg.lr, decay)


@dataclass
class LRSchedule:
    """Sets the learning rate of every step from the sequences trained on so far.

    ``lr`` is the peak, tuned for ``base_micro_batches`` per rank per step; ``scaling``
    (``none``/``linear``/``sqrt``, :func:`gradstep.scale_lr`) rescales it to the batch a
    step actually uses. Saved in checkpoints (``state_dict``) so a resume continues it: the
    clock, and the shape with its horizon (``shape.max_steps``), which a resume with a
    larger ``--max-steps`` keeps (the later steps run at the decay's end, ``min_ratio``).
    """

    shape: LRShape
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
        return {
            "trained": self.trained,
            "full_step": self.full_step,
            "max_steps": self.horizon,
            "shape": self.shape.to_json(),
        }

    @property
    def horizon(self) -> int:
        """The step (in full-batch steps) where the decay reaches ``min_ratio``."""
        return self.shape.max_steps

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved clock and horizon. The clock is rescaled to this run's unit: an
        exact global batch may be split into other micro-batches (another world size or
        --micro-batch-size), a full step is still a full step. The saved shape is the one
        the run continues (this schedule's, but for the horizon a resume keeps);
        checkpoints from before the shape was saved ran a cosine whose warm-up started at
        ``1 / warmup``, and those from before the horizon was saved keep the one this
        schedule was built with."""
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
        if isinstance(state.get("shape"), dict):
            self.shape = LRShape(**state["shape"])
            return
        self.shape = dataclasses.replace(self.shape, kind="cosine", decay=0, legacy_warmup=True)
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


def epoch_steps(epochs: float, epoch_length: Callable[[int], int], per_step: int) -> int:
    """Optimizer steps of ``epochs`` passes over a stream whose epoch ``e`` holds
    ``epoch_length(e)`` items, ``per_step`` items a step (over all ranks): the items of the
    whole epochs, and the fraction's share of the next one, rounded up to whole steps."""
    whole = math.floor(epochs)
    items = sum(epoch_length(e) for e in range(whole))
    if epochs > whole:
        items += math.ceil(round((epochs - whole) * epoch_length(whole), 9))
    return max(1, math.ceil(items / per_step))


def run_length(cfg: Any, stream: Any, items_per_step: int, rows: int) -> tuple[Any, str | None]:
    """``cfg`` with its ``--max-steps`` derived from ``--epochs`` (the line that says how),
    or as it is. ``stream``: the run's training stream (``epoch_length``, ``epoch_rows``);
    ``items_per_step``: its items one full step takes over all ranks, of ``rows`` rows
    each. A resume derives the same steps (the same data, epochs and global batch)."""
    if cfg.epochs is None:
        return cfg, None
    steps = epoch_steps(cfg.epochs, stream.epoch_length, items_per_step)
    derived = dataclasses.replace(cfg, max_steps=steps)
    per_epoch = stream.epoch_rows(0)
    unit = "packed rows" if getattr(stream, "packing", False) else "sequences"
    if rows > 1:
        shape = f"{stream.epoch_length(0):,} micro-batches, the last of the rows left"
    else:
        shape = "one row each"
    return derived, (
        f"--epochs {cfg.epochs:g}: {per_epoch:,} {unit} an epoch ({shape}), "
        f"{items_per_step * rows:,} a step: max_steps {steps} (each epoch reshuffled; every "
        "sequence of an epoch trains once, a step may end one epoch and begin the next)"
    )


def describe_schedule(schedule: LRSchedule) -> dict[str, Any]:
    """The schedule the run follows, for summary.json: its shape in steps and its rates."""
    shape = schedule.shape
    return {
        **shape.to_json(),
        "peak_lr": schedule.lr,
        "min_lr": schedule.lr * shape.min_ratio,
        "warmup_start_lr": schedule.lr * shape(0.0),
        "lr_scaling": schedule.scaling,
    }


def schedule_line(schedule: LRSchedule, stop: int | None = None) -> str:
    """The start line: warm-up, shape, where the decay ends, where this invocation stops."""
    shape, lr = schedule.shape, schedule.lr
    floor = lr * shape.min_ratio
    warm = "no warm-up"
    if shape.warmup:
        start = "1/warmup" if shape.legacy_warmup else f"{lr * shape(0.0):g}"
        steps = "step" if shape.warmup == 1 else "steps"
        warm = f"warm-up {shape.warmup} {steps} from {start}"
    if shape.kind == "constant":
        after = f"then constant {lr:g}"
    elif shape.kind == "wsd":
        after = (
            f"stable at {lr:g} until step {shape.max_steps - shape.decay}, then a cosine "
            f"decay to {floor:g} at step {shape.max_steps}"
        )
    else:
        after = f"then {shape.kind} decay from {lr:g} to {floor:g} at step {shape.max_steps}"
    line = f"lr schedule: {warm}, {after}"
    if stop is not None and stop < shape.max_steps:
        line += f"; this invocation stops after step {stop} (--stop-after)"
    return line
