"""`gradstep plan`, `--micro-batch-size auto`, `--global-batch`, `--activation-checkpointing`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradstep_cli.cli import main
from tests.support.batches import text_corpus

MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16"]

RUN = [*MODEL, "--eval-batches", "1", "--sample-tokens", "0", "--warmup", "1",
       "--eval-every", "0", "--max-steps", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_plan_json_has_the_contract_keys(capsys):
    argv = ["plan", *MODEL, "--global-batch", "12", "--memory-budget", "4GiB", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    for name in ("micro_batch_size", "accum_steps", "activation_checkpointing",
                 "loss_chunk_tokens", "predicted_peak_bytes", "candidates"):  # fmt: skip
        assert name in plan, name
    # The chosen row is among the candidates, fits, and covers the global batch exactly.
    key = ("micro_batch_size", "activation_checkpointing", "loss_chunk_tokens")
    chosen = [c for c in plan["candidates"] if [c[k] for k in key] == [plan[k] for k in key]]
    assert len(chosen) == 1 and chosen[0]["fits"]
    c = chosen[0]
    assert (c["accum_steps"] - 1) * c["micro_batch_size"] + c["last_micro_batch_size"] == 12
    assert plan["predicted_peak_bytes"] <= 4 * 2**30


def test_plan_table_and_a_budget_nothing_fits(capsys):
    assert main(["plan", *MODEL, "--global-batch", "8", "--memory-budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "chosen: micro-batch" in out and "mbs" in out
    assert main(["plan", *MODEL, "--global-batch", "8", "--memory-budget", "1MB"]) == 2
    assert "memory budget" in capsys.readouterr().err
    assert main(["plan", *MODEL, "--memory-budget", "1GiB"]) == 2  # no global batch
    assert main(["plan", *MODEL, "--global-batch", "8", "--memory-budget", "lots"]) == 2
    assert "--memory-budget: " in capsys.readouterr().err


def test_auto_micro_batch_plans_records_and_keeps_the_global_batch(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *RUN, "--data", str(corpus), "--out", str(out), "--global-batch", "6",
            "--micro-batch-size", "auto", "--memory-budget", "4GiB"]  # fmt: skip
    assert main(argv) == 0
    assert "chosen: micro-batch" in capsys.readouterr().err
    plan = json.loads((out / "plan.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["micro_batch_size"] == plan["micro_batch_size"]
    assert config["accum_steps"] == plan["accum_steps"]
    for row in rows(out):
        assert row["planned_peak_mb"] == pytest.approx(plan["predicted_peak_bytes"] / 2**20)
        assert row["micro_batches"] == plan["accum_steps"]


def test_global_batch_is_exact_and_its_split_does_not_change_the_update(corpus, tmp_path):
    """6 sequences as 4 + 2, as 3 + 3, or with checkpointing: the same updates (the loss is
    normalised by tokens; checkpointing recomputes the same values)."""
    finals = {}
    splits = {
        "4": ["--micro-batch-size", "4"],
        "3": ["--micro-batch-size", "3"],
        "ckpt": ["--micro-batch-size", "4", "--activation-checkpointing"],
    }
    for name, extra in splits.items():
        out = tmp_path / name
        argv = ["train", *RUN, "--data", str(corpus), "--out", str(out), "--global-batch", "6",
                "--save-every", "2", *extra]  # fmt: skip
        assert main(argv) == 0
        metrics = rows(out)
        assert [r["micro_batches"] for r in metrics] == [2, 2]
        finals[name] = (metrics, out / "checkpoints" / "step-000002" / "model.safetensors")
    from safetensors.torch import load_file

    ref_rows, ref_file = finals["4"]
    ref = load_file(ref_file)
    for name in ("3", "ckpt"):
        got_rows, got_file = finals[name]
        assert [r["items"] for r in got_rows] == [r["items"] for r in ref_rows]
        got = load_file(got_file)
        for key, value in ref.items():
            tol = 0 if name == "ckpt" else 1e-6
            torch.testing.assert_close(got[key], value, rtol=tol, atol=tol)
