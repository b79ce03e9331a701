"""One run per run folder, and an honest --resume (gradstep_cli.run.folder).

Each test reproduces a row of the robustness probe (shared/reviews/robustness.md) that used
to exit 0 with a lost or mixed run; the row number is in the test's docstring.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradstep_cli.cli import main
from tests.support.batches import text_corpus

SMALL = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0", "--max-steps", "3",
]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


def train(corpus: Path, out: Path | str, *flags: str) -> int:
    return main(["train", *SMALL, "--data", str(corpus), "--out", str(out), *flags])


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (the lock file aside), by relative path."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".gradstep.lock"
    }


def steps_of(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_folder_holding_a_run_is_refused_without_resume(corpus, tmp_path, capsys):
    """Row 60: a second run into the same --out used to truncate the first one's metrics
    and keep its checkpoints."""
    out = tmp_path / "run"
    assert train(corpus, out, "--save-every", "1") == 0
    before = snapshot(out)
    assert train(corpus, out, "--lr", "1e-3") == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--resume" in err and "--out" in err and "--overwrite" in err
    assert snapshot(out) == before


def test_overwrite_deletes_the_old_run_first(corpus, tmp_path):
    """Rows 60-61: the new run's checkpoints used to be pruned in favour of the old run's."""
    out = tmp_path / "run"
    save = ["--save-every", "1", "--keep-checkpoints", "2"]
    assert train(corpus, out, *save, "--max-steps", "5") == 0
    assert train(corpus, out, *save, "--overwrite") == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000002", "step-000003"]
    assert steps_of(out) == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_empty_out_is_refused(corpus, tmp_path, capsys, monkeypatch):
    """Row 35: --out "" wrote the run into the current folder."""
    monkeypatch.chdir(tmp_path)
    assert train(corpus, "", "--max-steps", "1") == 2
    assert "out" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_two_trainers_cannot_share_a_folder_and_a_dead_one_releases_it(corpus, tmp_path, capsys):
    """Row 62: two trainers on one --out interleaved their metrics lines."""
    out = tmp_path / "run"
    long_run = [sys.executable, "-m", "gradstep", "train", *SMALL, "--max-steps", "100000"]
    child = subprocess.Popen(
        [*long_run, "--data", str(corpus), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").exists():  # the child holds the lock by now
            assert child.poll() is None and time.monotonic() < deadline, "the child did not start"
            time.sleep(0.1)
        assert train(corpus, out, "--overwrite") == 2
        err = capsys.readouterr().err
        assert "in use by another gradstep train" in err and str(child.pid) in err
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert train(corpus, out, "--overwrite") == 0  # the kernel released the dead one's lock
    assert steps_of(out) == [1, 2, 3]


def test_resume_that_finds_nothing_is_an_error(corpus, tmp_path, capsys):
    """Rows 65-66, 75: --resume used to start from step 0 over the old files."""
    fresh = tmp_path / "fresh"
    assert train(corpus, fresh, "--resume") == 2
    assert "--resume-or-start" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train(corpus, tmp_path / "other", "--resume", str(empty)) == 2
    assert "no valid checkpoint" in capsys.readouterr().err
    out = tmp_path / "run"
    assert train(corpus, out, "--save-every", "1") == 0
    for step in (out / "checkpoints").iterdir():  # every checkpoint corrupted
        model = step / "model.safetensors"
        data = bytearray(model.read_bytes())
        data[-1] ^= 0xFF
        model.write_bytes(bytes(data))
    before = snapshot(out)
    assert train(corpus, out, "--resume", "--max-steps", "5") == 2
    assert "no valid checkpoint" in capsys.readouterr().err
    assert snapshot(out) == before


def test_resume_or_start_starts_once_then_continues(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--resume-or-start", "--save-every", "1"]
    assert train(corpus, out, *flags) == 0
    assert train(corpus, out, *flags, "--max-steps", "5") == 0
    assert "resumed from" in capsys.readouterr().err
    assert steps_of(out) == [1, 2, 3, 4, 5]


def test_resume_finds_the_checkpoints_of_a_run_folder_or_one_step_folder(corpus, tmp_path):
    """Row 67: --resume RUN_DIR (not RUN_DIR/checkpoints) restarted from scratch."""
    src = tmp_path / "src"
    assert train(corpus, src, "--save-every", "1") == 0
    assert train(corpus, tmp_path / "a", "--resume", str(src), "--max-steps", "4") == 0
    assert steps_of(tmp_path / "a") == [4]
    step2 = src / "checkpoints" / "step-000002"
    assert train(corpus, tmp_path / "b", "--resume", str(step2), "--max-steps", "4") == 0
    assert steps_of(tmp_path / "b") == [3, 4]


def test_resume_refuses_changed_settings_and_leaves_the_folder_alone(corpus, tmp_path, capsys):
    """Rows 70-71: a changed --lr was silently ignored while config.json recorded it, and a
    refused resume had already overwritten config.json."""
    out = tmp_path / "run"
    assert train(corpus, out, "--save-every", "1") == 0
    before = snapshot(out)
    for flag, value in (("--lr", "0.1"), ("--clip", "zclip"), ("--accum-steps", "5")):
        assert train(corpus, out, "--resume", "--max-steps", "5", flag, value) == 2
        err = capsys.readouterr().err
        assert "refused" in err and flag in err, err
        assert snapshot(out) == before


def test_resume_runs_the_checkpoints_settings_and_records_them(corpus, tmp_path, capsys):
    """Row 71: config.json must say what runs. The first run's lr and clip come from its
    flags; the resume gives neither, so the checkpoint's apply (not the defaults)."""
    out = tmp_path / "run"
    assert train(corpus, out, "--save-every", "1", "--lr", "1e-3", "--clip", "value:0.5") == 0
    assert train(corpus, out, "--resume", "--max-steps", "5") == 0
    err = capsys.readouterr().err
    assert "lr=0.001" in err and "keeps the checkpoint's max_steps 3" in err
    config = json.loads((out / "config.json").read_text())
    assert (config["lr"], config["clip"], config["max_steps"]) == (1e-3, "value:0.5", 5)
    assert steps_of(out) == [1, 2, 3, 4, 5]


def test_resuming_a_finished_run_says_so_and_changes_nothing(corpus, tmp_path, capsys):
    """Row 72: summary.json was rewritten with the initial validation loss."""
    out = tmp_path / "run"
    assert train(corpus, out, "--save-every", "1") == 0
    before = snapshot(out)
    for steps in ("3", "2"):
        assert train(corpus, out, "--resume", "--max-steps", steps) == 0
        assert "already finished" in capsys.readouterr().err
        assert snapshot(out) == before
