"""AGC, unit-wise, against a per-row float64 loop (helpers.agc_reference).

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradstep
from gradstep import LossSum, Stepper
from gradstep.policies import (
    AGC,
    find_output_layer,
)
from tests.policies.helpers import (
    ConvNet,
    agc_reference,
    mse_sum,
)

TOL = 1e-12  # float64 end to end: only rounding of w - (w - g) remains

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


def test_agc_exclude_accepts_any_iterable_of_names():
    names = ["head.weight", "head.bias"]
    assert gradstep.AGC(exclude=(n for n in names)).exclude == frozenset(names)
    with pytest.raises(TypeError, match="exclude"):
        gradstep.AGC(exclude="head.weight")
