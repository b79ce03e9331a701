"""Bad arguments are refused by name; the --clip grammar and the public names.

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

import pytest

import gradstep
from gradstep import ClipNorm
from gradstep.policies import (
    AGC,
    AutoClip,
    SpikeGuard,
    ZClip,
    clip_policies,
    find_output_layer,
    parse_clip,
)
from tests.policies.helpers import ConvNet

# --------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: ZClip(alpha=0.0), r"alpha must be a number in \(0, 1\)"),
        (lambda: ZClip(alpha=1.0), r"alpha must be a number in \(0, 1\)"),
        (lambda: ZClip(alpha=-0.5), "alpha"),
        (lambda: ZClip(z_thresh=-1.0), "z_thresh"),
        (lambda: ZClip(z_thresh=float("nan")), "z_thresh"),
        (lambda: ZClip(warmup_steps=0), "warmup_steps"),
        (lambda: ZClip(warmup_steps=2.5), "warmup_steps"),
        (lambda: ZClip(mode="median"), "mode must be one of zscore, mean, percentile"),
        (lambda: ZClip(max_grad_norm=-1.0), "max_grad_norm"),
        (lambda: AutoClip(percentile=0.0), r"percentile must be a number in \(0, 100\]"),
        (lambda: AutoClip(percentile=100.5), r"percentile must be a number in \(0, 100\]"),
        (lambda: AutoClip(history=0), "history"),
        (lambda: AGC(clipping=-0.01), "clipping"),
        (lambda: AGC(eps=0.0), "eps"),
        (lambda: AGC(exclude="head.weight"), "exclude"),
        (lambda: SpikeGuard(sigma=-6.0), "sigma"),
        (lambda: SpikeGuard(window=1), "window"),
        (lambda: SpikeGuard(window=10, min_steps=20), "min_steps must be <= window"),
        (lambda: SpikeGuard(on="gradnorm"), "on must be one of grad_norm, loss, both"),
    ],
)
def test_bad_arguments_are_rejected_by_name(make, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        make()


@pytest.mark.parametrize(
    ("spec", "kind", "attrs"),
    [
        ("none", type(None), {}),
        ("norm", ClipNorm, {"max_norm": 1.0}),
        ("norm:0.5", ClipNorm, {"max_norm": 0.5}),
        ("value:2", gradstep.ClipValue, {"value": 2.0}),
        ("zclip", ZClip, {"z_thresh": 2.5, "alpha": 0.97, "warmup_steps": 25}),
        ("zclip:3", ZClip, {"z_thresh": 3.0}),
        ("autoclip:10", AutoClip, {"percentile": 10.0, "history": 1000}),
        ("AutoClip", AutoClip, {"percentile": 10.0}),
        ("agc:0.02", AGC, {"clipping": 0.02, "eps": 1e-3}),
    ],
)
def test_parse_clip_specs(spec, kind, attrs):
    policy = parse_clip(spec)
    assert type(policy) is kind
    for key, value in attrs.items():
        assert getattr(policy, key) == value


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("zclp", "must be one of none, norm"),
        ("autoclip:abc", "autoclip:abc"),
        ("autoclip:0", "percentile"),
        ("zclip:-1", "z_thresh"),
        ("value", "value needs a number"),
        ("none:1", "must be one of"),
    ],
)
def test_parse_clip_rejects_bad_specs(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_clip(spec)


def test_public_names():
    assert (gradstep.AGC, gradstep.AutoClip, gradstep.ZClip, gradstep.SpikeGuard) == (
        AGC,
        AutoClip,
        ZClip,
        SpikeGuard,
    )
    assert gradstep.find_output_layer is find_output_layer


def test_clip_policies_for_the_cli():
    model = ConvNet()
    policies = clip_policies("agc:0.05", spike_guard=True, model=model)
    assert [type(p) for p in policies] == [SpikeGuard, AGC]
    assert policies[1].clipping == 0.05 and policies[1].exclude == {"head.weight", "head.bias"}
    assert clip_policies("none") == []
    assert [type(p) for p in clip_policies("none", spike_guard=True)] == [SpikeGuard]
