"""gradstep.trackers without any tracker's process: the scalars a record hands them, and the
install hint when a tracker's package is missing. (The offline runs of W&B and MLflow are in
tests/integration/cli/test_trackers.py.)"""

from __future__ import annotations

import sys

import pytest
import torch

from gradstep.metrics import TENSORBOARD_TAGS, MetricsLogger
from gradstep.trackers import TrackerError, scalars, tracker_sinks


def test_scalars_keep_finite_numbers_under_their_tags() -> None:
    record = {"loss": 2.5, "val_loss": float("nan"), "clipped": True, "items": torch.tensor(7),
              "skip_reason": "x", "val_accuracy": 0.25}  # fmt: skip
    got = scalars(record, TENSORBOARD_TAGS)
    assert got == {"train/loss": 2.5, "grad/clipped": 1.0, "perf/items": 7.0,
                   "val/accuracy": 0.25}  # fmt: skip


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_package_says_what_to_install(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(TrackerError, match=rf"pip install 'gradstep\[{name}\]'"):
        tracker_sinks([name], tmp_path)
    with pytest.raises(TrackerError):
        MetricsLogger(tmp_path, report_to=[name])


def test_unknown_tracker_is_a_value_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown tracker 'neptune'"):
        tracker_sinks(["neptune"], tmp_path)
