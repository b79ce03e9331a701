"""AutoClip against the percentile of past norms (helpers.linear_percentile).

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from gradstep.policies import AutoClip
from tests.policies.helpers import (
    Run,
    linear_percentile,
    spiky_norms,
)

TOL = 1e-12  # float64 end to end: only rounding of w - (w - g) remains

# ---------------------------------------------------------------------- AutoClip


@pytest.mark.parametrize("percentile", [10.0, 37.5, 100.0])
def test_autoclip_clips_to_the_percentile_of_a_bounded_history(percentile):
    norms = spiky_norms()
    history = 6
    policy = AutoClip(percentile=percentile, history=history)
    applied, stats = Run(policy).run(norms)
    assert applied[0] == pytest.approx(norms[0], rel=TOL) and not stats[0].clipped
    assert stats[0].policies[0]["threshold"] is None  # no history: first step not clipped
    for t in range(1, len(norms)):
        earlier = norms[max(0, t - history) : t]
        threshold = linear_percentile(earlier, percentile)
        assert threshold == pytest.approx(float(np.percentile(earlier, percentile)), rel=TOL)
        assert stats[t].policies[0]["threshold"] == pytest.approx(threshold, rel=TOL)
        assert applied[t] == pytest.approx(min(norms[t], threshold), rel=TOL)
    assert policy.state_dict()["norms"] == pytest.approx(norms[-history:], rel=TOL)
    assert 0 < sum(s.clipped for s in stats) < len(norms) - 1
