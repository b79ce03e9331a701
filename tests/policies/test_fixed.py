"""Clipping acts on the global, normalised gradient and reports the pre-clip norm."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import gradstep
from tests.support.asserts import rel_err
from tests.support.batches import collate, make_window
from tests.support.models import TinyLM
from tests.support.reference import lm_loss, reference_grads

WINDOW = [[5, 9], [2], [11, 3, 4]]


def run(clip, seed=0, scale_loss=1.0):
    torch.manual_seed(seed)
    model = TinyLM()
    mbs, seqs = make_window(WINDOW, seed=seed)
    ref, _ = reference_grads(model, collate(seqs))
    m = copy.deepcopy(model)
    stepper = gradstep.Stepper(m, torch.optim.SGD(m.parameters(), lr=0.0), clip=clip)
    stats = stepper.step(mbs, lm_loss)
    return stats, [p.grad for p in m.parameters()], ref


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_reported_norm_is_total_norm_of_full_batch_gradient(norm_type):
    stats, _, ref = run(gradstep.ClipNorm(1e6, norm_type=norm_type))
    expected = float(torch.nn.utils.get_total_norm(ref, norm_type))
    assert stats.grad_norm == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_norm_caps_at_max_norm_when_exceeded(norm_type):
    _, _, ref = run(None)
    full = float(torch.nn.utils.get_total_norm(ref, norm_type))
    max_norm = full / 3
    stats, got, _ = run(gradstep.ClipNorm(max_norm, norm_type=norm_type))
    after = float(torch.nn.utils.get_total_norm(got, norm_type))
    assert stats.clipped and stats.clip_coef < 1.0
    assert after == pytest.approx(max_norm, rel=1e-5)
    assert stats.post_clip_norm == pytest.approx(after, rel=1e-6)
    assert stats.grad_norm == pytest.approx(full, rel=1e-6)
    # clipping rescales, it does not change direction
    assert rel_err([g * (full / after) for g in got], ref) <= 1e-5


def test_clip_norm_leaves_small_gradients_untouched():
    _, _, ref = run(None)
    full = float(torch.nn.utils.get_total_norm(ref, 2.0))
    stats, got, _ = run(gradstep.ClipNorm(full * 1.5))
    assert not stats.clipped and stats.clip_coef == 1.0
    assert rel_err(got, ref) <= 1e-6


def test_clip_value_bounds_every_element():
    """Against the unclipped normalised reference r: elements with r > value become exactly
    value, r < -value exactly -value, the others stay r. A band of 1e-5 relative around
    +-value is left out of the exact checks (float32 vs the reference's rounding) and only
    bounded."""
    _, _, ref = run(None)
    peak = max(float(g.abs().max()) for g in ref)
    value = peak / 4
    stats, got, _ = run(gradstep.ClipValue(value))
    assert stats.clipped and stats.clip_threshold == value
    bound = torch.tensor(value, dtype=torch.float32)  # the clamp bound as stored in float32
    counts = {"above": 0, "below": 0, "inside": 0}
    for g, r in zip(got, ref, strict=True):
        above, below = r > value * (1 + 1e-5), r < -value * (1 + 1e-5)
        inside = r.abs() < value * (1 - 1e-5)
        assert torch.equal(g[above], bound.expand_as(g[above]))
        assert torch.equal(g[below], (-bound).expand_as(g[below]))
        torch.testing.assert_close(g[inside], r[inside], rtol=1e-6, atol=1e-6 * peak)
        assert bool((g.abs() <= bound).all())  # the band too
        for key, mask in (("above", above), ("below", below), ("inside", inside)):
            counts[key] += int(mask.sum())
    assert min(counts.values()) > 0, counts  # guard: both signs clamped, some untouched
    # The reported norms and coefficient against the clamped reference, computed here.
    clamped = [r.clamp(-value, value) for r in ref]
    ref_norm = float(torch.nn.utils.get_total_norm(ref))
    clamped_norm = float(torch.nn.utils.get_total_norm(clamped))
    assert stats.grad_norm == pytest.approx(ref_norm, rel=1e-6)
    assert stats.post_clip_norm == pytest.approx(clamped_norm, rel=1e-5)
    assert stats.clip_coef == pytest.approx(clamped_norm / ref_norm, rel=1e-5)


def test_clip_value_not_exceeded_reports_not_clipped():
    stats, _, _ = run(gradstep.ClipValue(1e9))
    assert not stats.clipped and stats.clip_coef == 1.0


def test_policies_compose_in_order():
    _, _, ref = run(None)
    full = float(torch.nn.utils.get_total_norm(ref, 2.0))
    stats, got, _ = run([gradstep.ClipNorm(full / 2), gradstep.ClipNorm(full / 4)])
    assert float(torch.nn.utils.get_total_norm(got, 2.0)) == pytest.approx(full / 4, rel=1e-5)
    assert stats.clip_coef == pytest.approx(0.25, rel=1e-5)
    assert [p["acted"] for p in stats.policies] == [True, True]


def test_default_clip_is_clip_norm_one():
    model = TinyLM()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(stepper.clip) == 1 and isinstance(stepper.clip[0], gradstep.ClipNorm)
    assert stepper.clip[0].max_norm == 1.0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_bad_max_norm_rejected(bad):
    with pytest.raises(ValueError, match="max_norm"):
        gradstep.ClipNorm(max_norm=bad)


def test_bad_norm_type_and_value_rejected():
    with pytest.raises(ValueError, match="norm_type"):
        gradstep.ClipNorm(1.0, norm_type=0.5)
    with pytest.raises(ValueError, match="value"):
        gradstep.ClipValue(-1.0)
    model = TinyLM()
    with pytest.raises(TypeError, match="clip must be"):
        gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip="norm")


def test_parse_clip():
    assert gradstep.policies.parse_clip("none") is None
    assert gradstep.policies.parse_clip("norm:0.5").max_norm == 0.5
    assert gradstep.policies.parse_clip("value:2").value == 2.0
    with pytest.raises(ValueError, match="--clip"):
        gradstep.policies.parse_clip("bogus")
