"""FSDP2 + tensor parallel on a (dp=2, tp=2) mesh, and HSDP on a (replicate=2, shard=2)
mesh, of 4 gloo ranks equal one process in float64 (tests/parallel/tp_ranks.py).

FSDP2 + TP: a plain ``Stepper(model, optimizer)`` detects the layout; items are counted
over the dp ranks only, the gradient divisor undoes FSDP2's average over dp only, and the
global norm counts every shard once and no copy twice, for norm types 2, 1 and inf, with
the clip active on every step and different token counts on the two dp ranks. Two plans:
tensor parallel blocks (gradients on two meshes) with AdamW, and sequence parallel (every
parameter on the 2-D mesh) with SGD + momentum and ``count=fn``. A tensor-parallel peer
with a longer window raises on every rank. HSDP: the norm counts the shards of one replica
only, taken in backward or after it.

HSDP + tensor parallel on a 3-D (dp_replicate=2, dp_shard=2, tp=2) mesh of 8 ranks, built
by a user with torch's own APIs and by ``prepare_model(layout=Layout(2, 2, 2))``: the same
exactness, items over the 4 data-parallel ranks (replicate x shard), divisor 4, each
element of the norm counted once (replicas and tp copies are copies)."""

from __future__ import annotations

import pytest

from tests.parallel import tp_ranks as tp
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed

EXACT = 1e-12


@pytest.mark.parametrize(
    ("sp", "opt", "with_count"), [(False, "adamw", False), (True, "sgd", True)], ids=["tp", "tp+sp"]
)
def test_fsdp2_with_tensor_parallel_equals_one_process(
    sp: bool, opt: str, with_count: bool
) -> None:
    ref = tp.reference(opt)
    ranks = run_ranks(tp.tp_run, tp.DP * tp.TP, sp, opt, with_count, timeout=300)
    for rank, res in enumerate(ranks):
        assert res["strategy"] == "FSDP2TPStrategy" and res["world_size"] == tp.DP, rank
        assert res["divisor"] == tp.DP, rank
        tp.check_steps(rank, res["steps"], ref, EXACT)
        assert res["mismatch"] is not None and "different lengths" in res["mismatch"], rank


@pytest.mark.parametrize("in_backward", [False, True], ids=["after", "in-backward"])
def test_hsdp_equals_one_process(in_backward: bool) -> None:
    world = tp.DP * tp.TP
    ref = tp.reference("adamw", dp=world)
    for rank, res in enumerate(run_ranks(tp.hsdp_run, world, in_backward, timeout=300)):
        assert res["strategy"] == "FSDP2Strategy" and res["world_size"] == world, rank
        assert res["in_backward"] is in_backward, rank
        tp.check_steps(rank, res["steps"], ref, EXACT)


def test_hsdp_with_tensor_parallel_on_a_3d_mesh_equals_one_process() -> None:
    """One 8-rank job, both ways of building the mesh, against one float64 process."""
    from gradstep.parallel import Layout

    world, dp = 8, 4
    ref = tp.reference("adamw", dp=dp)
    names = {("dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard", "tp")}
    for rank, res in enumerate(run_ranks(tp.hsdp_tp_run, world, timeout=600)):
        for how in ("user", "prepared"):
            got, where = res[how], (how, rank)
            assert (got["strategy"], got["world_size"]) == ("FSDP2TPStrategy", dp), where
            assert got["divisor"] == dp and got["dp_size"] == dp, where
            assert got["layout"] == Layout(dp_replicate=2, dp_shard=2, tp=2), where
            assert set(got["dims"].values()) == names, where  # on two meshes
            tp.check_steps(rank, got["steps"], ref, EXACT)
