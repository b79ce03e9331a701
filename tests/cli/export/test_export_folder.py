"""The export folder's clean-up of what killed exports left (gradstep_cli.export.folder):
a temporary folder whose process is gone is removed, one whose process lives is kept,
also when that process belongs to another user (``kill(pid, 0)`` then fails with EPERM:
simulated here, as the tests may run as root, whom no process refuses)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gradstep_cli.export import folder as export_folder


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_live_export_of_another_user_keeps_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, dead_pid, foreign_pid = export_folder._HOST, 999_991, 999_992
    dead = tmp_path / f".c.export-tmp-{host}-{dead_pid}-0123abcd"
    foreign = tmp_path / f".c.export-tmp-{host}-{foreign_pid}-4567abcd"
    for folder in (dead, foreign):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        if pid == dead_pid:
            raise ProcessLookupError(errno.ESRCH, os.strerror(errno.ESRCH))
        if pid == foreign_pid:  # alive, but another user's: no signal is permitted
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    export_folder.publish(tmp_path / "c", lambda tmp: (tmp / "done.json").write_text("{}"))
    assert (tmp_path / "c" / "done.json").read_text() == "{}"
    assert _leftovers(tmp_path) == [foreign.name]  # the dead one's removed, the live one kept
    assert (foreign / "model.safetensors").read_bytes() == b"partial"
