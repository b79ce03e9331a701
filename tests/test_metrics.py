"""Metrics sinks: what every sink receives equals the step that was taken.

The logged loss and pre-clip norm are checked against the plain computation (one fp64 batch
holding every item of the window, token-weighted mean), so a sink that logged a per-micro-
batch mean or a post-clip norm would fail, not just a sink that dropped a step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import gradstep
from gradstep.metrics import (
    TENSORBOARD_TAGS,
    CallbackSink,
    JsonlSink,
    MetricsLogger,
    peak_memory,
)
from tests.support.asserts import flat
from tests.support.batches import collate, make_window
from tests.support.models import TinyLM
from tests.support.reference import lm_loss, reference_grads

# Micro-batches with very different token counts: a mean of per-micro-batch means would
# give a loss and norm visibly different from the token-weighted ones checked here.
LENGTHS = [[[9, 2], [3]], [[12, 12, 7], [2, 2]], [[5], [11, 1, 8]]]


def fp64_reference(model: torch.nn.Module, seqs: list) -> tuple[float, float]:
    """Window mean loss and gradient norm, the plain way: one fp64 batch of every item."""
    grads, loss = reference_grads(model, collate(seqs), torch.float64)
    return loss, float(flat(grads).norm())


def vmhwm_mib() -> float:
    """This process's peak RSS read independently: ``VmHWM`` of /proc/self/status, which
    the kernel writes in kB (KiB), converted to MiB."""
    status = Path("/proc/self/status").read_text()
    (line,) = [x for x in status.splitlines() if x.startswith("VmHWM:")]
    value, unit = line.split()[1:]
    assert unit == "kB"
    return int(value) / 1024


def run_steps(logger: MetricsLogger, clip: float = 0.05) -> list[dict]:
    """Three Stepper steps through ``logger``. Returns, per step, the stats and what a
    sink must see independently of them: the fp64 reference loss and norm, the item count
    from the labels, the step time handed to ``log_step`` and VmHWM around that call."""
    model = TinyLM()
    stepper = gradstep.Stepper(
        model, torch.optim.SGD(model.parameters(), lr=0.5), clip=gradstep.ClipNorm(clip)
    )
    out = []
    for seed, lengths in enumerate(LENGTHS):
        window, seqs = make_window(lengths, seed=seed)
        ref_loss, ref_norm = fp64_reference(model, seqs)
        items = sum(int((labels != -100).sum()) for _, labels in seqs)
        t0 = time.perf_counter()
        stats = stepper.step(window, lm_loss)
        elapsed = time.perf_counter() - t0
        hwm_before = vmhwm_mib()
        logger.log_step(stats, elapsed, val_loss=1.5 if seed == 1 else None)
        hwm = (hwm_before, vmhwm_mib())
        out.append(
            dict(stats=stats, loss=ref_loss, norm=ref_norm, items=items, elapsed=elapsed, hwm=hwm)
        )
    return out


def test_callback_sink_receives_every_step_with_exact_values(tmp_path: Path) -> None:
    received: list[dict] = []
    with MetricsLogger(tmp_path, callbacks=[received.append]) as logger:
        steps = run_steps(logger)
    assert len(received) == len(steps) == 3
    fields = [f.name for f in dataclasses.fields(gradstep.StepStats)]
    for i, (rec, want) in enumerate(zip(received, steps, strict=True)):
        assert {k: rec[k] for k in fields} == dataclasses.asdict(want["stats"])
        # The true window quantities (fp32 vs fp64 reference): measured rel. error <= 1.1e-7.
        assert rec["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert rec["grad_norm"] == pytest.approx(want["norm"], rel=1e-6)
        assert rec["clipped"] and rec["post_clip_norm"] == pytest.approx(0.05, rel=1e-4)
        assert rec["clip_threshold"] == 0.05 and rec["lr"] == 0.5
        # Throughput from the labels' item count and the step time this test passed in.
        assert rec["items"] == want["items"] and rec["step_time_s"] == want["elapsed"]
        assert rec["tokens_per_s"] == pytest.approx(want["items"] / want["elapsed"], rel=1e-12)
        # Peak memory in MiB: VmHWM read just before and after log_step (it only grows).
        lo, hi = want["hwm"]
        assert rec["memory_source"] == "max_rss" and lo <= rec["peak_memory_mb"] <= hi
        assert ("val_loss" in rec) == (i == 1)
    # The JSON lines file holds the same records, one per line.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == received


def test_mutating_the_callback_record_does_not_change_other_sinks(tmp_path: Path) -> None:
    def vandal(rec: dict) -> None:
        rec["loss"] = -1.0

    with MetricsLogger(tmp_path, callbacks=[vandal]) as logger:
        run_steps(logger)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["loss"] > 0 for row in rows)


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _same_f32(a: float, b: float) -> bool:
    """TensorBoard stores float32: equal after rounding to float32, nan equal to nan."""
    fa, fb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    return bool(torch.equal(fa, fb) or (fa.isnan() and fb.isnan()))


def test_tensorboard_events_read_back_equal(tmp_path: Path) -> None:
    received: list[dict] = []
    with MetricsLogger(tmp_path, tensorboard=True, callbacks=[received.append]) as logger:
        run_steps(logger)
        # An empty window (every label ignored) is a skipped step: StepStats.step does not
        # advance, but it still gets its own x (window index 4) in TensorBoard.
        model = TinyLM()
        stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
        window, _ = make_window([[3]])
        window[0]["labels"].fill_(-100)
        logger.log_step(stepper.step(window, lm_loss), 0.01)
    scalars = _scalars(tmp_path / "tensorboard")
    expected: dict[str, list[tuple[int, float]]] = {}
    for index, rec in enumerate(received, start=1):
        for key, tag in TENSORBOARD_TAGS.items():
            if isinstance(rec.get(key), (bool, int, float)):
                expected.setdefault(tag, []).append((index, float(rec[key])))
    assert set(scalars) == set(expected)
    assert {"train/loss", "val/loss", "grad/norm_pre_clip", "grad/skipped"} <= set(scalars)
    for tag, points in expected.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert all(_same_f32(g, e) for (_, g), (_, e) in zip(got, points, strict=True)), tag
    assert scalars["grad/skipped"][-1] == (4, 1.0) and scalars["val/loss"] == [(2, 1.5)]


def test_jsonl_is_strict_json_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.write({"grad_norm": math.inf, "x": math.nan, "t": torch.tensor(2.5), "ok": 1})
    sink.close()
    again = JsonlSink(path, append=True)
    again.write({"ok": 2})
    again.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"grad_norm": None, "x": None, "t": 2.5, "ok": 1},
        {"ok": 2},
    ]
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]


def test_peak_memory_is_in_mib() -> None:
    # 128 MiB touched by this process, then the reported peak against VmHWM read before
    # and after it (the high-water mark only grows). A KiB slip is 1024x too large, a
    # bytes slip 1024x too small: both far outside the 1 MiB margin.
    block = torch.ones(128 * 2**20 // 4)
    before = vmhwm_mib()
    mib, source = peak_memory("cpu")
    after = vmhwm_mib()
    assert source == "max_rss" and mib >= 128
    assert before - 1 <= mib <= after + 1
    del block


def test_bad_input_errors_name_the_parameter(tmp_path: Path) -> None:
    model = TinyLM()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stats = stepper.step(make_window([[3]])[0], lm_loss)
    with MetricsLogger() as logger:
        with pytest.raises(ValueError, match="step_time_s"):
            logger.log_step(stats, 0.0)
        with pytest.raises(TypeError, match="StepStats"):
            logger.log_step(dataclasses.asdict(stats), 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out_dir"):
        MetricsLogger(tensorboard=True)
    with pytest.raises(TypeError, match="callable"):
        CallbackSink(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sinks"):
        MetricsLogger(sinks=[object()])  # type: ignore[list-item]


def test_custom_sink_gets_every_step_and_is_closed() -> None:
    class Collect:
        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.closed = False

        def write(self, record: dict) -> None:
            self.rows.append(record)

        def close(self) -> None:
            self.closed = True

    sink = Collect()
    with MetricsLogger(sinks=[sink]) as logger:
        run_steps(logger)
    assert len(sink.rows) == 3 and sink.closed and logger.steps_logged == 3


def test_tensorboard_flag_parses_as_a_boolean() -> None:
    from gradstep_cli.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["train", "--tensorboard"]).tensorboard is True
    assert parse(["train", "--no-tensorboard"]).tensorboard is False
    assert not hasattr(parse(["train"]), "tensorboard")  # absent: the TOML file decides


def test_resumed_logger_appends_and_continues_the_tensorboard_axis(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=True) as first:
        run_steps(first)
    # A resume after the 2nd step: the run cuts metrics.jsonl back to 2 lines, then appends.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    with MetricsLogger(tmp_path, tensorboard=True, append=True, start_index=2) as second:
        run_steps(second)
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 5 and rows[:2] == [x.rstrip("\n") for x in lines]
    # Both event files are read together: the first run's x = 1, 2, 3, then the resumed
    # run's 3, 4, 5 (its step 3 re-runs the one lost after the checkpoint), not 1, 2, 3 again.
    steps = [s for s, _ in _scalars(tmp_path / "tensorboard")["train/loss"]]
    assert steps == [1, 2, 3, 3, 4, 5]
