"""The collective census of ``bench/distributed.py --layouts`` (``bench/_census.py``), on 2
gloo ranks: the benchmark's table is only as good as its count.

Under the census and, at the same time, under the test suite's own ``CollectiveSpy`` (the
Python-level wrappers): one FSDP2 backward, a plain all-reduce, torch's norm of the
DTensor gradients (its all-reduce runs inside DTensor's dispatch of the ``vector_norm`` of
the stacked per-tensor norms, where a dispatch mode cannot see it) and a ``full_tensor``.
Every collective is counted once (as many as the spy's), by the right issuer and kind,
with the full buffer's bytes that FSDP2's padded flat buffers imply.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.multiproc import run_ranks

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.append(str(BENCH))  # last: its module names never shadow others

import _census  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD = 2
# The test's own calls; the spy's wrappers (distributed_ranks.py) call torch on the test's behalf.
OWN = {__file__: "test", str(Path(__file__).parent / "parallel" / "distributed_ranks.py"): "test"}


def _padded_bytes(params: list[torch.nn.Parameter], world: int) -> int:
    """FSDP2 shards dim 0, padded to a multiple of the world: its flat buffers' bytes."""
    return sum(
        math.ceil(p.shape[0] / world) * world * (p.numel() // p.shape[0]) * p.element_size()
        for p in params
    )


def census_ranks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import gradstep.parallel as gd
    from tests.parallel.distributed_ranks import CollectiveSpy
    from tests.support.batches import make_windows
    from tests.support.models import tiny_gpt
    from tests.support.reference import lm_loss

    plain = tiny_gpt()
    blocks = gd.find_blocks(plain)
    first = next(plain.parameters())
    expect = {
        "all": _padded_bytes(list(plain.parameters()), world),
        "blocks": sum(_padded_bytes(list(b.parameters()), world) for b in blocks),
        "first": _padded_bytes([first], world),
        "n_blocks": len(blocks),
    }
    model = gd.prepare_model(plain, "fsdp")
    mb = make_windows(1, world, 1, seed=0)[0][rank][0]
    spy = CollectiveSpy()
    try:
        with _census.Census(OWN) as census:
            lm_loss(model, mb).total.backward()
            dist.all_reduce(torch.zeros(5, dtype=torch.float64))
            torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()
            next(model.parameters()).full_tensor()
    finally:
        spy.remove()
    return {"calls": census.calls, "spy_calls": len(spy.calls), "expect": expect}


def _rows(calls: list[tuple], issuer: str, kind: str) -> list[tuple]:
    return [c for c in calls if c[0] == issuer and c[1] == kind]


def test_census_counts_every_collective_once_with_its_issuer_and_bytes() -> None:
    for res in run_ranks(census_ranks, WORLD, timeout=170):
        calls, want = res["calls"], res["expect"]
        assert len(calls) == res["spy_calls"]
        assert all(c[2] == WORLD for c in calls), calls  # every call on the world group
        gathers = _rows(calls, "fsdp2", "all_gather")
        # forward: every block and the root; backward: the blocks again (the root stays)
        assert len(gathers) == 2 * want["n_blocks"] + 1
        assert sum(c[3] for c in gathers) == want["all"] + want["blocks"]
        scatters = _rows(calls, "fsdp2", "reduce_scatter")
        assert len(scatters) == want["n_blocks"] + 1
        assert sum(c[3] for c in scatters) == want["all"]
        reduces = _rows(calls, "test", "all_reduce")
        plain = [c for c in reduces if not c[5]]
        assert [c[3:5] for c in plain] == [(40, 5)]
        hidden = [c for c in reduces if c[5]]
        assert hidden and all(c[4] <= _census.SMALL for c in hidden)
        assert [c[3] for c in _rows(calls, "test", "all_gather")] == [want["first"]]
        assert {c[0] for c in calls} == {"fsdp2", "test"}
        rows = _census.census_rows(calls)
        assert sum(r["calls"] for r in rows) == len(calls)
        assert sum(r["bytes"] for r in rows) == sum(c[3] for c in calls)
