"""The tests of tests/test_gns.py that start processes or run the CLI end to end; its other
tests stay there.
"""

from __future__ import annotations

import pytest
import torch

from gradstep import GradientNoiseScale, Stepper
from tests.test_gns import _loss, _model, _problem, _truth, _windows

RANK_STEPS = 400


def _rank_regression(rank: int, world: int) -> dict[str, float]:
    """DDP, learning rate 0: each rank draws its own micro-batches (unequal sizes)."""
    import gradstep.parallel as gd

    x, y = _problem()
    model = gd.prepare_model(_model(), "ddp")
    gns = GradientNoiseScale(beta=0.99)
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None, hooks=[gns])
    for window in _windows(x, y, (5, 11) if rank else (8, 3), RANK_STEPS, seed=10 + rank):
        stepper.step(window, _loss)
    return {"b_simple": gns.b_simple, "measured": gns.measured_steps}


def _rank_gpt(rank: int, world: int) -> dict[str, list]:
    """The tiny GPT in float64 under DDP and FSDP2 (with and without sync on every
    micro-batch): every window's raw estimates, to compare with one process."""
    import gradstep.parallel as gd
    from tests.parallel.distributed_ranks import K, adamw
    from tests.support.batches import make_windows
    from tests.support.models import tiny_gpt
    from tests.support.reference import lm_loss

    data = make_windows(3, world, K, seed=7)
    out = {}
    for strategy, sync_each in (("ddp", False), ("ddp", True), ("fsdp", False)):
        model = gd.prepare_model(tiny_gpt(torch.float64), strategy)
        gns = GradientNoiseScale(beta=0.5)
        stepper = Stepper(
            model, adamw(model.parameters()), hooks=[gns], sync_each_micro_batch=sync_each
        )
        lasts = []
        for window in data:
            stepper.step(window[rank], lm_loss)
            lasts.append(gns.last)
        out[f"{strategy}{'_sync_each' if sync_each else ''}"] = [lasts, _smoothed(gns)]
    return out


def _one_process_gpt() -> list:
    from tests.parallel.distributed_ranks import K, adamw
    from tests.support.batches import make_windows
    from tests.support.models import tiny_gpt
    from tests.support.reference import lm_loss

    data = make_windows(3, 2, K, seed=7)
    model = tiny_gpt(torch.float64)
    gns = GradientNoiseScale(beta=0.5)
    stepper = Stepper(model, adamw(model.parameters()), hooks=[gns])
    lasts = []
    for window in data:
        stepper.step([mb for rank_window in window for mb in rank_window], lm_loss)
        lasts.append(gns.last)
    return [lasts, _smoothed(gns)]


def _smoothed(gns: GradientNoiseScale) -> tuple:
    return gns.grad_sq, gns.trace_cov, gns.b_simple


@pytest.fixture(scope="module")
def rank_runs() -> dict:
    from tests.support.multiproc import run_ranks

    return {
        "regression": run_ranks(_rank_regression, 2, timeout=180),
        "gpt": run_ranks(_rank_gpt, 2, timeout=180),
    }


def test_two_ddp_ranks_measure_the_exact_noise_scale(rank_runs):
    x, y = _problem()
    truth = _truth(_model(), x, y)
    want = truth["trace_cov"] / truth["grad_sq"]
    a, b = rank_runs["regression"]
    assert a == b  # every rank holds the same estimate
    assert a["measured"] == RANK_STEPS
    assert a["b_simple"] == pytest.approx(want, rel=0.20)


@pytest.mark.parametrize("case", ["ddp", "ddp_sync_each", "fsdp"])
def test_two_ranks_estimate_what_one_process_does_on_the_same_window(rank_runs, case):
    """Per-rank micro-batch norms (FSDP2: of the unsharded gradient) and the global window
    norm give the same estimates as one process holding both ranks' micro-batches."""
    want_lasts, want_smoothed = _one_process_gpt()
    for result in rank_runs["gpt"]:
        lasts, smoothed = result[case]
        for got, want in zip(lasts, want_lasts, strict=True):
            assert got["grad_sq"] == pytest.approx(want["grad_sq"], rel=1e-9)
            assert got["trace_cov"] == pytest.approx(want["trace_cov"], rel=1e-9)
        # The EMAs; b_simple is None on both when the smoothed |G|^2 is not positive.
        assert smoothed[:2] == pytest.approx(want_smoothed[:2], rel=1e-9)
        b, want_b = smoothed[2], want_smoothed[2]
        assert b == want_b if want_b is None else b == pytest.approx(want_b, rel=1e-9)
