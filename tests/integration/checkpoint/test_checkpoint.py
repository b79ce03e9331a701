"""The tests of tests/checkpoint/test_checkpoint.py that start processes or run the CLI end to
end; its other tests stay there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gradstep
from gradstep.checkpoint import MANIFEST, Checkpointer
from tests.checkpoint.helpers import Blob
from tests.checkpoint.kill_child import new_model
from tests.checkpoint.test_checkpoint import CLI_TINY
from tests.support.batches import text_corpus

ROOT = Path(__file__).resolve().parents[3]  # the repo root: kill_child runs with -m from it


def _kill_child(*args: str) -> Any:
    """Run tests/checkpoint/kill_child.py (one interpreter; it forks per case)."""
    cmd = [sys.executable, "-m", "tests.checkpoint.kill_child", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _loaded_step(directory: Path) -> int | None:
    """What a fresh process would resume: the step, checked against the saved contents."""
    model = new_model()
    counter = Blob()
    step = Checkpointer(directory).load_latest(model=model, counter=counter)
    if step is not None:
        assert counter.state == {"step": step}
        assert all(torch.equal(p, torch.full_like(p, step)) for p in model.parameters())
    return step


KILL_POINTS = {
    # point: the step a resume must find (2 = the previous checkpoint, 3 = the new one)
    "mid_tensor_file": 2,
    "before_manifest": 2,
    "mid_manifest": 2,
    "before_rename": 2,
    "replace": 2,  # re-saving step 2, killed between moving the old copy and the new in
    "before_prune": 3,
    "mid_prune": 3,
}


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Every kill point run once: {point: the signal the saving process died of}."""
    directory = tmp_path_factory.mktemp("killed")
    return directory, _kill_child(str(directory), "points", ",".join(KILL_POINTS))


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_during_save_leaves_a_loadable_checkpoint(
    killed_saves: tuple[Path, dict[str, int]], point: str
) -> None:
    directory, died = killed_saves
    assert died[point] == signal.SIGKILL
    path = directory / point
    assert _loaded_step(path) == KILL_POINTS[point]
    # The next save tidies what the killed one left and keeps the format consistent.
    Checkpointer(path, keep=2).save(10, model=torch.nn.Linear(2, 2))
    names = sorted(os.listdir(path))
    assert names[-1] == "step-000010" and not [n for n in names if n.startswith(".")]


def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    """A process saving in a loop (keep=2) is killed at random instants, five times; each
    time the newest checkpoint it PUBLISHED loads (the newest step whose ``save`` returned,
    or the next one when the kill came after that one's rename), with exactly its step's
    contents, and saving resumes from it. Loading an older valid step (keep=2 leaves one)
    fails this."""
    rounds = _kill_child(str(tmp_path), "random", "5", "1")
    loaded = [r["loaded"] for r in rounds]
    assert len(loaded) == 5 and all(step is not None for step in loaded)
    for r in rounds:
        assert r["published"] is not None, r  # the round saved at least once before the kill
        newest_published = r["loaded"] == r["published"]
        renamed_then_killed = r["loaded"] == r["begun"] == r["published"] + 1
        assert newest_published or renamed_then_killed, r
    assert loaded == sorted(loaded) and loaded[-1] > loaded[0]
    assert _loaded_step(tmp_path) == loaded[-1]


def _rows(run: Path) -> list[dict[str, Any]]:
    """The deterministic part of each metrics line (no wall times, no memory)."""
    keep = {f.name for f in dataclasses.fields(gradstep.StepStats)} | {"val_loss"}
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k in keep} for line in lines]


def _final(run: Path) -> dict[str, Any]:
    manifest = json.loads((run / "checkpoints" / "step-000006" / MANIFEST).read_text())
    files = {n: m["sha256"] for n, m in manifest["files"].items()}
    del manifest["objects"]["progress"]["state"]["step_time"]  # wall time spent stepping
    return {"files": files, "objects": manifest["objects"], "step": manifest["step"]}


def test_cli_resume_is_bitwise_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gradstep train --save-every 3` runs 6 steps; a second run of the same command
    crashes in step 5 (after the step-3 checkpoint and 4 metrics lines); `gradstep train
    --resume` in a fresh process continues it. Metrics lines and the final checkpoint's files
    (parameters, optimizer, RNG: same sha256) equal the uninterrupted run's."""
    from gradstep_cli.cli import main

    args = [*CLI_TINY, "--data", str(text_corpus(tmp_path / "data"))]
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    assert main(["train", *args, "--out", str(whole)]) == 0

    real_step, calls = gradstep.Stepper.step, []

    def crash_in_step_5(self: gradstep.Stepper, *a: Any, **kw: Any) -> gradstep.StepStats:
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # what a kill looks like to the files: step 5 never ends
        return real_step(self, *a, **kw)

    monkeypatch.setattr(gradstep.Stepper, "step", crash_in_step_5)
    assert main(["train", *args, "--out", str(crashed)]) == 130
    monkeypatch.undo()
    assert len(_rows(crashed)) == 4
    assert sorted(os.listdir(crashed / "checkpoints")) == ["step-000003"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same thread count as this process
    resume = [sys.executable, "-m", "gradstep", "train", *args, "--out", str(crashed), "--resume"]
    result = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "step-000003" in result.stderr + result.stdout

    assert _rows(crashed) == _rows(whole)
    assert [r["step"] for r in _rows(crashed)] == list(range(1, 7))
    assert _final(crashed) == _final(whole)
    summaries = [json.loads((run / "summary.json").read_text()) for run in (whole, crashed)]
    for key in ("steps", "initial_val_loss", "final_val_loss", "final_train_loss", "sample"):
        assert summaries[0][key] == summaries[1][key], key
