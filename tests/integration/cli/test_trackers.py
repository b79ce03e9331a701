"""--report-to tensorboard,wandb,mlflow: every tracker gets the run's curves, offline.

W&B runs in offline mode (WANDB_MODE=offline, WANDB_DIR=tmp): its run file is read back
record by record (the transaction log's framing below, W&B's own protobufs). MLflow logs to
a file store (MLFLOW_TRACKING_URI=file:..., MLFLOW_ALLOW_FILE_STORE=true: MLflow 3 refuses
that store otherwise): one file per metric, ``timestamp value step`` lines. TensorBoard's
events are read with its EventAccumulator. Each must hold, at every step, the loss, the
pre-clip gradient norm and (on evaluation steps) the validation metrics of metrics.jsonl.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

from gradstep_cli.cli import main  # noqa: E402

TAGS = {
    "loss": "train/loss",
    "grad_norm": "grad/norm_pre_clip",
    "val_loss": "val/loss",
    "val_accuracy": "val/accuracy",
    "val_items": "val/items",
}
FLAGS = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--max-steps", "3", "--eval-every", "2",
    "--sample-tokens", "0", "--warmup", "1", "--device", "cpu",
]  # fmt: skip


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run file: a 7-byte header, then blocks of 32 KiB holding
    chunks (crc32, length, type: full / first / middle / last) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a chunk header
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf = (
            data[pos + 7 : pos + 7 + length]
            if kind in (1, 2)
            else buf + data[pos + 7 : pos + 7 + length]
        )
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def _wandb_history(root: Path) -> dict[int, dict[str, float]]:
    (run_file,) = root.glob("wandb/offline-run-*/run-*.wandb")
    history = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}  # fmt: skip
            history[row["_step"]] = row
    return history


def _mlflow_history(root: Path) -> dict[int, dict[str, float]]:
    history: dict[int, dict[str, float]] = {}
    (metrics,) = root.glob("*/*/metrics")
    for file in metrics.rglob("*"):
        if file.is_file():
            tag = str(file.relative_to(metrics))
            for line in file.read_text().splitlines():
                _, value, step = line.split()
                history.setdefault(int(step), {})[tag] = float(value)
    return history


def _tensorboard_history(folder: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    history: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            history.setdefault(event.step, {})[tag] = event.value
    return history


def test_every_tracker_gets_the_runs_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("def add(a, b):\n    return a + b\n" * 60)
    out = tmp_path / "run"
    argv = ["train", *FLAGS, "--data", str(data), "--out", str(out)]
    assert main([*argv, "--report-to", "wandb, mlflow", "--tensorboard"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trackers = {
        "wandb": _wandb_history(tmp_path / "wb"),
        "mlflow": _mlflow_history(tmp_path / "mlruns"),
        "tensorboard": _tensorboard_history(out / "tensorboard"),
    }
    for name, history in trackers.items():
        assert sorted(history) == [1, 2, 3], name
        for step, row in enumerate(rows, start=1):
            for key, tag in TAGS.items():
                if key in row:
                    assert history[step][tag] == pytest.approx(row[key], rel=1e-6), (name, tag)
                else:
                    assert tag not in history[step], (name, tag)
    assert set(json.loads((out / "trackers.json").read_text())) == {"wandb", "mlflow"}
    config = json.loads((out / "config.json").read_text())
    assert config["report_to"] == "wandb,mlflow" and config["tensorboard"] is True


def test_a_missing_tracker_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("x = 1\n" * 400)
    argv = ["train", *FLAGS, "--data", str(data), "--out", str(tmp_path / "run")]
    assert main([*argv, "--report-to", "wandb"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'gradstep[wandb]'" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "config.json").exists()  # refused before the run began


def test_a_resumed_run_logs_on_into_the_same_tracker_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trackers.json keeps the MLflow run id: the resume's steps 3-4 land in the run that
    holds steps 1-2, once each."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("def add(a, b):\n    return a + b\n" * 60)
    out = tmp_path / "run"
    argv = ["train", *FLAGS, "--data", str(data), "--report-to", "mlflow", "--save-every", "1"]
    assert main([*argv, "--max-steps", "2", "--out", str(out)]) == 0  # FLAGS' 3: the last wins
    first = json.loads((out / "trackers.json").read_text())
    assert main(["train", "--resume", "--max-steps", "4", "--out", str(out)]) == 0
    assert json.loads((out / "trackers.json").read_text()) == first
    history = _mlflow_history(tmp_path / "mlruns")  # one run: the glob finds one folder
    assert sorted(history) == [1, 2, 3, 4]
