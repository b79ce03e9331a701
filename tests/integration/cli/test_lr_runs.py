"""The learning rate `gradstep train` really uses, read back from metrics.jsonl.

- With a batch ramp the warm-up never pushes the LR above --lr (rows N33-N36).
- Extending a run (--resume --max-steps N after a shorter run) keeps the checkpoint's
  schedule as docs/guide/cli.md says: the cosine ends at the checkpoint's max_steps and later
  steps run at --min-lr; the steps both runs share are the uninterrupted run's (row N96).
- A resume with a new --max-steps and no --warmup runs the checkpoint's warm-up
  (hf-client-2, CLI table: it was refused on the default --warmup 20).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gradstep_cli.cli import main
from tests.cli.run.test_schedule import reference_factor
from tests.support.batches import text_corpus

TINY = [
    "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-every", "0",
    "--eval-batches", "1", "--sample-tokens", "0",
]  # fmt: skip
LR, MIN_LR = 3e-3, 3e-4  # the defaults: --min-lr is a tenth of --lr


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(text_corpus(tmp_path_factory.mktemp("lr") / "corpus"))


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(data: str, out: Path, *flags: str) -> int:
    return main(["train", *TINY, "--data", data, "--out", str(out), *flags])


@pytest.mark.parametrize("scaling", ["none", "linear"])
def test_a_ramped_warmup_never_exceeds_lr(data, tmp_path, scaling):
    """Row N34 (`--batch-ramp gns --warmup 1`: step 2 ran at 1.5 x --lr) and N33 (with
    --lr-scaling linear: 1.25 x and 1.5 x the scaled LR)."""
    out = tmp_path / "run"
    flags = ["--accum-steps", "4", "--max-steps", "4", "--batch-ramp", "gns", "--warmup", "1"]
    assert train(data, out, *flags, "--lr-scaling", scaling) == 0
    clock = 0.0
    records = rows(out)
    assert [r["micro_batches"] for r in records][:2] == [2, 2]  # the ramp's smaller steps
    for r in records:
        factor = r["micro_batches"] / 4 if scaling == "linear" else 1.0
        assert r["lr"] <= LR * factor  # the contract, exactly
        expected = LR * factor * reference_factor(clock, 1, 4, MIN_LR / LR)
        assert r["lr"] == pytest.approx(expected, rel=1e-12)
        clock += r["micro_batches"] / 4


def test_extending_a_run_keeps_the_checkpoints_schedule(data, tmp_path, capsys):
    """Row N96: a 4-step run resumed to 8 rebuilt the cosine over 8 steps (the LR doubled at
    step 5) while the run printed that it kept max_steps 4. Resumed from step 2, steps 3-4
    must be the uninterrupted run's (loss, norm and LR), steps 5-8 run at --min-lr, and a
    second extension keeps the horizon too (each extension used to move it again)."""
    first, longer = tmp_path / "first", tmp_path / "longer"
    assert train(data, first, "--max-steps", "4", "--warmup", "1", "--save-every", "1") == 0
    step2 = first / "checkpoints" / "step-000002"
    capsys.readouterr()
    assert train(data, longer, "--resume", str(step2), "--max-steps", "8") == 0
    err = capsys.readouterr().err
    assert "keeps the checkpoint's max_steps 4" in err and "--min-lr 0.0003" in err, err
    straight, resumed = rows(first), rows(longer)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6, 7, 8]
    keys = ("loss", "grad_norm", "items", "lr")
    assert [[r[k] for k in keys] for r in resumed[:2]] == [
        [r[k] for k in keys] for r in straight[2:]
    ]
    assert [r["lr"] for r in resumed[2:]] == [MIN_LR] * 4  # the docs: later steps at --min-lr
    assert train(data, longer, "--resume", "--max-steps", "10") == 0
    assert [r["lr"] for r in rows(longer)[-2:]] == [MIN_LR] * 2
    assert "keeps the checkpoint's max_steps 4" in capsys.readouterr().err
    config = json.loads((longer / "config.json").read_text())
    assert (config["max_steps"], config["warmup"], config["min_lr"]) == (10, 1, MIN_LR)


def test_a_resume_to_more_steps_without_warmup_keeps_the_checkpoints_warmup(data, tmp_path):
    """hf-client-2: `--resume --max-steps 5` without --warmup was refused on the default
    warmup 20 before the checkpoint's warmup could apply."""
    out = tmp_path / "run"
    assert train(data, out, "--max-steps", "3", "--warmup", "3", "--save-every", "1") == 0
    assert train(data, out, "--resume", "--max-steps", "5") == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["warmup"], config["max_steps"]) == (3, 5)
    lrs = [r["lr"] for r in rows(out)]
    # the warm-up, transformers' convention: step t of 3 at t / 3, the first at 0
    assert lrs[:3] == pytest.approx([0.0, LR / 3, 2 * LR / 3], rel=1e-15)
    assert lrs[3:] == [MIN_LR, MIN_LR]  # horizon 3: warm-up ended at the cosine's end
    assert all(math.isfinite(x) and x <= LR for x in lrs)


def test_a_resume_may_stop_before_the_checkpoints_warmup_ends(data, tmp_path, capsys):
    """A run with --max-steps 12 --warmup 10, resumed from step 2 with --max-steps 4: the
    schedule keeps its horizon (12) and warm-up (10), so stopping at 4 is fine (it was
    refused: '--warmup must be <= --max-steps (4), got 10', and `--warmup 1` was refused as
    a change). Steps 3-4 equal the uninterrupted run's, LR included."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ("--max-steps", "12", "--warmup", "10", "--save-every", "2", "--keep-checkpoints", "9")
    assert train(data, straight, *flags) == 0
    capsys.readouterr()
    step2 = straight / "checkpoints" / "step-000002"
    assert train(data, resumed, "--resume", str(step2), "--max-steps", "4") == 0
    err = capsys.readouterr().err
    assert "stopping at step 4" in err and "keeps the checkpoint's max_steps 12" in err, err
    keys = ("step", "loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in rows(resumed)] == [
        [r[k] for k in keys] for r in rows(straight)[2:4]
    ]
    assert [r["lr"] for r in rows(resumed)] == pytest.approx([2 * LR / 10, 3 * LR / 10])
    config = json.loads((resumed / "config.json").read_text())
    assert (config["max_steps"], config["warmup"]) == (4, 10)


HF_KINDS = [  # (gradstep flags, transformers' scheduler name and kwargs)
    (["--lr-schedule", "cosine", "--min-lr", "0"], "cosine", {}),
    (["--lr-schedule", "cosine"], "cosine_with_min_lr", {"min_lr_rate": MIN_LR / LR}),
    (["--lr-schedule", "linear", "--min-lr", "0"], "linear", {}),
    (["--lr-schedule", "constant"], "constant_with_warmup", {}),
    (
        ["--lr-schedule", "wsd", "--decay-ratio", "0.3"],
        "warmup_stable_decay",
        {"num_decay_steps": 3, "min_lr_ratio": MIN_LR / LR},
    ),
]


@pytest.mark.parametrize(("flags", "name", "kwargs"), HF_KINDS, ids=[k[1] for k in HF_KINDS])
def test_every_schedule_a_run_uses_is_transformers_curve(data, tmp_path, flags, name, kwargs):
    """Issue 30 §1: each --lr-schedule, with --warmup as a share (0.25 of 10 steps: 3,
    rounded up as transformers' warmup_steps=0.25), runs at every step the learning rate
    transformers' own scheduler gives the Trainer's step (read before the step)."""
    transformers = pytest.importorskip("transformers")
    import torch

    out = tmp_path / "run"
    assert train(data, out, "--max-steps", "10", "--warmup", "0.25", "--lr", str(LR), *flags) == 0
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=LR)
    scheduler = transformers.get_scheduler(
        name, optimizer, num_warmup_steps=3, num_training_steps=10,
        scheduler_specific_kwargs=kwargs or None,
    )  # fmt: skip
    expected = []
    for _ in range(10):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    ours = [r["lr"] for r in rows(out)]
    assert ours[0] == expected[0] == (MIN_LR if name == "warmup_stable_decay" else 0.0)
    assert max(abs(a - b) for a, b in zip(ours, expected, strict=True)) <= 1e-18
    config = json.loads((out / "config.json").read_text())
    assert (config["warmup"], config["lr_schedule"]) == (0.25, flags[1])
    described = json.loads((out / "summary.json").read_text())["lr_schedule"]
    assert (described["kind"], described["warmup"], described["max_steps"]) == (flags[1], 3, 10)
