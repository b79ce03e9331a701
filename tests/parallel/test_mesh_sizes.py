"""Meshes whose two sizes differ train exactly: FSDP2 + tensor parallel with the whole
world tensor parallel, (dp_shard=1, tp=2) on 2 ranks and (dp_shard=1, tp=4) on 4 (one head
per rank), and HSDP with every rank a replica, (dp_replicate=2, dp_shard=1) and
(dp_replicate=4, dp_shard=1), each built by ``prepare_model(layout=...)`` and stepped by a
plain ``Stepper`` (tests/parallel/mesh_sizes_ranks.py).

Property: the step of a layout equals one float64 process taking the step the plain way
on the micro-batches of all its data-parallel ranks (tests/parallel/tp_ranks.py's
``reference``: token-weighted loss, ``get_total_norm``, ``clip_grad_norm_``'s
coefficient, AdamW): per step the item count, the loss and the pre-clip grad norm (norm
types 2 and 1, the clip acting on both steps) to 1e-12 relative, and every parameter after
each step to 1e-12, on every rank. The Stepper counts items over the data-parallel ranks
only (1 under (dp_shard=1, tp=N): the tp peers read the same data) and the norm counts every
shard once and no copy twice.
"""

from __future__ import annotations

import pytest

from tests.parallel import layout_ranks as lr
from tests.parallel import mesh_sizes_ranks as ms
from tests.parallel.tp_ranks import check_steps
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed

EXACT = 1e-12


@pytest.mark.parametrize("world", [2, 4])
def test_meshes_of_unequal_sizes_equal_one_float64_process(world: int) -> None:
    ranks = run_ranks(ms.mesh_sizes_run, world, timeout=300)
    for name, layout in ms.layouts(world).items():
        dp = ms.data_ranks(layout, world)
        ref = lr.reference(dp)[: ms.STEPS]
        strategy = "FSDP2TPStrategy" if layout.tp > 1 else "FSDP2Strategy"
        for rank, res in enumerate(ranks):
            got, where = res[name], (name, rank)
            assert (got["strategy"], got["world_size"]) == (strategy, dp), where
            assert got["replicas"] == layout.dp_replicate, where
            assert got["layout"] == layout.resolve(world), where
            check_steps(rank, got["steps"], ref, EXACT)
