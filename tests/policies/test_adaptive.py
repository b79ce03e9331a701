"""Adaptive clip policies (AGC, AutoClip, ZClip) and SpikeGuard against plain references.

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. The expected values are computed the plain way, in float64, from the
papers' formulas (``statistics``, sorted lists, explicit per-row loops), independently of
the implementation; the harness and the references are in ``helpers.py``.
"""

from __future__ import annotations

import copy
import io
import json
import math
import statistics

import numpy as np
import pytest
import torch
from torch import nn

import gradstep
from gradstep import ClipNorm, LossSum, Stepper
from gradstep.policies import (
    AGC,
    AutoClip,
    GradientView,
    SpikeGuard,
    ZClip,
    clip_policies,
    find_output_layer,
    parse_clip,
)
from tests.policies.helpers import (
    ConvNet,
    Run,
    agc_reference,
    fsdp_worker,
    linear_percentile,
    mse_sum,
    spike_reference,
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


# --------------------------------------------------------------------------- AGC


def test_agc_unitwise_on_conv_and_linear_with_output_layer_excluded():
    torch.manual_seed(0)
    model = ConvNet().double()
    with torch.no_grad():
        model.fc.weight[0].zero_()  # a unit whose weight norm is below eps
    x, y = torch.randn(5, 2, 5, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ref = copy.deepcopy(model)
    (ref(x) - y).square().sum().div(5).backward()  # the plain full-batch mean gradient
    raw = {n: p.grad.clone() for n, p in ref.named_parameters()}
    exclude = find_output_layer(model)
    assert exclude == ["head.weight", "head.bias"]
    # Pick the clipping ratio between the middle unit ratios so about half the units clip.
    ratios = []
    for n, p in model.named_parameters():
        if n in exclude:
            continue
        w = p.detach().flatten(1) if p.dim() > 1 else p.detach().view(1, -1)
        g = raw[n].flatten(1) if p.dim() > 1 else raw[n].view(1, -1)
        ratios += (g.norm(dim=1) / w.norm(dim=1).clamp_min(1e-3)).tolist()
    ratios.sort()
    mid = len(ratios) // 2
    clipping = (ratios[mid - 1] + ratios[mid]) / 2
    expected = agc_reference(model, raw, clipping, 1e-3, exclude)
    policy = AGC(clipping=clipping, exclude=exclude)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = Stepper(model, opt, clip=policy).step([(x[:2], y[:2]), (x[2:], y[2:])], mse_sum)
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), expected[n], rtol=TOL, atol=TOL)
    torch.testing.assert_close(before["head.weight"] - model.head.weight, raw["head.weight"])
    assert policy.clipped_units == mid  # half of the units, counted
    assert stats.clipped and stats.policies == [
        {"name": "AGC", "threshold": clipping, "acted": True}
    ]
    full = lambda gs: math.sqrt(sum(float(g.square().sum()) for g in gs.values()))
    assert stats.grad_norm == pytest.approx(full(raw), rel=1e-12)
    assert stats.post_clip_norm == pytest.approx(full(expected), rel=1e-12)
    # The zeroed row's ratio uses eps: clipped to clipping * eps exactly.
    assert float(expected["fc.weight"][0].norm()) == pytest.approx(clipping * 1e-3, rel=1e-12)


def test_agc_not_acting_when_all_units_are_within_the_ratio():
    model = ConvNet().double()
    x, y = torch.randn(3, 2, 5, 5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=AGC(clipping=1e9))
    stats = stepper.step([(x, y)], mse_sum)
    assert not stats.clipped and stats.post_clip_norm == stats.grad_norm


def test_find_output_layer_cases():
    from gradstep_cli.models.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(n_layer=1, n_head=2, d_model=8, max_seq_len=8))
    assert find_output_layer(gpt) == ["embed.weight"]  # lm_head is tied to the embedding
    untied = GPT(GPTConfig(n_layer=1, n_head=2, d_model=8, max_seq_len=8, tie_weights=False))
    assert find_output_layer(untied) == ["lm_head.weight"]

    class Timm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Linear(4, 2)
            self.extra = nn.Linear(2, 2)  # registered later, but not the classifier

        def get_classifier(self) -> nn.Module:
            return self.classifier

    assert find_output_layer(Timm()) == ["classifier.weight", "classifier.bias"]
    with pytest.raises(ValueError, match="no Linear or Conv"):
        find_output_layer(nn.Sequential(nn.LayerNorm(3)))


def test_agc_rejects_unknown_exclude_names():
    model = ConvNet().double()
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=AGC(exclude=["hed"]))
    x, y = torch.randn(2, 2, 5, 5, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"exclude names \['hed'\]"):
        stepper.step([(x, y)], mse_sum)


def test_agc_on_bf16_params_clips_the_fp32_accumulation_buffers():
    # bf16 parameters accumulate in fp32 buffers, not in .grad: AGC must find and clip them.
    model = nn.Linear(4, 3).to(torch.bfloat16)
    xs = [torch.randint(-3, 4, (2, 4)).to(torch.bfloat16) for _ in range(3)]
    # d(sum of outputs)/dW_i = sum of the inputs, d/db_i = rows: integers, exact in bf16.
    total = sum(x.double().sum(0) for x in xs)
    raw = {"weight": total.expand(3, 4) / 6, "bias": torch.full((3,), 1.0, dtype=torch.float64)}
    w, b = model.weight.detach().double(), model.bias.detach().double()
    row_ratios = (raw["weight"].norm(dim=1) / w.norm(dim=1)).tolist()
    ratios = sorted([*row_ratios, float(3**0.5 / b.norm())])
    clipping = (ratios[1] + ratios[2]) / 2  # two of the four units clip
    policy = AGC(clipping=clipping)
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=policy,
                      precision="bf16")  # fmt: skip
    assert stepper.accumulator is not None  # the case under test
    stats = stepper.step(xs, lambda m, mb: LossSum(m(mb).float().sum(), mb.shape[0]))
    ref = nn.Linear(4, 3).double()
    ref.load_state_dict({"weight": w, "bias": b})
    expected = agc_reference(ref, raw, clipping, 1e-3, exclude=[])
    assert policy.clipped_units == 2 and stats.clipped
    for name, p in model.named_parameters():  # .grad = the clipped buffer, rounded once
        torch.testing.assert_close(p.grad.double(), expected[name], rtol=2**-8, atol=0)


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


# ------------------------------------------------------- FSDP2 (2 ranks, gloo)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_agc_zclip_spike_guard_under_fsdp2_match_single_process():
    from tests.support.multiproc import run_ranks

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    run_ranks(fsdp_worker, 2, timeout=75)


# ------------------------------------------------------------------ the CLI


TINY_TRAIN = [
    "train", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0",
]  # fmt: skip


def test_cli_adaptive_clip_and_spike_guard_reach_metrics(tmp_path):
    from gradstep_cli.cli import main

    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--max-steps", "3", "--clip", "zclip:2", "--spike-guard"]
    assert main([*argv, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert [p["name"] for p in row["policies"]] == ["SpikeGuard", "ZClip"]
        assert all({"threshold", "acted"} <= set(p) for p in row["policies"])
    config = json.loads((out / "config.json").read_text())
    assert config["clip"] == "zclip:2" and config["spike_guard"] is True


def test_cli_agc_excludes_the_output_layer_and_toml_spike_guard(tmp_path):
    from gradstep_cli.config.settings import resolve
    from gradstep_cli.models.gpt import GPT, GPTConfig

    toml = tmp_path / "c.toml"
    toml.write_text('clip = "agc:0.01"\nspike-guard = true\n')
    cfg = resolve(toml, spike_guard=None)
    assert cfg.clip == "agc:0.01" and cfg.spike_guard is True
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=8, max_seq_len=8))
    guard, agc = clip_policies(cfg.clip, cfg.spike_guard, model)
    assert isinstance(guard, SpikeGuard) and agc.exclude == {"embed.weight"}  # tied lm_head


def test_cli_rejects_a_bad_clip_spec(capsys):
    from gradstep_cli.cli import main

    assert main([*TINY_TRAIN, "--clip", "zclip:-1"]) == 2
    err = capsys.readouterr().err
    assert "clip" in err and "z_thresh" in err


def test_agc_exclude_accepts_any_iterable_of_names():
    names = ["head.weight", "head.bias"]
    assert gradstep.AGC(exclude=(n for n in names)).exclude == frozenset(names)
    with pytest.raises(TypeError, match="exclude"):
        gradstep.AGC(exclude="head.weight")
