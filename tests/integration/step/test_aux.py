"""The tests of tests/step/test_aux.py that start processes or run the CLI end to end; its other
tests stay there.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gradstep import LossSum, Stepper
from tests.step.test_aux import _assert_same, _windows, reference, stepped
from tests.support.models import tiny_gpt
from tests.support.reference import lm_loss


def _ranks(rank: int, world: int) -> dict:
    out = {s: stepped(rank, world, s) for s in ("ddp", "fsdp")}
    out["empty_rank_warned"] = _empty_rank(rank)
    return out


def _empty_rank(rank: int) -> list[bool]:
    """Rank 1's micro-batches have every label ignored; with tensor and with int counts."""
    import gradstep.parallel as gd

    warned = []
    for as_int in (False, True):
        model = gd.prepare_model(tiny_gpt(torch.float64), "ddp")
        stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=None)
        window = [{k: v.clone() for k, v in mb.items()} for mb in _windows(2)[1][rank]]
        for mb in window if rank == 1 else ():
            mb["labels"].fill_(-100)

        def loss_fn(m, mb, as_int=as_int):
            total, count = lm_loss(m, mb)
            return LossSum(total, int(count) if as_int else count)

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            stepper.step(window, loss_fn)
        warned.append(any("LossSum.count 0" in str(w.message) for w in seen))
    return warned


def test_aux_gradient_on_two_ranks_equals_one_process():
    from tests.support.multiproc import run_ranks

    want, aux_means = reference(2)
    results = run_ranks(_ranks, 2, timeout=180)
    # A rank whose micro-batches all count 0 says so (once), with tensor or int counts.
    assert [r["empty_rank_warned"] for r in results] == [[False, False], [True, True]]
    for result in results:
        for strategy in ("ddp", "fsdp"):
            _assert_same(result[strategy]["deltas"], want)
            assert result[strategy]["aux"] == pytest.approx(aux_means, rel=1e-12)
