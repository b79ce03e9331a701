"""Auxiliary loss terms (``LossSum.aux``) and ``step(..., count=fn)``.

The claim: the step's gradient is that of ``sum(total) / sum(count) + mean(aux)``, the
mean over every micro-batch of the window on every rank, exactly as one process computes
it on the whole window in float64. Micro-batches have unequal token counts (and one has
none), so a token-weighted aux, or an aux averaged per rank, would differ.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gradstep
from gradstep import LossSum, Stepper
from tests.support.batches import make_windows
from tests.support.models import tiny_gpt
from tests.support.reference import lm_loss

COEF = 0.05
EXACT = 1e-10


def aux_loss(model, mb) -> LossSum:
    """The token loss plus a router-like term: a per-micro-batch mean of the logits."""
    logits = model(mb["input_ids"])
    total, count = gradstep.token_loss(logits, mb["labels"])
    return LossSum(total, count, aux={"router": COEF * logits.square().mean()})


def count_tokens(mb) -> int:
    return int((mb["labels"] != -100).sum())


def _windows(world: int):
    data = make_windows(2, world, 3, seed=11)
    # One micro-batch without a single target token: it still counts in mean(aux).
    empty = {k: v.clone() for k, v in data[0][0][1].items()}
    empty["labels"].fill_(-100)
    data[0][0][1] = empty
    return data


def reference(world: int, strategy_windows=None):
    """One process, float64, the whole window: the objective written out, SGD(lr=1)."""
    model = tiny_gpt(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    deltas, aux_means = [], []
    for window in strategy_windows or _windows(world):
        mbs = [mb for rank in window for mb in rank]
        losses = [aux_loss(model, mb) for mb in mbs]
        items = sum(int(lo.count) for lo in losses)
        aux = torch.stack([lo.aux["router"] for lo in losses]).mean()
        objective = torch.stack([lo.total for lo in losses]).sum() / items + aux
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        objective.backward()
        opt.step()
        deltas.append([b - p.detach() for b, p in zip(before, model.parameters(), strict=True)])
        aux_means.append(float(aux.detach()))
    return deltas, aux_means


def stepped(rank: int, world: int, strategy: str = "none") -> dict:
    import gradstep.parallel as gd

    model = tiny_gpt(torch.float64)
    if strategy != "none":
        model = gd.prepare_model(model, strategy)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stepper = Stepper(model, opt, clip=None)
    deltas, aux = [], []
    for window in _windows(world):
        before = [_full(p).clone() for p in model.parameters()]
        stats = stepper.step(window[rank], aux_loss, count=count_tokens)
        deltas.append([b - _full(p) for b, p in zip(before, model.parameters(), strict=True)])
        aux.append(stats.aux["router"])
    return {"deltas": deltas, "aux": aux}


def _full(p: torch.Tensor) -> torch.Tensor:
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _assert_same(deltas, want) -> None:
    for step, (got_step, want_step) in enumerate(zip(deltas, want, strict=True)):
        for g, w in zip(got_step, want_step, strict=True):
            err = float((g - w).norm() / w.norm())
            assert err < EXACT, (step, err)


def test_aux_gradient_is_the_mean_over_micro_batches_on_one_process():
    want, aux_means = reference(1)
    got = stepped(0, 1)
    _assert_same(got["deltas"], want)
    assert got["aux"] == pytest.approx(aux_means, rel=1e-12)


def test_without_aux_count_changes_nothing():
    window = _windows(1)[1][0]

    def run(count):
        model = tiny_gpt(torch.float64)
        stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=1.0), clip=None)
        stats = stepper.step(window, lm_loss, count=count)
        return stats, [p.detach().clone() for p in model.parameters()]

    (a, pa), (b, pb) = run(None), run(count_tokens)
    assert a.aux == b.aux == {}
    assert (a.loss, a.items, a.grad_norm) == (b.loss, b.items, b.grad_norm)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


def _stepper():
    model = tiny_gpt(torch.float64)
    return model, Stepper(model, torch.optim.SGD(model.parameters(), lr=1.0), clip=None)


def test_aux_without_count_and_a_count_mismatch_are_clear_errors():
    window = _windows(1)[1][0]
    model, stepper = _stepper()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"pass stepper.step\(window, loss_fn, count=fn\)"):
        stepper.step(window, aux_loss)
    with pytest.raises(ValueError, match="differs from count.micro_batch. on 3 micro-batch"):
        stepper.step(window, aux_loss, count=lambda mb: count_tokens(mb) + 1)
    with pytest.raises(ValueError, match="must return an int >= 0; micro-batch 0 gave -1"):
        stepper.step(window, aux_loss, count=lambda mb: -1)
    with pytest.raises(TypeError, match="count must be None or a callable"):
        stepper.step(window, aux_loss, count=3)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert stepper.step_count == 0 and all(p.grad is None for p in model.parameters())

    def renamed(model, mb):
        out = aux_loss(model, mb)
        renamed.calls += 1
        name = "router" if renamed.calls == 1 else "balance"
        return LossSum(out.total, out.count, aux={name: out.aux["router"]})

    renamed.calls = 0
    with pytest.raises(ValueError, match="must be the same in every micro-batch"):
        stepper.step(window, renamed, count=count_tokens)


def test_aux_terms_are_checked():
    model, stepper = _stepper()
    window = _windows(1)[1][0]
    bad = lambda m, mb: LossSum(*lm_loss(m, mb), aux={"x": torch.ones(2, requires_grad=True)})  # noqa: E731
    with pytest.raises(TypeError, match="LossSum.aux must map names"):
        stepper.step(window, bad, count=count_tokens)
    flat = lambda m, mb: LossSum(*lm_loss(m, mb), aux={"x": torch.tensor(1.0)})  # noqa: E731
    with pytest.raises(ValueError, match=r"aux\['x'\] does not require grad"):
        stepper.step(window, flat, count=count_tokens)


def test_metrics_carry_the_aux_terms(tmp_path):
    from gradstep import MetricsLogger

    _, stepper = _stepper()
    stats = stepper.step(_windows(1)[1][0], aux_loss, count=count_tokens)
    with MetricsLogger(tmp_path) as logger:
        record = logger.log_step(stats, 0.1)
    assert record["aux"] == {"router": stats.aux["router"]}
    assert "aux" in (tmp_path / "metrics.jsonl").read_text()


def test_the_silent_traps_warn_once():
    model, stepper = _stepper()
    window = _windows(1)[1][0]
    model.eval()
    with pytest.warns(UserWarning, match="eval mode"):
        stepper.step(window, lm_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepper.step(window, lm_loss)  # said once
    model.train()

    def inf_no_grad(m, mb):
        total, count = lm_loss(m, mb)
        return LossSum(total + torch.tensor(float("inf"), dtype=total.dtype), count)

    with pytest.warns(UserWarning, match="loss is inf but its gradient is finite"):
        stats = stepper.step(window, inf_no_grad)
    assert not stats.skipped


def test_counted_up_front_is_the_same_step():
    """``token_loss(..., count=False)`` with ``step(..., count=fn)``: the tokens counted
    before the first forward, as a hand loop does; bitwise the same step."""
    window = _windows(1)[1][0]

    def run(loss_fn, count):
        model, stepper = _stepper()
        stats = stepper.step(window, loss_fn, count=count)
        return stats, [p.detach().clone() for p in model.parameters()]

    def uncounted(model, mb):
        return gradstep.token_loss(model(mb["input_ids"]), mb["labels"], count=False)

    (a, pa), (b, pb) = run(lm_loss, None), run(uncounted, count_tokens)
    assert (a.loss, a.items, a.grad_norm) == (b.loss, b.items, b.grad_norm)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    _, stepper = _stepper()
    with pytest.raises(TypeError, match=r"LossSum.count is None.*pass count=fn"):
        stepper.step(window, uncounted)
