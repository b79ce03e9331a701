"""What one step costs in small collectives and host syncs, on 2 gloo ranks: the floor
issue 22 sets, counted below the Python API (tests/parallel/sync_census.py).

| | DDP | DDP, ``count=fn`` | FSDP2 | FSDP2, ``count=fn`` |
|---|---|---|---|---|
| all-reduces / host reads | 1 / 1 | 2 / 1 | 2 / 2 | 2 / 2 |

DDP: the window's totals (one all-reduce, one read; its gradients are whole on every rank,
so the norm is local). ``count=fn`` adds the count's all-reduce, read only with the totals.
FSDP2: every forward all-gathers, so the ranks agree on the window's length before the
first one (an all-reduce and a read); the totals then carry each rank's ``norm**p``.
``count=fn`` folds that agreement into the count's all-reduce. The same with the norm taken
in backward (a large model's default) and after it.
"""

from __future__ import annotations

import pytest

from tests.parallel.sync_census import census_run
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed

FLOOR = {
    "ddp": {False: (1, 1), True: (2, 1)},
    "fsdp": {False: (2, 2), True: (2, 2)},
}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_step_issues_the_floor_of_small_collectives_and_host_reads(strategy: str) -> None:
    for rank, counts in enumerate(run_ranks(census_run, 2, strategy)):
        for (with_count, in_backward), got in counts.items():
            want = FLOOR[strategy][with_count]
            assert got == want, (strategy, rank, f"count={with_count}", f"nib={in_backward}")
