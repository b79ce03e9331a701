"""LARS and LAMB on 2 gloo ranks: FSDP2 and DDP equal one process, one collective per
FSDP2 step (none under DDP), and a sharded checkpoint resumes bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.optim import optimizer_ranks as ranks
from tests.support.multiproc import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    folder = tmp_path_factory.mktemp("optim-ckpt")
    return run_ranks(ranks.scenarios, 2, str(folder), timeout=120, collective_timeout_s=30)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_equal_one_process(results: list[dict], kind: str, strategy: str) -> None:
    for res in results:
        for got, want in zip(res[f"{kind}/{strategy}"], res[f"{kind}/one"], strict=True):
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_one_collective_per_step(results: list[dict], kind: str) -> None:
    # Under FSDP2 all norms of a step (2 per adapted parameter) go in one all_reduce;
    # under DDP every rank holds whole tensors: nothing to reduce.
    assert [r[f"{kind}/fsdp_collectives"] for r in results] == [1, 1]
    assert [r[f"{kind}/ddp_collectives"] for r in results] == [0, 0]


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_fsdp2_checkpoint_resumes_bitwise(results: list[dict], kind: str) -> None:
    assert [r[f"{kind}/resume"] for r in results] == [True, True]


def test_a_shard_norm_would_differ(results: list[dict]) -> None:
    """The case is what we think: the model has shards of unequal size, one empty."""
    shapes = {tuple(t.shape) for t in results[0]["lamb/one"]}
    assert {(16, 8), (5, 16), (5,), (1,)} <= shapes
