"""After a crash and a resume, metrics.jsonl holds each step once (issue 30 §4; the walk found
steps 71-78 twice after a SIGKILL at 78 and a resume from 70 of a run begun from another
folder's checkpoint): the file is cut back to the checkpoint's step by the steps its records
name, in the run's own folder (from its newest checkpoint or an older one named with
``--resume PATH``) and in a new one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gradstep.checkpoint import MANIFEST
from gradstep_cli.cli import main as gradstep_main
from tests.parallel import node_ranks
from tests.support.batches import text_corpus

TOY = [
    "--device", "cpu", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1", "--eval-every", "0",
    "--sample-tokens", "0", "--log-every", "1",
]  # fmt: skip


def windows(out: Path) -> list[int]:
    text = (out / "metrics.jsonl").read_text()
    return [json.loads(line)["window"] for line in text.splitlines() if line.endswith("}")]


def run_until_killed(args: list[str], out: Path, at: int, after: int) -> None:
    """Run ``gradstep train ARGS`` and SIGKILL it as it enters its ``at``-th step, once its
    step-``after`` checkpoint is published (tests/parallel/node_ranks.py's hook: a kill
    from outside that polls the folder races the tiny model's steps, and under load it
    once landed just after a checkpoint, with no step past it to log twice)."""
    mark = out.parent / f"{out.name}.killed"
    env = node_ranks.launch_env(**{
        "RANK": "0", node_ranks.KILL_RANK: "0", node_ranks.KILL_AT: str(at),
        node_ranks.KILL_AFTER: str(out / "checkpoints" / f"step-{after:06d}" / MANIFEST),
        node_ranks.KILL_MARK: str(mark),
    })  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "tests.parallel.node_ranks", "train", *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=240,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL and mark.exists(), done.returncode


@pytest.mark.timeout(600)
def test_each_step_is_logged_once_after_a_sigkill_and_resumes(tmp_path: Path) -> None:
    corpus = text_corpus(tmp_path / "data")
    first = tmp_path / "first"
    base = [*TOY, "--data", str(corpus), "--save-every", "4", "--keep-checkpoints", "10"]
    assert gradstep_main(["train", *base, "--max-steps", "8", "--out", str(first)]) == 0
    # Another folder, from the first run's step-8 checkpoint: killed entering its 11th step
    # (window 19), after its step-16 checkpoint: windows 17-18 are logged past it.
    other = tmp_path / "other"
    long = ["--max-steps", "100000"]
    resume = ["--resume", str(first / "checkpoints" / "step-000008")]
    run_until_killed([*base, *resume, *long, "--out", str(other)], other, at=11, after=16)
    logged = windows(other)
    assert logged == list(range(9, 19)), logged
    saved = max(int(p.name.split("-")[1]) for p in (other / "checkpoints").glob("step-*"))
    assert saved == 16, (saved, logged)  # steps after the checkpoint are run again
    end = logged[-1] + 3
    assert gradstep_main(["train", "--out", str(other), "--resume", "--max-steps", str(end)]) == 0
    assert windows(other) == list(range(9, end + 1))
    # The same folder from one of its older checkpoints (--resume PATH): cut back to it.
    older = min((other / "checkpoints").glob("step-*"))
    assert int(older.name.split("-")[1]) < end
    back = ["train", "--out", str(other), "--resume", str(older), "--max-steps", str(end)]
    assert gradstep_main(back) == 0
    assert windows(other) == list(range(9, end + 1))
    # A third folder from the killed one's checkpoints: its own steps, each once.
    third = tmp_path / "third"
    again = ["train", "--resume", str(other), "--out", str(third), "--max-steps", str(end + 2)]
    assert gradstep_main(again) == 0
    assert windows(third) == list(range(end + 1, end + 3))
