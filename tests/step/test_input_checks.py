"""The library refuses what would silently go wrong (robustness probe rows in the ids)."""

from __future__ import annotations

import math

import pytest
import torch

import gradstep
from gradstep import LossSum
from tests.support.asserts import assert_bitwise_equal, snapshot
from tests.support.batches import make_window
from tests.support.models import TinyLM
from tests.support.reference import lm_loss

WINDOW = [[3, 5], [4]]


def _stepper(**kw):
    model = TinyLM()
    opt = kw.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return gradstep.Stepper(model, opt, **kw), model, opt


def test_optimizer_that_misses_trainable_parameters_is_refused():
    """Row 92: their stale gradients counted in the clip norm forever."""
    model = TinyLM()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.0)
    with pytest.raises(ValueError, match=r"does not hold 3 trainable parameter\(s\).*emb.weight"):
        gradstep.Stepper(model, opt)
    model.emb.requires_grad_(False)
    model.mix.requires_grad_(False)
    gradstep.Stepper(model, opt)  # frozen parameters need no optimizer


@pytest.mark.parametrize("window", [("x", "y"), "ab", b"ab"], ids=["tuple", "str", "bytes"])
def test_a_window_must_be_a_list_of_micro_batches(window):
    """Row 104: an (inputs, targets) tuple ran as two micro-batches, a string per char."""
    stepper, model, opt = _stepper()
    with pytest.raises(TypeError, match="not a tuple or a string"):
        stepper.step(window, lm_loss)
    assert stepper.step_count == 0


def test_scheduler_is_checked_and_a_failing_one_is_reported_as_a_taken_step():
    """Row 111: a scheduler without step() failed after the update; one that raises left
    the parameters updated and the counters not."""
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="scheduler must be None or an LR scheduler"):
        gradstep.Stepper(model, opt, scheduler=object())

    class Broken:
        def step(self):
            raise KeyError("boom")

    stepper = gradstep.Stepper(model, opt, scheduler=Broken())
    before = [p.detach().clone() for p in model.parameters()]
    mbs, _ = make_window(WINDOW)
    with pytest.raises(RuntimeError, match="after optimizer step 1 was taken"):
        stepper.step(mbs, lm_loss)
    assert stepper.step_count == 1  # counters agree with the parameters: the step happened
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_clip_policy_class_instead_of_instance():
    """Row 114: accepted, then a TypeError at the first step."""
    with pytest.raises(TypeError, match="the class ClipNorm"):
        _stepper(clip=gradstep.ClipNorm)


def test_loss_sum_without_grad_and_bool_counts():
    """Rows 98 and 100: torch's own error from deep in backward; a bool count as 1 item."""
    stepper, model, opt = _stepper()
    mbs, _ = make_window(WINDOW)
    state = snapshot(model, opt)

    def detached(m, mb):
        total, count = lm_loss(m, mb)
        return LossSum(total.detach(), count)

    with pytest.raises(ValueError, match="LossSum.total does not require grad"):
        stepper.step(mbs, detached)

    def bool_count(m, mb):
        return LossSum(lm_loss(m, mb).total, torch.tensor(True))

    with pytest.raises(TypeError, match="LossSum.count must be an int"):
        stepper.step(mbs, bool_count)
    assert_bitwise_equal(snapshot(model, opt), state)


def test_loading_the_state_of_other_clip_policies_names_them():
    """Row 116: KeyError: 'norms' (the CLI showed "refused its saved state ('warmup')")."""
    zclip, _, _ = _stepper(clip=gradstep.ZClip())
    auto, _, _ = _stepper(clip=gradstep.AutoClip())
    with pytest.raises(ValueError, match=r"\['ZClip'\].*\['AutoClip'\]"):
        auto.load_state_dict(zclip.state_dict())
    with pytest.raises(ValueError, match="not a Stepper state"):
        auto.load_state_dict({})


def test_nan_norm_still_skips_with_every_check_in_place():
    stepper, model, opt = _stepper()
    mbs, _ = make_window(WINDOW)

    def nan_loss(m, mb):
        total, count = lm_loss(m, mb)
        return LossSum(total * math.nan, count)

    assert stepper.step(mbs, nan_loss).skipped


def test_a_loss_that_does_not_depend_on_the_model_skips():
    """Row 99: a LossSum connected to no parameter took a step (AdamW's decay alone)."""
    stepper, model, opt = _stepper(optimizer=None)
    state = snapshot(model, opt)
    free = torch.tensor(3.0, requires_grad=True)
    stats = stepper.step([None], lambda m, mb: LossSum(free * 1.0, 5))
    assert stats.skipped and "does not depend on the model" in stats.skip_reason
    assert_bitwise_equal(snapshot(model, opt), state)


def test_report_counts_only_true_flags(tmp_path):
    """Row 88: "clipped": "false" was counted as a clipped step."""
    import json

    from gradstep_cli.report import write_report

    rows = [{"step": 1, "loss": 1.0, "clipped": "false", "skipped": "no"}, {"step": 2, "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = write_report([tmp_path]).read_text()
    assert "<td>0</td>" in html
