"""Properties of the noise-scale hook (:class:`gradstep.GradientNoiseScale`) where the step
around it varies: what it holds after a run is decided by the windows the Stepper takes,
and by nothing else.

- A skipped step is never measured: after windows [A..., skipped, B...] the hook's state
  (EMAs, measured steps, last estimate) equals its state after [A..., B...], whatever
  skipped it (a policy's skip, a non-finite gradient, an fp16 overflow, 0 items).
- The clip policy does not change the measurement: B_simple's parts are L2 quantities of
  the pre-clip gradient, whatever norm type the policies use (ClipNorm 1 / 2 / inf,
  ClipValue, AGC, none), with the norm taken in backward or after it.
- A window redone after out-of-memory (``on_oom="split"``) is measured once: the state
  equals that of a Stepper given the split window directly.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import gradstep
from gradstep import GradientNoiseScale, LossSum, Stepper
from gradstep.step.oom import halve, split_in_half

D, H = 5, 4
SIZES = (3, 6, 2)  # rows of each micro-batch: unequal
EXACT = 1e-12


def _model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, 1)).to(dtype)


def _loss(model: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = mb
    return LossSum(0.5 * (model(x) - y).square().sum(), x.shape[0])


def _windows(steps: int, seed: int, sizes: tuple[int, ...] = SIZES, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        window = []
        for n in sizes:
            x = torch.randn(n, D, generator=gen, dtype=torch.float64)
            y = x[:, :1] - 2 * x[:, 1:2] + torch.randn(n, 1, generator=gen, dtype=torch.float64)
            window.append((scale * x, scale * y))
        out.append(window)
    return out


def _cast(window: list, dtype: torch.dtype) -> list:
    return [(x.to(dtype), y.to(dtype)) for x, y in window]


def _state(gns: GradientNoiseScale) -> dict[str, Any]:
    """Everything a reader of the hook can see."""
    return {
        "state": gns.state_dict(),
        "measured": gns.measured_steps,
        "last": gns.last,
        "b_simple": gns.b_simple,
    }


def _assert_same_state(got: dict, want: dict, rel: float = 0.0) -> None:
    assert got["measured"] == want["measured"]
    flat_got = [*got["state"]["ema"], *got["state"]["last"], got["b_simple"]]
    flat_want = [*want["state"]["ema"], *want["state"]["last"], want["b_simple"]]
    for a, b in zip(flat_got, flat_want, strict=True):
        if rel == 0.0 or (isinstance(b, float) and math.isnan(b)):
            assert a == b or (math.isnan(a) and math.isnan(b)), (got, want)
        else:
            assert a == pytest.approx(b, rel=rel), (got, want)


# ------------------------------------------------------------ a skipped step is not measured


def _skip_case(kind: str) -> dict[str, Any]:
    """The Stepper arguments, the dtype, and the window that ``kind`` skips."""
    a_like = _windows(1, seed=99)[0]
    if kind == "spike_guard":
        guard = lambda: [gradstep.SpikeGuard(sigma=3.0, window=16, min_steps=3, on="loss")]  # noqa: E731
        bad = [(x, 1e3 * y) for x, y in a_like]  # a loss spike
        return {"kw": lambda: {"clip": guard()}, "dtype": torch.float64, "bad": bad}
    if kind == "nonfinite":
        (x, y), *rest = a_like
        return {"kw": dict, "dtype": torch.float64, "bad": [(x * math.inf, y), *rest]}
    if kind == "fp16_overflow":
        # |x| ~ 1e6 overflows fp16's autocast matmul (max 65504): inf loss and gradients.
        bad = [(1e6 * x, y) for x, y in a_like]
        return {"kw": lambda: {"precision": "fp16"}, "dtype": torch.float32, "bad": bad}
    if kind == "empty":
        bad = [(x[:0], y[:0]) for x, y in a_like]  # every micro-batch without a row
        return {"kw": dict, "dtype": torch.float64, "bad": bad}
    raise AssertionError(kind)


def _run(windows: list, kw: dict, dtype: torch.dtype) -> tuple[list, GradientNoiseScale]:
    model = _model(dtype)
    gns = GradientNoiseScale(beta=0.7)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stepper = Stepper(model, opt, hooks=[gns], **{"clip": None, **kw})
    stats = [stepper.step(_cast(w, dtype), _loss) for w in windows]
    return stats, gns


@pytest.mark.parametrize("kind", ["spike_guard", "nonfinite", "fp16_overflow", "empty"])
def test_a_skipped_step_is_never_measured(kind):
    case = _skip_case(kind)
    # fp16: small values, so that the GradScaler's first scale (65536) does not overflow.
    scale = 1e-2 if kind == "fp16_overflow" else 1.0
    a, b = _windows(4, seed=1, scale=scale), _windows(3, seed=2, scale=scale)
    with_skip, gns = _run([*a, case["bad"], *b], case["kw"](), case["dtype"])
    without, twin = _run([*a, *b], case["kw"](), case["dtype"])
    skipped = [s.skipped for s in with_skip]
    assert skipped == [False] * len(a) + [True] + [False] * len(b), [
        s.skip_reason for s in with_skip
    ]
    assert not any(s.skipped for s in without)
    assert gns.measured_steps == len(a) + len(b)
    _assert_same_state(_state(gns), _state(twin))


# ------------------------------------------------------------ whatever the clip policy


def _policies() -> dict[str, Any]:
    return {
        "none": lambda: None,
        "norm_l1": lambda: gradstep.ClipNorm(1e-3, norm_type=1),
        "norm_l2": lambda: gradstep.ClipNorm(1e-3, norm_type=2),
        "norm_inf": lambda: gradstep.ClipNorm(1e-3, norm_type=math.inf),
        "value": lambda: gradstep.ClipValue(1e-3),
        "agc": lambda: gradstep.AGC(clipping=1e-3),
        "value_then_inf": lambda: [gradstep.ClipValue(1e-3), gradstep.ClipNorm(1e-4, math.inf)],
    }


POLICIES = _policies()


@pytest.mark.parametrize("early", [False, True], ids=["after_backward", "in_backward"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_noise_scale_is_the_same_whatever_the_clip_policy(policy, early):
    """Learning rate 0, so every policy sees the same gradients; each acts (small
    thresholds), yet the measurement is the pre-clip L2 one of ``clip=None``."""
    windows = _windows(4, seed=5)

    def run(make):
        model = _model()
        gns = GradientNoiseScale(beta=0.6)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        stepper = Stepper(model, opt, clip=make(), hooks=[gns], norm_in_backward=early)
        stats = [stepper.step(w, _loss) for w in windows]
        return stats, _state(gns)

    stats, got = run(POLICIES[policy])
    _, want = run(POLICIES["none"])
    if policy != "none":
        assert all(s.clipped for s in stats), policy  # the policy did act
    assert got["measured"] == len(windows)
    _assert_same_state(got, want, rel=EXACT)


# ------------------------------------------------------------ a retried window


class OOMOnce:
    """``_loss`` that runs out of memory in micro-batch ``at`` of the first window it sees
    (in its forward, or in its backward after the last layer's gradients were lent)."""

    def __init__(self, at: int, where: str) -> None:
        self.at, self.where, self.calls = at, where, 0

    def __call__(self, model: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
        self.calls += 1
        if self.calls != self.at + 1:
            return _loss(model, mb)
        if self.where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        x, y = mb
        hidden = model[1](model[0](x))

        def fail(grad: torch.Tensor) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory (injected, in backward)")

        hidden.register_hook(fail)  # after model[2]'s parameter gradients
        return LossSum(0.5 * (model[2](hidden) - y).square().sum(), x.shape[0])


@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_window_redone_after_out_of_memory_is_measured_once(where, at):
    windows = _windows(3, seed=8)
    model, twin = _model(), _model()
    gns, ref = GradientNoiseScale(beta=0.6), GradientNoiseScale(beta=0.6)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stepper = Stepper(model, opt, clip=None, hooks=[gns], on_oom="split")
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    reference = Stepper(twin, ref_opt, clip=None, hooks=[ref])
    loss_fn = OOMOnce(at, where)
    for i, window in enumerate(windows):
        stats = stepper.step(window, loss_fn)
        assert stats.oom_splits == (1 if i == 0 else 0)
        # The reference is handed the halved window, which the first window became.
        want = reference.step(halve(window, split_in_half, 1), _loss)
        assert (stats.items, stats.micro_batches) == (want.items, want.micro_batches)
        _assert_same_state(_state(gns), _state(ref))
    assert gns.measured_steps == len(windows)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_hooks_state_is_unchanged_by_a_window_that_raises():
    """A user error part-way through a window: no estimate, and the next window is
    measured from its own micro-batches only."""
    windows = _windows(3, seed=9)
    model = _model()
    gns = GradientNoiseScale(beta=0.6)
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None, hooks=[gns])
    stepper.step(windows[0], _loss)
    before = copy.deepcopy(_state(gns))

    def raising(model: nn.Module, mb: Any) -> LossSum:
        raising.calls += 1
        if raising.calls == 3:
            raise RuntimeError("bad micro-batch")
        return _loss(model, mb)

    raising.calls = 0
    with pytest.raises(RuntimeError, match="bad micro-batch"):
        stepper.step(windows[1], raising)
    _assert_same_state(_state(gns), before)
    stepper.step(windows[2], _loss)
    alone = GradientNoiseScale(beta=0.6)
    twin = _model()
    ref = Stepper(twin, torch.optim.SGD(twin.parameters(), lr=0.0), clip=None, hooks=[alone])
    ref.step(windows[0], _loss)
    ref.step(windows[2], _loss)
    _assert_same_state(_state(gns), _state(alone))
