"""The LR schedule and the batch ramp (gradstep_cli.run.schedule): properties for every input
drawn, the clock in sequences, the ramps, and their state."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from gradstep import scale_lr
from gradstep_cli.config.settings import LR_SCALINGS, ConfigError, TrainConfig
from gradstep_cli.data.batching import layout_for
from gradstep_cli.run.schedule import (
    GNS_PATIENCE,
    BatchRamp,
    LRSchedule,
    LRShape,
    WarmupCosine,
    parse_ramp,
)

LR = 3e-3


def reference_factor(clock: float, warmup: int, horizon: int, min_ratio: float) -> float:
    """The schedule's multiplier written out plainly: a linear warm-up from 0 that reaches 1
    at clock ``warmup`` (transformers' convention), then a cosine to ``min_ratio`` at
    ``horizon``, then flat."""
    if clock < warmup:
        return clock / warmup
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


def divisors(n: int, limit: int = 4) -> list[int]:
    return [w for w in range(1, limit + 1) if n % w == 0]


def test_warmup_cosine_schedule() -> None:
    schedule = WarmupCosine(warmup=4, max_steps=20, min_ratio=0.1)
    assert schedule(0) == 0.0  # from 0, as transformers' warm-ups
    assert schedule(3) == pytest.approx(0.75)
    assert schedule(4) == pytest.approx(1.0)
    assert schedule(12) == pytest.approx(0.55)
    assert schedule(20) == pytest.approx(0.1) and schedule(50) == pytest.approx(0.1)
    values = [schedule(s) for s in range(4, 21)]
    assert values == sorted(values, reverse=True)


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
        if clock >= p["warmup"]:  # after the warm-up (which starts at 0): never below min_lr
            assert lr >= peak * p["min_ratio"] * (1 - 1e-12)
        schedule.advance(k, taken)
        if not taken:  # a skipped step trained on nothing: the next one has the same LR
            assert schedule.lr_for(k) == lr
        taken_global += k * p["world"] if taken else 0
    assert schedule.trained == taken_global


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


def test_a_checkpoint_from_before_the_shapes_keeps_its_warmup_from_one_step() -> None:
    """Checkpoints without a saved shape ran a cosine whose warm-up started at lr / warmup
    (step t at (t + 1) / warmup): a resume mid-warm-up continues that curve, whatever
    --lr-schedule the new defaults would pick."""
    built = LRSchedule(LRShape("linear", 4, 20, 0.0), LR, 1)
    built.load_state_dict({"trained": 1, "full_step": 1, "max_steps": 20})
    assert built.shape == LRShape("cosine", 4, 20, 0.0, legacy_warmup=True)
    assert built.lr_for(1) == pytest.approx(LR * 2 / 4)  # step 1 of 4: (1 + 1) / 4
    new = LRSchedule(LRShape("wsd", 2, 20, 0.1, decay=5), LR, 1)
    twin = LRSchedule(LRShape("cosine", 0, 20, 0.0), LR, 1)
    twin.load_state_dict(new.state_dict())  # a saved shape is the one that continues
    assert twin.shape == new.shape


def test_without_a_ramp_the_schedule_is_the_step_keyed_one_exactly():
    """Full steps only: the sequence clock is the step count, so the LR of every step is
    what LambdaLR(WarmupCosine) gives, skipped steps included (neither advances on one)."""
    shape = WarmupCosine(warmup=3, max_steps=12, min_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    ref = torch.optim.lr_scheduler.LambdaLR(opt, shape)
    schedule = LRSchedule(shape, 0.5, base_micro_batches=4)
    skipped = {4, 7}
    for step in range(12):
        assert schedule.lr_for(4) == opt.param_groups[0]["lr"]
        schedule.advance(4, taken=step not in skipped)
        if step not in skipped:
            opt.step()
            ref.step()


@pytest.mark.parametrize(("rule", "factor"), [("none", 1.0), ("linear", 0.25), ("sqrt", 0.5)])
def test_a_ramped_step_advances_the_clock_by_its_share_and_scales_its_lr(rule, factor):
    shape = WarmupCosine(warmup=2, max_steps=10, min_ratio=0.0)
    schedule = LRSchedule(shape, 1.0, base_micro_batches=4, scaling=rule)
    assert schedule.lr_for(1) == pytest.approx(factor * shape(0))
    schedule.advance(1, taken=True)  # a quarter of a full step
    assert schedule.lr_for(1) == pytest.approx(factor * shape(0.25))
    for _ in range(3):
        schedule.advance(1, taken=True)
    assert schedule.lr_for(4) == pytest.approx(shape(1.0))  # 4 quarter steps = 1 full step
    twin = LRSchedule(shape, 1.0, 4, rule)
    twin.load_state_dict(schedule.state_dict())
    assert twin.lr_for(2) == schedule.lr_for(2)
    with pytest.raises(ValueError, match="LambdaLR"):
        twin.load_state_dict({"last_epoch": 3, "base_lrs": [1.0]})


def test_linear_ramp_is_a_pure_function_of_the_step():
    ramp = BatchRamp.from_spec("1:6", full=4, world=1)
    assert [ramp.micro_batches(s) for s in range(9)] == [1, 1, 2, 2, 3, 3, 4, 4, 4]
    assert BatchRamp.from_spec("4:3", full=4, world=2).micro_batches(0) == 4
    with pytest.raises(ValueError, match="must be <= --accum-steps"):
        BatchRamp.from_spec("5:3", full=4, world=1)


def test_gns_ramp_doubles_when_the_noise_scale_exceeds_the_batch_and_never_shrinks():
    ramp = BatchRamp.from_spec("gns", full=6, world=1)
    assert ramp.micro_batches(0) == 2  # two micro-batches: the least that measures noise
    assert BatchRamp.from_spec("gns", full=6, world=2).micro_batches(0) == 1
    big = 1e9
    assert not ramp.observe(5, big, 100, measured=GNS_PATIENCE - 1)  # too few measured
    assert not ramp.observe(GNS_PATIENCE, None, 100, measured=GNS_PATIENCE)  # unmeasurable
    assert not ramp.observe(GNS_PATIENCE, 99.0, 100, measured=GNS_PATIENCE)  # below batch
    assert ramp.observe(GNS_PATIENCE, 101.0, 100, measured=GNS_PATIENCE)
    assert ramp.micro_batches(GNS_PATIENCE + 1) == 4
    twin = BatchRamp.from_spec("gns", full=6, world=1)
    twin.load_state_dict(ramp.state_dict())  # a resume continues the grown ramp
    assert twin == ramp
    assert not ramp.observe(GNS_PATIENCE + 1, big, 100, measured=big)  # patience
    assert ramp.observe(2 * GNS_PATIENCE, big, 100, measured=big)
    assert ramp.micro_batches(0) == 6  # capped at --accum-steps
    assert not ramp.observe(10 * GNS_PATIENCE, big, 100, measured=big)
    ramp.observe(20 * GNS_PATIENCE, 1.0, 10**6, measured=big)
    assert ramp.micro_batches(0) == 6  # a small noise scale never shrinks it


def test_ramp_settings_are_checked():
    assert parse_ramp("2:50") == ("linear", 2, 50)
    for bad in ("2", "0:5", "2:0", "a:b", "gns:2", "-1:3"):
        with pytest.raises(ConfigError, match="--batch-ramp must be START:STEPS"):
            TrainConfig(batch_ramp=bad)
    with pytest.raises(ConfigError, match="--batch-ramp START .5. must be <= --accum-steps .4."):
        TrainConfig(batch_ramp="5:10", accum_steps=4)
    with pytest.raises(ConfigError, match="--global-batch"):
        TrainConfig(batch_ramp="1:10", global_batch=16)
    with pytest.raises(ConfigError, match="--lr-scaling must be one of none, linear, sqrt"):
        TrainConfig(lr_scaling="cube")
    with pytest.raises(ConfigError, match="--gns-beta"):
        TrainConfig(gns_beta=1.0)
    assert TrainConfig(batch_ramp="gns").measures_gns
