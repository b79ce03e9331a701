"""The planner's time and the analytic model's unknowns, as properties: where a held-out
mutation audit found bugs surviving (issue 20, section 4).

- A step's predicted time is the sum of its micro-batches' times, the short last one at its
  own size (per-rank 10 in micro-batches of 4 is 4 + 4 + 2, not 3 x 4), and the relative
  throughputs, which choose the plan, follow from those times.
- ``accum_steps=None`` (unknown) is the worst case: never below the estimate for any
  known number of micro-batches per step (the docstring: "gradients are counted as alive
  at the backward peak").
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from gradstep.memory import TransformerShape, estimate_step_memory, plan_step
from gradstep.memory.plan import default_step_time

# ----------------------------------------------------------------------------- step time


def micro_batch_sizes(per_rank: int, mbs: int) -> list[int]:
    """The micro-batches a rank's share is cut into, as a user would cut a list."""
    return [len(chunk) for chunk in torch.arange(per_rank).split(mbs)]


@given(
    global_batch=st.integers(1, 64),
    world=st.integers(1, 4),
    overhead=st.floats(0.0, 16.0),
    factor=st.floats(1.0, 2.0),
)
def test_a_steps_time_is_the_sum_of_its_micro_batches_times(global_batch, world, overhead, factor):
    assume(world <= global_batch)
    per_rank = math.ceil(global_batch / world)
    timer = default_step_time(overhead, factor)
    plan = plan_step(
        "1TiB", global_batch, world_size=world, predict=lambda mbs, ckpt: 0, step_time=timer
    )
    speed = {}
    for c in plan.candidates:
        sizes = micro_batch_sizes(per_rank, c.micro_batch_size)
        assert (c.accum_steps, c.last_micro_batch_size) == (len(sizes), sizes[-1])
        want = sum(timer(n, c.activation_checkpointing) for n in sizes)
        assert c.step_seconds == pytest.approx(want, rel=1e-12, abs=1e-12)
        speed[c] = per_rank / want if want else math.inf
    best = max(speed.values())
    if math.isfinite(best):
        for c, items_per_second in speed.items():
            assert c.relative_throughput == pytest.approx(items_per_second / best, rel=1e-9)


def test_a_short_last_micro_batch_is_timed_at_its_own_size():
    plan = plan_step("1TiB", 10, predict=lambda mbs, ckpt: 0, checkpointing=(False,))
    by_size = {c.micro_batch_size: c for c in plan.candidates}
    # Default timer: one item's worth of overhead per micro-batch, one unit per item.
    assert by_size[4].step_seconds == pytest.approx((1 + 4) + (1 + 4) + (1 + 2))
    assert by_size[10].step_seconds == pytest.approx(1 + 10)
    assert by_size[4].relative_throughput == pytest.approx(11 / 13)


# ----------------------------------------------------------------------------- unknown accum

SHAPES = st.builds(
    TransformerShape,
    n_layer=st.integers(1, 4),
    d_model=st.sampled_from([16, 32, 64]),
    n_head=st.sampled_from([1, 2, 4]),
    vocab_size=st.sampled_from([64, 256, 4096]),
    seq_len=st.integers(1, 256),
)
SETTINGS = st.fixed_dictionaries(
    {
        "param_dtype": st.sampled_from([torch.float32, torch.bfloat16]),
        "compute_dtype": st.sampled_from([None, torch.bfloat16]),
        "optimizer": st.sampled_from(["adamw", "lamb", "lars", "sgd_momentum", "sgd"]),
        "activation_checkpointing": st.booleans(),
        "sync_each_micro_batch": st.booleans(),
        "foreach": st.booleans(),
        "dropout": st.sampled_from([0.0, 0.1]),
        "attention": st.sampled_from(["fused", "math"]),
        "world_size": st.sampled_from([1, 2, 3]),
        "sharded": st.booleans(),
    }
)


@given(SHAPES, SETTINGS, st.integers(1, 16))
def test_unknown_accumulation_steps_are_the_worst_case(shape, kw, mbs):
    unknown = estimate_step_memory(shape, mbs, accum_steps=None, **kw)
    for steps in (1, 2, 3, 8):
        known = estimate_step_memory(shape, mbs, accum_steps=steps, **kw)
        assert unknown.total >= known.total, steps
        assert unknown.backward_peak >= known.backward_peak, steps


def test_unknown_accumulation_steps_are_the_worst_case_under_fsdp2_too():
    """Found by the held-out audit: under FSDP2 without per-micro-batch sync, unknown
    accumulation left out the reduce-scatter buffers (two blocks' unsharded gradients) that
    one micro-batch holds; with one layer and a small vocabulary they exceed the whole
    unsharded gradient."""
    shape = TransformerShape(n_layer=1, d_model=256, n_head=2, vocab_size=64, seq_len=1)
    kw = {"sharded": True, "world_size": 2, "activation_checkpointing": True}
    unknown = estimate_step_memory(shape, 1, accum_steps=None, **kw)
    assert unknown.total >= estimate_step_memory(shape, 1, accum_steps=1, **kw).total
