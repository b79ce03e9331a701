"""How a run lays its model over the ranks (gradstep_cli.models.parallel_plan): which data a
rank reads under ``--tp``."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.batching import layout_for
from gradstep_cli.models.parallel_plan import data_rank


@given(world=st.sampled_from([2, 4, 6, 8]), tp=st.sampled_from([1, 2]), rank=st.integers(0, 7))
def test_tensor_parallel_peers_read_one_data_rank(world: int, tp: int, rank: int) -> None:
    """Rank r of a (world / tp, tp) mesh, row-major, reads data rank r // tp: the tp ranks
    of a row share it, rows differ, and a global batch splits over the rows."""
    cfg = TrainConfig(strategy="fsdp", tp=tp, global_batch=world * 3)
    rank %= world
    mine, rows = data_rank(cfg, rank, world)
    assert rows == world // tp and 0 <= mine < rows
    assert mine == data_rank(cfg, rank - rank % tp, world)[0]  # its row's first rank
    layout = layout_for(cfg, rows)
    assert layout.rows_per_rank * rows == world * 3
