"""``gradstep train --nproc-per-node N`` (issue 30 §4): workers started through torch's own
launcher train; a flag error is printed once, with status 2, before any worker starts; a
failed worker ends in gradstep's one line naming its rank, not the launcher's
ChildFailedError traceback. Plain ``torchrun -m gradstep`` keeps working: it trains the
same steps (its refusals: tests/cli/test_torchrun_launch.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.batches import text_corpus
from tests.support.multiproc import free_port

TOY = [
    "--device", "cpu", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "2", "--eval-every", "0",
    "--sample-tokens", "0",
]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LAUNCHER_NOISE = ("ChildFailedError", "Traceback", "torch.distributed", "exitcode")


def gradstep(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gradstep", "train", *args],
        capture_output=True, text=True, timeout=timeout, env=ENV,
    )  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


@pytest.mark.timeout(300)
def test_two_workers_train_one_run_as_plain_torchrun_does(tmp_path: Path) -> None:
    """--nproc-per-node 2 trains one run of 2 ranks; ``torchrun -m gradstep train`` (no
    --nproc-per-node) still works, and trains the same steps, bit for bit."""
    out, plain = tmp_path / "run", tmp_path / "plain"
    data = str(text_corpus(tmp_path / "data"))
    args = [*TOY, "--strategy", "ddp", "--data", data, "--max-steps", "3"]
    proc = gradstep(["--nproc-per-node", "2", *args, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["strategy"], summary["steps"]) == (2, "ddp", 3)
    config = json.loads((out / "config.json").read_text())
    assert config["nproc_per_node"] == 2
    assert not any(noise in proc.stderr for noise in LAUNCHER_NOISE), proc.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                f"--master_port={free_port()}", "-m", "gradstep", "train"]  # fmt: skip
    ran = subprocess.run(
        [*torchrun, *args, "--out", str(plain)], capture_output=True, text=True, timeout=240,
        env=ENV,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert json.loads((plain / "config.json").read_text())["nproc_per_node"] is None
    keys = ("window", "loss", "grad_norm", "lr", "items")
    assert [[r[k] for k in keys] for r in _rows(plain)] == [
        [r[k] for k in keys] for r in _rows(out)
    ]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_flag_error_is_said_once_before_any_worker_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    data = str(text_corpus(tmp_path / "data"))
    started = time.monotonic()
    proc = gradstep(["--nproc-per-node", "2", *TOY, "--data", data, "--out", str(out)])
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == [
        "gradstep train: error: launched as 2 processes but strategy='none'; use --strategy "
        "ddp or --strategy fsdp"
    ], proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""  # no worker printed a thing
    assert not out.exists() and time.monotonic() - started < 120


@pytest.mark.timeout(300)
def test_a_failed_worker_ends_in_one_line_naming_its_rank(tmp_path: Path) -> None:
    missing = [
        "--data",
        str(tmp_path / "missing"),
        "--max-steps",
        "2",
        "--out",
        str(tmp_path / "a"),
    ]
    proc = gradstep(["--nproc-per-node", "2", "--strategy", "ddp", *TOY, *missing])
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == [
        f"gradstep train: error: ranks 0, 1: --data {str(tmp_path / 'missing')!r}: no such "
        "file or folder"
    ], proc.stderr
    assert not any(noise in proc.stderr for noise in LAUNCHER_NOISE), proc.stderr


@pytest.mark.timeout(300)
def test_a_killed_worker_is_named_not_the_ones_the_launcher_stopped(tmp_path: Path) -> None:
    out = tmp_path / "run"
    data = str(text_corpus(tmp_path / "data"))
    args = ["--nproc-per-node", "2", "--strategy", "ddp", *TOY, "--data", data]
    cmd = [sys.executable, "-m", "gradstep", "train", *args, "--max-steps", "100000"]
    proc = subprocess.Popen(
        [*cmd, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=ENV,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 200
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)  # the OOM killer, say
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr
    (line,) = error_lines(stderr)
    assert line.startswith("gradstep train: error: rank ") and "Signal 9 (SIGKILL)" in line, stderr
    assert "SIGTERM" not in stderr and "ChildFailedError" not in stderr, stderr


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (the launcher's workers), oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)
