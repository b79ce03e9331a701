"""The tests of tests/cli/test_cli.py that start processes or run the CLI end to end; its other
tests stay there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from gradstep import StepStats
from gradstep_cli.cli import main
from gradstep_cli.config.settings import TrainConfig
from tests.cli.test_cli import TINY, read_jsonl


def test_train_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    assert main(["train", *TINY, "--max-steps", "3", "--eval-every", "2", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # --threads (default 1) is undone afterwards

    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 3
    fields = {f.name for f in dataclasses.fields(StepStats)}
    for i, row in enumerate(rows, start=1):
        assert fields | {"tokens_per_s", "elapsed_s"} <= set(row)
        assert row["step"] == i and row["micro_batches"] == 2 and row["items"] > 0
        assert row["loss"] > 0 and row["tokens_per_s"] > 0
    assert "val_loss" not in rows[0] and "val_loss" in rows[1] and "val_loss" in rows[2]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["effective_batch_sequences"] == 4
    assert summary["max_tokens_per_step"] == 4 * 32
    assert summary["final_val_loss"] == rows[2]["val_loss"]
    assert math.isfinite(summary["initial_val_loss"])
    # The counters against the per-step records of metrics.jsonl; each record's clip flag
    # against its own pre-clip norm and the default --clip norm:1.0 (this tiny run's norms
    # are 1.5-1.8: every step clips, none is skipped).
    assert all(row["clipped"] == (row["grad_norm"] > 1.0) for row in rows)
    assert summary["clipped_steps"] == sum(row["clipped"] for row in rows)
    assert summary["skipped_steps"] == sum(row["skipped"] for row in rows)
    assert isinstance(summary["sample"], str) and summary["wall_time_s"] > 0

    config = json.loads((out / "config.json").read_text())
    assert config == {**dataclasses.asdict(TrainConfig()), **config}
    assert config["max_steps"] == 3 and config["d_model"] == 32


def test_toml_config_with_flag_override(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(f'max_steps = 5\nclip = "none"\nout = "{(tmp_path / "run").as_posix()}"\n')
    assert main(["train", "--config", str(toml), *TINY, "--max-steps", "2"]) == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and not any(r["clipped"] for r in rows)


def test_python_dash_m_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gradstep", "train", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and "--accum-steps" in result.stdout
