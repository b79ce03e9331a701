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

Property: each layout's checkpoint, saved by a plain ``Checkpointer`` that reads the
data-parallel ranks off the model, records them: ``dp_size`` is the world over tp (HSDP:
every rank, whatever the size of its replica), the global batch is ``K x dp_size x rows``,
and a resume on one process keeps it (``accum_steps`` ``K x dp_size``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradstep.checkpoint import MANIFEST, Checkpointer
from tests.parallel import layout_ranks as lr
from tests.parallel import mesh_sizes_ranks as ms
from tests.parallel.tp_ranks import check_steps
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed

EXACT = 1e-12


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world: f"{world}")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[Any], Path]:
    """Every layout of ``world`` ranks trained and saved: (world, each rank's result, the
    folder of the checkpoints)."""
    world, folder = request.param, tmp_path_factory.mktemp("meshes")
    return world, run_ranks(ms.mesh_sizes_run, world, str(folder), timeout=300), folder


def test_meshes_of_unequal_sizes_equal_one_float64_process(
    runs: tuple[int, list[Any], Path],
) -> None:
    world, ranks, _ = runs
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


def test_a_checkpoint_of_every_layout_records_its_data_parallel_ranks(
    runs: tuple[int, list[Any], Path],
) -> None:
    world, _, folder = runs
    for name, layout in ms.layouts(world).items():
        dp = ms.data_ranks(layout, world)
        info = Checkpointer(folder / name).latest()
        assert info is not None and info.step == ms.STEPS, name
        manifest = json.loads((info.path / MANIFEST).read_text())
        got = {k: manifest[k] for k in ("world_size", "dp_size", "global_micro_batches")}
        assert got == {"world_size": world, "dp_size": dp, "global_micro_batches": lr.K * dp}
        assert manifest["global_batch"] == lr.K * dp * ms.ROWS, name
        assert info.dp_size == dp and info.accum_steps_for(1) == lr.K * dp, name
