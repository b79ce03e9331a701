"""Properties of the probe's and the planner's arithmetic, for every input hypothesis finds.

Units round-trip; a budget read off an error message is enough; the analytic model grows
with the micro-batch and counts its fixed cost once; the probe's prediction is never below
the true peak of a synthetic process (fixed cost, cost per item, kernels per input shape
in a bounded cache) however many shapes training meets; a plan's micro-batches sum to the
per-rank batch, its short last micro-batch is predicted with its own size, and what it
calls fitting fits.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from gradstep.memory import (
    ProbeResult,
    TransformerShape,
    estimate_step_memory,
    format_bytes,
    parse_size,
    plan_step,
    probe,
    probe_memory,
    step_predictor,
)
from gradstep.memory.plan import budget_text, needed_budget

MiB = 2**20
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


# ----------------------------------------------------------------------------- units


@given(st.integers(1, 10**6), st.sampled_from(sorted(UNITS)))
def test_a_whole_number_of_units_is_that_many_bytes(k, unit):
    assert parse_size(f"{k}{unit}") == k * UNITS[unit]
    assert parse_size(f"{k} {unit.lower()}") == k * UNITS[unit]


@given(st.integers(1, 2**50))
def test_format_then_parse_is_within_the_printed_precision(n):
    text = format_bytes(n)
    value, unit = text.split()
    back = parse_size(value + unit)
    step = UNITS.get(unit, 1)
    assert abs(back - n) <= 0.005 * step + 0.5  # two decimals of the printed unit


@given(st.floats(1, 2**40, allow_nan=False))
def test_a_budget_read_off_a_message_holds_what_it_said(n):
    assert n <= parse_size(budget_text(n)) < n + 0.1 * MiB + 1


@given(st.floats(1, 2**40), st.floats(0, 0.9))
def test_the_needed_budget_leaves_the_margin(peak, margin):
    need = needed_budget(peak, margin)
    assert need * (1 - margin) >= peak * (1 - 1e-12)
    assert (need - 1) * (1 - margin) < peak


# ----------------------------------------------------------------------------- analytic model

SHAPES = st.builds(
    TransformerShape,
    n_layer=st.integers(1, 6),
    d_model=st.sampled_from([16, 32, 64, 96]),
    n_head=st.sampled_from([1, 2, 4]),
    vocab_size=st.sampled_from([64, 256]),
    seq_len=st.integers(1, 128),
)
SETTINGS = st.fixed_dictionaries(
    {
        "compute_dtype": st.sampled_from([None, torch.bfloat16]),
        "optimizer": st.sampled_from(["adamw", "lamb", "lars", "sgd_momentum", "sgd"]),
        "activation_checkpointing": st.booleans(),
        "dropout": st.sampled_from([0.0, 0.1]),
        "attention": st.sampled_from(["fused", "math"]),
        "world_size": st.sampled_from([1, 2, 3]),
        "sharded": st.booleans(),
        "accum_steps": st.sampled_from([None, 1, 4]),
    }
)


@given(SHAPES, SETTINGS, st.integers(1, 15), st.integers(0, 10**9))
def test_the_estimate_grows_with_the_micro_batch_and_counts_the_fixed_cost_once(
    shape, kw, mbs, fixed
):
    small = estimate_step_memory(shape, mbs, **kw)
    large = estimate_step_memory(shape, mbs + 1, **kw)
    assert large.total >= small.total
    assert large.activations > small.activations
    with_fixed = estimate_step_memory(shape, mbs, fixed_bytes=fixed, **kw)
    assert with_fixed.total == small.total + fixed


# ----------------------------------------------------------------------------- the probe


class Process:
    """A synthetic process: ``in_use`` bytes resident; a step of ``b`` items at a new input
    shape compiles kernels (``per_shape`` bytes, kept in a cache of ``cap`` shapes) and
    peaks ``transient + per_item * b`` above what is then resident."""

    def __init__(self, base: int, transient: int, per_item: int, per_shape: int, cap: int):
        self.in_use, self.transient, self.per_item = base, transient, per_item
        self.per_shape, self.cap = per_shape, cap
        self.cache: list[object] = []
        self.peak = base

    def step(self, b: int, shape: object) -> None:
        if shape not in self.cache:
            if len(self.cache) == self.cap:
                self.cache.pop(0)
                self.in_use -= self.per_shape
            self.cache.append(shape)
            self.in_use += self.per_shape
        self.peak = max(self.peak, self.in_use + self.transient + self.per_item * b)

    def reset(self, device: object = None) -> str:
        self.peak = self.in_use
        return "synthetic"


@given(
    base=st.integers(100 * MiB, 400 * MiB),
    transient=st.integers(0, 50 * MiB),
    per_item=st.integers(MiB, 40 * MiB),
    per_shape=st.sampled_from([0, 3 * MiB, 12 * MiB]),
    cap=st.integers(1, 8),
    b=st.integers(1, 64),
    shapes_seen=st.integers(1, 400),
)
def test_the_probe_never_predicts_below_the_true_peak(
    base, transient, per_item, per_shape, cap, b, shapes_seen
):
    proc = Process(base, transient, per_item, per_shape, cap)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe, "reset_peak", proc.reset)
        mp.setattr(probe, "peak_bytes", lambda device=None: proc.peak)
        mp.setattr(probe, "current_bytes", lambda device=None: proc.in_use)
        res = probe_memory(
            lambda n: proc.step(n, ("full", n)),
            (1, 2, 4),
            device="cpu",
            shapes=lambda i: proc.step(1, ("sweep", i)),
            max_shapes=2 * cap + 4,
        )
    assert res.shapes_settled
    # The same process goes on training at micro-batch b, meeting shapes_seen shapes.
    cached = min(cap, shapes_seen)
    true = base + per_shape * cached + transient + per_item * b
    predicted = res.predict(b) + res.shape_bytes
    assert predicted >= true
    if cap >= 3:  # the probe's three sizes fit in the cache: the measurement is exact
        assert res.predict(b) == base + per_shape + transient + per_item * b
        assert res.shape_bytes == per_shape * (cap - 1)
        assert predicted == base + per_shape * cap + transient + per_item * b


# ----------------------------------------------------------------------------- the planner


def _linear(fixed: int, per_item: int, ckpt_per_item: int):  # noqa: ANN202
    def predict(mbs: int, ckpt: bool) -> int:
        return fixed + (ckpt_per_item if ckpt else per_item) * mbs

    return predict


PLANS = st.fixed_dictionaries(
    {
        "global_batch": st.integers(1, 96),
        "world_size": st.integers(1, 4),
        "fixed": st.integers(50 * MiB, 400 * MiB),
        "per_item": st.integers(MiB, 60 * MiB),
        "ckpt_share": st.floats(0.05, 1.0),
        "budget": st.integers(100 * MiB, 4096 * MiB),
        "margin": st.sampled_from([0.0, 0.1, 0.25]),
    }
)


@given(PLANS)
def test_a_plan_covers_the_batch_and_what_it_calls_fitting_fits(p):
    assume(p["world_size"] <= p["global_batch"])
    predict = _linear(p["fixed"], p["per_item"], max(1, int(p["per_item"] * p["ckpt_share"])))
    per_rank = math.ceil(p["global_batch"] / p["world_size"])
    usable = p["budget"] * (1 - p["margin"])
    try:
        plan = plan_step(
            p["budget"],
            p["global_batch"],
            world_size=p["world_size"],
            predict=predict,
            margin=p["margin"],
        )
    except ValueError as exc:
        # Nothing fits; the budget the message names does (the planner's own rounding up).
        named = str(exc).split("a budget of at least ")[1].split()[0]
        again = plan_step(
            named,
            p["global_batch"],
            world_size=p["world_size"],
            predict=predict,
            margin=p["margin"],
        )
        assert again.predicted_peak_bytes <= parse_size(named) * (1 - p["margin"])
        return
    assert plan.predicted_peak_bytes <= usable
    for c in plan.candidates:
        assert (c.accum_steps - 1) * c.micro_batch_size + c.last_micro_batch_size == per_rank
        assert 1 <= c.last_micro_batch_size <= c.micro_batch_size
        ckpt = c.activation_checkpointing
        own = max(predict(c.micro_batch_size, ckpt), predict(c.last_micro_batch_size, ckpt))
        assert c.predicted_peak_bytes == own
        assert c.fits == (c.predicted_peak_bytes <= usable)
    for ckpt in (False, True):  # monotone predictions: what fits is every size below
        sizes = sorted(
            c.micro_batch_size for c in plan.candidates if c.activation_checkpointing == ckpt
        )
        fits = [
            c.fits
            for c in sorted(plan.candidates, key=lambda c: c.micro_batch_size)
            if c.activation_checkpointing == ckpt
        ]
        assert fits == sorted(fits, reverse=True), sizes


@given(
    st.integers(1, 64),
    st.integers(1, 64),
    st.integers(0, 20 * MiB),
    st.integers(0, 20 * MiB),
    st.booleans(),
)
def test_the_probe_configuration_is_predicted_as_measured(
    per_rank, mbs, per_shape, shape_bytes, swept
):
    """A candidate that is what the probe ran (one micro-batch, same checkpointing) gets
    the probe's own line, the fixed cost once, plus where the analytic model bends away
    from its own line through the probe's sizes (nothing at those sizes); plus the shapes."""
    assume(mbs <= per_rank)
    shape = TransformerShape(n_layer=2, d_model=32, n_head=2, vocab_size=64, seq_len=16)
    res = ProbeResult(
        fixed_bytes=300 * MiB,
        per_item_bytes=5 * MiB,
        points=[(1, 0, 0.0), (2, 0, 0.0)],
        seconds_total=0.0,
        source="x",
        per_shape_bytes=per_shape,
        shape_bytes=shape_bytes if swept else 0,
        shapes_run=3 if swept else 0,
    )

    def ran(b):  # what the probe ran: one micro-batch a step
        return estimate_step_memory(shape, b, accum_steps=1).total

    bend = ran(mbs) - (ran(1) + (ran(2) - ran(1)) * (mbs - 1))
    assert bend == 0 or mbs > 2
    predict = step_predictor(shape, probe=res, per_rank_batch=mbs)
    assert predict(mbs, False) == round(res.predict(mbs) + bend) + (shape_bytes if swept else 0)
    short = step_predictor(shape, probe=res, per_rank_batch=per_rank)
    extra = shape_bytes if swept else (per_shape if per_rank % mbs else 0)
    analytic = estimate_step_memory(shape, mbs, accum_steps=math.ceil(per_rank / mbs)).total
    analytic -= ran(mbs)
    assert short(mbs, False) == round(res.predict(mbs) + bend + analytic + extra)
