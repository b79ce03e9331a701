"""The manifest's ``dp_size``: the data-parallel ranks (ranks that read different data), the
world size except under FSDP2 + tensor parallel. The global batch and an elastic resume's
``accum_steps`` use it (a (dp=2, tp=2) run resumed on 2 plain ranks keeps its
accumulation: tests/cli/test_mesh_runs.py runs that end to end); a manifest from before
the field reads as ``dp_size = world_size``; a malformed one is refused like any field."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradstep.checkpoint import Checkpointer, CheckpointError, CheckpointInfo, elastic_accum_steps
from tests.checkpoint.test_prune_and_verify import _rewrite_manifest


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _info(**fields: object) -> CheckpointInfo:
    return CheckpointInfo(2, Path("step-000002"), {"world_size": 4, "accum_steps": 3, **fields})


def test_one_process_records_dp_size_one_and_its_global_batch(tmp_path: Path) -> None:
    path = Checkpointer(tmp_path, accum_steps=3, micro_batch_size=2).save(1, model=_model())
    info = Checkpointer(tmp_path).inspect(path)
    assert info.manifest["dp_size"] == info.dp_size == info.world_size == 1
    assert (info.manifest["global_micro_batches"], info.manifest["global_batch"]) == (3, 6)


def test_a_dp_size_the_world_cannot_hold_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    with pytest.raises(CheckpointError, match=r"dp_size=2 must divide the world size \(1\)"):
        Checkpointer(tmp_path, dp_size=2).save(1, model=_model())
    assert not tmp_path.exists() or os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match="dp_size must be an int >= 1, got 0"):
        Checkpointer(tmp_path, dp_size=0)


@given(dp=st.sampled_from([1, 2, 4]), accum=st.integers(1, 6), resume_on=st.sampled_from([1, 2, 4]))
def test_a_resume_keeps_the_global_batch_of_the_data_parallel_ranks(
    dp: int, accum: int, resume_on: int
) -> None:
    """Saved on 4 ranks of which ``dp`` read different data: the global batch is ``accum x
    dp`` micro-batches, whatever the world size; a manifest without ``dp_size`` (older) is
    ``dp = world``."""
    info = CheckpointInfo(1, Path("x"), {"world_size": 4, "dp_size": dp, "accum_steps": accum})
    if accum * dp % resume_on:
        with pytest.raises(CheckpointError, match="cannot keep the global batch"):
            info.accum_steps_for(resume_on)
    else:
        assert info.accum_steps_for(resume_on) * resume_on == accum * dp
        assert info.accum_steps_for(resume_on) == elastic_accum_steps(accum, dp, resume_on)
    old = CheckpointInfo(1, Path("x"), {"world_size": dp, "accum_steps": accum})
    assert old.dp_size == dp
    if accum * dp % resume_on == 0:
        assert old.accum_steps_for(resume_on) == info.accum_steps_for(resume_on)


def test_the_tp_checkpoint_of_pitfall_6_keeps_its_accumulation_on_two_plain_ranks() -> None:
    """(dp=2, tp=2) x accum 3: on 2 FSDP2 ranks accum stays 3 (the world size, 4, would
    have doubled it to 6)."""
    assert _info(dp_size=2).accum_steps_for(2) == 3
    assert _info().accum_steps_for(2) == 6  # the same manifest without dp_size: 4 ranks


@pytest.mark.parametrize("bad", [0, 3, "2", None])
def test_a_malformed_dp_size_falls_back_to_the_previous_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: object
) -> None:
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(2, model=_model())
    ckpt.save(4, model=_model())
    _rewrite_manifest(tmp_path / "step-000004", lambda raw: raw.update(dp_size=bad))
    with caplog.at_level(logging.WARNING, logger="gradstep.checkpoint"):
        assert ckpt.latest().step == 2
    assert "dp_size must be an int >= 1 dividing world_size" in caplog.text


def test_a_manifest_from_before_dp_size_still_loads(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, accum_steps=2)
    ckpt.save(3, model=_model())
    _rewrite_manifest(tmp_path / "step-000003", lambda raw: raw.pop("dp_size"))
    info = ckpt.latest()
    assert info is not None and info.dp_size == info.world_size == 1
    assert ckpt.load(info, model=_model()) == 3
