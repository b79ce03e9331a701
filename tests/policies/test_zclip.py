"""ZClip against the formula of Kumar et al. 2025 (helpers.zclip_reference).

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradstep.policies import ZClip
from tests.policies.helpers import (
    Run,
    spiky_norms,
    zclip_reference,
)

TOL = 1e-12  # float64 end to end: only rounding of w - (w - g) remains

# ------------------------------------------------------------------------- ZClip


@pytest.mark.parametrize("mode", ["zscore", "mean", "percentile"])
@pytest.mark.parametrize("cap", [None, 4.0])
def test_zclip_follows_the_formula_on_a_spiky_sequence(mode, cap):
    norms = spiky_norms()
    policy = ZClip(alpha=0.9, z_thresh=2.0, warmup_steps=5, mode=mode, max_grad_norm=cap)
    applied, stats = Run(policy).run(norms)
    expected = zclip_reference(norms, 0.9, 2.0, 5, mode, cap)
    np.testing.assert_allclose(applied, expected, rtol=TOL, atol=TOL)
    acted = [s.policies[0]["acted"] for s in stats]
    assert acted == [e < g for e, g in zip(expected, norms, strict=True)]
    assert 3 <= sum(acted) < len(norms) - 10  # the test clips some steps, not all
    for s, g, e, was_clipped in zip(stats, norms, expected, acted, strict=True):
        assert s.grad_norm == pytest.approx(g, rel=TOL)  # pre-clip
        if was_clipped:  # reported threshold = the norm clipped to = post-clip norm
            assert s.policies[0]["threshold"] == pytest.approx(e, rel=TOL)
            assert s.post_clip_norm == pytest.approx(e, rel=TOL)


def test_zclip_hand_computed_and_ema_takes_the_clipped_value():
    policy = ZClip(alpha=0.97, z_thresh=2.5, warmup_steps=3)
    run = Run(policy)
    applied, stats = run.run([1.0, 2.0, 3.0])
    assert applied == pytest.approx([1.0, 2.0, 3.0], rel=TOL)  # warm-up: never clipped
    assert [s.policies[0]["threshold"] for s in stats] == [None, None, None]
    mean, var = 2.0, 2.0 / 3.0  # mean and POPULATION variance of 1, 2, 3
    assert policy.mean == pytest.approx(mean, rel=TOL) and policy.var == pytest.approx(var)
    std = math.sqrt(var)
    z = (10.0 - mean) / (std + 1e-6)
    clipped = mean + 2.5**2 / z * std  # the reciprocal threshold, ~2.51
    got, s = run.step(10.0)
    assert got == pytest.approx(clipped, rel=TOL) and s.clipped and s.clip_coef < 0.26
    new_mean = 0.97 * mean + 0.03 * clipped
    new_var = 0.97 * var + 0.03 * (clipped - new_mean) ** 2
    assert policy.mean == pytest.approx(new_mean, rel=TOL)
    assert policy.var == pytest.approx(new_var, rel=TOL)
    assert abs(policy.mean - (0.97 * mean + 0.03 * 10.0)) > 0.2  # raw value would differ
    # A norm inside the band is untouched; the reported threshold is the band's edge.
    got, s = run.step(2.1)
    assert got == pytest.approx(2.1, rel=TOL) and not s.clipped
    edge = new_mean + 2.5 * (math.sqrt(new_var) + 1e-6)
    assert s.policies[0]["threshold"] == pytest.approx(edge, rel=TOL)


def test_zclip_max_grad_norm_caps_warmup_but_not_the_statistics():
    policy = ZClip(warmup_steps=3, max_grad_norm=1.5)
    applied, stats = Run(policy).run([1.0, 2.0, 3.0])
    assert applied == pytest.approx([1.0, 1.5, 1.5], rel=TOL)
    assert [s.policies[0]["threshold"] for s in stats] == [1.5, 1.5, 1.5]
    assert policy.mean == pytest.approx(2.0, rel=TOL)  # raw norms, not the capped ones
    # After warm-up: 2.5 is inside the z band (no adaptive clip) but above the cap.
    run = Run(ZClip(warmup_steps=3, max_grad_norm=2.2))
    applied, stats = run.run([1.0, 2.0, 3.0, 2.5])
    assert applied[-1] == pytest.approx(2.2, rel=TOL) and stats[-1].clipped
    zclip = run.stepper.clip[0]
    assert zclip.mean == pytest.approx(0.97 * 2.0 + 0.03 * 2.5, rel=TOL)  # the EMA saw 2.5
