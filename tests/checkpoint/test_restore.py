"""The load path (:mod:`gradstep.checkpoint.restore`): names, kinds and shapes checked
against the checkpoint before anything is loaded, and nothing left half-loaded.

Each refusal is checked against the state the objects had before the load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradstep.checkpoint import Checkpointer, CheckpointError
from tests.checkpoint.helpers import Blob, assert_same_state, build, snapshot_run, train


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a shared 2-core machine: more threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        ({"d_model": 24}, ["embed.weight (checkpoint (256, 16), model (256, 24))"]),
        ({"n_layer": 2}, ["missing keys", "blocks.1.attn.qkv.weight", "blocks.1.norm1.bias"]),
        ({"vocab_size": 128}, ["shape mismatches", "embed.weight", "lm_head.weight"]),
    ],
)
def test_incompatible_model_lists_keys_and_changes_nothing(
    tmp_path: Path, overrides: dict, keys: list[str]
) -> None:
    run = build()
    train(run, 2)
    Checkpointer(tmp_path).save(2, **run)
    other = build(**overrides)
    train(other, 1)
    before = snapshot_run(other)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path).load_latest(**other)
    message = str(info.value)
    assert "step-000002" in message and "Nothing was loaded" in message
    for key in keys:
        assert key in message
    assert_same_state(snapshot_run(other), before)


def test_unexpected_keys_are_listed(tmp_path: Path) -> None:
    run = build(n_layer=2)
    Checkpointer(tmp_path).save(0, **run)
    other = build(n_layer=1)
    with pytest.raises(CheckpointError, match=r"unexpected keys \(not in the model\): blocks\.1\."):
        Checkpointer(tmp_path).load_latest(**other)


def test_a_refused_object_rolls_back_the_others(tmp_path: Path) -> None:
    """The data stream of another seed refuses the state: nothing stays half-loaded."""
    run = build()
    train(run, 2)
    Checkpointer(tmp_path).save(2, **run)
    other = build()
    other["data"].seed = 99  # a differently configured stream
    before = snapshot_run(other)
    ordered = {k: other[k] for k in ("stepper", "scheduler", "data", "model", "optimizer")}
    with pytest.raises(CheckpointError, match="data refused its saved state.*seed"):
        Checkpointer(tmp_path).load_latest(**ordered)
    assert_same_state(snapshot_run(other), before)


def test_names_must_match_unless_not_strict(tmp_path: Path) -> None:
    run = build()
    train(run, 1)
    Checkpointer(tmp_path).save(1, **run)
    fresh = build()
    with pytest.raises(CheckpointError, match=r"also holds \['data', 'scheduler', 'stepper'\]"):
        Checkpointer(tmp_path).load_latest(model=fresh["model"], optimizer=fresh["optimizer"])
    with pytest.raises(CheckpointError, match=r"has no state for \['ema'\]"):
        Checkpointer(tmp_path).load_latest(**fresh, ema=Blob())
    with pytest.raises(CheckpointError, match="'model' was saved as kind 'module', got kind 'obj"):
        Checkpointer(tmp_path).load_latest(strict=False, model=Blob())
    step = Checkpointer(tmp_path).load_latest(strict=False, model=fresh["model"])
    assert step == 1 and torch.equal(fresh["model"].embed.weight, run["model"].embed.weight)
