"""Read leases (``gradstep.checkpoint.read_lease``): a checkpoint a reader holds is skipped by
a save's pruning and pruned by a later save once the lease is gone; a reader never gets half
a folder; a killed reader's lease never blocks pruning (robustness-3 row LIVE)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from gradstep.checkpoint import MANIFEST, Checkpointer, layout, lease, read_lease

pytestmark = pytest.mark.skipif(lease.fcntl is None, reason="leases need flock (POSIX)")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def _steps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_leased_checkpoint_outlives_a_prune_and_goes_at_a_later_save(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=1)
    model = _model()
    first = ckpt.save(1, model=model)
    with read_lease(first) as pinned:
        assert pinned == first
        ckpt.save(2, model=_model(seed=1))
        assert _steps(tmp_path) == ["step-000001", "step-000002"]  # skipped, not deleted
        fresh = _model(seed=2)
        assert ckpt.load(ckpt.inspect(first), model=fresh) == 1  # whole, and it loads
        assert torch.equal(fresh.weight, model.weight)
    assert ckpt.latest().step == 2  # the leased older one never outranks the newest
    ckpt.save(3, model=model)
    assert _steps(tmp_path) == ["step-000003"]


def test_leases_share_and_each_one_holds_the_folder(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=1)
    first = ckpt.save(1, model=_model())
    with read_lease(first):
        with read_lease(first):  # two readers at once: shared, not exclusive
            ckpt.save(2, model=_model())
        ckpt.save(3, model=_model())  # one reader left: still held
        assert "step-000001" in _steps(tmp_path)
    ckpt.save(4, model=_model())
    assert _steps(tmp_path) == ["step-000004"]


def test_a_pruned_folder_cannot_be_leased(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=1)
    first = ckpt.save(1, model=_model())
    ckpt.save(2, model=_model())
    with pytest.raises(FileNotFoundError) as caught, read_lease(first):
        pass
    assert caught.value.filename == str(first) and "pruned" in str(caught.value)


def test_a_reader_that_asks_during_a_prune_finds_the_folder_gone(tmp_path: Path) -> None:
    """The pruner holds its exclusive lock from before the rename to after it: a reader that
    asks meanwhile waits, then is told the folder is gone, and never reads half of it."""
    first = Checkpointer(tmp_path).save(1, model=_model())
    outcome: list[BaseException | None] = []

    def reader() -> None:
        try:
            with read_lease(first):
                outcome.append(None)
        except FileNotFoundError as exc:
            outcome.append(exc)

    with lease.unleased(first / MANIFEST) as free:
        assert free
        thread = threading.Thread(target=reader)
        thread.start()
        time.sleep(0.2)
        assert not outcome  # waiting for the prune
        os.rename(first, tmp_path / ".trash-step-000001")
    thread.join(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], FileNotFoundError)


def test_a_folder_without_a_manifest_is_read_unpinned(tmp_path: Path) -> None:
    mine = tmp_path / "step-000005"
    mine.mkdir()
    with read_lease(mine) as pinned:  # nothing gradstep prunes: nothing to pin, no error
        assert pinned == mine


def test_a_prune_without_readers_is_unchanged(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, model=_model())
    layout.prune(tmp_path, 1)
    assert _steps(tmp_path) == ["step-000003"]
