"""Properties of the demo's LR schedule (gradstep_cli.run.schedule), for every input drawn.

- The learning rate never exceeds ``--lr`` times the ``--lr-scaling`` factor of the step,
  whatever the warm-up, horizon, ramp, world size and skipped steps (rows N33-N36: a ramp's
  fractional clock pushed the warm-up factor to 1.75).
- The clock on N ranks equals one process's when they train on the same global batches,
  and a resume on another world size (or another split of an exact global batch) keeps it.
- The schedule's state carries its horizon, so extending a run never rebuilds the cosine
  (row N96).

The reference for every comparison is computed the plain way: one process, the global
number of micro-batches, in a closed-form warm-up/cosine written out below.
"""

from __future__ import annotations

import math

from hypothesis import assume, given
from hypothesis import strategies as st

from gradstep import scale_lr
from gradstep_cli.config.settings import LR_SCALINGS, TrainConfig
from gradstep_cli.data.batching import layout_for
from gradstep_cli.run.schedule import BatchRamp, LRSchedule, WarmupCosine

LR = 3e-3


def reference_factor(clock: float, warmup: int, horizon: int, min_ratio: float) -> float:
    """The schedule's multiplier written out plainly: a linear warm-up that reaches 1 at
    clock ``warmup - 1`` and stays there until ``warmup``, then a cosine to ``min_ratio``
    at ``horizon``, then flat."""
    if clock < warmup:
        return min(1.0, (clock + 1) / warmup)
    if clock >= horizon:
        return min_ratio
    progress = (clock - warmup) / (horizon - warmup)
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * progress)) / 2


@st.composite
def schedules(draw: st.DrawFn) -> dict:
    max_steps = draw(st.integers(1, 40))
    accum = draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["none", "linear", "gns"]))
    if kind == "gns":
        accum = max(accum, 2)
    spec = None
    if kind == "linear":
        spec = f"{draw(st.integers(1, accum))}:{draw(st.integers(1, 12))}"
    elif kind == "gns":
        spec = "gns"
    return {
        "warmup": draw(st.integers(0, max_steps)),
        "max_steps": max_steps,
        "min_ratio": draw(st.floats(0.0, 1.0)),
        "accum": accum,
        "spec": spec,
        "scaling": draw(st.sampled_from(LR_SCALINGS)),
        "world": draw(st.integers(1, 4)),
        "skipped": draw(st.frozensets(st.integers(0, 60), max_size=8)),
        "noise": draw(st.lists(st.floats(0.0, 1e4), min_size=1, max_size=8)),
    }


def ramped_steps(p: dict):
    """(step, micro-batches per rank, taken) of a run as train.py drives it: the ramp's
    windows until the budget of max_steps full batches is spent, the last one short."""
    ramp = BatchRamp.from_spec(p["spec"], p["accum"], p["world"]) if p["spec"] else None
    budget, used, step = p["max_steps"] * p["accum"], 0, 0
    while used < budget:
        k = min(budget - used, ramp.micro_batches(step) if ramp else p["accum"])
        yield step, k, step not in p["skipped"]
        if ramp is not None:  # any measured noise scale: grows or not, as it may
            noise = p["noise"][step % len(p["noise"])]
            ramp.observe(step, noise, k * p["world"] * 4, measured=step)
        used, step = used + k, step + 1


@given(schedules())
def test_the_lr_never_exceeds_lr_times_the_stated_scaling(p: dict) -> None:
    shape = WarmupCosine(p["warmup"], p["max_steps"], p["min_ratio"])
    schedule = LRSchedule(shape, LR, p["accum"], p["scaling"], p["world"])
    taken_global = 0
    for _, k, taken in ramped_steps(p):
        lr = schedule.lr_for(k)
        peak = scale_lr(LR, k, p["accum"], p["scaling"])  # --lr x the stated factor
        assert lr <= peak <= LR, (lr, peak)
        clock = taken_global / (p["accum"] * p["world"])
        ref = peak * reference_factor(clock, p["warmup"], p["max_steps"], p["min_ratio"])
        assert math.isclose(lr, ref, rel_tol=1e-12, abs_tol=1e-300), (lr, ref, clock)
        low = min(p["min_ratio"], 1 / p["warmup"] if p["warmup"] else 1.0)
        assert lr >= peak * low * (1 - 1e-12)  # never a dead step either
        schedule.advance(k, taken)
        if not taken:  # a skipped step trained on nothing: the next one has the same LR
            assert schedule.lr_for(k) == lr
        taken_global += k * p["world"] if taken else 0
    assert schedule.trained == taken_global


def divisors(n: int, limit: int = 4) -> list[int]:
    return [w for w in range(1, limit + 1) if n % w == 0]


@given(
    global_batch=st.integers(1, 24),
    micro=st.integers(1, 8),
    steps=st.integers(1, 12),
    warmup=st.integers(0, 6),
    skipped=st.frozensets(st.integers(0, 11), max_size=4),
    scaling=st.sampled_from(LR_SCALINGS),
)
def test_the_lr_clock_on_n_ranks_equals_one_process(
    global_batch: int, micro: int, steps: int, warmup: int, skipped: frozenset, scaling: str
) -> None:
    """An exact global batch split over 1..4 ranks (the last micro-batch shorter where the
    sizes do not divide): every rank count gives the one process's LRs, exactly."""

    def lrs(world: int) -> list[float]:
        layout = layout_for(TrainConfig(global_batch=global_batch, micro_batch_size=micro), world)
        shape = WarmupCosine(warmup, steps + 2, 0.1)
        schedule = LRSchedule(shape, LR, layout.micro_batches, scaling, world)
        out = []
        for step in range(steps):
            out.append(schedule.lr_for(layout.micro_batches))
            schedule.advance(layout.micro_batches, taken=step not in skipped)
        return out

    one = lrs(1)
    for world in divisors(global_batch)[1:]:
        assert lrs(world) == one, world


@given(
    full=st.integers(1, 6),
    world=st.sampled_from([2, 4]),
    grows=st.lists(st.integers(0, 6), min_size=1, max_size=10),
    warmup=st.integers(0, 5),
    scaling=st.sampled_from(LR_SCALINGS),
)
def test_a_ramped_clock_on_n_ranks_equals_one_process(
    full: int, world: int, grows: list[int], warmup: int, scaling: str
) -> None:
    """A ramp that trains the same global micro-batches per step (what gns does on 1 and 2
    ranks: 2, 4, ... over all ranks) gives the same LRs on N ranks as in one process."""
    per_rank = [min(full, g + 1) for g in grows]  # micro-batches per rank, <= the full batch
    shape = WarmupCosine(warmup, len(grows) + 1, 0.0)
    one = LRSchedule(shape, LR, full * world, scaling, world=1)
    many = LRSchedule(shape, LR, full, scaling, world=world)
    for k in per_rank:
        assert many.lr_for(k) == one.lr_for(k * world)
        one.advance(k * world, taken=True)
        many.advance(k, taken=True)


@given(
    global_batch=st.integers(1, 24),
    micros=st.tuples(st.integers(1, 8), st.integers(1, 8)),
    worlds=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    before=st.integers(0, 8),
    after=st.integers(1, 8),
    warmup=st.integers(0, 4),
)
def test_a_resume_on_another_world_size_keeps_the_clock(
    global_batch: int,
    micros: tuple[int, int],
    worlds: tuple[int, int],
    before: int,
    after: int,
    warmup: int,
) -> None:
    """Saved on one world size and micro-batch size, resumed on another with the same
    global batch (what --resume allows): the resumed LRs are the uninterrupted run's."""
    assume(all(global_batch % w == 0 for w in worlds))

    def build(micro: int, world: int) -> tuple[LRSchedule, int]:
        cfg = TrainConfig(global_batch=global_batch, micro_batch_size=micro)
        k = layout_for(cfg, world).micro_batches
        return LRSchedule(WarmupCosine(warmup, before + after, 0.1), LR, k, "none", world), k

    straight, k = build(micros[0], worlds[0])
    expected = []
    for _ in range(before + after):
        expected.append(straight.lr_for(k))
        straight.advance(k, taken=True)
    first, k = build(micros[0], worlds[0])
    for _ in range(before):
        first.advance(k, taken=True)
    second, k2 = build(micros[1], worlds[1])
    second.load_state_dict(first.state_dict())
    resumed = []
    for _ in range(after):
        resumed.append(second.lr_for(k2))
        second.advance(k2, taken=True)
    assert resumed == expected[before:]


def test_the_state_carries_the_horizon_and_old_states_keep_the_built_one() -> None:
    short = LRSchedule(WarmupCosine(1, 4, 0.1), LR, 2)
    for _ in range(4):
        short.advance(2, taken=True)
    extended = LRSchedule(WarmupCosine(1, 8, 0.1), LR, 2)  # built for --max-steps 8
    extended.load_state_dict(short.state_dict())
    assert extended.horizon == 4 and extended.lr_for(2) == LR * 0.1  # past it: min_lr
    old = LRSchedule(WarmupCosine(1, 8, 0.1), LR, 2)
    old.load_state_dict({"trained": 8})  # a checkpoint from before the horizon was saved
    assert old.horizon == 8 and old.clock == 4.0
