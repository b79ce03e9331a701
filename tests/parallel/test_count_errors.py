"""A negative int ``LossSum.count`` on one rank only: every rank raises the same error
after the window's collective (none waits alone in it), and the next window works."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed


def negative_count_run(rank: int, world: int, strategy: str) -> dict[str, Any]:
    import torch

    import gradstep
    import gradstep.parallel as gd
    from tests.support.batches import make_windows
    from tests.support.models import tiny_gpt
    from tests.support.reference import lm_loss

    model = gd.prepare_model(tiny_gpt(), strategy)
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = make_windows(2, world, 2, seed=0)

    def loss_fn(m: Any, mb: Any) -> gradstep.LossSum:
        out = lm_loss(m, mb)
        return gradstep.LossSum(out.total, -1 if rank == 1 else int(out.count))

    try:
        stepper.step(data[0][rank], loss_fn)
        message = None
    except ValueError as exc:
        message = str(exc)
    stats = stepper.step(data[1][rank], lm_loss)
    return {"message": message, "next_items": stats.items, "steps": stepper.step_count}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_negative_count_on_one_rank_raises_on_every_rank(strategy: str) -> None:
    results = run_ranks(negative_count_run, 2, strategy, timeout=120, collective_timeout_s=30)
    for rank, res in enumerate(results):
        assert res["message"] is not None and "must be >= 0" in res["message"], (rank, res)
        assert res["steps"] == 1 and res["next_items"] > 0, (rank, res)
