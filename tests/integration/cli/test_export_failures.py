"""`gradstep export` fails like `train` does: one line, the real reason, nothing half-written
(issue 28 §2; robustness-3 rows FS1-FS3, LIVE, CONC, E14, E23).

- a full disk or the file-size limit: one line naming the file and what to do, status 1,
  neither the folder nor its temporary folder left (FS3 runs a real ``ulimit -f`` in a child);
- a trainer that prunes the checkpoint mid-export: the export holds a read lease, so the
  checkpoint stays until a later save; where leases do not hold, the line says it was pruned;
- two exports to one ``--out``: each writes its own temporary folder, the loser is told the
  folder was taken meanwhile, the winner's folder is whole;
- ``--out ""`` is refused, as by ``train``; a LoRA run whose base folder moved is told so.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors import SafetensorError  # noqa: E402

from gradstep.checkpoint import Checkpointer, layout  # noqa: E402
from gradstep_cli.cli import main  # noqa: E402
from gradstep_cli.export import folder as export_folder  # noqa: E402
from gradstep_cli.export import run as export_module  # noqa: E402
from tests.checkpoint.test_prune_and_verify import _rewrite_manifest  # noqa: E402
from tests.integration.cli.test_export import RANK, base_dir, train  # noqa: E402

ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "gradstep_export.json"}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("lora"), "run", "--lora", str(RANK))


@pytest.fixture
def run(lora_run: Path, tmp_path: Path) -> Path:
    """A copy of the run that a test may change (its base folder is shared, read-only)."""
    return Path(shutil.copytree(lora_run, tmp_path / "run"))


def _failed(capsys: pytest.CaptureFixture[str], argv: list[str], status: int) -> str:
    """Run ``argv``: it must exit ``status`` with one error line, no traceback. The line."""
    capsys.readouterr()
    assert main(argv) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# --------------------------------------------------------------------- FS1-FS3: full disk


def test_the_file_size_limit_is_one_line_naming_the_file(lora_run: Path, tmp_path: Path) -> None:
    """FS3: ``ulimit -f`` below the merged model's size, in a child process (the real
    SafetensorError out of save_pretrained, EFBIG)."""
    out = tmp_path / "exp" / "fs3"
    limit = 64 * 1024  # the config and tokenizer files fit, the weights do not

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-m", "gradstep", "export", str(lora_run), "--out", str(out)]
        + ["--merge-lora"],
        preexec_fn=limited,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = done.stderr
    assert done.returncode == 1, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("gradstep export: error: File too large"), err
    assert repr(str(out / "model.safetensors")) in err, err
    assert "ulimit -f" in err and "--out" in err and "nothing was published" in err, err
    assert not out.exists() and _leftovers(out.parent) == []


@pytest.mark.parametrize("where", ["weights", "tokenizer"])
def test_a_full_disk_is_one_line_naming_the_file(
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """FS1/FS2: ENOSPC as safetensors raises it out of save_pretrained (its own error, no
    file name, the errno only in its text) and as a plain OSError naming the file."""
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    def full_weights(self: object, folder: str, **kwargs: object) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)  # as save_pretrained does
        (Path(folder) / "adapter_config.json").write_text("{}")  # written before the weights
        raise SafetensorError("Error while serializing: I/O error: No space left on "
                              "device (os error 28)")  # fmt: skip

    def full_tokenizer(self: object, folder: str, **kwargs: object) -> None:
        name = Path(folder) / "tokenizer.json"
        name.write_bytes(b"\0" * 100)  # half written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))

    if where == "weights":
        monkeypatch.setattr(PeftModel, "save_pretrained", full_weights)
    else:
        monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_tokenizer)
    out = tmp_path / "exp" / "fs1"
    name = "adapter_model.safetensors" if where == "weights" else "tokenizer.json"
    for _ in range(2):  # FS2: again, on the same disk
        err = _failed(capsys, ["export", str(run), "--out", str(out)], 1)
        assert err.startswith("gradstep export: error: No space left on device"), err
        assert repr(str(out / name)) in err and "free space" in err, err
        assert "nothing was published" in err, err
        assert not out.exists() and _leftovers(out.parent) == []


# ------------------------------------------------------------- LIVE: pruned mid-export


def _newer_step(checkpoints: Path) -> None:
    """What a trainer with --keep-checkpoints 1 does next: publish step 3 (here a copy of
    step 2 under its own number) and prune down to one checkpoint."""
    shutil.copytree(checkpoints / "step-000002", checkpoints / "step-000003")
    _rewrite_manifest(checkpoints / "step-000003", lambda raw: raw.update(step=3))
    layout.prune(checkpoints, keep=1, protect={checkpoints / "step-000003"})


def _trainer_saves_during(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Run :func:`_newer_step` once, when the export first calls ``export.<name>``."""
    real = getattr(export_module, name)
    calls = []

    def hooked(*args: object, **kwargs: object) -> object:
        if not calls:
            calls.append(1)
            info = args[0]
            _newer_step(Path(getattr(info, "path", info)).parent)
        return real(*args, **kwargs)

    monkeypatch.setattr(export_module, name, hooked)


def test_a_checkpoint_being_read_is_leased_and_pruned_by_a_later_save(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoints = run / "checkpoints"
    _trainer_saves_during(monkeypatch, "run_settings")  # the checkpoint is being read
    out = tmp_path / "exp"
    assert main(["export", str(run), "--out", str(out), "--step", "2"]) == 0
    assert {p.name for p in out.iterdir()} >= ADAPTER_FILES
    assert json.loads((out / "gradstep_export.json").read_text())["step"] == 2
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000003"]
    Checkpointer(checkpoints, keep=1).save(4, model=torch.nn.Linear(2, 2))  # the next save
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000004"]


def test_the_newest_checkpoint_pruned_before_it_is_leased_gives_way_to_the_newer_one(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _trainer_saves_during(monkeypatch, "read_lease")  # listed, then pruned: list again
    out = tmp_path / "exp"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "gradstep_export.json").read_text())["step"] == 3


def test_a_checkpoint_pruned_without_a_lease_is_named_as_pruned(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where leases cannot hold (a file system without locks, a trainer from before leases)
    the line says what happened, not "No such file or directory"."""

    @contextlib.contextmanager
    def no_lease(folder: Path) -> Iterator[Path]:
        yield Path(folder)

    monkeypatch.setattr(export_module, "read_lease", no_lease)
    _trainer_saves_during(monkeypatch, "run_settings")
    out = tmp_path / "exp"
    err = _failed(capsys, ["export", str(run), "--out", str(out)], 1)
    assert "step-000002 was pruned while export read it" in err, err
    assert "--step" in err and "wait until the run ends" in err, err
    assert not out.exists() and _leftovers(tmp_path) == []


# ------------------------------------------------------------------ CONC: one --out, two


def test_two_exports_to_one_out_never_share_a_folder(
    lora_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second export starts and finishes while the first is writing: the first is told
    the folder was taken, the second's folder is whole and holds only its own files."""
    out = tmp_path / "exp" / "c"
    real = export_module._write
    seen: list[list[str]] = []

    def racing(folder: Path, *args: object) -> None:
        if not seen:
            seen.append(_leftovers(out.parent))  # the first export's own temporary folder
            assert main(["export", str(lora_run), "--out", str(out)]) == 0
        real(folder, *args)

    monkeypatch.setattr(export_module, "_write", racing)
    capsys.readouterr()
    assert main(["export", str(lora_run), "--out", str(out), "--merge-lora"]) == 2
    won, err = capsys.readouterr().err.splitlines()  # the second's success, the first's error
    assert won.startswith("exported the LoRA adapter") and "Traceback" not in err, err
    assert "--out" in err and "was taken by another export meanwhile" in err, err
    assert "nothing of this export was published" in err, err
    (first_tmp,) = seen[0]
    assert first_tmp.startswith(".c.export-tmp-") and str(os.getpid()) in first_tmp
    names = {p.name for p in out.iterdir()}
    assert names >= ADAPTER_FILES and "model.safetensors" not in names  # the adapter's only
    assert json.loads((out / "gradstep_export.json").read_text())["kind"] == "lora-adapter"
    assert _leftovers(out.parent) == []


def test_only_the_temporary_folders_of_dead_exports_are_removed(
    lora_run: Path, tmp_path: Path
) -> None:
    """K2 still holds (a killed export's leftovers go) without touching a live export's."""
    child = subprocess.Popen(["true"])
    child.wait()
    host = export_folder._HOST
    dead = tmp_path / f".c.export-tmp-{host}-{child.pid}-0123abcd"
    live = tmp_path / f".c.export-tmp-{host}-{os.getppid()}-4567abcd"
    other_host = tmp_path / f".c.export-tmp-00000000-{child.pid}-89abcdef"
    legacy = tmp_path / ".c.export-tmp"  # gradstep's single name before this change
    for folder in (dead, live, other_host, legacy):
        folder.mkdir()
    assert main(["export", str(lora_run), "--out", str(tmp_path / "c")]) == 0
    assert _leftovers(tmp_path) == sorted([live.name, other_host.name])


# ---------------------------------------------------------------- E14, E23: refusals


def test_an_empty_out_is_refused_as_train_refuses_it(
    lora_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    err = _failed(capsys, ["export", str(lora_run), "--out", ""], 2)
    assert "--out must name the folder to write, got an empty path" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written in the current folder


def test_a_lora_run_whose_base_folder_moved_is_told_so(
    lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = base_dir(lora_run)
    moved = base.with_name(base.name + "-moved")
    base.rename(moved)
    try:
        for extra in ([], ["--merge-lora"]):
            argv = ["export", str(lora_run), "--out", str(tmp_path / "exp"), *extra]
            err = _failed(capsys, argv, 2)
            assert f"the base folder {str(base)!r}" in err and "is missing" in err, err
            assert str(lora_run / "checkpoints" / "step-000002") in err, err
            assert "randomly initialised" not in err, err
    finally:
        moved.rename(base)
    assert list(tmp_path.iterdir()) == []
