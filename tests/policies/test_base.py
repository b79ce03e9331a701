"""The policy contract: what GradientView lends and re-measures, and the order policies apply in.

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradstep import ClipNorm
from gradstep.policies import (
    AutoClip,
    GradientView,
    SpikeGuard,
    ZClip,
)
from tests.policies.helpers import Run

TOL = 1e-12  # float64 end to end: only rounding of w - (w - g) remains


def _view(grads, owners, scale=1.0):
    return GradientView(
        grads=grads, scale=scale, norm=1.0, norm_type=2.0, loss=0.0, step=0, params=owners,
        global_norm=lambda g, p: torch.linalg.vector_norm(torch.cat([t.flatten() for t in g])),
        grad_owners=owners,
    )  # fmt: skip


def test_gradient_view_named_grads_pairs_buffers_with_their_owners():
    # Gradients held outside .grad (fp32 accumulation buffers) keep their parameter.
    a, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(3))
    buffers = [torch.full((2, 2), 2.0), torch.full((3,), 4.0)]  # not a.grad / b.grad
    triples = _view(buffers, [("a", a), ("b", b)], scale=0.5).named_grads()
    assert [(n, p) for n, p, _ in triples] == [("a", a), ("b", b)]
    assert triples[0][2] is buffers[0] and torch.equal(buffers[1], torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="grad_owners has 1 entries for 2"):
        _view(buffers, [("a", a)])


def test_gradient_view_measures_again_only_after_lending_its_tensors():
    g = [torch.tensor([3.0, 4.0])]
    view = _view(g, [("w", nn.Parameter(torch.zeros(2)))])
    assert not view.settle() and view.norm == 1.0  # never handed out: no new measure
    view.grads()[0].mul_(2.0)  # a policy edits in place
    assert view.settle() and view.norm == pytest.approx(10.0)
    assert not view.settle()  # measured: clean again


# ------------------------------------------------------------------- composition


def test_spike_guard_first_keeps_a_skipped_spike_out_of_zclip():
    guard, zclip = SpikeGuard(sigma=3.0, window=8, min_steps=4), ZClip(warmup_steps=3)
    run = Run([guard, zclip])
    run.run([1.0, 1.1, 0.9, 1.05, 0.95, 1.0])
    before = copy.deepcopy(zclip.state_dict())
    _, stats = run.step(40.0)
    assert stats.skipped and zclip.state_dict() == before  # ZClip never saw the spike
    assert [p["name"] for p in stats.policies] == ["SpikeGuard"]  # the chain stopped there


def test_policies_apply_in_list_order_and_see_the_norm_as_it_stands():
    norms = [3.0, 1.0, 2.5, 0.5]
    first = ZClip(warmup_steps=10)  # warm-up only: records what it is shown
    applied, stats = Run([ClipNorm(2.0), first]).run(norms)
    assert first.state_dict()["warmup"] == pytest.approx([2.0, 1.0, 2.0, 0.5], rel=1e-6)
    second = ZClip(warmup_steps=10)
    Run([second, ClipNorm(2.0)]).run(norms)
    assert second.state_dict()["warmup"] == pytest.approx(norms, rel=TOL)
    # AutoClip after ClipNorm: the two coefficients multiply into one.
    applied, stats = Run([ClipNorm(2.0), AutoClip(50)]).run([3.0, 4.0, 1.0])
    # step 2: ClipNorm -> 2.0; AutoClip threshold = median of [2.0] -> no further clip
    # step 3: 1.0 untouched; AutoClip history [2.0, 2.0] -> threshold 2.0
    assert applied == pytest.approx([2.0, 2.0, 1.0], rel=1e-6)
    assert [p["name"] for p in stats[0].policies] == ["ClipNorm", "AutoClip"]
