"""What a run measures and records per step without running one: metrics.jsonl cut back to a
checkpoint's step (each step once), --epochs as steps, the tokens a window processed, the
memory budget's warning (once), and the start lines of the optimizer and schedule."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gradstep import StepStats
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.run import meter as meter_module
from gradstep_cli.run.meter import Meter, postfix
from gradstep_cli.run.resume import Progress, cut_metrics
from gradstep_cli.run.schedule import (
    LRSchedule,
    LRShape,
    epoch_steps,
    run_length,
    schedule_line,
    shape_of,
)


def lines(windows: list[int | None]) -> str:
    return "".join(
        json.dumps({"loss": 1.0} if w is None else {"window": w, "loss": float(w)}) + "\n"
        for w in windows
    )


def windows_of(path: Path) -> list[int]:
    return [json.loads(line)["window"] for line in path.read_text().splitlines()]


def test_a_resume_cuts_the_metrics_back_to_each_step_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    # Another folder's checkpoint at 40: steps 41-78, killed; resumed from 70 (the walk's
    # duplicated 71-78 when the cut counted lines).
    path.write_text(lines(list(range(41, 79))) + '{"window": 79, "lo')
    cut_metrics(path, 70)
    assert windows_of(path) == list(range(41, 71))
    # A file an older gradstep left with a step twice: the later copy (the rerun) is kept.
    path.write_text(lines([1, 2, 3, 2, 3, 4]))
    cut_metrics(path, 3)
    assert windows_of(path) == [1, 2, 3]
    assert [json.loads(x)["loss"] for x in path.read_text().splitlines()] == [1.0, 2.0, 3.0]
    # Records from before they named their step count by their line.
    path.write_text(lines([None, None, None]))
    cut_metrics(path, 2)
    assert len(path.read_text().splitlines()) == 2
    cut_metrics(tmp_path / "absent.jsonl", 3)  # nothing to cut
    assert not (tmp_path / "absent.jsonl").exists()


def test_epochs_are_steps_of_the_streams_epochs() -> None:
    lengths = {0: 4, 1: 4, 2: 4}.__getitem__  # micro-batches an epoch (the last one short)
    assert epoch_steps(1.0, lengths, 2) == 2
    assert epoch_steps(2.0, lengths, 2) == 4
    assert epoch_steps(1.5, lengths, 2) == 3
    assert epoch_steps(0.1, lengths, 4) == 1  # never 0 steps
    varying = [5, 7, 6].__getitem__  # documents re-chunked every epoch
    assert epoch_steps(2.5, varying, 3) == 5  # 5 + 7 + ceil(0.5 x 6) = 15 items
    stream = SimpleNamespace(epoch_length=lambda e: 4, epoch_rows=lambda e: 10)
    cfg, note = run_length(TrainConfig(epochs=2.0), stream, 2, 3)
    assert cfg.max_steps == 4 and cfg.epochs == 2.0 and cfg.warmup == 0  # 4 // 5
    assert "--epochs 2: 10 sequences an epoch (4 micro-batches" in note and "max_steps 4" in note
    same, none = run_length(TrainConfig(max_steps=9), stream, 2, 3)
    assert same.max_steps == 9 and none is None


def fake_run(budget: str | None = None, world: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=TrainConfig(memory_budget=budget),
        progress=Progress(),
        device=torch.device("cpu"),
        world_size=world,
        data_ranks=world,
        is_main=True,
    )


def stats(items: int) -> StepStats:
    return StepStats(1.5, items, 2, 1.0, 1.0, False, False, 1e-3, 1)


def test_a_step_counts_what_it_trained_and_what_it_processed(capsys) -> None:
    meter = Meter(fake_run())
    window = [
        {"input_ids": torch.zeros(3, 7, dtype=torch.long)},  # a micro-batch padded to 7
        {"input_ids": torch.zeros(1, 5, dtype=torch.long)},  # an epoch's short last one
    ]
    record = meter.step(1, window, stats(items=12), elapsed=0.5)
    assert record["window"] == 1 and record["processed_tokens"] == 26
    assert record["processed_tokens_per_s"] == 52.0 and record["rss_mb"] > 0
    assert meter.run.progress.positions == 26 and meter.run.progress.tokens == 12
    shown = postfix(stats(12), meter.rates(), clipped=0, steps=1)
    assert (shown["trained tok/s"], shown["processed tok/s"]) == ("24", "52")
    summary = meter.summary()
    assert summary["processed_tokens"] == 26 and summary["rss_first_step_mb"] > 0
    assert summary["memory_budget_mb"] is None and capsys.readouterr().err == ""


def test_a_run_near_its_memory_budget_says_so_once(capsys, monkeypatch) -> None:
    monkeypatch.setattr(meter_module, "peak_bytes", lambda device: 95 * 2**20)
    meter = Meter(fake_run(budget="100MiB"))
    window = [{"input_ids": torch.zeros(1, 2, dtype=torch.long)}]
    for n in (1, 2, 3):
        meter.step(n, window, stats(1), 0.1)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert "step 1: peak memory 95.00 MiB is 95% of --memory-budget 100.00 MiB" in err, err
    assert meter.summary()["memory_budget_warning_step"] == 1
    monkeypatch.setattr(meter_module, "peak_bytes", lambda device: 80 * 2**20)
    quiet = Meter(fake_run(budget="100MiB"))
    quiet.step(1, window, stats(1), 0.1)
    assert capsys.readouterr().err == "" and quiet.warned_at is None
    # Read every step: a peak that grows past 90% at step 4 is said at step 4.
    peaks = iter([80, 85, 89, 91, 99])
    monkeypatch.setattr(meter_module, "peak_bytes", lambda device: next(peaks) * 2**20)
    growing = Meter(fake_run(budget="100MiB"))
    for n in range(1, 6):
        growing.step(n, window, stats(1), 0.1)
    assert growing.warned_at == 4
    assert "warning: step 4: peak memory 91.00 MiB is 91% of" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cfg", "line"),
    [
        (
            TrainConfig(max_steps=80, warmup=8, lr=5e-4, min_lr=0.0),
            "lr schedule: warm-up 8 steps from 0, then cosine decay from 0.0005 to 0 at step 80",
        ),
        (
            TrainConfig(max_steps=5, warmup=1, lr=1e-3, lr_schedule="linear", min_lr=0.0),
            "lr schedule: warm-up 1 step from 0, then linear decay from 0.001 to 0 at step 5",
        ),
        (
            TrainConfig(max_steps=10, warmup=0, lr=1e-3, lr_schedule="constant"),
            "lr schedule: no warm-up, then constant 0.001",
        ),
        (
            TrainConfig(max_steps=10, warmup=2, lr=1e-3, min_lr=1e-4, lr_schedule="wsd"),
            "lr schedule: warm-up 2 steps from 0.0001, stable at 0.001 until step 8, then a "
            "cosine decay to 0.0001 at step 10",
        ),
    ],
)
def test_the_schedule_is_said_at_the_start(cfg: TrainConfig, line: str) -> None:
    schedule = LRSchedule(shape_of(cfg, cfg.max_steps), cfg.lr, 1)
    assert schedule_line(schedule) == line
    assert schedule_line(schedule, stop=4).endswith(
        "; this invocation stops after step 4 (--stop-after)"
    )
    legacy = LRSchedule(LRShape("cosine", 4, 20, 0.1, legacy_warmup=True), 1e-3, 1)
    assert "warm-up 4 steps from 1/warmup" in schedule_line(legacy)
