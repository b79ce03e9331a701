"""Planning on two ranks: every decision the probe takes is taken by every rank together.

Ranks measure different memory (their own processes); a decision one rank took alone
(stop the shape sweep, refuse the budget, probe with checkpointing) would leave the other
in a collective of the probe's steps: a hang. Here rank 1's memory keeps growing with
every shape while rank 0's settles, and then rank 1 alone cannot hold the budget.
"""

from __future__ import annotations

import pytest
import torch

MiB = 2**20


def plan_on_ranks(rank: int, world: int) -> dict:
    from gradstep.memory import probe
    from gradstep_cli.config.settings import ConfigError, TrainConfig
    from gradstep_cli.plan import planning

    cfg = TrainConfig(
        n_layer=1, n_head=2, d_model=16, seq_len=16, micro_batch_size="auto",
        global_batch=8, memory_budget="8GiB", strategy="ddp", device="cpu",
    )  # fmt: skip
    cpu = torch.device("cpu")
    real = probe.current_bytes
    if rank == 1:  # every reading 3 MiB above the last: the sweep never settles here
        calls = []
        probe.current_bytes = lambda device=None: (
            real(device) + 3 * MiB * len(calls.append(0) or calls)
        )  # noqa: E501
    planned = planning.plan_run(cfg, cpu)
    out = {"plan": planned.plan.to_json(), "shapes": planned.probe.shapes_run}
    probe.current_bytes = real
    if rank == 1:  # this rank alone is over the budget before probing
        planning.current_bytes = lambda device=None: 9 * 2**30
    try:
        planning.plan_run(cfg, cpu)
        out["refused"] = None
    except ConfigError as exc:
        out["refused"] = str(exc)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_ranks_that_measure_differently_still_probe_and_refuse_together():
    from tests.support.multiproc import run_ranks

    a, b = run_ranks(plan_on_ranks, 2, timeout=120, collective_timeout_s=40)
    assert a["plan"] == b["plan"]  # rank 0's plan on both
    assert a["shapes"] == b["shapes"] == 6  # rank 1 kept growing: both ran every shape
    assert a["refused"] and b["refused"]  # both refuse, neither waits for the other
    assert "--memory-budget" in b["refused"] and "already exceeded before probing" in b["refused"]
