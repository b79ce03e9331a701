"""Every policy's state travels in Stepper.state_dict(): a round trip continues identically.

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from gradstep.policies import (
    AGC,
    AutoClip,
    SpikeGuard,
    ZClip,
)
from tests.policies.helpers import (
    Run,
    spiky_norms,
)

# ------------------------------------------------------------- state round trip


POLICY_FACTORIES = {
    "zclip": lambda: [ZClip(alpha=0.8, z_thresh=1.5, warmup_steps=4)],
    "autoclip": lambda: [AutoClip(percentile=30.0, history=5)],
    "spike_guard": lambda: [SpikeGuard(sigma=2.0, window=6, min_steps=3, on="both")],
    "guard+zclip+agc": lambda: [
        SpikeGuard(sigma=2.5, window=5, min_steps=3),
        ZClip(warmup_steps=3, mode="mean", max_grad_norm=30.0),
        AGC(clipping=0.5),
    ],
}


@pytest.mark.parametrize("name", sorted(POLICY_FACTORIES))
@pytest.mark.parametrize("split", [2, 11])
def test_state_dict_round_trip_continues_identically(name, split):
    make = POLICY_FACTORIES[name]
    norms = spiky_norms(28, seed=3)
    offsets = [0.0] * len(norms)
    offsets[17] = 40.0  # a loss spike for on="both"
    full_applied, full_stats = Run(make(), w=1.0).run(norms, offsets)
    first = Run(make(), w=1.0)
    first.run(norms[:split], offsets[:split])
    buf = io.BytesIO()
    torch.save({"stepper": first.stepper.state_dict(), "opt": first.opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # plain Python types only
    json.dumps(saved["stepper"]["clip"])  # and JSON-serialisable
    second = Run(make(), w=first.model.w.item())
    second.opt.load_state_dict(saved["opt"])
    second.stepper.load_state_dict(saved["stepper"])
    applied, stats = second.run(norms[split:], offsets[split:])
    assert applied == full_applied[split:]  # bitwise identical continuation
    assert [s.policies for s in stats] == [s.policies for s in full_stats[split:]]
    assert [s.skip_reason for s in stats] == [s.skip_reason for s in full_stats[split:]]
    assert any(s.clipped or s.skipped for s in full_stats[split:])
