"""Pruning never deletes a good checkpoint for a bad or foreign one; verification never
crashes on what it finds (robustness probe rows 61, 76-78, 121-123)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from gradstep.checkpoint import Checkpointer, CheckpointError, layout


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _corrupt(step_dir: Path) -> None:
    path = step_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_manifest(step_dir: Path, edit) -> None:  # noqa: ANN001
    """Edit the manifest and recompute its checksum (what a buggy tool could write)."""
    path = step_dir / layout.MANIFEST
    raw = json.loads(path.read_text())
    raw.pop("checksum")
    edit(raw)
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canonical).hexdigest()
    path.write_text(json.dumps(raw))


def test_a_corrupted_newer_checkpoint_never_pushes_out_good_ones(tmp_path):
    """Row 123: with keep=1, after resuming past a corrupted step 6, save(4) deleted step 3
    and step 4 and left only the corrupted step 6."""
    model = _model()
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(3, model=model)
    Checkpointer(tmp_path, keep=2).save(6, model=model)
    _corrupt(tmp_path / "step-000006")
    assert ckpt.latest().step == 3
    ckpt.save(4, model=model)
    assert sorted(os.listdir(tmp_path)) == ["step-000004"]
    assert ckpt.latest().step == 4


def test_folders_gradstep_did_not_write_are_never_loaded_or_deleted(tmp_path, caplog):
    model = _model()
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, model=model)
    notes = tmp_path / "step-000007"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="gradstep.checkpoint"):
        assert ckpt.latest().step == 1
    assert "not a checkpoint gradstep published" in caplog.text
    ckpt.save(2, model=model)
    ckpt.save(3, model=model)
    assert sorted(os.listdir(tmp_path)) == ["step-000003", "step-000007"]
    assert (notes / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("case", "damage", "reason"),
    [
        ("76 NaN in the manifest", "nan", "not valid JSON"),
        ("77 manifest is a folder", "folder", "cannot be read"),
        ("78 files deleted", lambda raw: raw.pop("files"), "files and objects"),
        ("78 format_version a string", lambda raw: raw.update(format_version="1"), "format_"),
        ("78 negative step", lambda raw: raw.update(step=-3), "step must be an int"),
        ("78 path outside", lambda raw: raw["files"].update({"../x": raw["files"].popitem()[1]}),
         "inside the folder"),
    ],
)  # fmt: skip
def test_a_malformed_manifest_falls_back_to_the_previous_checkpoint(tmp_path, caplog, case,
                                                                   damage, reason):  # fmt: skip
    model = _model()
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(2, model=model)
    ckpt.save(4, model=model)
    newest = tmp_path / "step-000004"
    if damage == "nan":
        text = (newest / layout.MANIFEST).read_text()
        (newest / layout.MANIFEST).write_text(
            text.replace('"created_unix": ', '"created_unix": NaN, "x": ', 1)
        )
    elif damage == "folder":
        (newest / layout.MANIFEST).unlink()
        (newest / layout.MANIFEST).mkdir()
    else:
        _rewrite_manifest(newest, damage)
    with caplog.at_level(logging.WARNING, logger="gradstep.checkpoint"):
        info = ckpt.latest()
    assert info is not None and info.step == 2, case
    assert reason in caplog.text, (case, caplog.text)
    fresh = _model(seed=1)
    assert ckpt.load(info, model=fresh) == 2


def test_checkpoint_directory_that_is_a_file(tmp_path):
    """Row 121: FileExistsError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        Checkpointer(afile).save(1, model=_model())
    assert Checkpointer(afile).latest() is None


def test_optimizer_state_of_another_type_is_refused(tmp_path):
    """Row 122: SGD state loaded into AdamW, then KeyError: 'step' inside adam.py."""
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    sgd.step()
    Checkpointer(tmp_path).save(1, model=model, optimizer=sgd)
    other = _model(seed=1)
    adamw = torch.optim.AdamW(other.parameters())
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError, match="saved from a SGD, got a AdamW"):
        Checkpointer(tmp_path).load_latest(model=other, optimizer=adamw)
    assert all(torch.equal(b, p) for b, p in zip(before, other.parameters(), strict=True))
    assert adamw.state_dict()["state"] == {}


class _Crash(Exception):
    pass


def _fs_calls(hook) -> pytest.MonkeyPatch:  # noqa: ANN001
    """Patch the filesystem calls a prune makes (clear, rename, delete, fsync) so each goes
    through ``hook(real, *args)`` first."""
    mp = pytest.MonkeyPatch()
    for owner, name in ((layout.os, "rename"), (layout.shutil, "rmtree"), (layout, "fsync")):
        real = getattr(owner, name)
        mp.setattr(owner, name, lambda *a, _real=real, **k: hook(_real, *a, **k))
    return mp


def _prune_crashing_at(crash_at: int, calls: list):  # noqa: ANN202
    """A ``layout.prune`` that raises _Crash at its ``crash_at``-th filesystem call (and
    counts the calls into ``calls``)."""
    real_prune = layout.prune

    def hook(real, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == crash_at + 1:
            raise _Crash
        return real(*a, **k)

    def prune(*a, **k):  # noqa: ANN002, ANN003, ANN202
        mp = _fs_calls(hook)
        try:
            return real_prune(*a, **k)
        finally:
            mp.undo()

    return prune


def _saved(root: Path, model: nn.Module) -> Path:
    """Good steps 1 and 2, a corrupted step 4: what the prune after save(5) meets."""
    for step in (1, 2, 4):
        Checkpointer(root, keep=10).save(step, model=model)
    _corrupt(root / "step-000004")
    return root


def test_a_crash_at_any_point_of_a_prune_leaves_the_newest_valid_checkpoint(tmp_path):
    """Fault injection: the prune after save(5) (keep=2) raises at its i-th filesystem
    call, for every i. Afterwards a fresh Checkpointer finds step 5, and it loads."""
    model = _model()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    probe, counted = _saved(tmp_path / "probe", model), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout, "prune", _prune_crashing_at(10**9, counted))
        Checkpointer(probe, keep=2).save(5, model=model)
    n_calls = len(counted)
    assert n_calls >= 7  # two folders pruned: clear, rename, delete each, and one fsync
    for crash_at in range(n_calls):
        root = _saved(tmp_path / f"crash{crash_at}", model)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(layout, "prune", _prune_crashing_at(crash_at, []))
            with pytest.raises(_Crash):
                Checkpointer(root, keep=2).save(5, model=model)
        info = Checkpointer(root, keep=2).latest()
        assert info is not None and info.step == 5, crash_at
        fresh = _model(seed=1)
        Checkpointer(root).load(info, model=fresh)
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, want[key]), (crash_at, key)
