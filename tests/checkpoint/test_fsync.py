"""Durability of a save (README: "fsyncs every file ... fsyncs the folder ... and the
parent"): every ``os.fsync`` and ``os.rename`` of ``Checkpointer.save`` is recorded, with
the path each fsynced descriptor points at (Linux ``/proc/self/fd``), and their order is
checked: each file before the manifest, the manifest before the folder, the folder before
the rename that publishes it, the parent after that rename.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from gradstep.checkpoint import MANIFEST, Checkpointer, layout
from tests.checkpoint.helpers import build, train

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd to name fsynced files"
)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """("fsync", path), ("rename", src, dst) and ("rmtree", path), in call order."""
    log: list[tuple[Any, ...]] = []
    real_fsync, real_rename, real_rmtree = os.fsync, os.rename, shutil.rmtree

    def fsync(fd: int) -> None:
        log.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def rename(src: Any, dst: Any) -> None:
        log.append(("rename", Path(src).resolve(), Path(dst).resolve()))
        real_rename(src, dst)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        log.append(("rmtree", Path(path).resolve()))
        real_rmtree(path, *args, **kwargs)

    # layout.os / layout.shutil are the os and shutil modules: every caller is seen.
    monkeypatch.setattr(layout.os, "fsync", fsync)
    monkeypatch.setattr(layout.os, "rename", rename)
    monkeypatch.setattr(layout.shutil, "rmtree", rmtree)
    return log


def _index(log: list[tuple[Any, ...]], event: tuple[Any, ...]) -> int:
    assert event in log, (event, log)
    return log.index(event)


def _check_publish(log: list[tuple[Any, ...]], final: Path) -> None:
    tmp = final.with_name(f".tmp-{final.name}")
    publish = _index(log, ("rename", tmp, final))
    manifest = _index(log, ("fsync", tmp / MANIFEST))
    files = sorted(p.relative_to(final) for p in final.rglob("*") if p.is_file())
    assert Path(MANIFEST) in files and len(files) >= 4, files
    for rel in files:
        if rel != Path(MANIFEST):
            assert _index(log, ("fsync", tmp / rel)) < manifest, f"{rel} fsynced after manifest"
    folder = _index(log, ("fsync", tmp))
    assert manifest < folder < publish, "the folder is fsynced after its files, before rename"
    after = [i for i, e in enumerate(log) if e == ("fsync", final.parent) and i > publish]
    assert after, "the parent folder is not fsynced after the rename that publishes the step"


def test_save_fsyncs_every_file_the_folder_and_then_the_parent(
    tmp_path: Path, events: list[tuple[Any, ...]]
) -> None:
    run = build()
    train(run, 1)  # optimizer state: optimizer.safetensors is written too
    root = tmp_path.resolve() / "ckpt"
    final = Checkpointer(root, accum_steps=2).save(1, **run)
    _check_publish(events, final.resolve())


def test_replacing_a_step_fsyncs_the_parent_after_the_new_copy_is_in(
    tmp_path: Path, events: list[tuple[Any, ...]]
) -> None:
    run = build()
    root = tmp_path.resolve() / "ckpt"
    Checkpointer(root).save(1, **run)
    train(run, 1)
    events.clear()
    final = Checkpointer(root).save(1, **run).resolve()
    _check_publish(events, final)
    replaced = final.with_name(f".replaced-{final.name}")
    assert _index(events, ("rename", final, replaced)) < _index(
        events, ("rename", final.with_name(f".tmp-{final.name}"), final)
    )


def test_prune_fsyncs_the_folder_between_renaming_away_and_deleting(
    tmp_path: Path, events: list[tuple[Any, ...]]
) -> None:
    run = build()
    root = tmp_path.resolve() / "ckpt"
    checkpointer = Checkpointer(root, keep=1)
    checkpointer.save(1, **run)
    events.clear()
    checkpointer.save(2, **run)
    trash = root / ".trash-step-000001"
    away = _index(events, ("rename", root / "step-000001", trash))
    delete = max(i for i, e in enumerate(events) if e == ("rmtree", trash))
    assert any(e == ("fsync", root) for e in events[away:delete]), events[away:]
    assert sorted(os.listdir(root)) == ["step-000002"]
