"""A run's LR schedule in sequences and its batch ramp, end to end: recorded and resumed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import gradstep
from gradstep_cli.cli import main
from gradstep_cli.run.schedule import WarmupCosine
from tests.cli.test_cli import TINY, read_jsonl
from tests.support.batches import text_corpus

RAMP = [*TINY, "--accum-steps", "4", "--max-steps", "6", "--eval-every", "0"]


@pytest.mark.parametrize("ramp", ["1:5", "gns"])
def test_ramped_run_records_and_resumes_exactly(
    tmp_path: Path, ramp: str, monkeypatch: pytest.MonkeyPatch
):
    """A run resumed from a checkpoint in the middle of its ramp continues it exactly:
    every metrics line (batch, LR, noise scale, loss) equals the uninterrupted run's."""
    data = str(text_corpus(tmp_path / "data"))
    args = [*RAMP, "--data", data, "--batch-ramp", ramp, "--lr-scaling", "sqrt", "--gns"]
    args += ["--gns-beta", "0.5"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["train", *args, "--out", str(whole)]) == 0
    rows = read_jsonl(whole / "metrics.jsonl")
    per_step = [r["micro_batches"] for r in rows]
    assert sum(per_step) == 6 * 4  # the budget: max_steps full batches
    # Growing, the last window taking only what is left of the budget.
    assert per_step[:-1] == sorted(per_step[:-1]) and per_step[0] < 4
    if ramp == "1:5":
        assert per_step[:5] == [1, 1, 2, 2, 3]
    shape = WarmupCosine(1, 6, 3e-4 / 3e-3)
    clock = 0.0
    for r in rows:  # the LR follows the sequence clock and the sqrt rule
        assert r["lr"] == pytest.approx(3e-3 * math.sqrt(r["micro_batches"] / 4) * shape(clock))
        clock += r["micro_batches"] / 4
    assert all(isinstance(r["items"], int) and r["items"] > 0 for r in rows)
    assert rows[-1]["gns_b_simple"] is not None

    real_step, calls = gradstep.Stepper.step, []

    def crash_in_step_5(self, *a, **kw):  # a kill in the middle of the ramp
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step(self, *a, **kw)

    monkeypatch.setattr(gradstep.Stepper, "step", crash_in_step_5)
    assert main(["train", *args, "--out", str(cut), "--save-every", "3"]) == 130
    monkeypatch.undo()
    assert main(["train", *args, "--out", str(cut), "--resume"]) == 0
    resumed = read_jsonl(cut / "metrics.jsonl")
    keys = ("micro_batches", "items", "lr", "loss", "grad_norm", "gns_b_simple")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in rows]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["steps"] == len(rows)


@pytest.mark.parametrize("optimizer", ["sgd", "lars", "lamb"])
def test_every_optimizer_follows_the_ramp_and_its_lr_scaling(tmp_path: Path, optimizer: str):
    data = str(text_corpus(tmp_path / "data"))
    args = [*RAMP, "--data", data, "--optimizer", optimizer, "--batch-ramp", "1:3"]
    args += ["--lr-scaling", "linear", "--max-steps", "3", "--sample-tokens", "0"]
    assert main(["train", *args, "--out", str(tmp_path / "o")]) == 0
    rows = read_jsonl(tmp_path / "o" / "metrics.jsonl")
    shape, clock = WarmupCosine(1, 3, 3e-4 / 3e-3), 0.0
    assert [r["micro_batches"] for r in rows][:3] == [1, 2, 3]
    for r in rows:
        assert r["lr"] == pytest.approx(3e-3 * r["micro_batches"] / 4 * shape(clock))
        clock += r["micro_batches"] / 4
