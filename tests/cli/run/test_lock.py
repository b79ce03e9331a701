"""The run folder's lock and where a run folder may be (gradstep_cli.run.lock)."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path
from typing import Any

import pytest

from gradstep_cli.cli import main
from tests.support.batches import text_corpus

SMALL = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0", "--max-steps", "2",
]  # fmt: skip


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    gen = random.Random(0)
    for i in range(4):
        (folder / f"f{i}.py").write_text(" ".join(gen.choices(["def", "x", "(y)"], k=400)))
    return folder


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


GPT = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip

HF = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI, expect exit status 2 and one error line; return that line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if " error: " in line]
    assert len(lines) == 1, err
    return lines[0]


def train(capsys: Any, tmp_path: Path, *flags: str, model: Path | None = None) -> str:
    """``refused`` for a tiny run into ``tmp_path/run``: the demo GPT, or ``hf:model``."""
    size = GPT if model is None else ["--model", f"hf:{model}", *HF]
    return refused(capsys, "train", *size, "--out", str(tmp_path / "run"), *flags)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


def test_out_that_cannot_be_a_run_folder(small_corpus, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["train", *SMALL, "--data", str(small_corpus)]
    code, err = run(capsys, *base, "--out", str(afile))  # row 57
    assert code == 2 and "is not a folder" in err
    code, err = run(capsys, *base, "--out", str(afile / "sub"))  # row 58
    assert code == 2 and "cannot write the run folder" in err
    if Path("/sys").is_dir():  # row 59: read-only even for root (the tests run as root)
        code, err = run(capsys, *base, "--out", "/sys/gradstep-test-run")
        assert code == 2 and "cannot write the run folder" in err


@pytest.mark.parametrize(
    ("code", "why"),
    [(errno.EROFS, "is on a read-only file system"), (errno.EACCES, "is not writable")],
)
def test_a_read_only_run_folder_is_told_so(tmp_path, corpus, capsys, monkeypatch, code, why):
    """RO2: the lock error advised 'delete it and retry' on a read-only file system (root
    writes through file modes, so the file system's errno is simulated)."""
    from gradstep_cli.run import lock as run_lock

    out = tmp_path / "run"
    out.mkdir()

    def read_only(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(run_lock, "open", read_only, raising=False)
    line = train(capsys, tmp_path, "--data", str(corpus), "--resume")
    assert f"--out {str(out)!r} {why}" in line and ".gradstep.lock" in line, line
    assert f"pass --resume {str(out)!r} with a new, writable --out" in line
    assert "delete it" not in line
