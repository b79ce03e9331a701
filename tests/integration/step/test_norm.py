"""The tests of tests/step/test_norm.py that start processes or run the CLI end to end; its
other tests stay there.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradstep
from tests.step.test_norm import FP64, _raising_last, _Used
from tests.support.batches import make_windows
from tests.support.models import tiny_gpt
from tests.support.reference import lm_loss


def _ranks(rank: int, world: int) -> dict:
    import gradstep.parallel as gd

    used = _Used()
    data = make_windows(2, world, 3, seed=8)
    out = {}
    for strategy in ("ddp", "fsdp"):
        for norm_type in (1.0, 2.0, math.inf):
            for sync_each in (False, True):
                norms = []
                for early in (True, False):
                    model = gd.prepare_model(tiny_gpt(torch.float64), strategy)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                    stepper = gradstep.Stepper(
                        model,
                        opt,
                        clip=gradstep.ClipNorm(0.5, norm_type=norm_type),
                        sync_each_micro_batch=sync_each,
                        norm_in_backward=early,
                    )
                    norms.append([stepper.step(w[rank], lm_loss).grad_norm for w in data])
                out[(strategy, norm_type, sync_each)] = norms
    # A window whose last backward raises: nothing is left recording.
    model = gd.prepare_model(tiny_gpt(torch.float64), "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = gradstep.Stepper(model, opt, norm_in_backward=True)
    try:
        stepper.step(data[0][rank], _raising_last([], 3))
        raised = False
    except RuntimeError:
        raised = True
    out["raising"] = {"raised": raised, "recorder": stepper.strategy.recorder}
    out["used"] = used.calls
    return out


def test_two_ranks_same_norm_as_after_backward():
    from tests.support.multiproc import run_ranks

    results = run_ranks(_ranks, 2, timeout=180)
    for res in results:
        for key, value in res.items():
            if isinstance(key, tuple):
                early, post = value
                assert early == pytest.approx(post, rel=FP64), key
        # 2 strategies x 3 norm types x 2 syncs x 2 steps measured in backward; the
        # raising window armed the hooks too.
        assert res["used"] == 24
        assert res["raising"] == {"raised": True, "recorder": None}
    assert results[0][("fsdp", 2.0, False)] == results[1][("fsdp", 2.0, False)]
