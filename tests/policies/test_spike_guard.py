"""SpikeGuard: skips outliers of the loss or the norm, state bitwise untouched.

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch

from gradstep.policies import SpikeGuard
from tests.policies.helpers import (
    Run,
    spike_reference,
)

# -------------------------------------------------------------------- SpikeGuard


def test_spike_guard_skips_spikes_and_leaves_state_bitwise_untouched():
    norms = [1.0 + 0.1 * math.sin(i) for i in range(30)]
    norms[2] = 50.0  # before min_steps: not skipped (the guard is not active yet)
    norms[20] = 9.0  # a spike once active: skipped
    norms[24] = 1.9  # within 3 sigma of the window: taken
    guard = SpikeGuard(sigma=3.0, window=8, min_steps=5)
    run = Run(guard, adam=True)
    expected = spike_reference(norms, 3.0, 8, 5)
    assert [i for i, s in enumerate(expected) if s] == [20]  # the case is what we think
    for i, g in enumerate(norms):
        params = copy.deepcopy(run.model.state_dict())
        opt_state = copy.deepcopy(run.opt.state_dict())
        sched_epoch, steps = run.sched.last_epoch, run.stepper.step_count
        _, stats = run.step(g)
        assert stats.skipped == expected[i]
        if expected[i]:
            skipped = stats
            assert torch.equal(run.model.w, params["w"])  # bitwise: no update at all
            state = run.opt.state_dict()["state"][0]
            for key, value in opt_state["state"][0].items():
                assert torch.equal(state[key], value), key
            assert run.sched.last_epoch == sched_epoch and run.stepper.step_count == steps
            assert "grad_norm spike" in stats.skip_reason and "3 sigma" in stats.skip_reason
            assert stats.policies[0]["acted"] and stats.policies[0]["threshold"] < 9.0
        elif i == 2:
            assert not run.model.w.equal(params["w"])
    # The Stepper is the one record of skips (SpikeGuard keeps no counter of its own): one
    # skip, under the guard's reason.
    assert run.stepper.skipped_steps == 1
    assert dict(run.stepper.skip_reasons) == {skipped.skip_reason: 1}
    assert skipped.skip_reason.startswith("SpikeGuard: grad_norm spike")


def test_spike_guard_threshold_uses_the_sample_std():
    history = [1.0, 2.0, 1.0, 2.0]
    limit = statistics.fmean(history) + 2.0 * statistics.stdev(history)  # 1.5 + 2 * 0.577
    assert 1.5 + 2.0 * statistics.pstdev(history) < 2.6 < limit < 2.7  # 2.6 tells them apart
    for value, skipped in [(2.6, False), (2.7, True)]:
        run = Run(SpikeGuard(sigma=2.0, window=4, min_steps=4))
        _, stats = run.run([*history, value])
        assert stats[-1].skipped is skipped
        assert stats[-1].policies[0]["threshold"] == pytest.approx(limit, rel=1e-12)


@pytest.mark.parametrize("on", ["grad_norm", "loss", "both"])
def test_spike_guard_signal_selection(on):
    norms = [1.0 + 0.05 * math.cos(i) for i in range(16)]
    offsets = [0.02 * math.sin(i) for i in range(16)]
    norms[10] = 8.0  # a grad-norm spike with a normal loss
    offsets[13] = 30.0  # a loss spike with a normal grad norm
    _, stats = Run(SpikeGuard(sigma=4.0, window=8, min_steps=6, on=on)).run(norms, offsets)
    skipped = [i for i, s in enumerate(stats) if s.skipped]
    assert skipped == {"grad_norm": [10], "loss": [13], "both": [10, 13]}[on]
    # Each skip names the signal that fired; every other step has no reason.
    if on in ("grad_norm", "both"):
        assert "grad_norm spike" in stats[10].skip_reason
        assert "loss spike" not in stats[10].skip_reason
    if on in ("loss", "both"):
        assert "loss spike" in stats[13].skip_reason
        assert "grad_norm spike" not in stats[13].skip_reason
    assert all(s.skip_reason is None for i, s in enumerate(stats) if i not in skipped)
