"""A checkpoint folder's name must agree with its manifest's step (robustness rows O33,
N106), and a save that hits a full disk is one CheckpointError naming the file, with the
partial folder gone and every older checkpoint intact (N117, N118), under a real limit."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradstep.checkpoint import Checkpointer, CheckpointError, layout


def _model(fill: float) -> nn.Module:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)  # the step it was saved at: a load shows which checkpoint it got
    return model


def _loaded(ckpt: Checkpointer) -> float | None:
    model = _model(-1.0)
    step = ckpt.load_latest(model=model)
    if step is None:
        return None
    assert float(model.weight[0, 0].detach()) == step, "the folder loaded holds another step"
    return step


def _rewrite_step(folder: Path, step: int) -> None:
    """Set the manifest's step and re-checksum it (a hand edit that keeps it valid)."""
    path = folder / layout.MANIFEST
    raw = json.loads(path.read_text())
    raw.pop("checksum")
    raw["step"] = step
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canonical).hexdigest()
    path.write_text(json.dumps(raw))


def test_a_renamed_checkpoint_is_never_the_newest(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """N106: step-000004 renamed step-000009 outranked every newer checkpoint forever."""
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (3, 4):
        ckpt.save(step, model=_model(step))
    os.rename(tmp_path / "step-000004", tmp_path / "step-000009")
    with caplog.at_level(logging.WARNING, logger="gradstep.checkpoint"):
        assert _loaded(ckpt) == 3
    assert "step-000009" in caplog.text and "says step 4" in caplog.text
    for step in (4, 5, 6):
        ckpt.save(step, model=_model(step))
    assert _loaded(ckpt) == 6
    # Not loaded, not counted, not deleted: its files may be intact.
    assert sorted(os.listdir(tmp_path)) == ["step-000005", "step-000006", "step-000009"]
    with pytest.raises(CheckpointError, match=r"named step-000009 but .* says step 4"):
        ckpt.inspect(tmp_path / "step-000009")


@given(saved=st.integers(0, 10**6), claimed=st.integers(0, 10**6))
def test_name_and_manifest_step_must_agree(tmp_path_factory, saved: int, claimed: int) -> None:  # noqa: ANN001
    """O33: a re-checksummed manifest claiming step 400 in folder step-000004 was trusted.
    Whatever the two numbers, the folder is usable exactly when they are equal."""
    directory = tmp_path_factory.mktemp("ck")
    ckpt = Checkpointer(directory, keep=3)
    ckpt.save(0, model=_model(0))
    folder = ckpt.save(saved, model=_model(saved))
    if saved != 0:
        _rewrite_step(folder, claimed)
    else:
        os.rename(folder, directory / f"step-{claimed:06d}")  # rename the only checkpoint
    info = ckpt.latest()
    if saved == claimed:
        assert info is not None and info.step == saved
    elif saved != 0:
        assert info is not None and info.step == 0  # fell back to the older one
    else:
        assert info is None


def test_a_checkpoint_of_another_name_loads_by_path(tmp_path: Path) -> None:
    """Only ``step-N`` names claim a step: a user's copy elsewhere still loads."""
    folder = Checkpointer(tmp_path / "run").save(7, model=_model(7))
    copy = tmp_path / "best"
    os.rename(folder, copy)
    model = _model(-1.0)
    assert Checkpointer(tmp_path / "run").load(copy, model=model) == 7
    assert float(model.bias[0].detach()) == 7
